"""Eager op coverage of the neuron device: which ``op_db`` OpInfos run natively, which
need the CPU fallback, which fail; written to ``docs/op-coverage.md``.

    python -m tests.opinfo.coverage --jobs 2                  # the whole op_db
    python -m tests.opinfo.coverage --ops add,sum --out /tmp/coverage.md
    python -m tests.opinfo.coverage --jobs 2 --results run.json --conformance-out docs/op-conformance.md
    python -m tests.opinfo.coverage --from-results run.json --rerun-failed   # rerun failures, merge

The ops run through the conformance runner (``tests.opinfo.conformance``: worker processes,
time guards, the harness's comparison with the CPU). Each OpInfo is tested at float32, or
at the first dtype of ``harness.DTYPE_PREFERENCE`` it supports, and classified as

- ``native``: passed, and not one ATen call went through the CPU fallback;
- ``fallback``: passed, with at least one ATen call through the CPU fallback;
- ``failing``: a sample or error input failed (or the op crashed or hung);
- ``skipped``: not testable on neuron by design (complex-only, CUDA-only, no tensor argument).

An op's family is ``linalg``, ``fft`` or ``special`` when its OpInfo name starts with
``linalg.``, ``fft.`` or ``special.``; ``sparse`` when its name contains ``sparse`` or one of
its samples holds a non-strided (sparse) tensor; ``core`` otherwise.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

from tests.opinfo import conformance

DEFAULT_OUT = conformance.REPO_ROOT / "docs" / "op-coverage.md"
COMMAND = "python -m tests.opinfo.coverage"

NATIVE, FALLBACK, FAILING, SKIPPED = "native", "fallback", "failing", "skipped"
CLASSES = (NATIVE, FALLBACK, FAILING, SKIPPED)
FAMILY_PREFIXES = {"linalg": "linalg.", "fft": "fft.", "special": "special."}
CORE = "core"
FAMILIES = (CORE, "linalg", "fft", "special", "sparse")
NATIVE_TARGET = 85.0  # % of tested core ops that must be native
PASS_TARGET = 100.0  # % of all tested ops that must pass, fallback allowed
TODO_ROWS = 60  # ATen ops listed in the to-do table


# ---------------------------------------------------------------------------
# Classification


def family(res: dict) -> str:
    """The op family of a result: linalg, fft, special, sparse or core (see module doc)."""
    for fam, prefix in FAMILY_PREFIXES.items():
        if res["name"].startswith(prefix):
            return fam
    if "sparse" in res["name"] or res.get("sample_layouts"):
        return "sparse"
    return CORE


def classify(res: dict) -> str:
    """native / fallback / failing / skipped, from a conformance result."""
    if res["status"] == "skipped":
        return SKIPPED
    if res["status"] == "failed":
        return FAILING
    return FALLBACK if res["fallback_ops"] else NATIVE


def _short(aten: str) -> str:
    """``aten::add.out`` -> ``add.out``."""
    return aten.removeprefix("aten::")


def _pct(n: int, d: int) -> str:
    """``n/d`` as a percentage with one decimal (``-`` when d is 0)."""
    return f"{100.0 * n / d:.1f}%" if d else "-"


def _counts(results: list[dict]) -> dict[str, int]:
    """Results per class."""
    c = collections.Counter(classify(r) for r in results)
    return {k: c.get(k, 0) for k in CLASSES}


# ---------------------------------------------------------------------------
# Report sections


def _headline(results: list[dict]) -> list[str]:
    """The two target numbers and how they are computed."""
    core = [r for r in results if family(r) == CORE]
    cc, ca = _counts(core), _counts(results)
    core_tested = len(core) - cc[SKIPPED]
    all_tested = len(results) - ca[SKIPPED]
    passed = ca[NATIVE] + ca[FALLBACK]
    native_pct = 100.0 * cc[NATIVE] / core_tested if core_tested else 0.0
    pass_pct = 100.0 * passed / all_tested if all_tested else 0.0
    mark = lambda ok: "met" if ok else "not met"  # noqa: E731
    only_errors = sum(1 for r in core if classify(r) == FALLBACK
                      and r["fallback_ops"] == r.get("error_input_fallback_ops"))
    return [
        f"- **native (core ops): {cc[NATIVE]} of {core_tested} = {_pct(cc[NATIVE], core_tested)}** "
        f"(target ≥ {NATIVE_TARGET:.0f}%: {mark(native_pct >= NATIVE_TARGET)}) — core ops that passed with zero "
        f"CPU-fallback calls, over the core ops tested ({len(core)} core ops, {cc[SKIPPED]} skipped); "
        f"counting the skipped ones too: {_pct(cc[NATIVE], len(core))}",
        f"- **passing (all ops, fallback allowed): {passed} of {all_tested} = {_pct(passed, all_tested)}** "
        f"(target {PASS_TARGET:.0f}%: {mark(pass_pct >= PASS_TARGET)}) — {ca[NATIVE]} native + {ca[FALLBACK]} "
        f"fallback, {ca[FAILING]} failing, over the ops tested ({len(results)} ops, {ca[SKIPPED]} skipped); "
        f"counting the skipped ones too: {_pct(passed, len(results))}",
        f"- core ops whose only fallback calls came from their `error_inputs` (native on every sample): "
        f"{only_errors}",
    ]


def _family_table(results: list[dict]) -> list[str]:
    """Class counts per family."""
    lines = ["| family | ops | native | fallback | failing | skipped | native % of tested | pass % of tested |",
             "|---|---|---|---|---|---|---|---|"]
    groups = [(fam, [r for r in results if family(r) == fam]) for fam in FAMILIES] + [("all", results)]
    for fam, rs in groups:
        c = _counts(rs)
        tested = len(rs) - c[SKIPPED]
        lines.append(f"| {fam} | {len(rs)} | {c[NATIVE]} | {c[FALLBACK]} | {c[FAILING]} | {c[SKIPPED]} | "
                     f"{_pct(c[NATIVE], tested)} | {_pct(c[NATIVE] + c[FALLBACK], tested)} |")
    return lines


def _dtype_cell(res: dict) -> str:
    """The dtype tested, marked with † when it is not float32."""
    d = res["dtype"]
    return f"{d} †" if d and d != "float32" else d


def _fallback_list(fb: dict, limit: int = 6) -> str:
    """The ATen ops that fell back, most calls first: ``add.out ×3, mul.out ×1``."""
    names = sorted(fb, key=lambda k: (-fb[k], k))
    shown = ", ".join(f"{_short(n)} ×{fb[n]}" for n in names[:limit])
    return shown + (f", +{len(names) - limit} more" if len(names) > limit else "")


def _detail(res: dict) -> str:
    """What the table says beyond the class: the fallbacks, the first error, or the skip reason."""
    cls = classify(res)
    if cls == FALLBACK:
        text = _fallback_list(res["fallback_ops"])
        err = res.get("error_input_fallback_ops") or {}
        if err and err == res["fallback_ops"]:
            text += " (error inputs only)"
        return text
    if cls in (FAILING, SKIPPED):
        return res["error"].splitlines()[0] if res["error"] else ""
    return ""


def _op_table(results: list[dict]) -> list[str]:
    """One row per OpInfo."""
    lines = ["| op | family | dtype | coverage | fallback ATen ops / first error / why skipped |",
             "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["key"]):
        lines.append(f"| `{r['key']}` | {family(r)} | {_dtype_cell(r)} | {classify(r)} | "
                     f"{conformance._cell(_detail(r), 220)} |")
    return lines


def blockers(results: list[dict]) -> list[dict]:
    """ATen ops that fell back, with the OpInfos they keep from being native, most first."""
    table: dict[str, dict] = {}
    for r in results:
        if classify(r) not in (FALLBACK, FAILING):
            continue
        for aten, calls in r["fallback_ops"].items():
            row = table.setdefault(aten, {"aten": aten, "opinfos": [], "core": 0, "sole": 0, "calls": 0})
            row["opinfos"].append(r["key"])
            row["core"] += family(r) == CORE
            row["sole"] += classify(r) == FALLBACK and len(r["fallback_ops"]) == 1
            row["calls"] += calls
    return sorted(table.values(), key=lambda b: (-len(b["opinfos"]), -b["core"], b["aten"]))


def lowered_overloads() -> set[str]:
    """The ATen overloads (``add.Tensor``) that have a neuron kernel in this checkout."""
    from torchneuron.ops import LOWERED

    return set(LOWERED)


def _todo_table(results: list[dict], rows: int = TODO_ROWS) -> list[str]:
    """The lowering to-do list: the top ATen ops by OpInfos blocked."""
    bs = blockers(results)
    lowered = lowered_overloads()
    lines = [f"{len(bs)} distinct ATen ops fell back; the {min(rows, len(bs))} that block the most OpInfos:", "",
             "| # | ATen op | OpInfos blocked | of them core | sole blocker | fallback calls | has a kernel | "
             "OpInfos (first 6) |",
             "|---|---|---|---|---|---|---|---|"]
    for i, b in enumerate(bs[:rows], 1):
        ops = ", ".join(f"`{k}`" for k in b["opinfos"][:6]) + (" …" if len(b["opinfos"]) > 6 else "")
        kernel = "yes" if _short(b["aten"]) in lowered else ""
        lines.append(f"| {i} | `{_short(b['aten'])}` | {len(b['opinfos'])} | {b['core']} | {b['sole']} | "
                     f"{b['calls']} | {kernel} | {ops} |")
    rest = bs[rows:]
    if rest:
        lines += ["", "The others (OpInfos blocked): " +
                  ", ".join(f"`{_short(b['aten'])}` ({len(b['opinfos'])})" for b in rest)]
    return lines


def _failing_list(results: list[dict]) -> list[str]:
    """The failing ops with their first error, in full (one line each)."""
    failing = [r for r in results if classify(r) == FAILING]
    if not failing:
        return ["(none)"]
    return [f"- `{r['key']}` ({r['dtype'] or '-'}): {conformance._cell(r['error'].splitlines()[0], 400)}"
            for r in sorted(failing, key=lambda r: r["key"])]


def _dtype_section(results: list[dict]) -> list[str]:
    """Per dtype: the conformance counts, then native / fallback / failing / skipped of the core ops."""
    if not any("@" in r["key"] for r in results):
        return ["Each op ran at its preferred dtype only (`--dtypes` runs the others it supports too)."]
    by_dtype: dict[str, list[dict]] = {}
    for r in results:
        by_dtype.setdefault(r["dtype"] or "-", []).append(r)
    lines = ["| dtype | core ops | native | fallback | failing | skipped | native % of tested (core) |",
             "|---|---|---|---|---|---|---|"]
    for d in sorted(by_dtype, key=conformance.dtype_rank):
        core = [r for r in by_dtype[d] if family(r) == CORE]
        c = _counts(core)
        lines.append(f"| {d} | {len(core)} | {c[NATIVE]} | {c[FALLBACK]} | {c[FAILING]} | {c[SKIPPED]} | "
                     f"{_pct(c[NATIVE], len(core) - c[SKIPPED])} |")
    return [*conformance.dtype_table(results), "", *lines]


def write_report(results: list[dict], path: Path, *, meta: dict, total_ops: int) -> None:
    """Write docs/op-coverage.md: headline, families, per-op table, failing ops, to-do list (the headline and
    the family and to-do tables over each op at its preferred dtype; a per-dtype section over all runs)."""
    import torch

    all_runs, results = results, [r for r in results if "@" not in r["key"]]
    partial = len(results) < total_ops
    lines = [
        "# Eager op coverage of the `neuron` device",
        "",
        f"Generated by `{COMMAND}` (`make coverage`); do not edit by hand. Each OpInfo of PyTorch's `op_db`",
        "runs its `sample_inputs` and `error_inputs` on `neuron` against the CPU (the harness of",
        "`docs/op-conformance.md`, `tests/opinfo/harness.py`), at float32; an op that does not support",
        "float32 runs at the first dtype it supports of int64, bool, float64, bfloat16, float16, int32, …, "
        "float8 (marked †).",
        "",
        "- **native**: passed, and not one ATen call went through the CPU fallback (counted by",
        "  `torchneuron.fallback_counts()` over the op's samples and error inputs);",
        "- **fallback**: passed, with ATen calls through the CPU fallback (listed: ATen op ×calls);",
        "- **failing**: a sample output differs from the CPU's, an error input raises another exception type",
        "  than on the CPU, or the op raised, crashed or hung (first error shown);",
        "- **skipped**: not testable on neuron by design (complex-only or CUDA-only ops, complex outputs,",
        "  samples with no tensor argument), with why.",
        "",
        "Families, by OpInfo name: **linalg** = name starts with `linalg.`, **fft** = starts with `fft.`,",
        "**special** = starts with `special.`, **sparse** = the name contains `sparse` or a sample holds a",
        "non-strided (sparse COO/CSR/...) tensor (in this `op_db`: `sparse.mm.reduce`, `sparse.sampled_addmm`,",
        "`to_sparse`); **core** = every other op. Ops of other namespaces (`nn.functional.*`, `masked.*`,",
        "`signal.*`, ...) are core. Percentages are over the ops *tested* (not skipped).",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; "
        f"{meta.get('elapsed', 0.0) / 60:.1f} min",
        "- command: " + "; then ".join(f"`{c}`" for c in meta.get("commands", [COMMAND])),
        f"- ops: {len(results)} of {total_ops} in `op_db`" + (" (a partial run)" if partial else ""),
        "",
        "## Headline",
        "",
        *_headline(results),
        "",
        *_family_table(results),
        "",
        "## Per dtype",
        "",
        "Each op at every dtype it supports on the CPU (complex aside) with `--dtypes all`, and with `--grads` the",
        "input gradients of its samples compared too; an op's preferred dtype is the row above's run.",
        "",
        *_dtype_section(all_runs),
        "",
        "## Failing ops",
        "",
        *_failing_list(all_runs),
        "",
        "## ATen ops that fell back (the lowering to-do list)",
        "",
        "*OpInfos blocked*: the fallback and failing OpInfos in which the ATen op ran through the CPU fallback;",
        "*of them core*: those outside the linalg/fft/special/sparse families; *sole blocker*: fallback OpInfos",
        "for which it is the only ATen op that fell back (lowering it alone makes them native); *has a kernel*:",
        "the overload has a neuron kernel (`torchneuron.ops.LOWERED`) whose own `cpu_fallback` ran, for inputs",
        "it does not handle (a dtype, a CPU argument, ...).",
        "",
        *_todo_table(results),
        "",
        "## Per op",
        "",
        *_op_table(results),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# ---------------------------------------------------------------------------
# Results files


def load_results(path: Path) -> tuple[list[dict], dict]:
    """(results, meta) from a ``--results`` file."""
    data = json.loads(path.read_text())
    return data["results"], data["meta"]


def save_results(path: Path, results: list[dict], meta: dict) -> None:
    """Write the raw per-op results (tracebacks included) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def merge(old: list[dict], new: list[dict], order: list[str]) -> list[dict]:
    """``old`` with the ops of ``new`` replaced, in op_db order (an op's ``key@dtype`` runs after it)."""
    by_key = {r["key"]: r for r in old}
    by_key.update({r["key"]: r for r in new})
    rank = {k: i for i, k in enumerate(order)}
    keys = [k for k in by_key if conformance.split_job(k)[0] in rank]
    return [by_key[k] for k in sorted(keys, key=lambda k: (rank[conformance.split_job(k)[0]],
                                                         conformance.dtype_rank(conformance.split_job(k)[1])))]


