"""Partition: an ATen graph cut into compiled segments and eager nodes, segments cut into fusion groups.

Every call node gets a role from ``lowering.kind`` and its operands (``role``):

- ``view``: a view; computed wherever its operand lives (an access pattern inside a program, a
  ``torch`` view on the host), never a program output of its own;
- ``pointwise`` / ``kernel``: computed inside a program (``Segment``);
- ``eager``: run as the eager op on the host, between programs (also what the compiler cannot run
  on the device: float64/int64/complex operands, CPU tensors, data-dependent shapes).

Nodes are taken in graph order. Compiled nodes collect into the open segment; an eager node that
reads nothing of the open segment runs before it (the graph is functional, so this only reorders
independent work), while one that does closes it. Each segment becomes one Program: one launch.

Inside a segment, pointwise nodes of one compute kind (float or integer tiles) and one iteration
shape fuse into a ``FusionGroup``: the element-wise template streams the group's inputs once and
stores only the values used outside it. A node joins the group of a producer only if none of its
other operands is computed after that group starts, so emitting the group at its first node keeps
every operand available (no cycles through other nodes).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from torchneuron.compiler import lowering
from torchneuron.kernels import norms
from torchneuron.kernels.elementwise import stream_tile_width
from torchneuron.ops.base import FLOATS

# the dtypes a program binds and computes (ops.base.DEVICE_DTYPES less the unsigned wide ints and fp8, which
# the compiler's lowerings do not handle: those ops run as the eager op)
DEVICE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int16, torch.int8, torch.uint8,
                 torch.bool)


def tensor_values(node: fx.Node) -> list:
    """The fake tensors a node computes (its traced ``val``, a tuple's tensors for multi-output ops)."""
    v = node.meta.get("val")
    return [x for x in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(x, torch.Tensor)]


def _operand_vals(node: fx.Node) -> list:
    return [x for a in node.all_input_nodes for x in tensor_values(a)]


def _on_device(ts: list) -> bool:
    return all(t.device.type == "neuron" and t.dtype in DEVICE_DTYPES for t in ts)


def _static(ts: list) -> bool:
    return all(isinstance(s, int) for t in ts for s in (*t.shape, *t.stride()))


def _cast_ok(node: fx.Node) -> bool:
    """Casts fused into a group: float to float, or integer/bool to float (exact below 2**24, as eager's)."""
    (src,), (dst,) = _operand_vals(node)[:1], tensor_values(node)
    if node.target is torch.ops.aten._to_copy.default and set(node.kwargs) - {"dtype", "layout", "device"}:
        return False   # memory_format, pin_memory, non_blocking: the eager op
    return dst.dtype in FLOATS and src.device == dst.device


def role(node: fx.Node) -> str:
    """``placeholder``, ``output``, ``view``, ``pick`` (an element of a kernel's tuple), ``pointwise``,
    ``kernel`` or ``eager``."""
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op != "call_function":
        return "eager"
    if node.target is operator.getitem:
        src = node.args[0]
        src_role = role(src) if isinstance(src, fx.Node) else "eager"
        return {"kernel": "pick", "view": "view"}.get(src_role, "eager")
    k = lowering.kind(node.target)
    if k == "view":
        return "view"
    outs, ins = tensor_values(node), _operand_vals(node)
    if k == "eager" or not outs or not _static(outs + ins):
        return "eager"
    pred = lowering.SUPPORTS.get(node.target)
    if pred is not None:   # the lowering's own check covers dtypes (placeholder outputs may be int64 or empty)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        return k if all(t.device.type == "neuron" for t in outs + ins) and pred(node, *args, **kwargs) else "eager"
    # a CPU 0-d tensor operand is a scalar the program reads from HBM (copied there per call, as eager does)
    ins = [t for t in ins if not (t.device.type == "cpu" and t.dim() == 0)]
    if not _on_device(outs + ins) or any(t.numel() == 0 for t in outs + ins):
        return "eager"
    if k == "pointwise":
        if node.target in (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default) \
                and not _cast_ok(node):
            return "eager"
        if node.target is torch.ops.aten.clone.default and set(node.kwargs) - {"memory_format"}:
            return "eager"
    return k


def compute_kind(node: fx.Node) -> str:
    """``float`` when the node's result or a tensor operand is floating (fp32 tiles), else ``int``."""
    return "float" if any(t.dtype.is_floating_point for t in tensor_values(node) + _operand_vals(node)) else "int"


@dataclass
class FusionGroup:
    """Pointwise nodes streamed in one pass: ``nodes`` in graph order, over one iteration shape."""

    nodes: list[fx.Node]
    shape: tuple[int, ...]
    kind: str
    start: int                       # graph position of the first node (operands must come before it)
    outputs: list[fx.Node] = field(default_factory=list)   # members used outside the group

    @property
    def inputs(self) -> list[fx.Node]:
        """Operands computed outside the group, in first-use order."""
        members, seen = set(self.nodes), {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in members:
                    seen.setdefault(a, None)
        return list(seen)


@dataclass
class Segment:
    """Compiled nodes that become one Program: ``items`` are fx nodes (views, picks, kernels) and groups."""

    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)    # host values it reads (graph inputs, eager results)
    outputs: list[fx.Node] = field(default_factory=list)   # computed values read after it
    # matrix products stored in a wider dtype (node -> dtype), and the casts that thereby became no-ops
    widened: dict[fx.Node, torch.dtype] = field(default_factory=dict)
    widen_casts: dict[fx.Node, fx.Node] = field(default_factory=dict)   # cast -> its product
    # matrix products whose kernel applies a fusion group to its blocks: product -> (group, the group's operand
    # that is the product seen through reshapes, those reshape nodes)
    epilogues: dict[fx.Node, tuple] = field(default_factory=dict)

    def describe(self) -> str:
        """One line per item: what the program computes."""
        lines = []
        for it in self.items:
            if isinstance(it, FusionGroup):
                lines.append(f"  fused[{it.kind} {list(it.shape)}]: " + ", ".join(_name(n) for n in it.nodes)
                             + " -> " + ", ".join(n.name for n in it.outputs))
            elif isinstance(it, fx.Node) and it in self.epilogues:
                g, keep = self.epilogues[it][0], self.epilogues[it][3]
                lines.append(f"  kernel: {_name(it)} with epilogue [" + ", ".join(_name(n) for n in g.nodes)
                             + "] -> " + ", ".join(n.name for n in g.outputs) + (" (product kept)" if keep else ""))
            elif it in self.widen_casts:
                lines.append(f"  widened: {_name(it)} (stored as {tensor_values(it)[0].dtype} by {self.widen_casts[it].name})")
            else:
                lines.append(f"  {role(it)}: {_name(it)}")
        return "\n".join(lines)


def _name(n: fx.Node) -> str:
    t = n.target
    return f"{n.name}={getattr(t, '__name__', str(t))}"


@dataclass
class Plan:
    """The partitioned graph: ``steps`` in execution order, each an eager/view fx node or a Segment."""

    graph: fx.Graph
    steps: list[Any]
    segments: list[Segment]
    roles: dict[fx.Node, str]


def _root(node: fx.Node, roles: dict) -> fx.Node:
    """The node whose buffer a view/pick chain reads."""
    while roles.get(node) in ("view",) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def partition(graph: fx.Graph) -> Plan:
    """Cut ``graph`` into steps: eager nodes and compiled segments (with their fusion groups)."""
    roles = {n: role(n) for n in graph.nodes}
    owner: dict[fx.Node, Segment] = {}       # compiled node -> its segment
    steps: list[Any] = []
    segments: list[Segment] = []
    open_seg: Segment | None = None

    def produced_in(node: fx.Node, seg: Segment | None) -> bool:
        return seg is not None and owner.get(_root(node, roles)) is seg

    for node in graph.nodes:
        r = roles[node]
        if r in ("placeholder", "output"):
            continue
        if r == "view":
            # a view of a segment's value belongs to it; a view of a host value is applied on demand
            if open_seg is not None and produced_in(node.args[0], open_seg):
                owner[node] = open_seg
                open_seg.nodes.append(node)
            continue
        if r in ("pointwise", "kernel", "pick"):
            if open_seg is None:
                open_seg = Segment(len(segments))
                segments.append(open_seg)
                steps.append(open_seg)
            owner[node] = open_seg
            open_seg.nodes.append(node)
            continue
        # eager: before the open segment when independent of it, else it closes the segment; an op that
        # writes memory (copy_ into a graph input) also closes it when the segment reads what it writes
        if open_seg is not None and (any(produced_in(a, open_seg) for a in node.all_input_nodes)
                                     or (_mutates(node) and _writes_read_by(node, open_seg, roles))):
            open_seg = None
            steps.append(node)
        else:
            steps.insert(len(steps) - 1 if open_seg is not None else len(steps), node)

    for seg in segments:
        _finish_segment(seg, roles, owner)
    return Plan(graph, steps, segments, roles)


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or schema.is_mutable


def _writes_read_by(node: fx.Node, seg: Segment, roles: dict) -> bool:
    """Whether ``seg`` reads memory the mutating ``node`` may write (any tensor operand of it, unless its schema
    says which are written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    written = [a for a, arg in zip(node.args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
    targets = {_root(a, roles) for a in written if isinstance(a, fx.Node)} if written else \
        {_root(a, roles) for a in node.all_input_nodes}
    read = {_root(a, roles) for n in seg.nodes for a in n.all_input_nodes}
    return bool(targets & read)


def _finish_segment(seg: Segment, roles: dict, owner: dict) -> None:
    members = set(seg.nodes)
    inputs: dict[fx.Node, None] = {}
    for n in seg.nodes:
        for a in n.all_input_nodes:
            root = _root(a, roles)
            if root not in members and roles.get(root) not in ("view",):
                inputs.setdefault(root, None)
    seg.inputs = list(inputs)
    outputs: dict[fx.Node, None] = {}
    for n in seg.nodes:
        if roles[n] == "view":
            continue
        for user in _readers(n, roles):
            if user not in members:
                outputs.setdefault(n, None)
    seg.outputs = list(outputs)
    seg.items = _fold_epilogues(seg, _widen_products(seg, _fuse(seg, roles), roles), roles)


def _readers(node: fx.Node, roles: dict) -> list[fx.Node]:
    """The non-view nodes that read ``node``'s value, looking through views."""
    out = []
    for u in node.users:
        if roles.get(u) == "view":
            out.extend(_readers(u, roles) or [u])   # a view nobody reads still counts if it is an output
        else:
            out.append(u)
    return out


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(tensor_values(node)[0].shape)


def _fuse(seg: Segment, roles: dict) -> list[Any]:
    """The segment's items in order: view/pick/kernel nodes and FusionGroups."""
    order = {n: i for i, n in enumerate(seg.nodes)}
    group_of: dict[fx.Node, FusionGroup] = {}
    items: list[Any] = []
    escapes = set(seg.outputs)
    for node in seg.nodes:
        if roles[node] != "pointwise":
            items.append(node)
            continue
        shape, kind = _shape(node), compute_kind(node)
        target = None
        for a in node.all_input_nodes:
            g = group_of.get(a)
            if g is None or g.shape != shape or g.kind != kind:
                continue
            others = [b for b in node.all_input_nodes if group_of.get(b) is not g]
            if all(order.get(_root(b, roles), -1) < g.start for b in others):
                target = g
                break
        if target is None:
            target = FusionGroup([], shape, kind, order[node])
            items.append(target)
        target.nodes.append(node)
        group_of[node] = target
    items = _merge_into_readers(items, order)
    items = [part for it in items for part in (_fit(it, escapes, roles) if isinstance(it, FusionGroup) else [it])]
    return items


def _merge_into_readers(items: list[Any], order: dict) -> list[Any]:
    """``items`` with each group whose values only one later group of its shape and kind reads folded into
    that group (its nodes join the reader's pass, in graph order): AdamW's per-parameter update is built as
    three groups (decayed parameter, first moment, second moment and step) whose values went through HBM.
    The reader runs later than the producer did, so every operand of the producer is ready by then; other
    readers of the producer's values (an optimizer's ``copy_`` into its state) must come after the reader,
    which then writes those values too."""
    group_of = {n: it for it in items if isinstance(it, FusionGroup) for n in it.nodes}
    gone = set()
    for g in [it for it in items if isinstance(it, FusionGroup)]:
        members = set(g.nodes)
        users = [u for n in g.nodes for u in n.users if u not in members]
        readers = {id(group_of[u]): group_of[u] for u in users if u in group_of}
        if len(readers) != 1:
            continue
        (r,) = readers.values()
        if r.shape != g.shape or r.kind != g.kind or r.start < g.start or \
                any(order.get(u, -1) <= r.start for u in users if u not in group_of):
            continue
        r.nodes = sorted(r.nodes + g.nodes, key=order.__getitem__)
        for n in g.nodes:
            group_of[n] = r
        gone.add(id(g))
    return [it for it in items if id(it) not in gone]


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
# matrix products whose kernel can widen its store or apply an epilogue (the embedding backward is one: the
# one-hot of the ids times the gradient; a GPT's tied embedding then adds the output projection's gradient)
_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.embedding_dense_backward.default)


