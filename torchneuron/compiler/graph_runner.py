"""Running a compiled graph: its steps in order, each segment's Program launched once per call.

``CompiledGraph(gm, name)`` partitions the graph once, and writes the plan's steps as one Python
function (operand lookups resolved once, not interpreted per call). A call runs the steps:

    eager node   the ATen op on the host values (it dispatches to the eager neuron kernel, or the
                 counted CPU fallback; strict mode holds); a run of like ops on CPU tensors as one
                 foreach call
    segment      its Program for the inputs' signature (traced on the first call with that
                 signature, or read from the cache), launched once: inputs bound as the flat span
                 of their storage, outputs viewed with the layout the trace gave them

Views are applied to host tensors on demand (``torch`` views: the strides eager would give).
A segment whose lowering meets a case it cannot emit (``NotLowerable``) runs as eager ops for
that signature, with a one-time warning; the report counts it.

A backward graph may get ``None`` for a tangent: the gradient of an output nothing used, which
autograd is asked not to fill with zeros (``backend.py``). Such a call runs a variant of the graph in
which the tangent is known to be zero: its ``add``s drop out (``x + 0`` is ``x``, as eager's autograd
never adds it). A variant whose zero tangent has other uses gets the zeros after all.
"""
from __future__ import annotations

import keyword
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchneuron import _C, runtime
from torchneuron.compiler import cache
from torchneuron.compiler.codegen import (HOST_SCALARS, InputSig, OutputLayout, SegmentProgram, signatures,
                                         trace_segment)
from torchneuron.compiler.memory_plan import ARENA
from torchneuron.compiler.partition import Plan, Segment, partition, tensor_values
from torchneuron.compiler.report import GraphReport, dump_graph, dump_segment
from torchneuron.compiler.values import NotLowerable
from torchneuron.runtime.launch import launch_slots

EAGER = "eager"   # a segment signature that runs as eager ops
_ERRORS = {"IndexError": IndexError, "RuntimeError": RuntimeError, "ValueError": ValueError}   # Check.error


