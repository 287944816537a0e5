"""The graph runner's per-call paths: the generated step function against an fx interpretation of the same plan,
programs selected per input signature after earlier calls (layouts, offsets, shared storage), one InputSig per
tensor layout, and an eager node's error."""
from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from torchneuron import _C
from torchneuron.compiler import graph_runner
from torchneuron.compiler.codegen import InputSig, signature, signatures
from torchneuron.compiler.graph_runner import CompiledGraph
from torchneuron.compiler.partition import Segment


@pytest.fixture
def graphs(monkeypatch) -> list[CompiledGraph]:
    """The CompiledGraphs the backend makes while the test runs, in order."""
    made: list[CompiledGraph] = []
    init = CompiledGraph.__init__

    def recording_init(self, gm, name):
        init(self, gm, name)
        made.append(self)
    monkeypatch.setattr(graph_runner.CompiledGraph, "__init__", recording_init)
    return made


def _interpreted(graph: CompiledGraph, env: dict) -> list:
    """The graph's outputs from host values ``env`` by walking its plan node by node (an fx interpretation, no
    generated code)."""
    for step in graph.plan.steps:
        if isinstance(step, Segment):
            graph._segment(step, [graph._host(n, env) for n in step.inputs], env)
        else:
            env[step] = graph._run_eager(step, env)
    return list(fx.node.map_arg(graph.output_node.args[0], lambda n: graph._host(n, env)))


def _twin(v):
    """A tensor of ``v``'s layout, dtype, device and values in new memory (other values as they are)."""
    if not isinstance(v, torch.Tensor):
        return v
    t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    with torch.no_grad():
        t.copy_(v)
    return t


def _assert_identical(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert (g.dtype, g.shape, g.stride(), g.device) == (w.dtype, w.shape, w.stride(), w.device)
            assert torch.equal(g.cpu(), w.cpu())
        else:
            assert g == w


def _checked_against_interpretation(graph: CompiledGraph) -> list[int]:
    """Make each call of ``graph`` also run its plan interpreted on twins of its inputs, and assert the outputs
    and the inputs after the call (an optimizer step updates them in place) are identical. Returns the list
    the count of checked calls is appended to."""
    generated, calls = graph.run_steps, []

    def both(env: dict) -> list:
        twins = {n: _twin(v) for n, v in env.items()}
        with torch.no_grad():
            want = _interpreted(graph, dict(twins))
        got = generated(env)
        _assert_identical(got, want)
        _assert_identical([env[n] for n in graph.placeholders], [twins[n] for n in graph.placeholders])
        calls.append(len(calls))
        return got
    graph.run_steps = both
    return calls


def test_generated_steps_equal_the_interpreted_plan_with_constants_kwargs_lists_and_host_views(graphs):
    """Eager nodes with a lifted constant (``get_attr``), keyword arguments, a list operand and views of host
    values between two programs: the generated function gives the interpreted plan's outputs bit for bit
    (values, dtypes, layouts)."""
    def f(x, y):
        h = (x * 3 + y).sum(0)                                   # a program
        d = h.double()                                           # float64: eager ops from here
        e = torch.add(d, torch.tensor([0.5, -2.0, 4.0, 1.0], dtype=torch.float64, device=d.device), alpha=-3)
        c = torch.cat([e, d.flip(0), e[1:3]])                    # a list operand, views of host values
        return (c.float() * y[0, :1]).exp(), e.t(), d.view(2, 2)[1]

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(5, 4, generator=gen).to("neuron") for _ in range(2))
    torch.compile(f, backend="neuron", dynamic=False)(x, y)
    (graph,) = graphs
    eager = [s for s in graph.plan.steps if not isinstance(s, Segment)]
    assert any(s.op == "get_attr" for s in eager) and any(s.kwargs for s in eager)
    assert len(graph.plan.steps) - len(eager) == 2
    calls = _checked_against_interpretation(graph)
    for _ in range(2):   # (the programs traced by the first call)
        graph([x, y])
    assert len(calls) == 2
    got = graph([x, y])
    for g, w in zip(got, f(x.cpu(), y.cpu())):   # and the eager CPU values (float64 math: rounding aside)
        torch.testing.assert_close(g.cpu(), w)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam])
