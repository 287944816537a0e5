"""Graph inputs that share one storage (a fused projection's q, k and v, a tensor and its transpose) are bound
as one program slot, each seen through its own offset and strides: values equal the CPU's and eager's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torchneuron.compiler.codegen import signatures


def _slots(dump, kind: str) -> list[str]:
    """The input slots of the one dumped program of a ``kind`` graph (``args:`` line of its listing)."""
    (listing,) = (p for p in dump.glob("*/program_s*.txt") if kind in p.parent.name)
    args = listing.read_text().splitlines()[1].removeprefix("args: ").split(", ")
    return [a for a in args if ":input:" in a and not a.startswith("arena")]


def test_signatures_mark_inputs_of_one_storage():
    """Device tensors of one storage and dtype share a slot that spans them all, from the lowest offset; other
    inputs (another storage, another dtype view, a CPU tensor, a scalar) keep their own."""
    base = torch.arange(100, dtype=torch.float32, device="neuron")
    a, b, c = base[40:60], base[10:30].view(4, 5).t(), base[50:90]
    other = torch.zeros(8, device="neuron")
    words = base.view(torch.int32)[:8]
    sigs = signatures([a, other, b, 3.0, c, words, torch.ones(2)])
    assert [s.shared for s in sigs] == [(0, 30, 80), None, (0, 0, 80), None, (0, 40, 80), None, None]
    assert (sigs[0].slot_span, sigs[1].slot_span, sigs[1].slot_offset) == (80, 8, 0)


def test_overlapping_offset_and_transposed_views_of_one_storage(tmp_path, monkeypatch):
    """Three views of one storage as inputs, the first at the highest offset (the slot starts at another's), one
    transposed: one input slot, and each view reads its own elements (bit for bit: the same fp32 roundings as
    the CPU's and eager's)."""
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    base = torch.randn(40, 40, generator=torch.Generator().manual_seed(0))

    def views(t):
        return t[12:32, 6:36], t.t()[3:23, 1:31], t[0:20, 10:40]

    def f(a, b, c):
        return a * b - c

    dev = base.to("neuron")
    got = torch.compile(f, backend="neuron")(*views(dev))
    torch.testing.assert_close(got.cpu(), f(*views(base)), rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), f(*views(dev)).cpu(), rtol=0, atol=0)
    assert len(_slots(tmp_path / "dump", "inference")) == 1


def test_an_input_updated_in_place_while_another_view_of_it_is_read():
    """``x`` updated in place while ``y``, a view of the same storage, is read before and after: the values
    eager computes (AOTAutograd orders the update after the reads), and ``x`` holds the CPU's update."""
    def f(x, y):
        before = y * 2
        x.mul_(3).add_(1)
        return before, y + x[: y.shape[0]]

    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    dev = base.to("neuron")
    want = f(base[8:], base[:40])
    got = torch.compile(f, backend="neuron")(dev[8:], dev[:40])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    torch.testing.assert_close(dev.cpu(), base, rtol=0, atol=0)


def test_attention_backward_reads_q_k_v_of_one_projection_from_one_slot(tmp_path, monkeypatch):
    """The backward of attention over a fused projection's heads gets q, k and v as three inputs of one storage:
    one slot for the three (the kernel then loads each row's q, k and v as one piece), gradients equal eager's
    bit for bit."""
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    B, T, H, E = 4, 32, 4, 16
    lin = torch.nn.Linear(H * E, 3 * H * E)

    def attend(x, w, b):
        q, k, v = F.linear(x, w, b).split(H * E, dim=2)
        q, k, v = (z.view(B, T, H, E).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * E)

    x = torch.randn(B, T, H * E, generator=torch.Generator().manual_seed(2))
    grads = []
    for run in (torch.compile(attend, backend="neuron"), attend):
        w, b = (p.detach().to("neuron").requires_grad_() for p in (lin.weight, lin.bias))
        xn = x.to("neuron").requires_grad_()
        run(xn, w, b).square().sum().backward()
        grads.append([t.grad.cpu() for t in (xn, w, b)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    slots = _slots(tmp_path / "dump", "backward")
    # q, k, v each span all rows but two heads' columns of the projection; the three together all of it
    qkv = [s for s in slots if f"[{B * T * 3 * H * E - 2 * H * E}]" in s or f"[{B * T * 3 * H * E}]" in s]
    assert len(qkv) == 1, slots