class CompiledGraph:
    """A partitioned ATen graph, callable with the boxed calling convention (the argument list is cleared)."""

    def __init__(self, gm: fx.GraphModule, name: str):
        t0 = time.perf_counter()
        self.gm, self.name = gm, name
        self.plan: Plan = partition(gm.graph)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.programs: dict[tuple, _Binding | str] = {}   # per input signature: its bound program, or EAGER
        # per segment: (bound program, device) by the inputs' layout key (``_C._layout_key``: what their signatures
        # are made from), so that a call with inputs laid out as before computes no signatures
        self.by_layout: list[dict[bytes, tuple]] = [{} for _ in self.plan.segments]
        self.report = GraphReport.of(name, self.plan, time.perf_counter() - t0)
        self.fingerprints = [cache.segment_fingerprint(self.plan, s) for s in self.plan.segments]
        self.zero_variants: dict[tuple[int, ...], CompiledGraph | None] = {}
        # the inputs that may be None (an undefined gradient): tensors something reads
        self.optional_inputs = [i for i, p in enumerate(self.placeholders)
                                if p.users and isinstance(p.meta.get("val"), torch.Tensor)]
        steps = _StepsSource(self)
        self.run_steps = steps.function()
        self.foreach_runs = steps.foreach_runs   # (aten op, nodes) per run of eager ops called as one foreach op
        dump_graph(self)

    def __call__(self, args: list) -> list:
        """Run the graph on ``args`` (cleared, as the boxed convention asks); return its outputs."""
        absent = tuple(i for i in self.optional_inputs if i < len(args) and args[i] is None)
        if absent:
            return self._with_zero_inputs(absent, args)
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args))
        args.clear()
        return self.run_steps(env)

    def _with_zero_inputs(self, absent: tuple[int, ...], args: list) -> list:
        """A call whose tensor inputs ``absent`` are ``None`` (undefined gradients: zeros)."""
        if absent not in self.zero_variants:
            gm = without_zero_inputs(self.gm, [self.placeholders[i] for i in absent])
            self.zero_variants[absent] = None if gm is None else CompiledGraph(
                gm, f"{self.name}_zero{'_'.join(map(str, absent))}")
        variant = self.zero_variants[absent]
        if variant is not None:
            return variant(args)
        device = next(a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "neuron")
        for i in absent:   # the zeros autograd would have made
            val = self.placeholders[i].meta["val"]
            args[i] = torch.zeros(val.shape, dtype=val.dtype, device=device)
        return self(args)

    def _run_eager(self, node: fx.Node, env: dict) -> Any:
        """One fx node run on host values: an ATen op (or getitem), a method call, or a graph attribute."""
        if node.op == "get_attr":   # a constant the graph holds (AOTAutograd's lifted tensor constants)
            value = self.gm
            for part in node.target.split("."):
                value = getattr(value, part)
            return value
        a, kw = fx.node.map_arg((node.args, node.kwargs), lambda n: self._host(n, env))
        if node.op == "call_method":
            return getattr(a[0], node.target)(*a[1:], **kw)
        return node.target(*a, **kw)

    def _host(self, node: fx.Node, env: dict) -> Any:
        """A node's host value; views (and picks of views) are applied to host tensors on demand."""
        if node in env:
            return env[node]
        if self.plan.roles.get(node) != "view":
            raise RuntimeError(f"compiled graph {self.name}: {node.name} has no host value (a partition bug)")
        a, kw = fx.node.map_arg((node.args, node.kwargs), lambda n: self._host(n, env))
        try:
            v = node.target(*a, **kw)
        except RuntimeError:  # a ``view`` the program output's layout does not allow: of a copy, as reshape does
            v = node.target(a[0].contiguous(), *a[1:], **kw)
        env[node] = v
        return v

    def _segment(self, seg: Segment, values: list, env: dict) -> None:
        """Run ``seg`` on its input values: launch its program for their signatures (or run its nodes eagerly)."""
        # fast path: the inputs' layout key (``_C._layout_key``) seen before gives the bound program and device
        layout = _C._layout_key(values)
        known = self.by_layout[seg.index]
        found = known.get(layout) if layout is not None else None
        if found is None:
            found = self._bound(seg, values)
            if layout is not None:
                known[layout] = found
        bound, device = found
        if bound is EAGER:
            self._eager(seg, env)
            return
        prog = bound.prog
        tensors: list = [None] * len(prog.program.args)
        for i, pos, length, offset, words, whole in bound.inputs:
            v = values[i]
            if whole and not v.is_cpu:   # contiguous over its own slot: bound as it is (the launch sees its span)
                tensors[pos] = v
                continue
            t = _scalar_to_device(v, device) if v.is_cpu else v
            # the span of its storage it reaches, or that of the inputs sharing the storage (one slot)
            t = t.as_strided((length,), (1,), t.storage_offset() - offset)
            tensors[pos] = t.view(torch.int32) if words else t   # int64: its words
        if prog.host_scalars:   # CPU 0-d operands, written to the device together
            tensors[bound.host_scalars] = _scalars_to_device([values[i] for i in prog.host_scalars], device)
        if bound.arena is not None:   # the planned intermediates: one device allocation per call
            slot = prog.program.args[bound.arena]
            tensors[bound.arena] = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        out = launch_slots(prog.program, tensors, device.index, f"compiled::{self.name}")
        for check, pos in zip(prog.checks, bound.checks):   # device-side assertions (one host read each, as the
            if out[pos].reshape(-1)[0].item():                # eager ops read them)
                raise _ERRORS[check.error](check.message)
        env.update(zip(bound.slot_outputs, bound.slot_views(out)))
        for node, lay in bound.host_outputs:
            if lay.dtype is not None:   # a placeholder the program does not compute (never read)
                env[node] = torch.empty(lay.shape, dtype=lay.dtype, device=device)
            else:
                env[node] = lay.scalar

    def _bound(self, seg: Segment, values: list) -> tuple[_Binding | str, torch.device]:
        """(``seg``'s bound program for its input values' signatures, traced or loaded on first use, or EAGER; the
        device it runs on)."""
        sigs = signatures(values)
        device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.device.type == "neuron"), None)
        if device is None:   # a segment reading no device tensor (an ``arange``): the device its results are on
            device = next(t.device for n in seg.outputs for t in tensor_values(n) if t.device.type == "neuron")
        key = (seg.index, device.index, *sigs)
        bound = self.programs.get(key)
        if bound is None:
            prog = self._compile(seg, sigs, device)
            bound = self.programs[key] = prog if prog is EAGER else _Binding.of(prog, sigs, seg)
        return bound, device

    def _compile(self, seg: Segment, sigs: list, device: torch.device | None) -> SegmentProgram | str:
        """The segment's program for these signatures: from the cache, else traced (and stored)."""
        spec = runtime.core(device.index).spec
        key = cache.program_key(self.fingerprints[seg.index], sigs, spec.name)
        t0 = time.perf_counter()
        prog = cache.load(key)
        if prog is not None:
            self.report.cache_hits += 1
            return prog
        try:
            prog = trace_segment(self.plan, seg, sigs, spec, f"{self.name}_s{seg.index}")
        except NotLowerable as e:
            warnings.warn(f"torch.compile(backend='neuron'): graph {self.name}, segment {seg.index} runs as eager "
                          f"ops for these inputs: {e}", stacklevel=3)
            self.report.eager_segments += 1
            return EAGER
        self.report.add_program(seg.index, prog, time.perf_counter() - t0, spec)
        cache.store(key, prog)
        dump_segment(self, seg, prog, spec)
        return prog

    def _eager(self, seg: Segment, env: dict) -> None:
        for node in seg.nodes:
            env[node] = self._run_eager(node, env)


