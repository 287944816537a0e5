"""``torch._foreach_*`` ops run as multi-tensor launches (strict mode): bit-identical to the per-tensor
ops on the device, close to the CPU, one launch per op, and the per-tensor loop for lists that mix
devices, dtypes or layouts."""
import math

import pytest
import torch

from torchneuron.ops import foreach as foreach_ops
from torchneuron.runtime import profiler
from tests.ops.conftest import to_n

torch.manual_seed(0)
SHAPES = [(3, 4), (17,), (2, 300, 5), (0,), (1,)]


def _lists():
    x = [torch.randn(s) for s in SHAPES]
    y = [torch.randn(s) for s in SHAPES]
    z = [torch.rand(s) + 0.5 for s in SHAPES]
    return x, y, z


CASES = {
    "add_scalar": (lambda x, y, z: torch._foreach_add(x, 2.5), lambda x, y, z: [a.add(2.5) for a in x]),
    "add_list_alpha": (lambda x, y, z: torch._foreach_add(x, y, alpha=0.3),
                       lambda x, y, z: [a.add(b, alpha=0.3) for a, b in zip(x, y)]),
    "sub_scalarlist": (lambda x, y, z: torch._foreach_sub(x, [1.0, 2, 3, 4, 5]),
                       lambda x, y, z: [a.sub(s) for a, s in zip(x, [1.0, 2, 3, 4, 5])]),
    "mul_list": (lambda x, y, z: torch._foreach_mul(x, y), lambda x, y, z: [a.mul(b) for a, b in zip(x, y)]),
    "div_list": (lambda x, y, z: torch._foreach_div(x, z), lambda x, y, z: [a.div(b) for a, b in zip(x, z)]),
    "sqrt": (lambda x, y, z: torch._foreach_sqrt(z), lambda x, y, z: [a.sqrt() for a in z]),
    "exp": (lambda x, y, z: torch._foreach_exp(x), lambda x, y, z: [a.exp() for a in x]),
    "mul_tensor": (lambda x, y, z: torch._foreach_mul(x, z[4][0]), lambda x, y, z: [a.mul(z[4][0]) for a in x]),
    "addcdiv": (lambda x, y, z: torch._foreach_addcdiv(x, y, z, 0.1),
                lambda x, y, z: [a.addcdiv(b, c, value=0.1) for a, b, c in zip(x, y, z)]),
    "addcmul_tensor": (lambda x, y, z: torch._foreach_addcmul(x, y, z, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])),
                       lambda x, y, z: [a.addcmul(b, c, value=v) for a, b, c, v in
                                        zip(x, y, z, [0.1, 0.2, 0.3, 0.4, 0.5])]),
    "lerp_scalar": (lambda x, y, z: torch._foreach_lerp(x, y, 0.9),
                    lambda x, y, z: [a.lerp(b, 0.9) for a, b in zip(x, y)]),
    "lerp_list": (lambda x, y, z: torch._foreach_lerp(x, y, z), lambda x, y, z: [a.lerp(b, c) for a, b, c in
                                                                               zip(x, y, z)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_foreach_matches_per_tensor_ops_and_cpu(case, strict):
    fused, per_tensor = CASES[case]
    cpu = _lists()
    dev = [[to_n(t) for t in lst] for lst in cpu]
    got = fused(*dev)
    for g, d, c in zip(got, per_tensor(*dev), fused(*cpu)):
        assert torch.equal(g.cpu(), d.cpu())        # the same tile math as the per-tensor lowering
        torch.testing.assert_close(g.cpu(), c)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_repeated_call_launches_the_traced_program(case, strict, monkeypatch):
    # the second call with the same shapes binds its tensors to the traced program's slots directly (no trace,
    # no views): new values, the same bits as the per-tensor ops
    fused, per_tensor = CASES[case]
    for seed in (1, 2):
        torch.manual_seed(seed)
        cpu = _lists()
        dev = [[to_n(t) for t in lst] for lst in cpu]
        got = fused(*dev)
        for g, d, c in zip(got, per_tensor(*dev), fused(*cpu)):
            assert g.shape == c.shape and torch.equal(g.cpu(), d.cpu())
            torch.testing.assert_close(g.cpu(), c)
        monkeypatch.setattr(foreach_ops, "traced_kernel", None)   # a second trace would fail


def test_in_place_foreach_and_one_launch(strict):
    x, y, z = _lists()
    dx, dy, dz = ([to_n(t) for t in lst] for lst in (x, y, z))
    with profiler.record() as records:
        torch._foreach_addcdiv_(dx, dy, dz, [0.1] * 5)
    torch._foreach_addcdiv_(x, y, z, [0.1] * 5)
    assert len(records) == 1
    for a, b in zip(dx, x):
        torch.testing.assert_close(a.cpu(), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_foreach_norm_is_the_per_tensor_norm(dtype, strict):
    # one launch, each norm bit for bit linalg_vector_norm's on the device (the same instructions per tensor), over
    # partial tiles and the edges: -0 and +0 only, an inf, a NaN, squares past fp32's range, subnormal squares
    g = torch.Generator().manual_seed(7)
    x = [torch.randn(2, 300, 5, generator=g),
         torch.randn(5000, generator=g) * 10 ** (torch.rand(5000, generator=g) * 6 - 3),   # six decades
         torch.randn(256, 256, generator=g)]
    x += [torch.randn(s, generator=g) for s in [(3, 4), (17,), (1,), (5,), (7,), (8,), (9,), (10,)]]
    x[5] = torch.full((1,), 1e-30 if dtype != torch.float16 else 1e-7)
    x[6] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])
    x[7][2] = float("inf")
    x[8][3] = float("nan")
    x[9] = torch.full((9,), 3e19 if dtype != torch.float16 else 2e4)   # fp16: squares past 65504, the norm not
    dev = [to_n(t.to(dtype)) for t in x]
    with profiler.record() as records:
        got = torch._foreach_norm(dev)
    assert len(records) == 1                    # squares, sums and square roots in one launch
    for g_, t in zip(got, dev):
        want = torch.linalg.vector_norm(t)
        assert g_.shape == want.shape == () and g_.dtype == want.dtype == dtype
        assert torch.equal(g_.cpu(), want.cpu()) or (g_.isnan().item() and want.isnan().item())
        # and within n * u of the float64 norm (fp32 squares and sums), as rounding to the dtype allows, plus what
        # squares below fp32's normal range lose (at most n * 2**-126 of the sum: sqrt(n) * 2**-63 of the norm)
        exact = torch.linalg.vector_norm(t.cpu().double())
        if exact.isfinite() and (t.cpu().double().square().sum() < 2.0**127).item():
            eps = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
            assert abs(g_.cpu().double() - exact) <= (t.numel() * 2.0**-24 + eps) * exact + math.sqrt(t.numel()) * 2.0**-63
        else:
            assert g_.cpu().double().item() == exact.item() or (g_.isnan().item() and exact.isnan().item()) or \
                (exact.isfinite() and g_.cpu().isinf().item())   # an fp32 sum of squares past 3.4e38 is inf


def test_a_repeated_foreach_norm_replays_the_plan_of_its_shapes(strict):
    # norms keep a plan per list shapes: lists of other shapes in between get their own program, and a call on
    # the first shapes again gives the first call's bits for the same values, one launch, 0-d norms
    lists = [[torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
             for shapes in ([(3, 4), (17,), (1,)], [(4, 3), (5, 2), (9,)])]
    first = [torch._foreach_norm([to_n(t) for t in lst]) for lst in lists]
    for lst, want in zip(lists, first):
        with profiler.record() as records:
            got = torch._foreach_norm([to_n(t) for t in lst])
        assert len(records) == 1
        for g, w, t in zip(got, want, lst):
            exact = torch.linalg.vector_norm(t.double())
            assert g.shape == () and g.dtype == t.dtype and torch.equal(g.cpu(), w.cpu())
            assert abs(g.cpu().double() - exact) <= t.numel() * 2.0**-24 * exact


def test_lists_that_do_not_fuse_take_the_per_tensor_loop():
    a = [torch.randn(3), torch.randn(4)]
    mixed = [to_n(a[0]), to_n(a[1]).double()]               # two dtypes: the loop (float64 falls back)
    torch.testing.assert_close([t.cpu() for t in torch._foreach_mul(mixed, 2.0)], [a[0] * 2, a[1].double() * 2])
    with pytest.raises(RuntimeError):                        # lists of different lengths: PyTorch's error
        torch._foreach_add([to_n(a[0])], [to_n(a[0]), to_n(a[1])])


def test_transposed_lists_take_the_loop_and_equal_the_cpu(strict):
    # transposed (non-contiguous) lists of the shapes a contiguous call has just traced must not take its
    # traced program (which reads each tensor as a contiguous run): in place and out of place, called
    # several times, each result bit for bit the CPU's (the same IEEE fp32 add and multiply)
    torch.manual_seed(3)
    shapes = [(4, 6), (5, 3), (7, 2)]
    flat = [torch.randn(s) for s in shapes]
    cpu_t = [torch.randn(s[::-1]).t() for s in shapes]
    other = [torch.randn(s) for s in shapes]
    dev_flat, dev_t = [to_n(t) for t in flat], [to_n(t.t().contiguous()).t() for t in cpu_t]
    dev_other = [to_n(t) for t in other]
    assert not any(t.is_contiguous() for t in dev_t)
    for step in range(3):
        for cpu, dev in ((flat, dev_flat), (cpu_t, dev_t)):
            torch._foreach_add_(cpu, other, alpha=0.5)
            torch._foreach_add_(dev, dev_other, alpha=0.5)
            torch._foreach_add_(cpu, 0.25 * step)
            torch._foreach_add_(dev, 0.25 * step)
            want, got = torch._foreach_mul(cpu, other), torch._foreach_mul(dev, dev_other)
            for g, w, c, d in zip(got, want, cpu, dev):
                assert g.shape == w.shape and torch.equal(g.cpu(), w)
                assert d.stride() == c.stride() and torch.equal(d.cpu(), c)
            want, got = torch._foreach_mul(cpu, 1.5 + step), torch._foreach_mul(dev, 1.5 + step)
            assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_default_adamw_and_clipping_match_cpu(strict):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    dev = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    dev.load_state_dict(model.state_dict())
    dev.to("neuron")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, dev)]
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(3):
        for m, opt, (xi, yi) in ((model, opts[0], (x, y)), (dev, opts[1], (to_n(x), to_n(y)))):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(xi), yi).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
    for p, q in zip(model.parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["lerp_scalar", "addcmul_tensor", "sub_scalarlist"])
