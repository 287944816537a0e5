"""The backend around the compiler: registration, the default backend on neuron, eager ops inside a graph
(fallback counting, strict mode), the on-disk program cache (a second run compiles nothing; a corrupt
entry is rebuilt) and the debug dumps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torchneuron
from torchneuron.compiler import cache_stats, clear_cache, reports
from torchneuron.runtime import profiler


def _start(code: str, env: dict, **pipes) -> subprocess.Popen:
    """A Python process running ``code`` (dedented) with ``env`` added to this one's environment; text pipes as
    ``pipes`` asks (stdout=subprocess.PIPE, ...)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, text=True,
                            **pipes)


def _run(code: str, env: dict) -> str:
    proc = _start(code, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_backend_is_registered_by_import_torch_alone(tmp_path):
    out = _run("""
        import torch
        print("neuron" in torch._dynamo.list_backends())
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="neuron")
        x = torch.randn(5, 7)
        print(torch.equal(f(x.to("neuron")).cpu(), torch.relu(x) * 2))
    """, {"TORCHNEURON_CACHE_DIR": str(tmp_path)})
    assert out.split() == ["True", "True"]


def test_default_backend_runs_neuron_graphs_through_ours():
    x = torch.randn(33, 65)
    before = {id(r) for r in reports()}     # (not a count: the list keeps the latest MAX_REPORTS)
    got = torch.compile(lambda t: torch.tanh(t) + t)(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), torch.tanh(x) + x)
    assert id(reports()[-1]) not in before and reports()[-1].segments == 1


def test_backend_rejects_options():
    from torchneuron.compiler import neuron_backend
    with pytest.raises(TypeError, match="takes no options"):
        neuron_backend(None, [], mode="max-autotune")


def test_an_op_without_lowering_runs_eagerly_between_programs():
    """cumsum has no compiler lowering: two programs around the eager op, results equal to the CPU."""
    x = torch.randn(16, 40)
    fn = lambda t: torch.cumsum(torch.exp(t) * 2, dim=1).sigmoid()  # noqa: E731
    got = torch.compile(fn, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x))
    rep = reports()[-1]
    assert rep.segments == 2 and any("cumsum" in e for e in rep.eager_nodes)


def test_fallback_inside_a_compiled_graph_is_counted_and_strict_mode_refuses_it():
    """A float64 op in a compiled graph takes the counted CPU fallback; strict mode turns it into an error."""
    x = torch.randn(8, 8)
    fn = lambda t: (t.double() * 3).sum()  # noqa: E731
    torchneuron.reset_fallback_counts()
    got = torch.compile(fn, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert torchneuron.fallback_counts()
    torch._dynamo.reset()
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError):
            torch.compile(fn, backend="neuron")(x.to("neuron"))
    finally:
        torchneuron.set_strict(False)


SCRIPT = """
    import torch, torchneuron
    from torchneuron.compiler import cache_stats
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)).to("neuron")
    y = torch.compile(m, backend="neuron")(torch.ones(8, 32, device="neuron"))
    y.sum().backward()
    print(cache_stats["misses"], cache_stats["disk_hits"], cache_stats["corrupt"], round(float(y.sum()), 3))
"""


def test_second_run_compiles_nothing_and_a_corrupt_entry_is_rebuilt(tmp_path):
    env = {"TORCHNEURON_CACHE_DIR": str(tmp_path)}
    misses, hits, corrupt, first = _run(SCRIPT, env).split()
    assert int(misses) > 0 and int(hits) == 0
    misses2, hits2, corrupt2, second = _run(SCRIPT, env).split()
    assert int(misses2) == 0 and int(hits2) == int(misses) and second == first
    entries = sorted(tmp_path.glob("*.tnp"))
    assert len(entries) == int(misses)
    entries[0].write_bytes(entries[0].read_bytes()[:-40])          # a half-written entry
    misses3, hits3, corrupt3, third = _run(SCRIPT, env).split()
    assert int(corrupt3) == 1 and int(misses3) == 1 and third == first