@dataclass(frozen=True)
class _Binding:
    """A segment's program for one input signature, with where each argument goes in its launch's slot order
    worked out once: per bound input (its position among the segment's inputs, its slot's position, the slot's
    length, the input's offset in the slot, whether it is int64 bound as int32 words, whether it is its whole
    slot as it is: ``_whole_slot``), the host scalars' slot, the arena's, each check's, the outputs in slots
    (their nodes, and ``_C._SlotViews`` making their views of the launch's slots: as_strided in the slot's
    storage, whatever the slot's shape; an int64 output as its slot's int32 words) and the others (node, layout)."""

    prog: SegmentProgram
    inputs: list[tuple[int, int, int, int, bool, bool]]
    host_scalars: int | None
    arena: int | None
    checks: list[int]
    slot_outputs: list[fx.Node]
    slot_views: Any
    host_outputs: list[tuple[fx.Node, OutputLayout]]

    @staticmethod
    def of(prog: SegmentProgram, sigs: list, seg: Segment) -> _Binding:
        """The binding of ``prog``, traced for inputs of signatures ``sigs``."""
        index = prog.slot_index
        inputs = [(i, index[slot], max(sig.slot_span, 1), sig.slot_offset, sig.dtype == torch.int64, _whole_slot(sig))
                  for i, (sig, slot) in enumerate(zip(sigs, prog.input_slots)) if slot is not None]
        in_slots = [(node, lay) for node, lay in zip(seg.outputs, prog.outputs) if lay.slot is not None]
        views = _C._SlotViews([index[lay.slot] for _, lay in in_slots], [list(lay.shape) for _, lay in in_slots],
                              [list(lay.stride) for _, lay in in_slots], [lay.offset for _, lay in in_slots],
                              [lay.dtype for _, lay in in_slots])
        return _Binding(prog, inputs, index.get(HOST_SCALARS), index.get(ARENA), [index[c.slot] for c in prog.checks],
                        [node for node, _ in in_slots], views,
                        [(node, lay) for node, lay in zip(seg.outputs, prog.outputs) if lay.slot is None])


