"""OpInfo conformance of the neuron device: every op of PyTorch's ``op_db`` on neuron
against the CPU, with a per-op table written to ``docs/op-conformance.md``.

    python -m tests.opinfo.conformance                      # the whole op_db
    python -m tests.opinfo.conformance --ops add,nn.functional.conv2d
    python -m tests.opinfo.conformance --limit 40 --jobs 2

Each op runs in a worker process under a time guard: the harness stops an op that runs
past ``--timeout`` seconds between two samples, and the parent kills and replaces a
worker that has not answered after ``2 * --timeout + 30`` seconds (a hang inside one
kernel) or that died (a crash), recording the op as failed. The last line printed is
``N passed, M failed, K skipped``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "docs" / "op-conformance.md"


# ---------------------------------------------------------------------------
# Worker side


def split_job(job: str) -> tuple[str, str]:
    """(op key, dtype name) of a job: ``add`` (the op's preferred dtype, dtype name "") or ``add@bfloat16``."""
    key, _, dtype = job.partition("@")
    return key, dtype


def _worker(conn, timeout: float, error_inputs: bool, grads: bool = False) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from tests.opinfo import harness

    ops = harness.load_op_db()
    by_key = {harness.op_key(op): op for op in ops}
    conn.send(("ready", None))
    while True:
        try:
            key = conn.recv()
        except EOFError:
            return
        if key is None:
            return
        op_key, dtype = split_job(key)
        res = harness.run_op(by_key[op_key], getattr(torch, dtype) if dtype else None, time_budget=timeout,
                             error_inputs=error_inputs, grads=grads)
        res.key = key
        conn.send(("result", dataclasses.asdict(res)))


class _Worker:
    def __init__(self, ctx, timeout: float, error_inputs: bool, grads: bool = False):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, timeout, error_inputs, grads), daemon=True)
        self.proc.start()
        child.close()
        self.key: str | None = None
        self.started = 0.0
        self.ready = False

    def submit(self, key: str) -> None:
        self.key, self.started = key, time.monotonic()
        self.conn.send(key)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _failed(key: str, op_names: dict, error: str, seconds: float) -> dict:
    """The result of an op whose worker crashed or hung."""
    from tests.opinfo.harness import STATUS_FAILED, OpResult

    name, variant = op_names[split_job(key)[0]]
    return dataclasses.asdict(OpResult(key=key, name=name, variant=variant, dtype=split_job(key)[1],
                                       status=STATUS_FAILED, error=error, seconds=seconds))


def run_all(keys: list[str], op_names: dict, *, jobs: int, timeout: float, error_inputs: bool,
            verbose: bool = True, grads: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    hard_limit = 2 * timeout + 30
    pending = list(keys)
    results: dict[str, dict] = {}
    workers = [_Worker(ctx, timeout, error_inputs, grads) for _ in range(max(1, min(jobs, len(keys))))]
    done = 0

    def record(res: dict) -> None:
        nonlocal done
        done += 1
        results[res["key"]] = res
        if verbose:
            err = f"  {res['error'][:120]}" if res["status"] != "passed" else ""
            print(f"[{done}/{len(keys)}] {res['key']}: {res['status']} ({res['seconds']:.1f}s){err}", flush=True)

    try:
        while len(results) < len(keys):
            for w in workers:
                if w.ready and w.key is None and pending:
                    w.submit(pending.pop(0))
            conns = [w.conn for w in workers]
            ready = mp.connection.wait(conns, timeout=5.0)
            for i, w in enumerate(list(workers)):
                replace = None
                if w.conn in ready:
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError):
                        code = w.proc.exitcode
                        if w.key is not None:
                            record(_failed(w.key, op_names, f"worker crashed (exit code {code}) while running "
                                           f"this op", time.monotonic() - w.started))
                        elif not w.ready:
                            raise RuntimeError(f"a conformance worker failed to start (exit code {code})")
                        replace = w
                    else:
                        if kind == "ready":
                            w.ready = True
                        else:
                            record(payload)
                            w.key = None
                elif w.key is not None and time.monotonic() - w.started > hard_limit:
                    record(_failed(w.key, op_names, f"timeout: no answer after {hard_limit:.0f}s, worker killed",
                                   time.monotonic() - w.started))
                    replace = w
                if replace is not None:
                    replace.kill()
                    workers[i] = _Worker(ctx, timeout, error_inputs, grads)
    finally:
        for w in workers:
            if w.key is None and w.proc.is_alive():
                w.stop()
            else:
                w.kill()
    return [results[k] for k in keys]


# ---------------------------------------------------------------------------
# Report


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _fallback_cell(res: dict) -> str:
    fb = res["fallback_ops"]
    if not fb:
        return "no" if res["status"] != "skipped" else "-"
    calls = sum(fb.values())
    names = sorted(fb, key=lambda k: -fb[k])
    shown = ", ".join(n.replace("aten::", "") for n in names[:3])
    more = f", +{len(names) - 3}" if len(names) > 3 else ""
    return f"yes: {calls} calls ({shown}{more})"


