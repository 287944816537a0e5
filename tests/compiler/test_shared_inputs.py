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


def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Make ``model``'s parameters views of one device buffer, each at an offset past a gap (none at offset 0)."""
    params = list(model.named_parameters())
    buf = torch.zeros(sum(p.numel() + 3 for _, p in params) + 7, device="neuron")
    off = 7
    for name, p in params:
        view = buf[off:off + p.numel()].view_as(p)
        view.copy_(p.detach())
        off += p.numel() + 3
        *path, last = name.split(".")
        owner = model
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, torch.nn.Parameter(view))
    return buf


def test_training_parameters_that_are_views_of_one_buffer_at_offsets():
    """A compiled model and AdamW step whose parameters are views of one buffer at non-zero offsets (inputs of one
    storage: one slot, bound from its lowest offset; the step's in-place updates there) give, bit for bit, the
    losses, parameters and BatchNorm statistics of the same compiled training with a storage per parameter, and
    the CPU's losses; the gaps between the parameters stay untouched."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.1)
    cpu_losses = []
    for _ in range(3):
        loss = cpu(x).square().mean()
        cpu_opt.zero_grad()
        loss.backward()
        cpu_opt.step()
        cpu_losses.append(loss.detach())
    runs = []
    for flat in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.BatchNorm1d(4),
                                    torch.nn.Linear(4, 3)).to("neuron")
        buf = _flat_parameters(model) if flat else None
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        fwd, step = torch.compile(model, backend="neuron"), torch.compile(opt.step, backend="neuron")
        losses = []
        for _ in range(3):
            loss = fwd(x.to("neuron")).square().mean()
            opt.zero_grad()
            loss.backward()
            step()
            losses.append(loss.detach().cpu())
        runs.append((losses, [p.detach().cpu() for p in model.parameters()], model[1].running_var.cpu()))
        if flat:
            kept = torch.ones_like(buf, dtype=torch.bool)
            for p in model.parameters():
                start = p.storage_offset()
                kept[start:start + p.numel()] = False
            assert torch.equal(buf.cpu()[kept.cpu()], torch.zeros(int(kept.sum())))
            assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in model.parameters())
    (l0, p0, v0), (l1, p1, v1) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0 + p0 + [v0], l1 + p1 + [v1]))
    # (the compiled step's bias corrections are fp32, eager AdamW's Python floats: 1e-4, the compiler's tolerance)
    torch.testing.assert_close(torch.stack(l1), torch.stack(cpu_losses), rtol=1e-4, atol=0)