def _whole_slot(sig: InputSig) -> bool:
    """Whether an input of signature ``sig`` is its slot's span as it is: contiguous (a size-1 dim's stride aside),
    its slot its own, not int64 (bound as int32 words). A launch binds such a tensor at its slot's shape, as it
    does the 1-D view of its span."""
    if sig.shared or sig.dtype == torch.int64:
        return False
    expected = 1
    for n, st in zip(reversed(sig.shape), reversed(sig.stride)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


class _StepsSource:
    """A compiled graph's steps as one generated Python function of the host values ``env`` (placeholders
    filled) returning the graph's outputs: each eager node's op called with its operands' lookups resolved
    once, here (an operand computed by an earlier step is read from ``env``, a view made on first use by a
    generated function of its own, as ``_host`` does), each segment run by ``_segment``. Per call this costs the
    ops, not an fx interpretation (``map_arg`` and a role lookup per operand of each node); the ops, their order
    and their arguments are the same. A run of like ops on CPU tensors (an optimizer's per-parameter ``step``
    arithmetic) is one call of their foreach op, which runs the same per-tensor kernels in order with one
    dispatch (``_FOREACH``)."""

    def __init__(self, graph: CompiledGraph):
        self.graph, self.roles = graph, graph.plan.roles
        self.scope: dict[str, Any] = {"host": graph._host, "map_arg": fx.node.map_arg, "segment": graph._segment,
                                      "run_eager": graph._run_eager}
        self.names: dict[int, str] = {}
        self.inputs: set[fx.Node] = set(graph.placeholders)   # in ``env`` from the start
        self.defined = set(self.inputs)                        # in ``env`` when the next step runs
        self.views: dict[fx.Node, str] = {}                    # view node -> its function's name
        self.functions: list[str] = []
        self.foreach_runs: list[tuple[Any, list[fx.Node]]] = []   # (aten op, its nodes) per foreach call

    def function(self) -> Callable[[dict], list]:
        """The generated function."""
        lines, steps, i = [], self.graph.plan.steps, 0
        while i < len(steps):
            step = steps[i]
            if isinstance(step, Segment):
                values = ", ".join(self.operand(n, self.defined) for n in step.inputs)
                lines.append(f"segment({self.ref(step)}, [{values}], env)")
                self.defined.update(step.outputs)
                i += 1
                continue
            run = self.foreach_run(steps, i)
            lines.extend(self.foreach_call(run) if len(run) > 1 else [f"env[{self.ref(step)}] = {self.call(step)}"])
            self.defined.update(run)
            i += len(run)
        outputs = self.graph.output_node.args[0]
        if isinstance(outputs, (tuple, list)):
            lines.append(f"return [{', '.join(self.operand(n, self.defined) for n in outputs)}]")
        else:
            lines.append(f"return list(map_arg({self.ref(outputs)}, lambda n: host(n, env)))")
        source = "".join(self.functions) + _function_source("run_steps", lines)
        exec(compile(source, f"<compiled graph {self.graph.name}>", "exec"), self.scope)
        return self.scope["run_steps"]

    def foreach_run(self, steps: list, i: int) -> list[fx.Node]:
        """The eager nodes from ``steps[i]`` on that run as one foreach call: consecutive, of one ``_FOREACH`` op
        with the same numbers, and CPU tensor operands in ``env`` before the run (none another node's result: the
        foreach op computes them in order, as the separate calls do, from operands all looked up before). Just
        ``steps[i]`` if none."""
        first = steps[i]
        if not self.batchable(first):
            return [first]
        run = [first]
        for node in steps[i + 1:]:
            if (isinstance(node, Segment) or node.target is not first.target or not self.batchable(node)
                    or not _same_numbers(first, node)):
                break
            run.append(node)
        return run

    def batchable(self, node: fx.Node) -> bool:
        """Whether ``node`` may be one of a foreach call's: a ``_FOREACH`` op on CPU tensors already in ``env``
        (not views: made on first use) and numbers, as its entry's pattern says, without keywords."""
        entry = _FOREACH.get(node.target) if node.op == "call_function" and not node.kwargs else None
        if entry is None or len(node.args) != len(entry[1]) or not _on_cpu(node):
            return False
        return all(isinstance(a, fx.Node) and a in self.defined and self.roles.get(a) != "view" and _on_cpu(a)
                   if kind == "t" else type(a) in (int, float, bool) for a, kind in zip(node.args, entry[1]))

    def foreach_call(self, run: list[fx.Node]) -> list[str]:
        """The lines running the nodes ``run`` as one call of their foreach op, each result put in ``env``
        (an in-place op's: its first operand); the number as one 0-d tensor per node where ``_NUMBER_AS_TENSOR``
        allows (each node's tensor fp32 or fp64, its result of that dtype: the same bits, in the foreach op's
        tensor-list form, which is ~2.5x faster on the CPU than its number form)."""
        op, pattern = _FOREACH[run[0].target]
        dtypes = {n.meta["val"].dtype for n in run} | {a.meta["val"].dtype for n in run for a in n.args
                                                      if isinstance(a, fx.Node)}
        as_tensor = _NUMBER_AS_TENSOR.get(run[0].target) if len(dtypes) == 1 else None
        if as_tensor is not None and dtypes <= {torch.float32, torch.float64}:
            number = next(a for a, kind in zip(run[0].args, pattern) if kind == "n")
            with unset_fake_temporarily():   # (the graph is compiled under fake tensors; the constant is real)
                const = self.ref(torch.tensor(number, dtype=dtypes.pop(), device="cpu"))
            op, pattern = as_tensor, pattern.replace("n", "c")
        args = [f"[{', '.join(self.operand(n.args[pos], self.defined) for n in run)}]" if kind == "t"
                else f"[{', '.join([const] * len(run))}]" if kind == "c"
                else self.ref(run[0].args[pos]) for pos, kind in enumerate(pattern)]
        call, results = f"{self.ref(op._op)}({', '.join(args)})", ", ".join(f"env[{self.ref(n)}]" for n in run)
        self.foreach_runs.append((run[0].target, list(run)))
        if run[0].target in _IN_PLACE:
            return [call, f"{results} = {', '.join(self.operand(n.args[0], self.defined) for n in run)}"]
        return [f"{results} = {call}"]

    def ref(self, obj: Any) -> str:
        """A name in the function's scope bound to ``obj``."""
        name = self.names.get(id(obj))
        if name is None:
            name = self.names[id(obj)] = f"v{len(self.names)}"
            self.scope[name] = obj
        return name

    def operand(self, a: Any, defined: set[fx.Node]) -> str:
        """The expression of one argument (where the nodes ``defined`` are in ``env``): a node's host value, a
        structure holding nodes, or a constant."""
        if isinstance(a, fx.Node):
            if self.roles.get(a) == "view":
                return f"{self.view(a)}(env)"
            if a in defined:
                return f"env[{self.ref(a)}]"
            return f"host({self.ref(a)}, env)"   # (not computed yet: a partition bug, which ``_host`` reports)
        if isinstance(a, (tuple, list, dict, slice)) and _holds_node(a):
            return f"map_arg({self.ref(a)}, lambda n: host(n, env))"
        return self.ref(a)

    def arguments(self, node: fx.Node, defined: set[fx.Node]) -> list[str] | None:
        """The expressions of a node's arguments, keywords as ``name=``; None if a keyword is no identifier."""
        if not all(k.isidentifier() and not keyword.iskeyword(k) for k in node.kwargs):
            return None
        return ([self.operand(a, defined) for a in node.args]
                + [f"{k}={self.operand(v, defined)}" for k, v in node.kwargs.items()])

    def target(self, node: fx.Node) -> str:
        """The name of a call_function node's callable: an OpOverload's ``_op`` (the same ATen operator its call
        runs, one Python frame less)."""
        fn = node.target
        return self.ref(fn._op if type(fn) is torch._ops.OpOverload else fn)

    def call(self, node: fx.Node) -> str:
        """The expression of an eager node's value (what ``_run_eager`` computes)."""
        args = None if node.op == "get_attr" else self.arguments(node, self.defined)
        if args is None:
            return f"run_eager({self.ref(node)}, env)"
        if node.op == "call_method":
            return f"getattr({args[0]}, {self.ref(node.target)})({', '.join(args[1:])})"
        return f"{self.target(node)}({', '.join(args)})"

    def view(self, node: fx.Node) -> str:
        """The name of a function of ``env`` returning view node ``node``'s host value: kept in ``env`` when first
        made; a view its operand's layout does not allow is of a contiguous copy (what ``_host`` does)."""
        name = self.views.get(node)
        if name is not None:
            return name
        name = self.views[node] = f"view{len(self.views)}"
        n = self.ref(node)
        args = self.arguments(node, self.inputs) if node.args else None
        if args is None:
            self.functions.append(_function_source(name, [f"return host({n}, env)"]))
            return name
        call, rest = self.target(node), "".join(f", {a}" for a in args[1:])
        self.functions.append(_function_source(name, [
            f"if {n} in env:", f"    return env[{n}]", f"a = {args[0]}", "try:", f"    v = {call}(a{rest})",
            "except RuntimeError:", f"    v = {call}(a.contiguous(){rest})", f"env[{n}] = v", "return v"]))
        return name


aten = torch.ops.aten
# aten op -> its foreach op, and per positional argument: "t" a tensor (a list of one per node), "n" a number (the
# run's). On CPU each foreach op runs the aten op per tensor, in order (bit for bit the separate calls: tested).
_FOREACH = {aten.add.Tensor: (aten._foreach_add.Scalar, "tn"), aten.sub.Tensor: (aten._foreach_sub.Scalar, "tn"),
            aten.mul.Tensor: (aten._foreach_mul.Scalar, "tn"), aten.div.Tensor: (aten._foreach_div.Scalar, "tn"),
            aten.pow.Scalar: (aten._foreach_pow.ScalarAndTensor, "nt"), aten.neg.default: (aten._foreach_neg.default, "t"),
            aten.reciprocal.default: (aten._foreach_reciprocal.default, "t"),
            aten.sqrt.default: (aten._foreach_sqrt.default, "t"), aten.copy_.default: (aten._foreach_copy_.default, "tt")}
_IN_PLACE = {aten.copy_.default}   # their foreach op returns nothing; each node's value is its first operand
# the tensor-list form of a number op's foreach op: the number as a 0-d tensor of the op's fp32 or fp64 dtype gives
# the same bits (the CPU kernels read a scalar operand in that dtype; fp16/bf16 kernels would read the number in
# fp32, which a 0-d tensor of their dtype cannot hold)
_NUMBER_AS_TENSOR = {aten.add.Tensor: aten._foreach_add.List, aten.sub.Tensor: aten._foreach_sub.List,
                     aten.mul.Tensor: aten._foreach_mul.List, aten.div.Tensor: aten._foreach_div.List,
                     aten.pow.Scalar: aten._foreach_pow.List}


def _on_cpu(node: fx.Node) -> bool:
    """Whether a node's value (as traced) is a CPU tensor."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _same_numbers(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' number arguments are the same: type, value and a zero's sign (``x - 0.0`` differs from
    ``x - -0.0`` at ``x = -0.0``; ``1`` and ``1.0`` promote differently); NaN never is."""
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, fx.Node):
            return True
        return type(x) is type(y) and x == y and (type(x) is not float or math.copysign(1.0, x) == math.copysign(1.0, y))
    return all(same(x, y) for x, y in zip(a.args, b.args))


