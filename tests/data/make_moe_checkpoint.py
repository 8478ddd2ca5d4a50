"""Writes tests/data/moe-checkpoint-v1: a tiny MoE model's checkpoint (weights and AdamW
state after two reference steps) as raypar wrote them while every expert was its own
module, and the losses of the two steps that follow it. `test_experts` loads it into
the stacked experts of today's model.

    python tests/data/make_moe_checkpoint.py     # run on the code that wrote the fixture
"""
import json
import shutil
from pathlib import Path

import torch

from raypar.checkpoint import Manifest, commit, merge_entries, write_shard
from raypar.config import config_from_dict
from raypar.reference import ReferenceTrainer
from raypar.runtime.state import state_tensors

HERE = Path(__file__).resolve().parent
MODEL = {"vocab_size": 64, "dim": 16, "n_layers": 2, "n_heads": 2, "n_experts": 4, "moe_top_k": 2,
         "moe_ffn_dim": 24, "moe_aux_loss_coef": 0.01, "max_seq_len": 16}
TRAIN = {"steps": 4, "global_batch_size": 4, "lr": 1e-2, "warmup_steps": 1}
DATA = {"seq_len": 16}


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(step))


def main() -> None:
    cfg = config_from_dict({"model": MODEL, "train": TRAIN, "data": DATA})
    ref = ReferenceTrainer(cfg)
    for step in range(2):
        ref.step(step, batch(step), batch(step))
    out = HERE / "moe-checkpoint-v1"
    shutil.rmtree(out, ignore_errors=True)
    tensors = state_tensors(ref.model, ref.optimizer, None, 0, torch.device("cpu"), with_rng=False)
    pieces = [(n, t, (0,) * t.ndim, tuple(t.shape)) for n, t in tensors.items()]
    results = write_shard(out, "shard-0.safetensors", pieces)
    commit(out, Manifest(step=2, consumed_samples=8, tensors=merge_entries(results, {n: t.shape for n, t in tensors.items()})))
    losses = [ref.step(step, batch(step), batch(step))[0] for step in (2, 3)]
    (HERE / "moe-checkpoint-v1.json").write_text(json.dumps({"model": MODEL, "train": TRAIN, "data": DATA,
                                                            "losses_after": losses}, indent=1) + "\n")


if __name__ == "__main__":
    main()
