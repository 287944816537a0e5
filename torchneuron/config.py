"""TorchNeuron's configuration, read once from TORCHNEURON_* environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass

from torchneuron.sim.specs import ChipSpec, chip_spec


@dataclass(frozen=True)
class Config:
    """The settings in force for this process."""

    chip: ChipSpec
    num_devices: int
    strict: bool


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1")


def from_environment() -> Config:
    """Read TORCHNEURON_CHIP, TORCHNEURON_NUM_DEVICES and TORCHNEURON_STRICT."""
    chip = chip_spec(os.environ.get("TORCHNEURON_CHIP", "trn2").strip().lower())
    raw = os.environ.get("TORCHNEURON_NUM_DEVICES", "").strip()
    if raw:
        try:
            num_devices = int(raw)
        except ValueError:
            raise ValueError(f"TORCHNEURON_NUM_DEVICES={raw!r}: expected a positive integer") from None
        if not 1 <= num_devices <= 64:
            raise ValueError(f"TORCHNEURON_NUM_DEVICES={raw!r}: expected 1 to 64 devices")
    else:
        num_devices = chip.cores_per_chip
    return Config(chip=chip, num_devices=num_devices, strict=_flag("TORCHNEURON_STRICT"))


CONFIG = from_environment()