def dtype_rank(dtype: str) -> int:
    """A dtype name's place in ``harness.DTYPE_PREFERENCE`` (sort key)."""
    from tests.opinfo.harness import DTYPE_PREFERENCE

    order = [str(d).removeprefix("torch.") for d in DTYPE_PREFERENCE]
    return order.index(dtype) if dtype in order else len(order)


def write_report(results: list[dict], path: Path, *, command: str, elapsed: float, total_ops: int) -> None:
    """Write the per-op conformance table (markdown) to ``path``."""
    import torch

    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("passed", "failed", "skipped")}
    tested = [r for r in results if r["status"] != "skipped"]
    native = [r for r in tested if not r["fallback_ops"]]
    fallback_ops = sorted({k for r in results for k in r["fallback_ops"]})
    partial = len({(r["name"], r["variant"]) for r in results}) < total_ops
    lines = [
        "# OpInfo conformance of the `neuron` device",
        "",
        "Generated by `python -m tests.opinfo.conformance` (`make conformance`); do not edit by hand.",
        "Each OpInfo of PyTorch's `op_db` runs its `sample_inputs` on `neuron` and on the CPU and the",
        "outputs are compared with `torch.testing.assert_close` (the OpInfo's tolerances where it declares",
        "them); its `error_inputs` must raise the CPU's exception type on neuron. Random ops are compared by",
        "shape, dtype and device only. Complex-only ops are skipped: the device rejects complex dtypes by design.",
        "Bounds derived from the math replace the plain tolerance where summation order alone separates the two:",
        "sums of products (matmul, convolution, their gradients, a broadcast input's gradient) within rounding",
        "units of sum(|terms|) for their length; `normalize`'s gradient within its two cancelling terms; a",
        "bf16/fp16 result at least as close to float64 on the same inputs as the CPU's; and an fp32 result that",
        "fails the plain comparison, within tolerance of float64 beyond the CPU's own error on the sample.",
        "See `tests/opinfo/harness.py`.",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; "
        f"{elapsed / 60:.1f} min",
        f"- command: `{command}`",
        f"- ops run: {len({(r['name'], r['variant']) for r in results})} of "
        f"{total_ops} in `op_db`" + (" (a partial run)" if partial else "") + f"; {len(results)} (op, dtype) runs",
        f"- **{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped**",
        f"- ops that ran without the CPU fallback: {len(native)} of {len(tested)} tested "
        f"(the rest ran at least one ATen op on the CPU)",
        f"- distinct ATen ops that fell back to the CPU: {len(fallback_ops)}",
        "",
        "Per dtype (each op at its preferred dtype, and with `--dtypes` at the others it supports on the CPU; "
        "with `--grads`, the input gradients of each sample, a vector-Jacobian product with seeded random "
        "cotangents, compared too):",
        "",
        *dtype_table(results),
        "",
        "Columns: *dtype* is the dtype tested (float32, else the first the op supports of int64, bool, float64, "
        "...; see `DTYPE_PREFERENCE` in the harness); *samples* is passed/skipped "
        "samples and checked error inputs; *fallback* counts ATen calls that ran through the CPU fallback "
        "(`torchneuron.fallback_counts()` before/after the op); *error / notes* is the first failure, "
        "truncated, or why the op was skipped.",
        "",
        "| op | variant | dtype | status | fallback | samples | s | error / notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["name"], r["variant"], dtype_rank(r["dtype"]))):
        detail = r["error"] if r["error"] else "; ".join(r["notes"])
        samples = f"{r['samples_passed']}/{r['samples_skipped']}, err {r['error_inputs_checked']}" + (
            f", grad {r['grads_checked']}" if r.get("grads_checked") else "")
        lines.append(f"| `{r['name']}` | {_cell(r['variant'] or '')} | {r['dtype']} | {r['status']} | "
                     f"{_cell(_fallback_cell(r), 90)} | {samples} | {r['seconds']:.1f} | {_cell(detail)} |")
    lines += ["", "## ATen ops that ran through the CPU fallback", "",
              ", ".join(f"`{n}`" for n in fallback_ops) if fallback_ops else "(none)", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# ---------------------------------------------------------------------------


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options that select and run ops, shared with ``tests.opinfo.coverage``."""
    p.add_argument("--ops", default="", help="comma-separated op names (all variants) or name.variant keys")
    p.add_argument("--limit", type=int, default=None, help="run only the first N ops (after --ops)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-op time budget in seconds (default 300)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--no-error-inputs", action="store_true", help="skip error_inputs")
    p.add_argument("--dtypes", default="", help="besides each op's preferred dtype, run it at these dtypes too "
                   "(comma-separated, e.g. bfloat16,float16,int32,bool), where the op supports them on the CPU; "
                   "'all': every non-complex dtype it supports")
    p.add_argument("--grads", action="store_true", help="also compare the input gradients of each sample of "
                   "the ops that support autograd, at float dtypes")
    p.add_argument("--quiet", action="store_true", help="no per-op progress lines")


def _prepare_environment() -> None:
    """Make ``tests.opinfo`` importable and quiet the expected warnings (workers inherit this)."""
    if str(REPO_ROOT) not in sys.path:  # workers import tests.opinfo.harness
        sys.path.insert(0, str(REPO_ROOT))
    # the fallback's once-per-op warnings are expected here, and those raised outside a Python
    # call (torch.ops.aten.*) would go to stderr via c10.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def selected_ops(args: argparse.Namespace, p: argparse.ArgumentParser) -> list:
    """The OpInfos chosen by --ops and --limit (all of op_db by default)."""
    _prepare_environment()
    from tests.opinfo import harness

    ops = harness.load_op_db()
    if args.ops:
        try:
            ops = harness.find_ops(args.ops.split(","), ops)
        except KeyError as e:
            p.error(str(e.args[0]))
    if args.limit is not None:
        ops = ops[: args.limit]
    return ops


def run_ops(ops: list, args: argparse.Namespace) -> tuple[list[dict], float]:
    """Run ``ops`` in worker processes; returns (results as dicts, elapsed seconds)."""
    _prepare_environment()
    from tests.opinfo import harness

    keys = jobs_for(ops, getattr(args, "dtypes", ""))
    op_names = {harness.op_key(op): (op.name, op.variant_test_name or "") for op in ops}
    start = time.monotonic()
    results = run_all(keys, op_names, jobs=args.jobs, timeout=args.timeout, error_inputs=not args.no_error_inputs,
                      verbose=not args.quiet, grads=getattr(args, "grads", False)) if keys else []
    return results, time.monotonic() - start


def extra_dtypes(op, dtypes: str) -> list:
    """The dtypes ``--dtypes`` asks ``op`` to run at besides its preferred one: those it supports on the CPU,
    complex ones aside (the device rejects them by design), in ``harness.DTYPE_PREFERENCE`` order."""
    import torch

    from tests.opinfo import harness

    if not dtypes:
        return []
    supported = op.supported_dtypes("cpu")
    wanted = harness.DTYPE_PREFERENCE if dtypes == "all" else [getattr(torch, d) for d in dtypes.split(",")]
    try:
        preferred = harness.pick_dtype(op)
    except harness.OpSkipped:
        return []
    return [d for d in harness.DTYPE_PREFERENCE if d in wanted and d in supported and d != preferred]


def jobs_for(ops: list, dtypes: str) -> list[str]:
    """The jobs of ``ops``: each op at its preferred dtype (its key), then at each of ``extra_dtypes``
    (``key@dtype``)."""
    from tests.opinfo import harness

    return [job for op in ops for job in [harness.op_key(op)] + [
        f"{harness.op_key(op)}@{str(d).removeprefix('torch.')}" for d in extra_dtypes(op, dtypes)]]


def dtype_table(results: list[dict]) -> list[str]:
    """Per dtype: OpInfos run, passed, failed, skipped, passed without the CPU fallback, and those whose input
    gradients were compared (markdown)."""
    by_dtype: dict[str, list[dict]] = {}
    for r in results:
        by_dtype.setdefault(r["dtype"] or "-", []).append(r)
    lines = ["| dtype | ops | passed | failed | skipped | passed natively | native % of tested | "
             "gradients compared (ops / samples) |", "|---|---|---|---|---|---|---|---|"]
    for d in sorted(by_dtype, key=dtype_rank):
        rs = by_dtype[d]
        n = {s: sum(1 for r in rs if r["status"] == s) for s in ("passed", "failed", "skipped")}
        native = sum(1 for r in rs if r["status"] == "passed" and not r["fallback_ops"])
        tested = n["passed"] + n["failed"]
        pct = f"{100.0 * native / tested:.1f}%" if tested else "-"
        g_ops = sum(1 for r in rs if r.get("grads_checked"))
        g_samples = sum(r.get("grads_checked", 0) for r in rs)
        lines.append(f"| {d} | {len(rs)} | {n['passed']} | {n['failed']} | {n['skipped']} | {native} | {pct} | "
                     f"{g_ops} / {g_samples} |")
    return lines


def print_summary(results: list[dict]) -> str:
    """Print the failures and return the ``N passed, M failed, K skipped`` line."""
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("passed", "failed", "skipped")}
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        print("\nfailed:")
        for r in failed:
            print(f"  {r['key']}: {r['error'][:200]}")
    summary = f"{counts['passed']} passed, {counts['failed']} failed"
    if counts["skipped"]:
        summary += f", {counts['skipped']} skipped"
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m tests.opinfo.conformance", description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report (default docs/op-conformance.md)")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when an op fails")
    args = p.parse_args(argv)

    ops = selected_ops(args, p)
    results, elapsed = run_ops(ops, args)
    from tests.opinfo import harness

    write_report(results, Path(args.out), command=" ".join(["python -m tests.opinfo.conformance", *argv]),
                 elapsed=elapsed, total_ops=len(harness.load_op_db()))
    summary = print_summary(results)
    print(f"\nreport: {args.out}")
    print(summary, flush=True)
    return 1 if args.strict and any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
