"""Codegen: one segment of a partitioned graph, for one input signature, traced into one Program.

The segment becomes a kernel of our NKI language whose body walks the segment's items in order:

    view node     the operand's layout changed (torch on a meta tensor), no instruction
    fusion group  one pass of the element-wise template (``kernels.elementwise.stream``) whose tile
                  function evaluates every member over fp32 (or int32) tiles, storing only the
                  members used outside the group; casts to bf16/fp16 inside it round the tile
    kernel node   its library kernel, called inline (``kernel_lowerings``)

then its HBM intermediates are packed into one arena by liveness (``memory_plan``), its transfers queued and
ordered (``dma_queues``, ``dma_order``) and its element-wise instructions spread over the engines that can run
them (``engine_balance``).

Library kernels called inside a trace add their instructions to it, so the whole segment is one
instruction list: one Program, one launch, with the timing model free to overlap one kernel's
DMA with the previous kernel's compute. Graph inputs are bound as the flat span of their storage
(a 1-D slot), seen through their real strides; the segment's outputs are returned as whole HBM
tensors, with the layout each value has over its buffer (``OutputLayout``) for the host to view.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler import group_batch, lowering
from torchneuron.compiler.dma_order import order_dma
from torchneuron.compiler.dma_queues import allocate_dma_queues
from torchneuron.compiler.engine_balance import balance_engines
from torchneuron.compiler.kernel_lowerings import dma_cast, embedding_onehot, pointwise
from torchneuron.compiler.memory_plan import plan_memory
from torchneuron.compiler.partition import DEVICE_DTYPES, FusionGroup, Plan, Segment
from torchneuron.compiler.values import HostTensor, NotLowerable, Value, dense, hbm_value, numel, strided_value
from torchneuron.kernels.matmul import Epilogue
from torchneuron.sim import Program
from torchneuron.sim.specs import ChipSpec

CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
ROUNDED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class InputSig:
    """What a program depends on in one segment input: a tensor's layout, or a host scalar's value."""

    shape: tuple | None = None
    stride: tuple | None = None
    dtype: torch.dtype | None = None
    scalar: Any = dataclasses.field(default=None, compare=False)
    # what tells host scalars apart (``scalar_key``): compared instead of the value, which == would not (0.0 and
    # -0.0, 1 and True are ==, a NaN is not == itself)
    key: Any = None
    # inputs sharing one storage are bound as one slot (a fused projection's q, k and v, which kernels then see
    # as views of one tensor): (the first such input, this input's offset in the slot, the slot's length)
    shared: tuple[int, int, int] | None = None

    def __hash__(self) -> int:
        # computed once (the fields' hash): a call's program is looked up by all its inputs' InputSigs
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.shape, self.stride, self.dtype, self.key, self.shared))
        return h

    def __getstate__(self) -> dict:
        # the cached hash is this process's (a dtype hashes by identity): a pickled InputSig does not carry it
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @cached_property
    def span(self) -> int:
        """Elements of the storage the tensor reaches from its offset."""
        if any(n == 0 for n in self.shape):
            return 0
        return 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))

    @property
    def slot_offset(self) -> int:
        """Elements from the start of the input's slot to its storage offset."""
        return self.shared[1] if self.shared else 0

    @property
    def slot_span(self) -> int:
        """Elements of the input's slot: its own span, or that of the inputs sharing its storage."""
        return self.shared[2] if self.shared else self.span


def signature(v: Any) -> InputSig:
    """The InputSig of a host value."""
    if isinstance(v, torch.Tensor):
        return _tensor_signature(v.shape, v.stride(), v.dtype)
    return InputSig(scalar=v, key=scalar_key(v))


def scalar_key(v: Any) -> tuple:
    """A host scalar's type and, for a float (or complex), its bits: equal keys give equal programs."""
    if isinstance(v, (float, complex)):
        return type(v).__name__, struct.pack("<dd", v.real, v.imag)
    return type(v).__name__, v


@functools.lru_cache(maxsize=4096)
def _tensor_signature(shape: torch.Size, stride: tuple, dtype: torch.dtype) -> InputSig:
    """The InputSig of a tensor layout, made once per layout: a compiled graph's calls see the same layouts
    again, and each InputSig computes its ``span`` once."""
    return InputSig(tuple(shape), tuple(stride), dtype)


