"""``torch.compile(model, backend="neuron")``: TorchDynamo -> AOTAutograd -> our graph compiler.

AOTAutograd splits a captured graph into forward and backward ATen graphs (or one inference
graph under ``no_grad``), applies ``decompositions.decomposition_table()`` and hands each graph
to ``compile_graph``, which returns a ``CompiledGraph`` in the boxed calling convention.
Input mutations in inference graphs (BatchNorm running statistics) stay in the graph as
trailing ``copy_`` ops, which run as eager ops; AOTAutograd's wrappers handle aliased outputs.

The backend is found by name through the ``torch_dynamo_backends`` entry point, so it works
after ``import torch`` alone. ``install_default_backend()`` (run when the device registers)
routes the default backend (Inductor) to this one when a compiled graph's inputs are on
``neuron``, as AWS's backend is auto-selected on a Neuron device: Inductor has no code generator
for this device.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import itertools
import sys
import warnings
from typing import Any, Callable

import torch

_graph_ids = itertools.count()


def compile_graph(kind: str) -> Callable:
    """The AOTAutograd compiler for ``kind`` graphs (``forward``, ``backward``, ``inference``)."""
    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torchneuron.compiler.graph_runner import CompiledGraph
        compiled = CompiledGraph(gm, f"g{next(_graph_ids)}_{kind}")
        compiled._boxed_call = True   # it takes the argument list itself (and clears it), as AOTAutograd asks
        return compiled
    return compile_fn


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    """The TorchDynamo backend ``"neuron"``."""
    if options:
        raise TypeError(f"torch.compile(backend='neuron') takes no options; got {sorted(options)}")
    if any(_symbolic(v) for v in example_inputs):
        return _specialize_per_shape(gm)
    return _aot(gm, example_inputs)


def _symbolic(v: Any) -> bool:
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))


_warned_dynamic = False


def _specialize_per_shape(gm: torch.fx.GraphModule) -> Callable:
    """A graph with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes after a size
    changed) is compiled again for each concrete input signature it is called with, as AWS's backend
    does: programs are static. Dynamo then stops recompiling for new sizes; this cache grows instead."""
    global _warned_dynamic
    if not _warned_dynamic:
        _warned_dynamic = True
        warnings.warn("torch.compile(backend='neuron'): a graph with dynamic shapes is specialized for each "
                      "concrete input shape (one compile per shape); pass dynamic=False to have Dynamo "
                      "recompile per shape instead", stacklevel=2)
    compiled: dict[tuple, Callable] = {}

    def run(*args: Any) -> Any:
        key = tuple((tuple(a.shape), a.stride(), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in args)
        fn = compiled.get(key)
        if fn is None:
            fn = compiled[key] = _aot(gm, list(args))
        return fn(*args)
    return run


def _aot(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    from torch._dynamo.backends.common import aot_autograd

    from torchneuron.compiler.decompositions import decomposition_table
    with _gradients_left_undefined():
        return aot_autograd(fw_compiler=compile_graph("forward"), bw_compiler=compile_graph("backward"),
                            inference_compiler=compile_graph("inference"), decompositions=decomposition_table(),
                            keep_inference_input_mutations=True)(gm, example_inputs)


@contextlib.contextmanager
def _gradients_left_undefined():
    """While AOTAutograd builds this backend's autograd function: its forward tells autograd not to fill the
    gradient of an output nothing used with zeros (``ctx.set_materialize_grads(False)``).

    The backward then gets ``None`` for it and runs without it (``graph_runner``): no zeros kernel, and no
    add of zeros to the other gradients (the demo's unused logits: ~20 us of its backward's critical path).
    AOTAutograd passes ``None`` tangents through to the compiled backward. Without the hook (another
    PyTorch's internals) autograd materializes the zeros, which is only slower."""
    try:
        from torch._functorch._aot_autograd import runtime_wrappers
        make_forward = runtime_wrappers._codegen_compiled_forward
    except (ImportError, AttributeError):
        yield
        return

    def make_forward_without_zero_gradients(*args: Any, **kwargs: Any) -> Callable:
        forward = make_forward(*args, **kwargs)

        def forward_without_zero_gradients(ctx: Any, *rest: Any) -> Any:
            ctx.set_materialize_grads(False)
            return forward(ctx, *rest)
        return forward_without_zero_gradients
    runtime_wrappers._codegen_compiled_forward = make_forward_without_zero_gradients
    try:
        yield
    finally:
        runtime_wrappers._codegen_compiled_forward = make_forward


def _on_neuron(inputs: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in inputs)


def install_default_backend() -> None:
    """Route ``torch.compile``'s default backend to ``neuron_backend`` for graphs whose inputs are on neuron."""
    wrapper = torch._TorchCompileInductorWrapper
    if getattr(wrapper.__call__, "_torchneuron", False):
        return
    inductor_call = wrapper.__call__

    def __call__(self, model_, inputs_, **kwargs):
        if _on_neuron(inputs_):
            return neuron_backend(model_, inputs_)
        return inductor_call(self, model_, inputs_, **kwargs)
    __call__._torchneuron = True
    wrapper.__call__ = __call__


def skip_device_frames() -> None:
    """Keep TorchDynamo out of this package's Python (the eager kernels, the simulator).

    Around a graph break, eager ops run while Dynamo's frame hook is installed; without this it would
    try to compile our eager kernels' frames themselves (seconds per op). Dynamo is imported lazily
    (it costs seconds), so the package is added to its skip list when ``torch._dynamo.trace_rules``
    loads, or at once if it already has."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is not None:
        rules.add("torchneuron")
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("torch._dynamo.trace_rules", lambda m: m.add("torchneuron")))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` has been executed (once)."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        real, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return real.create_module(spec)

            def exec_module(self, module: Any) -> None:
                real.exec_module(module)
                then(module)
        spec.loader = Loader()
        return spec
