"""NeuronBackend: the collectives of the ``neuron`` process-group backend.

The C++ ``torchneuron._C._ProcessGroupNeuron`` (a ``c10d::Backend``) forwards every
collective here, with the method names and arguments of torch's ``Backend`` binding.

Gloo moves the bytes: a neuron tensor is host memory owned by our allocator, so Gloo runs
on its zero-copy CPU alias (``torchneuron._C._alias_as_cpu``) and writes results straight
into device memory. Results are therefore exactly Gloo's on the CPU (its dtypes, its
reduction order, its AVG). Before each collective on neuron tensors the ranks exchange a
small record (their stream clocks and what they are about to run): ranks that disagree
on the collective, its dtype or its shape all raise a clear error instead of hanging or
exchanging garbage, and the collective starts on the simulated clock when the last rank
issues it and lasts what the cost model (``cost.py``) says. CPU tensors go straight to
Gloo (a group created with ``"neuron"`` alone serves CPU tensors too).

Collectives on neuron tensors complete before the call returns (the returned ``Work`` is
already done and its future holds the neuron tensors, which DDP's reducer reads); send and
recv return Gloo's pending work, so pairs of them can be posted in either order.

Each Gloo work this module waits for is waited for with ``_wait``, which also waits for Gloo's
worker thread to let go of it: the work holds tensors made in Python (the aliases, the metadata),
and a worker thread destroying it takes the GIL, which at interpreter exit ends the thread inside
a noexcept destructor and aborts the process ("terminate called without an active exception").
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
from torch._C._distributed_c10d import ProcessGroupGloo, _create_work_from_future

from torchneuron import _C
from torchneuron.config import CONFIG
from torchneuron.distributed import cost
from torchneuron.distributed.record import CollectiveRecord
from torchneuron.distributed.topology import links, local_world_size, placement
from torchneuron.runtime import profiler

#: Every dtype, in an order all processes agree on (the metadata exchange sends indices).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DTYPE_ID = {d: i for i, d in enumerate(_DTYPES)}
_MAX_DIMS = 6
# clock, method, dtype, reduce op, root, numel, ndim, dims..., contiguous
_META_LEN = 8 + _MAX_DIMS
_NO_SHAPE = -1


class _Signature:
    """What every rank of a collective must agree on, and what the cost model is given."""

    __slots__ = ("dtype", "reduce_op", "root", "shape", "kind", "nbytes")

    def __init__(self, kind: str, nbytes: int, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None,
                 reduce_op: int = -1, root: int = -1):
        self.kind, self.nbytes, self.dtype, self.shape = kind, nbytes, dtype, shape
        self.reduce_op, self.root = reduce_op, root


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _reduce_op(opts: Any) -> int:
    return int(opts.reduceOp.op) if hasattr(opts.reduceOp, "op") else int(opts.reduceOp)


def _describe(method: str, meta: Sequence[int]) -> str:
    """A rank's metadata as "method(dtype, shape [..], root r, op o)"."""
    _, m, dtype, reduce_op, root, numel, ndim, *dims, _ = meta
    parts = [_METHODS[m] if 0 <= m < len(_METHODS) else f"method #{m}"]
    if dtype >= 0:
        parts.append(str(_DTYPES[dtype]).replace("torch.", ""))
    if ndim != _NO_SHAPE:
        shown = list(dims[:min(ndim, _MAX_DIMS)]) + (["..."] if ndim > _MAX_DIMS else [])
        parts.append(f"shape {shown} ({numel} elements)")
    if root >= 0:
        parts.append(f"root {root}")
    if reduce_op >= 0:
        parts.append(f"op {torch.distributed.ReduceOp.RedOpType(reduce_op).name}")
    return parts[0] + "(" + ", ".join(parts[1:]) + ")"


def _wait(work: Any) -> None:
    """Wait for a Gloo ``work`` and for the Gloo thread that ran it to drop it, so that this thread
    destroys it (``_C._wait_work``; the module docstring says why)."""
    _C._wait_work(work)


def _done(outputs: list[torch.Tensor]) -> Any:
    """A completed Work whose future holds ``outputs``."""
    future = torch.futures.Future(devices=sorted({str(t.device) for t in outputs if t.device.type != "cpu"}))
    future.set_result(outputs)
    return _create_work_from_future(future)


def _flat(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or nested lists holding tensors and other things)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat(item)]
    return []


#: 8-bit floats: Gloo has no such dtype. Moved as their bytes (uint8); never reduced (as with NCCL).
_FLOAT8 = frozenset(d for d in _DTYPES if d.is_floating_point and d.itemsize == 1)
_REDUCING = frozenset({"allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base",
                       "reduce_scatter_tensor_coalesced"})


