"""Packed passes (``compiler/group_batch.py``): fusion groups of one signature streamed together give the values the
groups give as passes of their own, bit for bit (the same tile math on the same elements), across tile boundaries,
partial rows and tensors of a few elements."""
from __future__ import annotations

import pytest
import torch

from torchneuron.compiler import cache, group_batch, reports
from torchneuron.compiler.group_batch import PMAX, layout

# sizes: a partial row only, whole rows, rows then a partial row, more than a tile's rows (split by a boundary)
SHAPES = [(5,), (64,), (300, 70), (129, 3), (1000,), (64, 64), (700, 300)]


def _adamw_runs(params, grads, dtype=torch.float32) -> tuple[list, list, int]:
    """Parameters and second moments after one compiled AdamW step per gradient list; the program's instructions."""
    ps = [p.to("neuron", dtype).requires_grad_() for p in params]
    # two learning rates (no weight decay, which would make the groups' constants differ): each parameter's
    # bias-corrected step size, a host scalar, differs from its neighbour's
    opt = torch.optim.AdamW([{"params": ps[0::2], "lr": 1e-2}, {"params": ps[1::2], "lr": 3e-3}], weight_decay=0.0)
    step = torch.compile(opt.step, backend="neuron")
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.to("neuron", dtype)
        step()
    prog = reports()[-1].programs[-1]
    return [p.detach().cpu() for p in ps], [opt.state[p]["exp_avg_sq"].cpu() for p in ps], prog.instructions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_adamw_step_equals_one_pass_per_parameter_bit_for_bit(dtype, tmp_path, monkeypatch):
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(2)]
    grads[1][2][0, :4] = torch.tensor([float("inf"), float("nan"), 0.0, -0.0])   # NaN/inf stay on their elements
    grads[1][6][-1, -3:] = torch.tensor([3e38, -3e38, 1e-40])                    # near fp32's max, a subnormal
    runs = []
    real = group_batch.packed_stream
    monkeypatch.setattr(group_batch, "packed_stream", lambda fn, operands, *a, **kw: runs.append(len(operands))
                        or real(fn, operands, *a, **kw))
    packed = _adamw_runs(params, grads, dtype)
    assert runs == [len(SHAPES)]   # (traced once: the second step reuses the program)
    torch._dynamo.reset()
    cache.clear()
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path / "unpacked"))
    monkeypatch.setattr(group_batch, "signature", lambda g, values: None)
    alone = _adamw_runs(params, grads, dtype)
    for got, want in zip(packed[0] + packed[1], alone[0] + alone[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert packed[2] < alone[2]


def test_consecutive_groups_pack_and_a_dependent_group_does_not(monkeypatch):
    """Two independent groups of one signature (results in new buffers, not in place) share a pass; a third of the
    same signature reading the second's result (through a view) cannot join it. All equal the CPU exactly (each op
    rounds once in fp32, as the CPU's)."""
    runs = []
    real = group_batch.packed_stream
    monkeypatch.setattr(group_batch, "packed_stream", lambda fn, operands, *a, **kw: runs.append(len(operands))
                        or real(fn, operands, *a, **kw))

    def fn(a, b):
        d = b * 2 + 1
        return a * 2 + 1, d, d.reshape(7, 11) * 2 + 1
    a, b = torch.randn(200, 30), torch.randn(77)
    got = torch.compile(fn, backend="neuron")(a.to("neuron"), b.to("neuron"))
    for g, w in zip(got, fn(a, b)):
        assert torch.equal(g.cpu(), w)
    assert runs == [2]


def test_layout_covers_every_element_once():
    """The packed layout: every tensor's elements exactly once, rows within a tile's partitions, pieces in order."""
    sizes = [5, 64, 21000, 387, 1000, 4096, 210000]
    for f in (64, 256, 512):
        seen = [torch.zeros(n, dtype=torch.int32) for n in sizes]
        for pieces in layout(sizes, f):
            used = torch.zeros(PMAX, dtype=torch.int32)
            for pc in pieces:
                assert pc.width <= f and pc.p0 + pc.rows <= PMAX
                used[pc.p0:pc.p0 + pc.rows] += 1
                seen[pc.j][pc.e0:pc.e0 + pc.rows * pc.width] += 1
            assert used.max() <= 1
        assert all(bool((s == 1).all()) for s in seen)