@functools.lru_cache(maxsize=4096)
def _shared_signature(sig: InputSig, shared: tuple[int, int, int]) -> InputSig:
    """``sig`` of an input sharing its storage as ``shared`` says, made once per layout and sharing."""
    return dataclasses.replace(sig, shared=shared)


def signatures(values: list) -> list[InputSig]:
    """The InputSigs of a segment's input values, device tensors of one dtype that share a storage marked
    ``shared``: they are bound as one slot spanning all of them (``InputSig.shared``)."""
    sigs = [signature(v) for v in values]
    groups: dict[tuple, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and not v.is_cpu:
            groups.setdefault((v.untyped_storage().data_ptr(), v.dtype), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            members = [i for i in members if bindable(sigs[i])]
        if len(members) > 1:
            start = min(values[i].storage_offset() for i in members)
            span = max(values[i].storage_offset() + sigs[i].span for i in members) - start
            for i in members:
                sigs[i] = _shared_signature(sigs[i], (members[0], values[i].storage_offset() - start, span))
    return sigs


@dataclass(frozen=True)
class OutputLayout:
    """Where a segment output lies in its program output slot: sizes, strides and offset in elements (``dtype``
    int64: of the slot's int32 words viewed as int64). With no slot, the output is made on the host: an
    uninitialized tensor of ``shape``/``dtype`` (a placeholder), or the Python value ``scalar``."""

    slot: str | None
    shape: tuple = ()
    stride: tuple = ()
    offset: int = 0
    dtype: torch.dtype | None = None
    scalar: Any = None


@dataclass(frozen=True)
class Check:
    """A device-side assertion: the program writes a count to ``slot``; after the launch the host reads it and
    raises ``error`` (a builtin exception's name) with ``message`` when it is not 0 (bad class targets: the
    eager op reads the same count and raises the same exception type)."""

    slot: str
    error: str
    message: str


@dataclass
class SegmentProgram:
    """A traced segment: its Program, the slot bound to each input, and where each output lies."""

    program: Program
    input_slots: list[str | None]        # per segment input (None: a host scalar, baked in)
    outputs: list[OutputLayout]
    buffer_bytes: int = 0                # the intermediates' bytes before the memory plan packed them
    checks: tuple = ()                   # Check per device-side assertion, read after each launch
    host_scalars: tuple = ()             # segment inputs (CPU fp32 0-d tensors) bound together in slot HOST_SCALARS

    @cached_property
    def slot_index(self) -> dict[str, int]:
        """Each argument slot's position in the program's slot order (what a launch binds by)."""
        return {s.name: i for i, s in enumerate(self.program.args)}


class _Body:
    """The segment kernel's body: evaluates the items over Values while the trace records instructions."""

    def __init__(self, plan: Plan, seg: Segment, sigs: list[InputSig]):
        self.plan, self.seg, self.sigs = plan, seg, sigs
        self.roles = plan.roles
        self.folded = {n for _, _, chain, _ in seg.epilogues.values() for n in chain}
        self.checks: list[tuple[Any, str, str]] = []   # (count buffer, exception name, message)
        # the [p, 1] constant columns of the fused groups' tile math, each set once for the whole program (an
        # optimizer step's groups share their betas, learning rate and eps)
        self.consts: dict = {}
        self.written_in_place: dict[fx.Node, fx.Node] = {}   # a group's result -> the graph input it was stored in
        self.host_scalars = host_scalars(seg, sigs)

    def check(self, count: Any, error: str, message: str) -> None:
        """A lowering's device-side assertion: raise ``error(message)`` after the launch if ``count`` (an HBM
        tensor of one element) is not 0."""
        self.checks.append((count, error, message))

    def __call__(self, **slots: Any) -> tuple:
        env: dict[fx.Node, Any] = {}
        self.scalar_slot = slots.get(HOST_SCALARS)
        for i, (node, sig) in enumerate(zip(self.seg.inputs, self.sigs)):
            if sig.shape is None:
                env[node] = sig.scalar
            elif not bindable(sig):
                env[node] = HostTensor(sig.shape, sig.dtype)
            elif i in self.host_scalars:   # one element of the slot all such scalars share
                env[node] = strided_value(self.scalar_slot, (), offset=self.host_scalars.index(i))
            else:
                slot = slots[f"in{sig.shared[0] if sig.shared else i}"]
                env[node] = strided_value(slot, sig.shape, sig.stride, sig.slot_offset, sig.dtype)
        self.env = env
        self.early_values = self._early_values()
        packed: set[int] = set()   # ids of the groups a packed pass already computed
        for k, item in enumerate(self.seg.items):
            if not isinstance(item, FusionGroup):
                self._node(item)
            elif id(item) not in packed:
                run = self._packable_run(k)
                if len(run) > 1:
                    self._packed(run)
                    packed.update(map(id, run))
                else:
                    self._group(item)
        outs = tuple(v.buf for v in map(self.value, self.seg.outputs) if isinstance(v, Value))
        return outs + tuple(count for count, _, _ in self.checks)

    def _early_values(self) -> dict:
        """Operands of later kernels that read only the program's inputs, built first so their transfers are
        not queued behind the whole program's (DMA queues are first in, first out, in program order): the
        embedding backward's one-hot of its ids (its gradient comes last in a backward graph)."""
        early = {}
        for item in self.seg.items:
            if (isinstance(item, fx.Node) and item.target is torch.ops.aten.embedding_dense_backward.default
                    and self.roles.get(item) == "kernel" and isinstance(self.env.get(item.args[1]), Value)):
                _, indices, num_weights, padding_idx, _ = item.args
                early[item] = embedding_onehot(self.env[indices], num_weights, padding_idx,
                                               item.args[0].meta["val"].dtype)
        return early

    # values ------------------------------------------------------------------------------------

    def value(self, node: Any) -> Any:
        """The Value (or scalar, or tuple) of an fx node argument, applying views on demand."""
        if not isinstance(node, fx.Node):
            return node
        hit = self.env.get(node, _MISSING)
        if hit is not _MISSING:
            return hit
        if self.roles.get(node) != "view":
            raise NotLowerable(f"{node.name} is read before it is computed")
        v = self.env[node] = self._view(node)
        return v

    def args(self, node: fx.Node) -> tuple[tuple, dict]:
        """The node's arguments with fx nodes replaced by their values."""
        return fx.node.map_arg((node.args, node.kwargs), self.value)

    def _view(self, node: fx.Node) -> Any:
        args, kwargs = self.args(node)
        src = args[0]
        if node.target is operator.getitem:
            return src[args[1]]
        try:
            metas = node.target(src.layout, *args[1:], **kwargs)
        except RuntimeError:  # not a view of this layout (``view`` of a transpose): of a dense copy, as reshape does
            src = hbm_value(dense(src)).reshape(src.shape)
            metas = node.target(src.layout, *args[1:], **kwargs)
        if isinstance(metas, (tuple, list)):
            return tuple(src.with_layout(m) for m in metas)
        return src.with_layout(metas)

    # items -------------------------------------------------------------------------------------

    def _node(self, node: fx.Node) -> None:
        if node in self.env:   # computed by an earlier kernel (a bias gradient by its weight gradient's product)
            return
        role = self.roles[node]
        if node.target is torch.ops.aten.copy_.default and self.written_in_place.get(node.args[1]) is node.args[0]:
            self.env[node] = self.value(node.args[0])   # its group already stored the new value there
            return
        if role == "view":
            if node not in self.folded:   # (a reshape of a product read only by its epilogue has no value)
                self.value(node)
            return
        args, kwargs = self.args(node)
        if role == "pick":
            self.env[node] = args[0][args[1]]
            return
        if role == "widened":   # a cast its product's kernel already applied (partition._widen_products)
            v = args[0]
            if v.dtype != node.meta["val"].dtype:
                raise NotLowerable(f"{node.name}: its product was not stored as {node.meta['val'].dtype}")
            self.env[node] = v
            return
        lower = lowering.KERNELS[node.target]
        self.bind(node, lower(self, node, *args, **kwargs))

    def bind(self, node: fx.Node, res: Any) -> None:
        """Record kernel node ``node``'s result ``res`` (a lowering may bind a later node it computed beside its
        own): with an epilogue, the group's result, and the product where it is kept (else None: only the group
        read it, and the node counts as computed)."""
        if node not in self.seg.epilogues:
            self.env[node] = res
            return
        g, _, _, keep = self.seg.epilogues[node]   # the product's kernel computed its epilogue group's result
        if isinstance(res, tuple) and not keep:   # a kernel of several results applies it to its first (dx)
            res, self.env[node] = res[0], (None, *res[1:])
        out, product = res if keep else (res, None)
        self.env[g.outputs[0]] = out.reshape(g.shape)
        if keep or node not in self.env:
            self.env[node] = product

    def epilogue(self, node: fx.Node) -> Epilogue | None:
        """The fusion group a product's kernel applies to its blocks (``Segment.epilogues``), as an Epilogue."""
        hit = self.seg.epilogues.get(node)
        if hit is None:
            return None
        g, src, _, keep = hit
        val = node.meta["val"]
        shape = tuple((val[0] if isinstance(val, (tuple, list)) else val).shape)   # (of several results, the first)
        N = shape[-1]
        M = numel(shape) // N
        others = [n for n in g.inputs if n is not src]
        extras = [self.value(n) for n in others]
        if not all(isinstance(v, Value) for v in extras):
            raise NotLowerable(f"{node.name}: an epilogue operand is not a device tensor")
        fn = self._group_fn(g, [src] + others)
        dtype = g.outputs[0].meta["val"].dtype

        def result(*tiles):
            out = fn(*tiles)[0]
            if dtype not in ROUNDED or out.dtype == dtype:   # (a cast result comes rounded already)
                return out
            # rounded on chip, so the store moves 2-byte elements (a DMA that casts moves the wider side's bytes)
            return _rounded_on_gpsimd(out, dtype)
        return Epilogue(result, tuple(dense(v, (M, N)) for v in extras), dtype, keep_product=keep)

    def _group(self, g: FusionGroup) -> None:
        inputs = g.inputs
        values = [self.value(n) for n in inputs]
        tensors = [(n, v) for n, v in zip(inputs, values) if isinstance(v, Value)]
        if not tensors:
            raise NotLowerable("a fused group with no tensor operand")
        dtypes = tuple(o.meta["val"].dtype for o in g.outputs)
        dests = tuple(self._in_place_target(g, o) for o in g.outputs)
        if self._dma_castable(g, values, dests):   # a lone cast: DMAs convert it on the way, HBM to HBM
            self.env[g.outputs[0]] = dma_cast(values[0], dtypes[0])
            return
        outs = pointwise(self._group_fn(g, [n for n, _ in tensors]), [v for _, v in tensors], g.shape, dtypes,
                         dests if any(d is not None for d in dests) else None)
        for o, d in zip(g.outputs, dests):
            if d is not None:
                self.written_in_place[o] = _copied_into(o)
        self.env.update(zip(g.outputs, outs))

    def _packable_run(self, k: int) -> list[FusionGroup]:
        """The fusion group at ``items[k]`` and the groups of its signature right after it (views between them
        aside) whose operands are all available now: what one packed pass computes (``group_batch``)."""
        items = self.seg.items
        key = self._pack_signature(items[k])
        run = [items[k]]
        if key is None:
            return run
        for it in items[k + 1:]:
            if not isinstance(it, FusionGroup):
                if self.roles.get(it) == "view":
                    continue
                break
            if self._pack_signature(it) != key:
                break
            run.append(it)
        return run

    def _pack_signature(self, g: FusionGroup) -> tuple | None:
        """``group_batch.signature`` of ``g``, None when an operand is not computed yet (the output of a group
        before it in the run) or ``g`` is a lone cast (``dma_cast``)."""
        try:
            values = [self.value(n) for n in g.inputs]
        except NotLowerable:
            return None
        if self._dma_castable(g, values, tuple(self._in_place_target(g, o) for o in g.outputs)):
            return None
        return group_batch.signature(g, values)

    def _packed(self, groups: list[FusionGroup]) -> None:
        """Groups of one signature in one packed pass (``group_batch.packed_stream``)."""
        g0 = groups[0]
        values = [[self.value(n) for n in g.inputs] for g in groups]
        pos = [i for i, v in enumerate(values[0]) if isinstance(v, Value)]
        kinds = ["full" if tuple(values[0][i].shape) == tuple(g0.shape) else "scalar" for i in pos]
        operands, dests = [], []
        for g, vals in zip(groups, values):
            n = numel(g.shape)
            operands.append([dense(vals[i], (n,) if kd == "full" else (1, 1)) for i, kd in zip(pos, kinds)])
            dests.append(tuple(self._in_place_target(g, o) for o in g.outputs))
        flat_dests = [tuple(None if d is None else dense(d, (numel(g.shape),)) for d in ds)
                      for g, ds in zip(groups, dests)]
        fn = self._group_fn(g0, [g0.inputs[i] for i in pos])
        dtypes = tuple(o.meta["val"].dtype for o in g0.outputs)
        scalars = [[vals[i] for i, kd in zip(pos, kinds) if kd == "scalar"] for vals in values]
        table = None
        if "scalar" in kinds and all(v.buf is self.scalar_slot for vs in scalars for v in vs):
            table = (self.scalar_slot, [[v.layout.storage_offset() for v in vs] for vs in scalars])
        results = group_batch.packed_stream(fn, operands, kinds, dtypes, flat_dests, table=table)
        for g, ds, outs in zip(groups, dests, results):
            for o, d, buf in zip(g.outputs, ds, outs):
                if d is not None:
                    self.written_in_place[o] = _copied_into(o)
                self.env[o] = hbm_value(buf).reshape(g.shape)

    @staticmethod
    def _dma_castable(g: FusionGroup, values: list, dests: tuple) -> bool:
        """Whether ``g`` is one cast of a contiguous float device value to another float dtype, its result stored
        in a buffer of its own (what ``dma_cast`` does)."""
        if len(g.nodes) != 1 or g.nodes[0].target not in CASTS or g.kind != "float" or dests != (None,):
            return False
        (v,), dtype = values, g.nodes[0].meta["val"].dtype
        return (isinstance(v, Value) and v.dtype in DEVICE_DTYPES and dtype in DEVICE_DTYPES
                and v.dtype.is_floating_point and dtype.is_floating_point and v.dtype != dtype
                and tuple(v.shape) == tuple(g.shape) and v.layout.is_contiguous() and numel(v.shape) > 0)

    def _in_place_target(self, g: FusionGroup, out: fx.Node) -> Value | None:
        """The graph input ``out`` is copied into (AOTAutograd's ``copy_`` of an updated input: an optimizer's
        parameters and moments), when the group can store ``out`` there itself instead of into a buffer the
        copy then reads: the copy is ``out``'s only reader outside the group, and nothing but this group (where each tile is read
        before the same tile is written) and the copy reads the input, which is a contiguous tensor of the
        group's shape and ``out``'s dtype, whose storage no other input shares."""
        members = set(g.nodes)
        copies = [u for u in out.users if u not in members]
        if len(copies) != 1:
            return None
        copy = copies[0]
        if (copy.target is not torch.ops.aten.copy_.default or copy.args[1] is not out or copy.kwargs
                or self.roles.get(copy) != "kernel" or copy not in self.seg.items):
            return None
        dst = copy.args[0]
        if dst.op != "placeholder" or any(u is not copy and u not in members for u in dst.users):
            return None
        if dst in self.seg.inputs and self.sigs[self.seg.inputs.index(dst)].shared:
            return None   # other inputs view its storage: their readers are not this group's
        v = self.value(dst)
        val = out.meta["val"]
        if (not isinstance(v, Value) or v.dtype != val.dtype or tuple(v.shape) != tuple(g.shape)
                or tuple(val.shape) != tuple(g.shape) or not v.layout.is_contiguous()):
            return None
        return v

    def _group_fn(self, g: FusionGroup, operands: list[fx.Node]):
        """The group's tile function: tiles of ``operands`` (in that order) in, a tuple of its outputs' tiles out."""
        compute = nl.float32 if g.kind == "float" else nl.int32
        consts = self.consts

        def const(value: Any, like):
            p = like.shape[0]
            key = (str(compute), p, type(value), repr(value))   # (repr: -0.0 is not 0.0)
            if key not in consts:
                col = nl.ndarray((p, 1), compute, buffer=nl.sbuf)
                nisa.memset(dst=col, value=value)
                consts[key] = col
            return consts[key]

        read_inside = {a for node in g.nodes for a in node.all_input_nodes}

        def fn(*tiles):
            env = dict(zip(operands, tiles))
            like = tiles[0]
            for node in g.nodes:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a] if a in env else self.value(a))
                if node.target in lowering.SCALARS_AT_COMMON_DTYPE:
                    args, kwargs = lowering.scalars_at_common_dtype(node, args, kwargs)
                tile_fn, tile_args = lowering.POINTWISE[node.target](*args, **kwargs)
                ops = [const(o, like) if isinstance(o, (int, float, bool)) else o for o in tile_args]
                out = tile_fn(*ops)
                dtype = node.meta["val"].dtype
                if node.target in CASTS and dtype in ROUNDED and g.kind == "float":
                    # a cast no member reads is a result only: rounded once, into a tile of its dtype, on GpSimd
                    # (VectorE carries the arithmetic), so its store moves 2-byte elements and needs no second round
                    out = _round(out, dtype) if node in read_inside else _rounded_on_gpsimd(out, dtype)
                env[node] = out
            return tuple(env[o] for o in g.outputs)
        return fn