def test_two_processes_compiling_at_once_share_the_cache_safely(tmp_path):
    """Two processes compiling the same graphs at once into one empty cache directory: both get the values of a
    run alone, neither reads a corrupt entry, no temporary file is left, and a third run reads every program from
    disk (atomic writes: each entry is renamed into place whole)."""
    alone = _run(SCRIPT, {"TORCHNEURON_CACHE_DIR": str(tmp_path / "alone")}).split()
    shared = tmp_path / "shared"
    procs = [_start(SCRIPT, {"TORCHNEURON_CACHE_DIR": str(shared)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    for out, _ in outs:
        misses, hits, corrupt, value = out.split()
        assert int(corrupt) == 0 and value == alone[3]
    assert not list(shared.glob(".tmp-*")) and len(list(shared.glob("*.tnp"))) == int(alone[0])
    misses, hits, corrupt, value = _run(SCRIPT, {"TORCHNEURON_CACHE_DIR": str(shared)}).split()
    assert (int(misses), int(hits), int(corrupt), value) == (0, int(alone[0]), 0, alone[3])


def test_a_reader_never_sees_a_partly_written_entry(tmp_path):
    """One process rewriting a cache entry 300 times while another reads it 300 times: every read finds the whole
    program (an entry is written to a temporary file and renamed into place)."""
    writer = """
        import torch, torchneuron
        from torchneuron.compiler import cache
        torch.compile(lambda x: torch.tanh(x) * 3 + 1, backend="neuron")(torch.ones(64, 96, device="neuron"))
        (key, prog), = cache._memory.items()
        print(key, flush=True)
        for _ in range(300):
            cache.store(key, prog)
    """
    reader = """
        import sys, time, torchneuron
        from torchneuron.compiler import cache
        path = cache._path(sys.stdin.readline().strip())
        while not path.exists():
            time.sleep(0.01)
        print(sum(cache._read(path) is None for _ in range(300)))
    """
    env = {"TORCHNEURON_CACHE_DIR": str(tmp_path)}
    w = _start(writer, env, stdout=subprocess.PIPE)
    r = _start(reader, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    key = w.stdout.readline()
    r.stdin.write(key)
    r.stdin.flush()
    bad, _ = r.communicate(timeout=300)
    w.communicate(timeout=300)
    assert w.returncode == 0 and r.returncode == 0 and key.strip()
    assert int(bad) == 0


def test_in_memory_cache_serves_a_recompiled_graph():
    x = torch.randn(20, 30, device="neuron")
    fn = lambda t: torch.sin(t) * torch.cos(t)  # noqa: E731
    clear_cache()
    torch.compile(fn, backend="neuron")(x)
    before = dict(cache_stats)
    torch._dynamo.reset()
    torch.compile(fn, backend="neuron")(x)
    assert cache_stats["memory_hits"] == before["memory_hits"] + 1 and cache_stats["misses"] == before["misses"]


def test_dump_dir_holds_graph_groups_program_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path))
    x = torch.randn(64, 96)
    torch.compile(lambda t: torch.softmax(t * 2, -1) + 1, backend="neuron")(x.to("neuron"))
    rep = reports()[-1]
    d = tmp_path / rep.name
    assert "aten" in (d / "graph.txt").read_text()
    assert "segment 0" in (d / "fusion.txt").read_text()
    listing = (d / "program_s0.txt").read_text().splitlines()
    assert len(listing) == 2 + rep.programs[0].instructions
    assert json.loads((d / "report.json").read_text())["segments"] == rep.segments


@pytest.mark.parametrize("dynamic", [True, None])
def test_dynamic_shapes_are_specialized_per_concrete_shape(dynamic):
    """dynamic=True, and Dynamo's automatic dynamic shapes after a size change: each shape gets its own
    static programs (nothing falls back to eager ops), forward and backward."""
    fn = lambda t: torch.softmax(t * 2, -1).sum(0)  # noqa: E731
    f = torch.compile(fn, backend="neuron", dynamic=dynamic)
    before = {id(r) for r in reports()}
    for n in (8, 16, 24):
        x = torch.randn(n, 33)
        xn = x.to("neuron").requires_grad_()
        got = f(xn)
        got.sum().backward()
        x.requires_grad_()
        want = fn(x)
        want.sum().backward()
        torch.testing.assert_close(got.cpu(), want)
        torch.testing.assert_close(xn.grad.cpu(), x.grad)
    new = [r for r in reports() if id(r) not in before]
    assert new and all(r.segments and not r.eager_nodes for r in new)


def test_memory_plan_reuses_intermediates_and_reports_the_peak():
    """A chain of library kernels whose results die one after another: the planned arena holds no more than
    the two largest intermediates alive at once, less than one buffer each; results equal the eager ops'."""
    x = torch.randn(256, 512)
    fn = lambda t: torch.softmax(torch.softmax(torch.softmax(torch.softmax(t, -1) * 3, -1) * 3, -1) * 3, -1)  # noqa: E731
    got = torch.compile(fn, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x))
    (prog,) = reports()[-1].programs
    one = x.numel() * 4
    assert prog.buffer_bytes >= 6 * one and prog.arena_bytes <= 2 * one
    before = torch.neuron.memory_stats()["allocation.all.allocated"]
    torch.compile(fn, backend="neuron")(x.to("neuron"))       # the arena is a device allocation per call
    assert torch.neuron.memory_stats()["allocation.all.allocated"] > before


def test_fused_groups_share_their_constant_columns(tmp_path, monkeypatch):
    """A constant column is set once per program however many fused groups use it (an optimizer step's groups
    share their betas and learning rate), and -0.0 stays apart from 0.0."""
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path))

    def fn(a, w):      # a group before the first product, one epilogue of each product: three uses of 0.375
        return ((((a * 0.375) @ w) * 0.375) @ w) * 0.375
    a, w = torch.randn(128, 128), torch.randn(128, 128)
    got = torch.compile(fn, backend="neuron")(a.to("neuron"), w.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(a, w), rtol=1e-4, atol=1e-4)
    rep = reports()[-1]
    assert "with epilogue" in (tmp_path / rep.name / "fusion.txt").read_text()
    listing = (tmp_path / rep.name / "program_s0.txt").read_text().splitlines()
    assert sum("memset" in ln for ln in listing) == 1

    def zeros(x):
        return x * -0.0, x * 0.0
    x = torch.rand(64, 32) + 0.5
    for g, want in zip(torch.compile(zeros, backend="neuron")(x.to("neuron")), zeros(x)):
        assert torch.equal(g.cpu(), want) and torch.equal(torch.signbit(g.cpu()), torch.signbit(want))