def _widen_products(seg: Segment, items: list[Any], roles: dict) -> list[Any]:
    """``items`` with each group that only widens a matrix product (2-byte float to float32) read by
    nothing else folded into that product: the matmul kernel rounds the product to its dtype as always and
    its store widens it (autocast's float32 weight gradients: one HBM write instead of write, read, write)."""
    escapes = set(seg.outputs)
    out = []
    for it in items:
        if isinstance(it, FusionGroup) and len(it.nodes) == 1 and it.nodes[0].target in _CASTS:
            cast = it.nodes[0]
            src = cast.all_input_nodes[0] if len(cast.all_input_nodes) == 1 else None
            prod = _root(src, roles) if src is not None else None
            if (prod is not None and roles.get(prod) == "kernel" and prod.target in _PRODUCTS and prod in seg.nodes
                    and prod not in escapes and _readers(prod, roles) == [cast]
                    and tensor_values(prod)[0].dtype in (torch.bfloat16, torch.float16)
                    and tensor_values(cast)[0].dtype == torch.float32):
                seg.widened[prod] = torch.float32
                seg.widen_casts[cast] = prod
                roles[cast] = "widened"
                out.append(cast)
                continue
        out.append(it)
    return out


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _fold_epilogues(seg: Segment, items: list[Any], roles: dict) -> list[Any]:
    """``items`` with each float fusion group that reads a matrix product no other node of the segment reads
    moved into that product's kernel as its epilogue (``Segment.epilogues``): the product never goes to HBM and
    back. The group has one result, which depends on the product; the product reaches it through reshapes
    only; its other operands span the product's elements and are computed before the product (they are read
    block by block while it is evicted). A product read after the segment too (an activation's input saved for
    the backward) is kept: the kernel stores it beside the group's result."""
    order = {n: i for i, n in enumerate(seg.nodes)}
    escapes = set(seg.outputs)
    out = []
    for it in items:
        hit = _epilogue_of(it, seg, roles, order, escapes) if isinstance(it, FusionGroup) else None
        if hit is None:
            out.append(it)
            continue
        seg.epilogues[hit[0]] = (it, *hit[1:])
    return out