_MISSING = object()


def _copied_into(out: fx.Node) -> fx.Node:
    """The graph input a group result is copied into (its ``copy_`` user), which the group stored it in."""
    return next(u for u in out.users if u.target is torch.ops.aten.copy_.default and u.args[1] is out).args[0]


def _rounded_on_gpsimd(tile, dtype: torch.dtype):
    """An fp32 tile rounded to ``dtype`` (nearest even) into a new tile of that dtype, on GpSimd."""
    low = nl.ndarray(tile.shape, dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=low, src=tile, engine=nisa.gpsimd_engine)
    return low


def _round(tile, dtype: torch.dtype):
    """Round an fp32 tile through ``dtype`` (an explicit cast inside a fused group), back in fp32."""
    low = nl.ndarray(tile.shape, dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=low, src=tile)
    back = nl.ndarray(tile.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=back, src=low)
    return back


def trace_segment(plan: Plan, seg: Segment, sigs: list[InputSig], spec: ChipSpec, name: str) -> SegmentProgram:
    """Trace ``seg`` for inputs of signatures ``sigs`` into one Program on ``spec``."""
    body = _Body(plan, seg, sigs)
    params, kwargs, slots = [], {}, []
    for i, sig in enumerate(sigs):
        if (sig.shape is None or not bindable(sig) or i in body.host_scalars
                or (sig.shared and sig.shared[0] != i)):   # (an input sharing another's slot binds none)
            slots.append(None)
            continue
        n = f"in{i}"
        params.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY))
        words = 2 if sig.dtype == torch.int64 else 1     # an int64 input is bound as its int32 words
        kwargs[n] = torch.empty((words * max(sig.slot_span, 1),), dtype=torch.int32 if words == 2 else sig.dtype,
                                device="meta")
        slots.append(n)
    if body.host_scalars:
        params.append(inspect.Parameter(HOST_SCALARS, inspect.Parameter.KEYWORD_ONLY))
        kwargs[HOST_SCALARS] = torch.empty((len(body.host_scalars),), dtype=torch.float32, device="meta")

    def kernel(**kw):
        return body(**kw)
    kernel.__signature__ = inspect.Signature(params)
    kernel.__name__ = kernel.__qualname__ = name
    traced = nki.jit(kernel).trace((), kwargs, spec)
    program, memory = plan_memory(traced.program)
    program = balance_engines(order_dma(allocate_dma_queues(program, spec), spec), spec)
    outs, returned = [], iter(traced.result)
    for node in seg.outputs:
        v = body.env[node]
        if isinstance(v, Value):
            lay = v.layout
            wide = torch.int64 if v.dtype == torch.int64 else None   # int32 words the host views as int64
            outs.append(OutputLayout(next(returned), tuple(lay.shape), tuple(lay.stride()), lay.storage_offset(),
                                     wide))
        elif isinstance(v, HostTensor):
            outs.append(OutputLayout(None, tuple(v.shape), dtype=v.dtype))
        else:
            outs.append(OutputLayout(None, scalar=v))
    checks = tuple(Check(next(returned), error, message) for _, error, message in body.checks)
    return SegmentProgram(program, slots, outs, memory.buffer_bytes, checks, body.host_scalars)


HOST_SCALARS = "host_scalars"


def host_scalars(seg: Segment, sigs: list[InputSig]) -> tuple[int, ...]:
    """The segment inputs that are CPU fp32 0-d tensors (an optimizer's per-parameter bias corrections), when there
    are several: the host copies them to the device together, as one slot, and a program reads several in one DMA."""
    found = tuple(i for i, (node, sig) in enumerate(zip(seg.inputs, sigs))
                  if sig.shape == () and sig.dtype == torch.float32
                  and getattr(node.meta.get("val"), "device", None) == torch.device("cpu"))
    return found if len(found) > 1 else ()


def bindable(sig: InputSig) -> bool:
    """Whether a tensor input can be an HBM slot of a program (a device dtype or int64 indices, at least one
    element)."""
    return (sig.dtype in DEVICE_DTYPES or sig.dtype == torch.int64) and sig.span > 0
