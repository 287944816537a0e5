import pytest
import torch

import torchneuron.nki.language as nl
from torchneuron.kernels import elementwise
from torchneuron.kernels.elementwise import MIN_BLOCK
from tests.kernels.conftest import DTYPES, close

SHAPES = [((1,), (1,)), ((127, 129), (127, 129)), ((300,), (300,)), ((3, 129, 5), (129, 1)),
          ((300, 1), (1, 513)), ((2, 3, 4), (1,)), ((5, 1, 7), (1, 6, 1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_callable_over_broadcast_inputs(sa, sb, dtype):
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    out = elementwise(lambda x, y: nl.maximum(x * y + 1.0, 0.0), a, b)
    assert out.dtype == dtype and out.shape == torch.broadcast_shapes(sa, sb)
    close(out, torch.clamp(a.float() * b.float() + 1, min=0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expression_string_three_inputs(dtype):
    a, b, c = torch.randn(129, 300).to(dtype), torch.randn(300).to(dtype), torch.randn(129, 1).to(dtype)
    out = elementwise("exp(a) * b - c", a, b, c)
    close(out, torch.exp(a.float()) * b.float() - c.float(), dtype)


def test_add_large_flat_tail():
    a, b = torch.randn(128 * 600 + 77), torch.randn(128 * 600 + 77)
    close(elementwise(nl.add, a, b), a + b, torch.float32)


def test_consecutive_tiles_compute_on_vector_and_gpsimd():
    # the template alternates its tiles' element-wise ops between VectorE and GpSimdE (the compiler's choice
    # for ops placed on no engine): the engines overlap, the results are those of one engine
    a, b = torch.randn(128 * 2048 * 4), torch.randn(128 * 2048 * 4)
    rep = elementwise(lambda x, y: nl.maximum(x * y + 1.0, 0.0), a, b, profile=True)
    close(rep.outputs, torch.clamp(a * b + 1, min=0), torch.float32)
    alu = [i.engine.value for i in rep.program.instructions if i.opcode in ("tensor_tensor", "tensor_scalar")]
    assert alu.count("vector") == alu.count("gpsimd") == len(alu) // 2
    assert rep.engine_busy_ns["gpsimd"] > 0 and rep.engine_busy_ns["vector"] < rep.device_time_ns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,C", [(16, 4096), (5, 3000), (1, 640), (100, 130), (127, 65)])
def test_few_long_rows_with_a_broadcast_row(R, C, dtype):
    # fewer rows than partitions: each row's column blocks spread over partitions, the broadcast row repeated
    # into each row's partitions (and a scalar beside them)
    g = torch.Generator().manual_seed(R * C)
    a, b = torch.randn(R, C, generator=g).to(dtype), torch.randn(C, generator=g).to(dtype)
    out = elementwise(lambda x, y, z: x * y + z, a, b, torch.tensor(0.5).to(dtype))
    close(out, a.float() * b.float() + 0.5, dtype)


@pytest.mark.parametrize("n", [1, 15, 64, 100, 192, 1000, 2047, 128 * 16 + 5])
def test_small_flat_tensors_stream_rows_of_a_block(n):
    # a tensor too small for [128, 16] tiles goes on fewer partitions with rows of at least 16 elements (each
    # partition's row is a DMA descriptor of its own: 4-byte rows cost an optimizer step most of its DMA time);
    # the scalar operand's column is loaded on those partitions only
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    rep = elementwise(lambda x, y, z: x * y + z, a, b, torch.tensor(0.5), profile=True)
    close(rep.outputs, a * b + 0.5, torch.float32)
    parts = [i.cost_inputs().partitions for i in rep.program.instructions if i.engine.value == "dma"]
    assert parts and max(parts) <= max(1, n // MIN_BLOCK)