def _producer(node: fx.Node, roles: dict) -> tuple[fx.Node, fx.Node] | None:
    """(kernel, the node of its result) when ``node`` reads, through views, a result whose kernel can apply an
    epilogue: a matrix product, or the first result (a pick) of a kernel of several results that applies it
    there (layer norm's backward: dx, the gradient a pre-norm block's residual then adds to)."""
    r = _root(node, roles)
    if roles.get(r) == "kernel" and r.target in _PRODUCTS:
        return r, r
    k = r.args[0] if roles.get(r) == "pick" and r.args[1] == 0 else None
    if isinstance(k, fx.Node) and roles.get(k) == "kernel" and k.target in _FIRST_RESULT_EPILOGUES:
        return k, r
    return None


# kernels of several results that apply an epilogue to their first (``norms.layer_norm_bwd_kernel``: the
# single-pass layer norm backward)
_FIRST_RESULT_EPILOGUES = (torch.ops.aten.native_layer_norm_backward.default,)


def _epilogue_of(g: FusionGroup, seg: Segment, roles: dict, order: dict, escapes: set) -> tuple | None:
    """(product, operand, the reshapes between them, whether the product is kept) when ``g`` can be that
    product's epilogue (see ``_fold_epilogues``), else None."""
    if g.kind != "float" or len(g.outputs) != 1:
        return None
    found = [(n, *p) for n, p in ((n, _producer(n, roles)) for n in g.inputs) if p is not None and p[0] in order]
    if len({r for _, r, _ in found}) != len(found) or not found:
        return None
    # of several products (a tied embedding's two weight gradients), the last computed: the others are operands
    src, prod, value = max(found, key=lambda f: order[f[1]])
    n = tensor_values(value)[0].numel()
    others = [a for a in g.inputs if a is not src]
    chain, node = [], src
    while node is not value:
        chain.append(node)
        node = node.args[0]
    later = [r for r in _readers(value, roles) if r not in g.nodes]   # readers after the segment (or its output)
    keep = bool(later) or value in escapes
    if value is not prod:   # the pick of a kernel's first result: part of the chain; that kernel keeps nothing
        chain.append(value)
        if keep or not norms.bwd_fits(_shape(value)[-1], len(others)):
            return None
    if (prod not in order or prod in seg.widened or prod in seg.epilogues
            or any(r in order for r in later) or any(c in escapes for c in chain) or math.prod(g.shape) != n
            or any(c.target not in _RESHAPES for c in chain if c is not value)
            or not all(tensor_values(a) and tensor_values(a)[0].numel() == n and order.get(_root(a, roles), -1) < order[prod]
                       for a in others)
            or not _depends_on(g.outputs[0], src, set(g.nodes))):
        return None
    return prod, src, chain, keep