def _logits_and_loss(x, w, y):
    logits = torch.tanh(x @ w)
    return logits, F.cross_entropy(logits, y)


def _grads(x, w, y, device, backward):
    """x and w's gradients after ``backward(logits, loss)`` on ``device`` (compiled there on neuron), and the
    launches that backward made."""
    xd, wd = (t.to(device).requires_grad_() for t in (x, w))
    fn = torch.compile(_logits_and_loss, backend="neuron") if device == "neuron" else _logits_and_loss
    logits, loss = fn(xd, wd, y.to(device))
    with profiler.record() as records:
        backward(logits, loss)
    return xd.grad.cpu(), wd.grad.cpu(), records


@pytest.mark.parametrize("use", ["loss only", "logits too", "given gradient"])
def test_an_unused_output_gets_no_zero_gradient(use):
    """The logits nothing used: autograd fills no zeros for them and the backward adds none (a variant of the
    backward graph without their tangent, and no zeros kernel); when the logits do get a gradient (a loss on
    them too, or one given), the full backward runs. Gradients equal the CPU's either way."""
    gen = torch.Generator().manual_seed(0)
    x, w, y = torch.randn(48, 32, generator=gen), torch.randn(32, 20, generator=gen), torch.randint(0, 20, (48,))
    g = torch.randn(48, 20, generator=gen)
    backward = {"loss only": lambda logits, loss: loss.backward(),
                "logits too": lambda logits, loss: (loss + logits.square().mean()).backward(),
                "given gradient": lambda logits, loss: torch.autograd.backward(
                    [loss, logits], [torch.ones((), device=loss.device), g.to(logits.device)])}[use]
    *got, records = _grads(x, w, y, "neuron", backward)
    *want, _ = _grads(x, w, y, "cpu", backward)
    for a, b in zip(got, want):   # fp32 products of 32 terms and one softmax: a few ulp of their magnitudes
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    programs = [r.op for r in records if r.op.startswith("compiled::")]
    assert len(programs) == 1 and ("_zero" in programs[0]) == (use == "loss only")
    if use == "loss only":   # the backward program alone: no zeros for the logits (the loss's seed of one is
        assert len(records) == 1   # the host's write of one element, no kernel)


def test_an_unused_output_whose_gradient_is_not_only_added_gets_zeros():
    """A zero tangent read by more than an add (here a product): the backward gets the zeros autograd would have
    made, and its gradients equal the CPU's; with both outputs used, the same."""
    def fn(t):
        return torch.sin(t), t * 3
    x = torch.randn(40, 24)
    for both in (False, True):
        xn, xc = x.to("neuron").requires_grad_(), x.clone().requires_grad_()
        (a, b), (ac, bc) = torch.compile(fn, backend="neuron")(xn), fn(xc)
        (a.sum() + b.sum() if both else a.sum()).backward()
        (ac.sum() + bc.sum() if both else ac.sum()).backward()
        torch.testing.assert_close(xn.grad.cpu(), xc.grad, rtol=1e-6, atol=1e-6)
        torch._dynamo.reset()