def _contiguous(t: torch.Tensor) -> bool:
    """Dense in its memory format (what NCCL accepts): contiguous, or channels-last in 4-D / 5-D."""
    if t.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()])


def _host(value: Any) -> Any:
    """``value`` (a tensor, or nested lists of them) with each neuron tensor as its CPU alias
    (8-bit floats as their bytes)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "neuron":
            return value
        alias = _C._alias_as_cpu(value)
        return alias.view(torch.uint8) if alias.dtype in _FLOAT8 else alias
    if isinstance(value, (list, tuple)):
        return [_host(v) for v in value]
    return value


_PREMUL_SUM = torch.distributed.ReduceOp.RedOpType.PREMUL_SUM
_IN_PLACE = frozenset({"allreduce", "allreduce_coalesced", "reduce"})


def _scaled(value: Any, factor: float) -> Any:
    """New tensors ``t * factor`` for each tensor in ``value`` (nested lists kept)."""
    if isinstance(value, torch.Tensor):
        return value * factor
    return [_scaled(v, factor) for v in value]


def _premul_as_sum(method: str, args: tuple) -> tuple:
    """``PREMUL_SUM(f)`` (which Gloo lacks) as NCCL defines it: each input times ``f``, then SUM.

    ``args`` are the Gloo call's arguments (tensors already on the host); the options object is
    this call's own copy, so it is switched to SUM in place."""
    opts = args[-1]
    op = getattr(opts, "reduceOp", None)
    if op is None or op.op != _PREMUL_SUM:
        return args
    factor = op.factor
    factor = float(factor.item()) if isinstance(factor, torch.Tensor) else float(factor)
    opts.reduceOp = torch.distributed.ReduceOp.SUM
    if method in _IN_PLACE:  # the tensors are inputs and outputs: scale them where they are
        for t in args[0]:
            t.mul_(factor)
        return args
    return (args[0], _scaled(args[1], factor), *args[2:])


