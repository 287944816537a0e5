"""The graph compiler behind ``torch.compile(model, backend="neuron")``.

One stage per module, in pipeline order:

    backend.py          TorchDynamo backend: AOTAutograd with ``decompositions.py``'s table
    lowering.py         what each ATen op becomes: a view, a fusable pointwise op, a library kernel
                        (``kernel_lowerings.py``) or an eager op
    partition.py        the graph cut into segments (one Program each) and eager ops; fusion groups
    codegen.py          a segment traced into one Program of NeuronCore instructions (``values.py``:
                        a tensor inside the trace)
    graph_runner.py     a compiled graph's calls: programs launched, eager ops run between them
    cache.py            programs cached in memory and on disk
    report.py           compile reports and ``TORCHNEURON_DUMP_DIR`` dumps

``docs/compile.md`` walks through an example.
"""
from __future__ import annotations

from torchneuron.compiler import kernel_lowerings  # noqa: F401  (registers the library-kernel lowerings)
from torchneuron.compiler.backend import neuron_backend
from torchneuron.compiler.cache import cache_dir, clear as clear_cache, stats as cache_stats
from torchneuron.compiler.report import GraphReport, reports

__all__ = ["neuron_backend", "reports", "GraphReport", "cache_dir", "clear_cache", "cache_stats"]