def _depends_on(node: fx.Node, src: fx.Node, members: set) -> bool:
    """Whether ``node`` reads ``src`` through members of its group."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is src:
            return True
        if n in seen or (n is not node and n not in members):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


# Streamed tensors (inputs of more than one element, and outputs) of one fusion group: the element-wise
# template keeps NBUF = 3 [128, 2048] fp32 tiles per full input and output, plus one temporary (a broadcast
# row takes one 8 KiB tile instead, a scalar a [128, 1] column): at most (6 + 1) x 3 x 8 KiB = 168 KiB,
# within the smallest SBUF partition modelled (trn1: 192 KiB). Smaller tensors stream narrower tiles, so the
# same SBUF holds more of them (an optimizer step's per-parameter update: 4 inputs and 3 results).
MAX_GROUP_OPERANDS = 6


def _max_operands(shape: tuple) -> int:
    """Streamed tensors a group of result ``shape`` may have within MAX_GROUP_OPERANDS' SBUF budget."""
    n = math.prod(shape) if shape else 1
    full = stream_tile_width(1 << 30, 1 << 30)
    return max(MAX_GROUP_OPERANDS, (MAX_GROUP_OPERANDS + 1) * full // stream_tile_width(n, shape[-1] if shape else 1) - 1)


def _with_outputs(g: FusionGroup, escapes: set, roles: dict) -> FusionGroup:
    members = set(g.nodes)
    g.outputs = [n for n in g.nodes if n in escapes or any(u not in members for u in _readers(n, roles))]
    return g


def _fit(g: FusionGroup, escapes: set, roles: dict) -> list[FusionGroup]:
    """``g``, split in halves (in node order) until each part streams at most ``_max_operands`` tensors."""
    g = _with_outputs(g, escapes, roles)
    streamed = [n for n in g.inputs if any(t.numel() > 1 for t in tensor_values(n))]
    if len(streamed) + len(g.outputs) <= _max_operands(tuple(g.shape)) or len(g.nodes) == 1:
        return [g]
    half = len(g.nodes) // 2
    first = FusionGroup(g.nodes[:half], g.shape, g.kind, g.start)
    second = FusionGroup(g.nodes[half:], g.shape, g.kind, g.start)
    return _fit(first, escapes, roles) + _fit(second, escapes, roles)