def _momentum_step(p, m, g):
    m.mul_(0.9).add_(g)
    p.add_(m, alpha=-0.1)


def _assert_step_close(got, want, old, m):
    """p - 0.1 m in fp32 on both sides, the product and the sum rounded (or fused) differently: each result within
    half an ulp of the product plus half an ulp of the sum of the exact one, 2**-24 * (|0.1 m| + |old p| +
    |0.1 m|) per element; the two results within twice that of each other."""
    bound = 2.0 ** -23 * (old.abs() + 0.2 * m.abs())
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


def test_updated_inputs_are_written_by_their_group_in_place():
    """An optimizer-style update of graph inputs: the fused group stores the new values straight into the
    inputs (each written once: no buffer and no copy after it), equal to the CPU's."""
    gen = torch.Generator().manual_seed(0)
    p, m, g = (torch.randn(300, 70, generator=gen) for _ in range(3))
    pn, mn, gn = (t.to("neuron") for t in (p, m, g))
    old = p.clone()
    torch.compile(_momentum_step, backend="neuron")(pn, mn, gn)
    _momentum_step(p, m, g)
    torch.testing.assert_close(mn.cpu(), m, rtol=0, atol=0)
    _assert_step_close(pn.cpu(), p, old, m)
    (prog,) = reports()[-1].programs
    assert prog.hbm_bytes_written == 2 * p.numel() * 4


def test_updated_inputs_read_elsewhere_or_strided_are_copied_after_their_readers():
    """An updated input another op also reads (its old value, after the update's group), or one whose layout is
    not the group's (a transposed view): the new value goes through a buffer and a copy after every reader, as
    before; results equal the CPU's."""
    def read_too(p, m, g):
        m.mul_(0.9).add_(g)
        old = p.sum(1)
        p.add_(m, alpha=-0.1)
        return old
    gen = torch.Generator().manual_seed(1)
    p, m, g = (torch.randn(64, 48, generator=gen) for _ in range(3))
    pn, mn, gn = (t.to("neuron") for t in (p, m, g))
    old = p.clone()
    got = torch.compile(read_too, backend="neuron")(pn, mn, gn)
    want = read_too(p, m, g)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)   # sums of 48 terms of ~1: fp32 order
    _assert_step_close(pn.cpu(), p, old, m)
    (prog,) = reports()[-1].programs
    assert prog.hbm_bytes_written > 2 * p.numel() * 4        # p's new value went through a buffer
    p, m, g = (torch.randn(shape, generator=gen) for shape in ((48, 64), (64, 48), (48, 64)))
    pn, mn, gn = (t.to("neuron") for t in (p, m, g))
    old = p.clone()
    torch.compile(_momentum_step, backend="neuron")(pn.t(), mn, gn.t())
    _momentum_step(p.t(), m, g.t())
    torch.testing.assert_close(mn.cpu(), m, rtol=0, atol=0)
    _assert_step_close(pn.cpu(), p, old, m.t())


def test_a_program_read_from_disk_keeps_its_checks_and_host_scalars():
    """What a traced program carries besides its instructions survives the disk cache: the device-side assertion
    of a bad class target (IndexError from a program read from disk, not a silent loss), and the slot of the host
    scalars (an AdamW step read from disk updates the parameters as the traced one did, bit for bit)."""
    x, t = torch.randn(16, 10), torch.randint(0, 10, (16,))
    bad = t.clone()
    bad[3] = 10
    ps = [torch.randn(40, 3), torch.randn(7)]
    results = []
    for run in range(2):   # traced, then read from disk (the in-memory cache and Dynamo's emptied in between)
        clear_cache()
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b: F.cross_entropy(a, b), backend="neuron")
        compiled(x.to("neuron"), t.to("neuron"))
        with pytest.raises(IndexError, match="Target out of bounds"):
            compiled(x.to("neuron"), bad.to("neuron"))
        params = [p.to("neuron").requires_grad_() for p in ps]
        opt = torch.optim.AdamW([{"params": params[:1], "lr": 1e-2}, {"params": params[1:], "lr": 3e-3}])
        step = torch.compile(opt.step, backend="neuron")
        for k in range(2):
            for p in params:
                p.grad = torch.full_like(p, 0.5 + k)
            step()
        results.append([p.detach().cpu() for p in params])
    assert cache_stats["disk_hits"] > 0
    for a, b in zip(*results):
        assert torch.equal(a, b)