_FILE_OPTIONS = ("--out", "--conformance-out", "--results", "--from-results")


def run_command(argv: list[str]) -> str:
    """The command line that selected and ran the ops, without the options naming files."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _FILE_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in _FILE_OPTIONS)):
            kept.append(a)
    return " ".join([COMMAND, *kept])


def _ops_to_run(args: argparse.Namespace, p: argparse.ArgumentParser, old: list[dict]) -> list:
    """The OpInfos this invocation runs: --ops/--limit, failing ones with --rerun-failed."""
    if args.from_results and not (args.ops or args.rerun_failed or args.limit is not None):
        return []
    ops = conformance.selected_ops(args, p)
    if args.rerun_failed:
        from tests.opinfo import harness

        failing = {conformance.split_job(r["key"])[0] for r in old if classify(r) == FAILING}
        ops = [op for op in ops if harness.op_key(op) in failing]
    return ops


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    conformance.add_run_arguments(p)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report (default docs/op-coverage.md)")
    p.add_argument("--conformance-out", default="", help="also write the conformance table of the same run here")
    p.add_argument("--results", default="", help="write the raw per-op results (JSON) here")
    p.add_argument("--from-results", default="", help="start from these results (JSON): run only --ops, "
                   "--limit or --rerun-failed ops and merge them in (nothing, without one of those)")
    p.add_argument("--rerun-failed", action="store_true", help="with --from-results: rerun its failing ops")
    args = p.parse_args(argv)
    if args.rerun_failed and not args.from_results:
        p.error("--rerun-failed needs --from-results")

    old, meta = load_results(Path(args.from_results)) if args.from_results else ([], {"elapsed": 0.0, "commands": []})
    ops = _ops_to_run(args, p, old)
    new, elapsed = conformance.run_ops(ops, args)
    from tests.opinfo import harness

    order = [harness.op_key(op) for op in harness.load_op_db()]
    results = merge(old, new, order)
    if ops:
        meta = {"elapsed": meta["elapsed"] + elapsed, "commands": [*meta["commands"], run_command(argv)]}
    write_report(results, Path(args.out), meta=meta, total_ops=len(order))
    if args.conformance_out:
        conformance.write_report(results, Path(args.conformance_out), command="; then ".join(meta["commands"]),
                                 elapsed=meta["elapsed"], total_ops=len(order))
    if args.results:
        save_results(Path(args.results), results, meta)
    summary = conformance.print_summary(results)
    c = _counts(results)
    print(f"\nreport: {args.out}")
    print(f"{summary}; coverage: {c[NATIVE]} native, {c[FALLBACK]} fallback, {c[FAILING]} failing, "
          f"{c[SKIPPED]} skipped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