def test_generated_optimizer_step_equals_the_interpreted_plan(graphs, optimizer):
    """A compiled Adam(W) step (its bias corrections: eager ops on CPU 0-d ``step`` tensors, bound as host
    scalars, run as one foreach call per op: a run of one node per parameter) updates parameters, moments and
    steps bit for bit as the interpreted plan (one call per node) does."""
    shapes = ((6, 5), (7,), (3, 2))

    def states():
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(shape, generator=gen).to("neuron").requires_grad_() for shape in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to("neuron")
        return params, optimizer(params, lr=1e-2)

    params, opt = states()
    step = torch.compile(opt.step, backend="neuron")
    step()
    (graph,) = graphs
    eager = [s for s in graph.plan.steps if not isinstance(s, Segment)]
    assert len(eager) > 10
    batched = [n for _, nodes in graph.foreach_runs for n in nodes]
    assert sorted(map(str, batched)) == sorted(map(str, eager))   # every eager node, in runs of one per parameter
    assert {len(nodes) for _, nodes in graph.foreach_runs} == {len(shapes), 2 * len(shapes)}
    assert {str(op) for op, _ in graph.foreach_runs} >= {"aten.add.Tensor", "aten.pow.Scalar", "aten.copy_.default"}
    calls = _checked_against_interpretation(graph)
    for _ in range(3):
        step()
    assert len(calls) == 3
    want_params, want_opt = states()
    for _ in range(4):
        want_opt.step()
    for p, w in zip(params, want_params):   # and the eager step's values (rounding aside: other roundings)
        torch.testing.assert_close(p.detach().cpu(), w.detach().cpu())
    for state, want in zip(opt.state.values(), want_opt.state.values()):
        assert torch.equal(state["step"], want["step"]) and state["step"].device.type == "cpu"