def test_packed_tiles_span_segments_and_tiles(case, strict):
    # a tensor longer than one packed tile (split into column segments), tails of n % 128, many small tensors
    shapes = [(300000,), (129,), (5,), (64, 33), (1,), (2050, 3)]
    cpu = [[torch.randn(s) + (2.0 if k == 2 else 0.0) for s in shapes] for k in range(3)]
    dev = [[to_n(t) for t in lst] for lst in cpu]
    fused, per_tensor = CASES[case]
    if case == "sub_scalarlist":  # its scalar list has one value per tensor of SHAPES: one per tensor here
        fused = lambda x, y, z: torch._foreach_sub(x, [float(i) for i in range(len(x))])  # noqa: E731
        per_tensor = lambda x, y, z: [a.sub(float(i)) for i, a in enumerate(x)]  # noqa: E731
    elif case == "addcmul_tensor":
        vals = torch.linspace(0.1, 0.6, len(shapes))
        fused = lambda x, y, z: torch._foreach_addcmul(x, y, z, vals)  # noqa: E731
        per_tensor = lambda x, y, z: [a.addcmul(b, c, value=float(v)) for a, b, c, v in zip(x, y, z, vals)]  # noqa: E731
    with profiler.record() as records:
        got = fused(*dev)
    assert len(records) == 1
    for g, d, c in zip(got, per_tensor(*dev), fused(*cpu)):
        assert torch.equal(g.cpu(), d.cpu())
        torch.testing.assert_close(g.cpu(), c)