class NeuronBackend:
    """The Python half of one ``neuron`` backend instance (one per process group)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Sequence[int] = ()) -> None:
        self.gloo = ProcessGroupGloo(store, rank, size, timeout)
        self.rank, self.size = rank, size
        self.global_ranks = list(global_ranks) or list(range(size))
        self.spec = CONFIG.chip
        self.link = links(self.spec)
        self.ranks_per_node = local_world_size(max(self.global_ranks) + 1)
        self.placement = placement(self.global_ranks, self.spec, self.ranks_per_node)
        self._sequence = 0

    # -- the exchange before each collective ------------------------------------------------
    def _metadata(self, method: str, sig: _Signature, clock: int, contiguous: bool) -> torch.Tensor:
        meta = torch.full((_META_LEN,), _NO_SHAPE, dtype=torch.int64)
        meta[-1] = int(contiguous)
        meta[0], meta[1] = clock, _METHOD_ID[method]
        meta[2] = _DTYPE_ID[sig.dtype] if sig.dtype is not None else -1
        meta[3], meta[4] = sig.reduce_op, sig.root
        if sig.shape is not None:
            shape = list(sig.shape)
            meta[5], meta[6] = int(torch.Size(shape).numel()), len(shape)
            meta[7:7 + min(len(shape), _MAX_DIMS)] = torch.tensor(shape[:_MAX_DIMS], dtype=torch.int64)
        return meta

    def _agree(self, method: str, sig: _Signature, clock: int, contiguous: bool) -> int:
        """Exchange metadata with every rank; raise if they disagree or a tensor is not contiguous
        (on every rank alike); return the latest clock."""
        mine = self._metadata(method, sig, clock, contiguous)
        everyone = torch.empty(self.size * _META_LEN, dtype=torch.int64)
        _wait(self.gloo._allgather_base(everyone, mine))
        rows = everyone.view(self.size, _META_LEN)
        if not torch.equal(rows[:, 1:], mine[1:].expand(self.size, -1)):
            described = [f"rank {r}: {_describe(method, rows[r].tolist())}" for r in range(self.size)]
            raise RuntimeError(f"neuron process group: the ranks disagree on a collective (this rank, {self.rank}, "
                               "called " + _describe(method, mine.tolist()) + "); " + "; ".join(described))
        if not contiguous:  # Gloo would read the view's first numel elements of memory (NCCL refuses)
            raise RuntimeError(f"{method}: Tensors must be contiguous; pass t.contiguous() (and copy the result "
                               "back into the view if it is an output)")
        return int(rows[:, 0].max())

    # -- running one collective --------------------------------------------------------------
    def _run(self, method: str, args: tuple, sig: _Signature, outputs: list[torch.Tensor],
             device: int | None = None) -> Any:
        """Run ``method`` on Gloo with neuron tensors as CPU aliases, on the simulated clock."""
        tensors = _flat(args)
        types = {t.device.type for t in tensors}
        gloo = getattr(self, f"_gloo_{method}", None) or getattr(self.gloo, method)  # ours where Gloo lacks it
        if types == {"cpu"} and device is None:
            return gloo(*_premul_as_sum(method, args))
        if len(types) > 1:
            raise RuntimeError(f"{method}: expected all tensors on one device type, got "
                               + ", ".join(sorted({str(t.device) for t in tensors})))
        if method in _REDUCING and tensors[0].dtype in _FLOAT8:
            raise RuntimeError(f"{sig.kind} of {tensors[0].dtype} tensors: 8-bit floats cannot be reduced "
                               "(Gloo has no 8-bit float arithmetic; neither does NCCL); reduce in bfloat16 "
                               "or float32 and cast back")
        if device is None:
            device = tensors[0].device.index
        stream = torch.accelerator.current_stream(device)
        clock = _C._stream_clock(device, stream.stream_id)
        contiguous = all(_contiguous(t) for t in tensors)
        start = self._agree(method, sig, clock, contiguous)
        if sig.kind != "barrier":
            _wait(gloo(*_premul_as_sum(method, tuple(_host(a) for a in args))))
        duration = cost.collective_ns(sig.kind, sig.nbytes, self.placement, self.spec, self.link)
        self._advance(method, sig, device, stream.stream_id, clock, start, duration, self.placement)
        return _done(outputs)

    def _advance(self, method: str, sig: _Signature, device: int, stream_id: int, clock: int, start: int,
                 duration: int, place: Any) -> None:
        """Move the stream clock to the collective's end and record it for the profiler."""
        end = start + duration
        _C._advance_stream_clock(device, stream_id, end - clock)
        self._sequence += 1
        op = f"c10d::{method}"
        if sig.reduce_op >= 0:
            op += f" ({torch.distributed.ReduceOp.RedOpType(sig.reduce_op).name})"
        profiler._add(CollectiveRecord(
            name=sig.kind, op=op, device=device, stream=stream_id, start_ns=clock, end_ns=end, wait_ns=start - clock,
            device_time_ns=float(duration), bytes=sig.nbytes, ranks=place.size, level=place.level()))

    def _p2p(self, method: str, tensors: list[torch.Tensor], peer: int | None, call: Callable[[list], Any]) -> Any:
        """send / recv: Gloo's pending work on the aliases; this rank's clock only (no exchange)."""
        if {t.device.type for t in tensors} == {"cpu"}:
            return call(tensors)
        if not all(_contiguous(t) for t in tensors):
            raise RuntimeError(f"{method}: Tensors must be contiguous; pass t.contiguous()")
        work = call(_host(tensors))
        device = tensors[0].device.index
        stream = torch.accelerator.current_stream(device)
        clock = _C._stream_clock(device, stream.stream_id)
        ranks = [self.global_ranks[self.rank]] + ([self.global_ranks[peer]] if peer is not None else [])
        pair = placement(ranks, self.spec, self.ranks_per_node)
        kind = "send" if method == "send" else "recv"
        sig = _Signature(kind, _nbytes(tensors), tensors[0].dtype)
        duration = cost.collective_ns(kind, sig.nbytes, pair, self.spec, self.link) if len(ranks) > 1 else 0
        self._advance(method, sig, device, stream.stream_id, clock, clock, duration, pair)
        return work

    # -- what Gloo's binding lacks ------------------------------------------------------------
    def _gloo_allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            _wait(self.gloo._allgather_base(out, inp, opts))
        return _done(outputs)

    def _gloo_reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            _wait(self.gloo._reduce_scatter_base(out, inp, opts))
        return _done(outputs)

    # -- the Backend methods (names and arguments of torch's Backend binding) -----------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """All-reduce ``tensors`` in place."""
        t = tensors[0]
        sig = _Signature("all_reduce", _nbytes(tensors), t.dtype, t.shape, _reduce_op(opts))
        return self._run("allreduce", (tensors, opts), sig, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """All-reduce several tensors as one."""
        sig = _Signature("all_reduce", _nbytes(tensors), tensors[0].dtype, [sum(t.numel() for t in tensors)],
                         _reduce_op(opts))
        return self._run("allreduce_coalesced", (tensors, opts), sig, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Broadcast from ``opts.rootRank``."""
        t = tensors[0]
        sig = _Signature("broadcast", _nbytes(tensors), t.dtype, t.shape, root=opts.rootRank)
        return self._run("broadcast", (tensors, opts), sig, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Reduce onto ``opts.rootRank``."""
        t = tensors[0]
        sig = _Signature("reduce", _nbytes(tensors), t.dtype, t.shape, _reduce_op(opts),
                         opts.rootRank)
        return self._run("reduce", (tensors, opts), sig, tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        """Gather every rank's input into each rank's output list."""
        t = inputs[0]
        sig = _Signature("all_gather", _nbytes(inputs) * self.size, t.dtype, t.shape)
        return self._run("allgather", (outputs, inputs, opts), sig, _flat(outputs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        """All-gather into one flat output tensor."""
        sig = _Signature("all_gather", _nbytes([input]) * self.size, input.dtype, input.shape)
        return self._run("_allgather_base", (output, input, opts), sig, [output])

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        """All-gather several tensors as one."""
        sig = _Signature("all_gather", _nbytes(inputs) * self.size, inputs[0].dtype, [sum(t.numel() for t in inputs)])
        return self._run("allgather_coalesced", (outputs, inputs, opts), sig, _flat(outputs))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Any:
        """All-gather each input into its flat output."""
        sig = _Signature("all_gather", _nbytes(inputs) * self.size, inputs[0].dtype, [sum(t.numel() for t in inputs)])
        return self._run("allgather_into_tensor_coalesced", (outputs, inputs, opts), sig, outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        """Gather every rank's input onto ``opts.rootRank``."""
        t = inputs[0]
        sig = _Signature("gather", _nbytes(inputs) * self.size, t.dtype, t.shape, root=opts.rootRank)
        return self._run("gather", (outputs, inputs, opts), sig, _flat(outputs) or inputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        """Scatter ``opts.rootRank``'s inputs, one per rank."""
        t = outputs[0]
        sig = _Signature("scatter", _nbytes(outputs) * self.size, t.dtype, t.shape, root=opts.rootRank)
        return self._run("scatter", (outputs, inputs, opts), sig, outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        """Reduce the inputs, each rank keeping its own part."""
        t = outputs[0]
        sig = _Signature("reduce_scatter", _nbytes(outputs) * self.size, t.dtype, t.shape, _reduce_op(opts))
        return self._run("reduce_scatter", (outputs, inputs, opts), sig, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        """Reduce-scatter a flat input into each rank's output."""
        sig = _Signature("reduce_scatter", _nbytes([input]), output.dtype, output.shape, _reduce_op(opts))
        return self._run("_reduce_scatter_base", (output, input, opts), sig, [output])

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Any:
        """Reduce-scatter each flat input into its output."""
        sig = _Signature("reduce_scatter", _nbytes(inputs), outputs[0].dtype, [sum(t.numel() for t in outputs)],
                         _reduce_op(opts))
        return self._run("reduce_scatter_tensor_coalesced", (outputs, inputs, opts), sig, outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any) -> Any:
        """All-to-all of one tensor split along dim 0 (evenly when no splits are given)."""
        even = not output_splits and not input_splits
        sig = _Signature("all_to_all", _nbytes([input]), input.dtype, input.shape if even else None)
        return self._run("alltoall_base", (output, input, output_splits, input_splits, opts), sig, [output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Any:
        """All-to-all of lists of tensors (one per rank)."""
        sig = _Signature("all_to_all", _nbytes(inputs), inputs[0].dtype)
        return self._run("alltoall", (outputs, inputs, opts), sig, outputs)

    def barrier(self, opts: Any) -> Any:
        """Wait for every rank; the stream clocks meet at the latest one."""
        ids = list(getattr(opts, "device_ids", []) or [])
        device = ids[0] if ids else torch.accelerator.current_device_index()
        return self._run("barrier", (), _Signature("barrier", 0), [], device=device)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        """Send to ``dst`` (pending work)."""
        return self._p2p("send", tensors, dst, lambda ts: self.gloo.send(ts, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        """Receive from ``src`` into ``tensors`` (pending work)."""
        return self._p2p("recv", tensors, src, lambda ts: self.gloo.recv(ts, src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        """Receive from any rank into ``tensors`` (pending work)."""
        return self._p2p("recv", tensors, None, lambda ts: self.gloo.recv_anysource(ts, tag))

    def monitored_barrier(self, opts: Any, wait_all_ranks: bool) -> None:
        """Gloo's monitored barrier (it names the ranks that did not arrive)."""
        self.gloo.monitored_barrier(opts.timeout, wait_all_ranks)

    def sequence_number(self) -> int:
        """How many collectives this backend has run."""
        return self._sequence

    def set_timeout(self, timeout_ms: int) -> None:
        """Change the timeout of later collectives."""
        self.gloo.set_timeout(datetime.timedelta(milliseconds=timeout_ms))

    def abort(self) -> None:
        """Abort pending collectives."""
        self.gloo.abort()

    def shutdown(self) -> None:
        """Release the transport."""
        self.gloo.shutdown()


_METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
            "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
            "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "barrier")
_METHOD_ID = {m: i for i, m in enumerate(_METHODS)}