def _bits(t: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and bytes (NaN payloads and zero signs included)."""
    return t.dtype, t.shape, t.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("aten_op", list(graph_runner._FOREACH), ids=str)
def test_each_foreach_op_gives_its_aten_op_per_tensor_bit_for_bit(aten_op):
    """On CPU, each table entry's foreach op gives, per tensor, the bits its aten op gives (a returned result, or
    an in-place op's first operand): fp32 0-d and 1-D, fp64 and int64 tensors holding +-0, +-inf, NaN, 65504,
    ints above 2**24, subnormals; int, float and negative-zero numbers."""
    op, pattern = graph_runner._FOREACH[aten_op]
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 2.0**24 + 1, 1e-40, -3.5, 0.9, 1.0]
    gen = torch.Generator().manual_seed(5)

    def tensors() -> list[torch.Tensor]:
        return [torch.tensor(0.999), torch.tensor(-0.0), torch.tensor(edges), torch.tensor(edges, dtype=torch.float64),
                torch.randn(9, generator=gen) * 100, torch.tensor([3, -7, 2**25 + 1, 0])]
    for number in (1, 0.01, -0.0, 0.9, 2):
        firsts, seconds = tensors(), [t.flip(0) * 0.5 for t in tensors()]
        lists = iter([firsts, seconds])
        args = [next(lists) if kind == "t" else number for kind in pattern]
        try:
            want = [aten_op(*[a[i] if kind == "t" else a for a, kind in zip(args, pattern)]).clone()
                    for i in range(len(firsts))]
        except RuntimeError:   # an op the int64 tensor does not have (sqrt, reciprocal: float results are fine)
            continue
        args = [[t.clone() for t in a] if kind == "t" else a for a, kind in zip(args, pattern)]
        got = op(*args)
        if aten_op in graph_runner._IN_PLACE:
            assert got is None or got == []
            got = args[0]
        assert [_bits(g) for g in got] == [_bits(w) for w in want]


@pytest.mark.parametrize("aten_op", list(graph_runner._NUMBER_AS_TENSOR), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_number_as_a_0d_tensor_of_the_op_dtype_gives_the_number_form_bits(aten_op, dtype):
    """The tensor-list foreach form the graph runner calls for a number op on fp32 or fp64 tensors (the number as a
    0-d tensor of that dtype) gives, per tensor, the bits of the aten op with the number: 0-d and 1-D tensors
    holding +-0, +-inf, NaN, 65504, ints above 2**24, subnormals, a tenth; int, float, bool and negative-zero
    numbers, including ones fp32 rounds (0.1, 1e-40)."""
    op = graph_runner._NUMBER_AS_TENSOR[aten_op]
    pattern = graph_runner._FOREACH[aten_op][1]
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 2.0**24 + 1, 1e-40, -3.5, 0.9, 1.0, 0.1]
    gen = torch.Generator().manual_seed(7)
    for number in (1, 0.1, -0.0, 0.9, 2, 1e-40, True, 2.0**24 + 1):
        tensors = [torch.tensor(0.999, dtype=dtype), torch.tensor(-0.0, dtype=dtype), torch.tensor(edges, dtype=dtype),
                   (torch.randn(9, generator=gen) * 100).to(dtype), torch.tensor(3.0, dtype=dtype)]
        try:
            want = [aten_op(*[t if kind == "t" else number for kind in pattern]) for t in tensors]
        except RuntimeError:   # (subtracting a bool: no graph holds it)
            continue
        const = torch.tensor(number, dtype=dtype)
        got = op(*[[t.clone() for t in tensors] if kind == "t" else [const] * len(tensors) for kind in pattern])
        assert [_bits(g) for g in got] == [_bits(w) for w in want]


def test_a_run_is_one_foreach_call_only_of_independent_cpu_nodes_with_the_same_numbers(graphs):
    """Consecutive eager CPU ops are one foreach call only when none reads another's result, their numbers are the
    same (type, value, a zero's sign) and their tensors are on the CPU (not float64 neuron tensors: eager neuron
    ops); the outputs are the eager CPU values bit for bit, and the interpreted plan's."""
    def f(a, b, c, x, y):
        a1 = a + 1
        a2 = a1 + 1                              # reads a1
        s1, s2 = a - 0.0, b - -0.0               # another zero
        m1, m2 = a * 5, b * 5.0                  # int and float
        d1, d2, d3 = a * 3, b * 3, c * 3         # one run
        xs, ys = x.double(), y.double()
        return a2, s1, s2, m1, m2, d1, d2, d3, xs.sqrt(), ys.sqrt()

    a, b, c = torch.tensor(-0.0), torch.tensor(2.5), torch.tensor(-7.0)
    gen = torch.Generator().manual_seed(6)
    x, y = torch.rand(3, generator=gen).to("neuron"), torch.rand(4, generator=gen).to("neuron")
    compiled = torch.compile(f, backend="neuron", dynamic=False)
    compiled(a, b, c, x, y)
    (graph,) = graphs
    eager = [s for s in graph.plan.steps if not isinstance(s, Segment)]
    assert [str(s.target) for s in eager].count("aten.add.Tensor") == 2
    assert sum(str(s.target) == "aten.sqrt.default" and not graph_runner._on_cpu(s) for s in eager) == 2
    assert [(str(op), [n.args for n in nodes]) for op, nodes in graph.foreach_runs] == [
        ("aten.mul.Tensor", [(p, 3) for p in graph.placeholders[:3]])]
    calls = _checked_against_interpretation(graph)
    got = compiled(a, b, c, x, y)
    assert len(calls) == 1
    want = f(a, b, c, x.cpu(), y.cpu())
    assert [_bits(g) for g in got[:8]] == [_bits(w) for w in want[:8]]


def test_a_run_of_in_place_copies_gives_each_node_its_destination():
    """A run of ``copy_`` nodes (one foreach call, which returns nothing) gives each node its destination: the
    input tensor itself, holding the float64 source rounded to float32 (1e300: inf)."""
    def f(a, b, c, d):
        return torch.ops.aten.copy_.default(a, c), torch.ops.aten.copy_.default(b, d)

    a, b = torch.zeros(3), torch.zeros(())
    c, d = torch.tensor([0.1, -0.0, 1e300], dtype=torch.float64), torch.tensor(1 / 3, dtype=torch.float64)
    graph = CompiledGraph(make_fx(f, tracing_mode="fake")(a, b, c, d), "copies")
    assert [(str(op), len(nodes)) for op, nodes in graph.foreach_runs] == [("aten.copy_.default", 2)]
    got = graph([a, b, c, d])
    assert got[0] is a and got[1] is b
    assert _bits(a) == _bits(c.float()) and _bits(b) == _bits(d.float())


def test_programs_are_selected_per_layout_offset_and_shared_storage_after_repeated_calls(graphs):
    """After calls that reuse one program, inputs with other strides, another storage offset, or views of one
    storage (bound as one slot) get their own program, and an earlier layout its earlier one: each call's values
    equal the CPU's bit for bit (a multiply by 2 and one fp32 add)."""
    def f(a, b):
        return a * 2 + b

    gen = torch.Generator().manual_seed(2)
    base = torch.randn(64, generator=gen)
    dense_a, dense_b = base[:24].view(4, 6).clone(), base[24:48].view(4, 6).clone()
    torch.compile(f, backend="neuron", dynamic=False)(dense_a.to("neuron"), dense_b.to("neuron"))
    (graph,) = graphs

    def check(a: torch.Tensor, b: torch.Tensor) -> int:
        """The call's programs so far, after checking its value."""
        dev = base.to("neuron")
        da = dev.as_strided(a.shape, a.stride(), a.storage_offset()) if a.untyped_storage() is base.untyped_storage() \
            else a.to("neuron")
        db = dev.as_strided(b.shape, b.stride(), b.storage_offset()) if b.untyped_storage() is base.untyped_storage() \
            else b.to("neuron")
        (got,) = graph([da, db])
        assert torch.equal(got.cpu(), f(a, b))
        return len(graph.programs)

    n = check(dense_a, dense_b)
    assert check(dense_a * 3, dense_b - 1) == n                                    # same signatures: no new program
    transposed = base[:24].view(6, 4).t()
    assert check(transposed, dense_b) == n + 1                                     # other strides
    assert check(base[5:29].view(4, 6), dense_b) == n + 1                          # shared? no: b is another storage
    shared = (base[:24].view(4, 6), base[30:54].view(4, 6))
    assert check(*shared) == n + 2                                                 # one storage: one slot
    assert check(base[10:34].view(4, 6), base[40:64].view(4, 6)) == n + 2          # same shape of sharing
    assert check(base[1:25].view(4, 6), base[0:24].view(4, 6)) == n + 3            # overlapping, the first later
    assert check(base[8:32].view(4, 6), base[8:32].view(4, 6)) == n + 4            # one tensor twice
    assert check(transposed, base[40:64].view(4, 6)) == n + 5                      # transposed and sharing
    assert check(dense_a, dense_b) == n + 5                                        # the first layout: its program


def test_one_input_sig_per_layout_and_spans_as_computed():
    """Tensors of one layout (any storage, offset, values) get one InputSig; another dtype, shape or stride gets
    another; spans follow the strides; a shared signature is a new InputSig with its own span."""
    a = torch.zeros(4, 6, device="neuron")
    b = torch.ones(30, device="neuron")[3:27].view(4, 6)
    assert signature(a) is signature(b)
    assert signature(a) == InputSig((4, 6), (6, 1), torch.float32)
    t = b.view(6, 4).t()
    others = [a.to(torch.bfloat16), a.view(6, 4), t, torch.zeros(4, 6, dtype=torch.float32)[:, :5]]
    assert len({signature(v) for v in [a, *others]}) == 5
    assert [signature(v).span for v in [a, t, others[3], a[:0]]] == [24, 24, 23, 0]
    sigs = signatures([a[1:], a[:2]])
    assert [s.shared for s in sigs] == [(0, 6, 24), (0, 0, 24)]
    assert [s.span for s in sigs] == [18, 12] and [s.slot_span for s in sigs] == [24, 24]
    assert signature(a[1:]).shared is None
    again = signatures([a[1:], a[:2]])
    assert all(x is y for x, y in zip(sigs, again)) and sigs[0] != sigs[1]


def test_input_sig_hash_is_the_fields_and_stays_in_its_process():
    """An InputSig hashes as its fields do (equal InputSigs: equal hashes, whether made by ``signature`` or not);
    a pickled one leaves its cached hash behind."""
    t = torch.zeros(3, 5, device="neuron")[:, 1:]
    made = signature(t)
    fresh = InputSig((3, 4), (5, 1), torch.float32)
    assert hash(made) == hash(fresh) == hash(((3, 4), (5, 1), torch.float32, None, None)) and made == fresh
    assert {made: 1}[fresh] == 1
    assert hash(signature(2.5)) == hash(signature(2.5)) != hash(signature(3.5))
    assert "_hash" not in pickle.loads(pickle.dumps(made)).__dict__ and pickle.loads(pickle.dumps(made)) == made


def test_host_scalars_of_other_bits_or_types_get_other_input_sigs():
    """A program traced for a host scalar is reused only for that scalar: 0.0 and -0.0 (x * s differs in the sign
    of a zero), 1, 1.0 and True are different inputs, a NaN is the same NaN again (not a new program per call)."""
    nan = float("nan")
    distinct = [0.0, -0.0, 1, 1.0, True, nan, float("inf"), -float("inf"), 2.5, complex(0.0, -0.0), 0j]
    sigs = [signature(v) for v in distinct]
    assert len(set(sigs)) == len(distinct)
    assert all(a != b for i, a in enumerate(sigs) for b in sigs[i + 1:])
    assert signature(nan) == signature(float("nan")) and {signature(nan): 1}[signature(float("nan"))] == 1
    assert signature(-0.0) == signature(-0.0) and signature(True) == signature(True)
    assert math.copysign(1.0, signature(-0.0).scalar) == -1.0   # (the value the program is traced with)


def _value_pool(seed: int) -> list[list]:
    """Random segment input lists: device tensors of a few layouts and dtypes (fresh, or views of one storage at
    various offsets, one of them twice), CPU tensors, and host scalars."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.zeros(64, device="neuron")
    ints = torch.zeros(64, dtype=torch.int32, device="neuron")

    def tensor() -> torch.Tensor:
        kind = int(torch.randint(6, (1,), generator=gen))
        off = int(torch.randint(0, 8, (1,), generator=gen))
        if kind == 0:
            return torch.zeros(4, 6, device="neuron")
        if kind == 1:
            return base[off:off + 24].view(4, 6)
        if kind == 2:
            return base[off:off + 24].view(6, 4).t()
        if kind == 3:
            return ints[off:off + 24].view(4, 6)
        if kind == 4:
            return base.view(torch.int32)[off:off + 24].view(4, 6)    # the float storage as int32: another group
        return torch.zeros(4, 6)
    scalars = [0.0, -0.0, 1, 1.0, True, False, None, float("nan"), 2.5]
    pool = []
    for _ in range(300):
        values = [tensor() if torch.rand(1, generator=gen) < 0.7
                  else scalars[int(torch.randint(len(scalars), (1,), generator=gen))] for _ in range(3)]
        if torch.rand(1, generator=gen) < 0.2 and isinstance(values[0], torch.Tensor):
            values[2] = values[0]                                          # one tensor twice
        pool.append(values)
    return pool


def test_equal_layout_keys_give_equal_signatures():
    """``_C._layout_key`` (the graph runner's per-call lookup of a bound program) holds what the inputs' signatures
    are made from: of 300 random input lists, two with equal keys have equal signatures (layouts, scalars' bits and
    types, which inputs share a storage and where), and two with equal signatures and no shared storage have equal
    keys where no two device tensors share a storage (fresh tensors of a layout seen before find its program)."""
    pool = _value_pool(0)
    keys = [_C._layout_key(v) for v in pool]
    sigs = [signatures(v) for v in pool]
    assert all(k is not None for k in keys)
    by_key: dict = {}
    for k, s in zip(keys, sigs):
        assert by_key.setdefault(k, s) == s
    assert len(by_key) > 50                              # (the pool is varied)
    def shares(values: list) -> bool:
        groups = [(v.untyped_storage().data_ptr(), v.dtype) for v in values
                  if isinstance(v, torch.Tensor) and not v.is_cpu]
        return len(set(groups)) < len(groups)
    unshared = [(k, s, v) for k, s, v in zip(keys, sigs, pool) if not shares(v)]
    assert len(unshared) > 100
    by_sig: dict = {}
    for k, s, v in unshared:   # (the key also tells a CPU tensor from a device one: they are bound differently)
        by_sig.setdefault((*s, *(str(x.device) for x in v if isinstance(x, torch.Tensor))), set()).add(k)
    assert all(len(ks) == 1 for ks in by_sig.values())


def test_layout_keys_tell_scalars_and_sharing_apart_and_leave_other_values_to_signatures():
    """Scalars as ``scalar_key`` tells them apart (0.0 / -0.0, 1 / 1.0 / True, a NaN equal to itself); views of one
    storage differ from two storages and from other offsets in it; a value the key does not describe (a complex,
    a NumPy scalar, an int beyond 64 bits, a list, a tensor without storage) gives None: that call computes its
    signatures."""
    scalars = [0.0, -0.0, 1, 1.0, True, float("nan"), float("inf"), None]
    keys = [_C._layout_key([s]) for s in scalars]
    assert len(set(keys)) == len(scalars) and _C._layout_key([float("nan")]) == keys[5]
    base = torch.zeros(48, device="neuron")
    two = _C._layout_key([base[:24].view(4, 6), torch.zeros(4, 6, device="neuron")])
    one = _C._layout_key([base[:24].view(4, 6), base[24:].view(4, 6)])
    moved = _C._layout_key([base[:24].view(4, 6), base[20:44].view(4, 6)])
    assert len({two, one, moved}) == 3
    wide = torch.zeros(100, device="neuron")                 # the same sharing elsewhere in a storage: the same key
    assert _C._layout_key([wide[30:54].view(4, 6), wide[54:78].view(4, 6)]) == one
    import numpy as np
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True)
    for odd in (1j, np.float64(1.0), 2 ** 70, [1.0], sparse):
        assert _C._layout_key([base, odd]) is None


def test_an_eager_node_raising_raises_the_cpu_error_and_the_next_call_runs(graphs):
    """An out-of-range index read by an eager node raises the error type the CPU raises; the same graph then runs
    good calls with the CPU's values."""
    def f(x, idx, y):
        return y * 2 + 1, x.double()[idx] * 3

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, generator=gen), torch.randn(3, 5, generator=gen)
    good, bad = torch.tensor([3, 0, 1]), torch.tensor([1, 9, 0])
    with pytest.raises(Exception) as cpu_error:
        f(x, bad, y)
    assert cpu_error.type is IndexError
    compiled = torch.compile(f, backend="neuron", dynamic=False)
    compiled(x, good, y.to("neuron"))
    with pytest.raises(cpu_error.type):
        compiled(x, bad, y.to("neuron"))
    for _ in range(2):
        got = compiled(x, good, y.to("neuron"))
        for g, w in zip(got, f(x, good, y)):
            assert torch.equal(g.cpu(), w)
    assert len(graphs) == 1


def test_a_view_its_operand_layout_does_not_allow_is_of_a_contiguous_copy(graphs):
    """A ``view`` of an input traced contiguous, called with a transposed input: the view the layout does not
    allow is taken of a contiguous copy (as ``reshape`` would), as the interpreted plan does, with the CPU's
    values."""
    def f(x):
        return x.view(-1).double() * 3, x * 2

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, generator=gen)
    torch.compile(f, backend="neuron", dynamic=False)(x.to("neuron"))
    (graph,) = graphs
    calls = _checked_against_interpretation(graph)
    transposed = torch.randn(6, 4, generator=gen).t()
    with pytest.raises(RuntimeError):
        transposed.view(-1)
    got = graph([transposed.to("neuron").t().contiguous().t()])
    assert len(calls) == 1
    assert torch.equal(got[0].cpu(), transposed.reshape(-1).double() * 3)
    assert torch.equal(got[1].cpu(), transposed * 2)


def test_an_input_is_bound_as_it_is_only_when_contiguous_over_a_slot_of_its_own():
    """``_whole_slot``: contiguous layouts (a size-1 dim's stride aside, a 0-d tensor) are; transposed, strided or
    int64 inputs, or inputs sharing a slot, are not (they are bound as the 1-D view of their span)."""
    base = torch.zeros(8, 6, device="neuron")
    cases = {base: True, base[2:5]: True, base[:, :1]: False, base[:1]: True, base[3, :]: True, base[0, 0]: True,
             base.t(): False, base[::2]: False, base.as_strided((4, 1, 6), (6, 99, 1)): True,
             base.long(): False, base[:, 2]: False}
    for t, whole in cases.items():
        assert graph_runner._whole_slot(signature(t)) is whole, (t.shape, t.stride())
    assert not any(graph_runner._whole_slot(s) for s in signatures([base[:2], base[4:]]))