@pytest.mark.parametrize("case", ["add_scalar", "sub_scalarlist", "addcmul_tensor", "lerp_scalar"])
def test_a_scalar_operand_binds_one_slot(case, strict):
    # a scalar shared by the list and the per-tensor scalars are one kernel argument each, not one per tensor:
    # the launch binds the four live tensors of each list, one slot per scalar position and the four results
    fused, _ = CASES[case]
    dev = [[to_n(t) for t in lst] for lst in _lists()]
    with profiler.record() as records:
        fused(*dev)
    lists = {"add_scalar": 1, "sub_scalarlist": 1, "addcmul_tensor": 3, "lerp_scalar": 2}[case]
    assert len(records) == 1 and len(records[0].program.args) == 4 * lists + 1 + 4


def test_per_tensor_scalars_past_one_launch(strict, monkeypatch):
    # more tensors than one launch takes, empty ones among them: each launch's (n, 1) scalars are the values of
    # its own tensors, in order, on the first call and on the planned ones, written to the device once per call
    writes = []
    write = foreach_ops.host_operand
    monkeypatch.setattr(foreach_ops, "host_operand", lambda values, *a: writes.append(values.shape) or write(values, *a))
    n = foreach_ops.MAX_GROUPS + 9
    shapes = [(0,) if i % 17 == 5 else (i % 7 + 1, 3) for i in range(n)]
    for seed in (4, 5):
        torch.manual_seed(seed)
        cpu = [torch.randn(s) for s in shapes]
        scalars = [float(v) for v in torch.randn(n)]
        den = [t.abs() + 1 for t in cpu]
        dev, dev_den = [to_n(t) for t in cpu], [to_n(t) for t in den]
        with profiler.record() as records:
            torch._foreach_mul_(dev, scalars)
            got = torch._foreach_addcdiv(dev, dev, dev_den, scalars)
        torch._foreach_mul_(cpu, scalars)
        want = torch._foreach_addcdiv(cpu, cpu, den, scalars)
        assert len(records) == 4                   # two launches per op
        live = sum(1 for s in shapes if s != (0,))
        assert writes == [(live, 1)] * 2           # one transfer of every live tensor's scalar per op
        writes.clear()
        for d, c, g, w in zip(dev, cpu, got, want):
            assert torch.equal(d.cpu(), c)         # an IEEE fp32 multiply, as the CPU's
            torch.testing.assert_close(g.cpu(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lerp_by_one_number_computes_its_branch_only(dtype, strict):
    # the branch lerp takes for a scalar weight (|w| < 0.5 or not, on the weight rounded to fp32) is chosen when
    # tracing: bit for bit the per-tensor lerp (which computes both and selects), the CPU's values, on both sides
    # of 0.5, at it, for a weight that rounds to 0.5 in fp32, for negative, infinite and NaN weights
    torch.manual_seed(6)
    cpu = [[(torch.randn(s) * 4).to(dtype) for s in [(3, 4), (17,), (130,)]] for _ in range(2)]
    for w in (0.1, -0.3, 0.49999999, 0.5, -0.5, 0.9, -2.0, float("inf"), float("nan")):
        dev = [[to_n(t) for t in lst] for lst in cpu]
        with profiler.record() as records:
            got = torch._foreach_lerp(*dev, w)
        assert len(records) == 1
        for g, s, e, (cs, ce) in zip(got, *dev, zip(*cpu)):
            assert torch.equal(g.cpu(), s.lerp(e, w).cpu()) or math.isnan(w)
            assert torch.equal(g.cpu().isnan(), s.lerp(e, w).cpu().isnan())
            torch.testing.assert_close(g.cpu(), cs.lerp(ce, w), equal_nan=True)
    lists = [[to_n(t) for t in lst] for lst in cpu]
    with profiler.record() as small:
        torch._foreach_lerp(*lists, 0.1)
    with profiler.record() as both:
        torch._foreach_lerp(*lists, lists[1])      # tensor weights: both branches and the select
    assert len(small[0].program.instructions) < len(both[0].program.instructions)


def test_equal_per_tensor_scalars_are_one_shared_operand(strict):
    # a scalar list of one number (Adam's bias corrections) is one shared (1, 1) operand: the same bits as the
    # per-tensor ops; zeros of both signs, or a NaN among equal numbers, stay one scalar per tensor (-0.0 == 0.0)
    cpu = _lists()
    dev = [[to_n(t) for t in lst] for lst in cpu]
    for scalars in ([0.3] * 5, [0.0, -0.0, 0.0, 0.0, 0.0], [2.0, 2.0, float("nan"), 2.0, 2.0]):
        with profiler.record() as records:
            got = torch._foreach_div(dev[0], scalars)
        per_tensor = sum(1 for a in records[0].program.args if tuple(a.shape) == (4, 1))   # (live tensors, 1)
        assert per_tensor == (0 if scalars[0] == 0.3 else 1)
        for g, d, c in zip(got, (a.div(s) for a, s in zip(dev[0], scalars)), torch._foreach_div(cpu[0], scalars)):
            g, d = g.cpu(), d.cpu()
            assert torch.equal(g.isnan(), d.isnan()) and torch.equal(g[~g.isnan()], d[~d.isnan()])
            torch.testing.assert_close(g, c, equal_nan=True)


def test_a_scalar_list_of_another_length_raises_like_cpu(strict):
    cpu = _lists()
    dev = [[to_n(t) for t in lst] for lst in cpu]
    for scalars in ([2.0] * 4, [2.0] * 6):
        with pytest.raises(RuntimeError) as want:
            torch._foreach_mul_(cpu[0], scalars)
        with pytest.raises(type(want.value), match="same number of elements"):
            torch._foreach_mul_(dev[0], scalars)
        with pytest.raises(type(want.value), match="same number of elements"):
            torch._foreach_addcdiv_(dev[0], dev[1], dev[2], scalars)
    assert all(torch.equal(d.cpu(), c) for d, c in zip(dev[0], cpu[0]))   # nothing written


def test_in_place_foreach_writes_over_self_with_one_slot_each(strict):
    # in place the kernel writes each result over its self tensor: one slot per tensor (not an input and an output),
    # the per-tensor ops' bits and the CPU's values on the first and the planned calls, self also read as an operand
    cpu = _lists()
    dev = [[to_n(t) for t in lst] for lst in cpu]
    each = [t.clone() for t in dev[0]]
    for step in range(2):
        with profiler.record() as records:
            torch._foreach_add_(dev[0], 2.5)
            torch._foreach_addcmul_(dev[0], dev[0], dev[1], 0.5)
        for t, o in zip(each, dev[1]):
            t.add_(2.5).addcmul_(t, o, value=0.5)
        torch._foreach_add_(cpu[0], 2.5)
        torch._foreach_addcmul_(cpu[0], cpu[0], cpu[1], 0.5)
        assert [len(r.program.args) for r in records] == [4 + 1, 4 * 3 + 1]
        for d, e, c in zip(dev[0], each, cpu[0]):
            assert torch.equal(d.cpu(), e.cpu())
            torch.testing.assert_close(d.cpu(), c)


@pytest.mark.parametrize("case", ["repeated self", "operands swapped", "addcmul reads a later self", "own elements"])
def test_in_place_lists_sharing_memory_equal_the_cpu_loop(case, strict):
    # the CPU runs an in-place foreach tensor by tensor, so a tensor written first is read written: a repeated self
    # tensor is multiplied twice, a swapped operand reads the other's new value; one launch reading every input
    # first would differ (a * 2 for a * 4). Only self[i] read at position i (a += a) keeps the one launch.
    torch.manual_seed(5)
    base = torch.randn(2, 8)
    cpu, dev = base.clone(), to_n(base)
    launches = []
    for t in (cpu, dev):
        a, b = t[0], t[1]
        later = t.view(-1)[8:]                  # b's elements as another view
        with profiler.record() as records:
            if case == "repeated self":
                torch._foreach_mul_([a, b, a], 1.5)
            elif case == "operands swapped":
                torch._foreach_add_([a, b], [b, a], alpha=0.5)
            elif case == "addcmul reads a later self":
                torch._foreach_addcmul_([a, b], [later, a], [b, b], 0.25)
            else:
                torch._foreach_add_([a, b], [a, b])
        launches.append(len(records))
    torch.testing.assert_close(dev.cpu(), cpu)   # (addcmul: the CPU may fuse its multiply-add; a stale read is off by O(1))
    assert (launches[1] == 1) == (case == "own elements")


def test_aliasing_is_decided_for_every_lists_memory(strict):
    # the aliasing decision is kept per the byte ranges of every list (an optimizer passes the same tensors every
    # step): the same self tensors with an unrelated list, then with their own tensors swapped, then unrelated
    # again, each equal the CPU loop, one launch only where nothing aliases
    torch.manual_seed(6)
    base, other = torch.randn(2, 8), torch.randn(2, 8)
    cpu, dev, cpu_other, dev_other = base.clone(), to_n(base), other, to_n(other)
    launches = []
    for t, o in ((cpu, cpu_other), (dev, dev_other)):
        for operands in ([o[0], o[1]], [t[1], t[0]], [o[0], o[1]]):
            with profiler.record() as records:
                torch._foreach_add_([t[0], t[1]], operands, alpha=0.5)
            launches.append(len(records))
    torch.testing.assert_close(dev.cpu(), cpu)   # a stale read of the swapped operand is off by O(1)
    assert launches[3:] == [1, 2, 1]