def _function_source(name: str, lines: list[str]) -> str:
    """The source of ``def name(env)`` with body ``lines``."""
    return f"def {name}(env):\n" + "".join(f"    {line}\n" for line in lines)


def _holds_node(a: Any) -> bool:
    """Whether an argument structure contains an fx node."""
    found = []
    fx.node.map_arg(a, found.append)
    return bool(found)


def without_zero_inputs(gm: fx.GraphModule, zeros: list[fx.Node]) -> fx.GraphModule | None:
    """A copy of ``gm`` in which the placeholders ``zeros`` are known to be zero and no node reads them:
    each ``add(x, zero)`` is ``x`` (when it has ``x``'s dtype, shape and strides). ``None`` if another
    use remains (a product, a view, an output)."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for zero in (copies[z] for z in zeros):
        for use in list(zero.users):
            other = _added_to_zero(use, zero)
            if other is None:
                return None
            use.replace_all_uses_with(other)
            graph.erase_node(use)
    graph.lint()
    return fx.GraphModule(gm, graph)


def _added_to_zero(node: fx.Node, zero: fx.Node) -> fx.Node | None:
    """``x`` if ``node`` is ``x + zero`` (or ``zero + x``) and equals ``x`` exactly: same dtype, shape and
    strides (no promotion or broadcast), ``alpha`` only on the zero."""
    if node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2 or node.args.count(zero) != 1:
        return None
    other = node.args[1] if node.args[0] is zero else node.args[0]
    if not isinstance(other, fx.Node) or ("alpha" in node.kwargs and node.args[0] is zero):
        return None
    out, val = node.meta.get("val"), other.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)):
        return None
    same = (out.dtype, out.shape, out.stride(), out.device) == (val.dtype, val.shape, val.stride(), val.device)
    return other if same else None


def _scalar_to_device(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU 0-d operand written straight into device memory (a host-to-device transfer, as eager's scalar
    operands are: no kernel launch)."""
    t = torch.empty((), dtype=v.dtype, device=device)
    _C._alias_as_cpu(t).copy_(v)
    return t


def _scalars_to_device(vs: list, device: torch.device) -> torch.Tensor:
    """CPU fp32 0-d operands written straight into one device vector (one host-to-device transfer)."""
    t = torch.empty((len(vs),), dtype=torch.float32, device=device)
    _C._alias_as_cpu(t).copy_(torch.stack(vs))
    return t
