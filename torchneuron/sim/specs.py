"""Chip specifications: the single table every figure of the hardware model comes from.

Sources (paths in the public ``aws-neuron/aws-neuron-sdk`` repository):
  A-v2  nki/guides/architecture/trainium_inferentia2_arch.rst   (Trn1, NeuronCore-v2)
  A-v3  nki/guides/architecture/trainium2_arch.rst              (Trn2, NeuronCore-v3)
  A-v4  nki/guides/architecture/trainium3_arch.rst              (Trn3, NeuronCore-v4)
  HW    about-neuron/arch/neuron-hardware/*.rst
  DMAO  nki/get-started/about/nki-dma-overview.rst
Figures marked DERIVED are arithmetic on published ones; ASSUMPTION marks a choice
where the documentation gives no number.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
KiB = 1 << 10


@dataclass(frozen=True)
class ChipSpec:
    """One Trainium chip model and the NeuronCore generation inside it."""

    name: str                   # TORCHNEURON_CHIP value
    core_generation: str        # NeuronCore-vN
    cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bytes_per_second: float  # whole chip
    tensor_clock_hz: float
    vector_clock_hz: float
    scalar_clock_hz: float
    gpsimd_clock_hz: float
    sbuf_partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    dma_engines_per_core: int
    dma_bytes_per_second_per_core: float
    tensor_bf16_flops_per_core: float
    tensor_fp32_flops_per_core: float

    @property
    def hbm_bytes_per_core(self) -> int:
        """HBM capacity one NeuronCore sees: the chip's HBM divided among its cores (DERIVED)."""
        return self.hbm_bytes_per_chip // self.cores_per_chip

    @property
    def hbm_bytes_per_second_per_core(self) -> float:
        """HBM bandwidth share of one core (DERIVED: chip bandwidth / cores)."""
        return self.hbm_bytes_per_second / self.cores_per_chip


CHIPS: dict[str, ChipSpec] = {
    "trn1": ChipSpec(
        name="trn1",
        core_generation="NeuronCore-v2",
        cores_per_chip=2,                     # A-v2
        hbm_bytes_per_chip=32 * GiB,          # A-v2: 2 stacks, 32 GiB
        hbm_bytes_per_second=820e9,           # A-v2
        tensor_clock_hz=2.8e9,                # A-v2
        vector_clock_hz=1.12e9,               # A-v2
        scalar_clock_hz=1.4e9,                # A-v2
        gpsimd_clock_hz=1.4e9,                # A-v2
        sbuf_partitions=128,                  # A-v2
        sbuf_bytes_per_partition=192 * KiB,   # A-v2: 24 MiB = 128 x 192 KiB
        psum_bytes_per_partition=16 * KiB,    # A-v2: 2 MiB = 128 x 16 KiB
        psum_banks=8,                         # A-v2
        dma_engines_per_core=16,              # DMAO
        dma_bytes_per_second_per_core=272e9,  # DMAO: 16 engines x 17 B/ns
        tensor_bf16_flops_per_core=92e12,     # A-v2
        tensor_fp32_flops_per_core=23e12,     # A-v2
    ),
    "trn2": ChipSpec(
        name="trn2",
        core_generation="NeuronCore-v3",
        cores_per_chip=8,                     # A-v3
        hbm_bytes_per_chip=96 * GiB,          # A-v3: 4 stacks, 96 GiB
        hbm_bytes_per_second=2.9e12,          # HW (A-v3 rounds to 3 TB/s)
        tensor_clock_hz=2.4e9,                # A-v3
        vector_clock_hz=0.96e9,               # A-v3
        scalar_clock_hz=1.2e9,                # A-v3
        gpsimd_clock_hz=1.2e9,                # A-v3
        sbuf_partitions=128,                  # A-v3
        sbuf_bytes_per_partition=224 * KiB,   # A-v3: 28 MiB = 128 x 224 KiB
        psum_bytes_per_partition=16 * KiB,    # A-v3
        psum_banks=8,                         # A-v3
        dma_engines_per_core=16,              # DMAO
        dma_bytes_per_second_per_core=368e9,  # DMAO: 16 engines x 23 B/ns
        tensor_bf16_flops_per_core=79e12,     # A-v3
        tensor_fp32_flops_per_core=20e12,     # A-v3
    ),
    "trn3": ChipSpec(
        name="trn3",
        core_generation="NeuronCore-v4",
        cores_per_chip=8,                     # A-v4
        hbm_bytes_per_chip=144 * GiB,         # A-v4: 4 stacks, 144 GiB
        hbm_bytes_per_second=4.7e12,          # A-v4 (HW says 4.9 TB/s)
        tensor_clock_hz=2.4e9,                # A-v4
        vector_clock_hz=1.2e9,                # A-v4
        scalar_clock_hz=1.2e9,                # A-v4
        gpsimd_clock_hz=1.2e9,                # A-v4
        sbuf_partitions=128,                  # A-v4
        sbuf_bytes_per_partition=256 * KiB,   # DERIVED: 32 MiB / 128 partitions (A-v4)
        psum_bytes_per_partition=16 * KiB,    # A-v4
        psum_banks=8,                         # A-v4
        dma_engines_per_core=16,              # DMAO
        dma_bytes_per_second_per_core=528e9,  # DMAO: 16 engines x 33 B/ns
        tensor_bf16_flops_per_core=79e12,     # A-v4
        tensor_fp32_flops_per_core=20e12,     # A-v4
    ),
}


def chip_spec(name: str) -> ChipSpec:
    """Look up a chip model by its TORCHNEURON_CHIP name."""
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"unknown neuron chip {name!r}: expected one of {sorted(CHIPS)}") from None
