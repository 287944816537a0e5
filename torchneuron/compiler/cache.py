"""The compiled-program cache: in memory, and on disk so a second run of a script compiles nothing.

A program is keyed by the segment's fingerprint (its ops, arguments and wiring), the signature of
every input (shape, strides, dtype; host scalars by value), the chip, and the compiler version
(a hash of the sources that decide what a program contains). On disk
(``TORCHNEURON_CACHE_DIR``, default ``$XDG_CACHE_HOME/torchneuron`` or ``~/.cache/torchneuron``)
each entry is one file: a header line with the format and the SHA-256 of the payload, then the
payload (JSON). Entries are written to a temporary file and renamed into place, so a reader sees
a whole entry or none and two processes compiling the same graph at once both succeed. An entry
that does not check (truncated, corrupt, another format) is removed and rebuilt.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from torchneuron.compiler.codegen import Check, InputSig, OutputLayout, SegmentProgram
from torchneuron.compiler.partition import Plan, Segment
from torchneuron.sim import Program

FORMAT = "torchneuron-program-1"
_memory: dict[str, SegmentProgram] = {}
stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0, "stores": 0, "disk_read_seconds": 0.0}


def cache_dir() -> Path | None:
    """The on-disk cache directory (``TORCHNEURON_CACHE_DIR``; ``0``/empty turns the disk cache off)."""
    env = os.environ.get("TORCHNEURON_CACHE_DIR")
    if env is not None:
        return None if env.strip() in ("", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchneuron"


@functools.cache
def compiler_version() -> str:
    """A hash of the sources that decide a program's instructions (compiler, kernels, language, simulator)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("compiler", "kernels", "nki", "sim"):
        for p in sorted((root / sub).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def segment_fingerprint(plan: Plan, seg: Segment) -> str:
    """A canonical text of what ``seg`` computes: its inputs, nodes (op, arguments, roles) and outputs."""
    names = {n: f"i{k}" for k, n in enumerate(seg.inputs)}
    lines = []

    def name(n: fx.Node) -> str:
        if n not in names:   # a view of a host value, applied inside the segment
            names[n] = f"v{len(names)}"
            lines.append(f"{names[n]} = {plan.roles.get(n)} {n.target} {_args(n, name)}")
        return names[n]

    for n in seg.nodes:
        args = _args(n, name)
        names[n] = f"n{len(names)}"
        lines.append(f"{names[n]} = {plan.roles[n]} {n.target} {args} -> {_meta(n)}")
    lines.append("out " + " ".join(names[n] for n in seg.outputs))
    return "\n".join(lines)


def _args(n: fx.Node, name) -> str:
    return repr(fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{name(a)}"))


def _meta(n: fx.Node) -> str:
    v = n.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return ",".join(str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in vals)


def program_key(fingerprint: str, sigs: list[InputSig], chip: str) -> str:
    """The cache key of a segment's program for these inputs on ``chip``."""
    h = hashlib.sha256()
    for part in (FORMAT, compiler_version(), chip, fingerprint, repr(sigs)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def load(key: str) -> SegmentProgram | None:
    """The cached program (memory, then disk), or None."""
    hit = _memory.get(key)
    if hit is not None:
        stats["memory_hits"] += 1
        return hit
    path = _path(key)
    if path is not None and path.exists():
        t0 = time.perf_counter()
        prog = _read(path)
        stats["disk_read_seconds"] += time.perf_counter() - t0
        if prog is not None:
            stats["disk_hits"] += 1
            _memory[key] = prog
            return prog
        stats["corrupt"] += 1
        path.unlink(missing_ok=True)
    stats["misses"] += 1
    return None


def store(key: str, prog: SegmentProgram) -> None:
    """Keep ``prog`` in memory and write it to disk atomically (a failure to write only loses the disk copy)."""
    _memory[key] = prog
    path = _path(key)
    if path is None:
        return
    payload = json.dumps({"program": base64.b64encode(prog.program.to_bytes()).decode(),
                          "inputs": prog.input_slots, "host_scalars": list(prog.host_scalars),
                          "checks": [[c.slot, c.error, c.message] for c in prog.checks],
                          "outputs": [[o.slot, list(o.shape), list(o.stride), o.offset,
                                       None if o.dtype is None else str(o.dtype).removeprefix("torch."), o.scalar]
                                      for o in prog.outputs]}).encode()
    header = f"{FORMAT} {hashlib.sha256(payload).hexdigest()}\n".encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(header + payload)
        os.replace(tmp, path)
        stats["stores"] += 1
    except OSError:
        pass


def clear(memory: bool = True, disk: bool = False) -> None:
    """Forget cached programs (in memory; on disk too with ``disk=True``)."""
    if memory:
        _memory.clear()
    root = cache_dir()
    if disk and root is not None and root.exists():
        for p in root.glob("*.tnp"):
            p.unlink(missing_ok=True)


def _path(key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{key}.tnp"


def _read(path: Path) -> SegmentProgram | None:
    try:
        data = path.read_bytes()
        header, _, payload = data.partition(b"\n")
        fmt, digest = header.decode().split(" ")
        if fmt != FORMAT or hashlib.sha256(payload).hexdigest() != digest:
            return None
        doc: dict[str, Any] = json.loads(payload)
        program = Program.from_bytes(base64.b64decode(doc["program"]))
        outputs = [OutputLayout(s, tuple(sh), tuple(st), off, None if dt is None else getattr(torch, dt), sc)
                   for s, sh, st, off, dt, sc in doc["outputs"]]
        return SegmentProgram(program, list(doc["inputs"]), outputs, checks=tuple(Check(*c) for c in doc["checks"]),
                              host_scalars=tuple(doc["host_scalars"]))
    except Exception:  # noqa: BLE001 (whatever fails to decode is rebuilt, never trusted)
        return None
