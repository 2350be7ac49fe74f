"""A few learner steps on fixed data, under torchrun or alone; each rank saves its parameters.

``python -m torch.distributed.run --nproc_per_node 2 tests/support/ddp_steps.py MODEL OUT``
(or plain ``python tests/support/ddp_steps.py MODEL OUT`` for the world of one). Rank 0
drives with ``Trainer.lead``, as the learner service does: it broadcasts each step's
samples and trains its shard;
the other ranks run ``Trainer.follow`` until rank 0's ``close``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

from rlbus.learner.settings import LearnerSettings, OffPolicySettings
from rlbus.learner.trainer import Trainer
from rlbus.learner.work import Work


def steps(count: int) -> list[list[Work]]:
    """Batches of different sizes (7, 1 and 4 sequences: one rank gets none in the second),
    sequences of different lengths, sampled and observed spans, mixed-sign advantages."""
    rng = random.Random(7)
    out = []
    for k in range(count):
        batch: list[Work] = []
        for _ in range((7, 1, 4)[k % 3]):
            length = rng.randint(6, 30)
            ids = [rng.randrange(3, 40) for _ in range(length)]
            sampled = [i >= 3 and rng.random() < 0.6 for i in range(length)]
            logprobs = [-rng.uniform(0.5, 4.0) if s else 0.0 for s in sampled]
            batch.append(Work(ids, sampled, logprobs, rng.choice([-1.5, -0.5, 0.7, 1.2])))
        out.append(batch)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loss-norm", default="token")
    p.add_argument("--micro-batch-tokens", type=int, default=None)
    p.add_argument("--off-policy", default="none")
    a = p.parse_args()
    cfg = LearnerSettings(model_path=a.model, lr=1e-2, torch_threads=1, loss_norm=a.loss_norm,
                          micro_batch_tokens=a.micro_batch_tokens, entropy_coef=0.01,
                          off_policy=OffPolicySettings(mode=a.off_policy))
    trainer = Trainer(cfg)
    world = trainer.world
    stats: list[dict[str, object]] = []
    if world.main:
        for work in steps(a.steps):
            stats.append(dataclasses.asdict(trainer.lead(work)))
        trainer.close()
    else:
        followed = trainer.follow()
        trainer.world.close()
        stats = [{"followed": followed}]
    a.out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               a.out / f"rank{world.rank}.pt")
    (a.out / f"rank{world.rank}.json").write_text(json.dumps(
        {"world": world.size, "stats": stats}))


if __name__ == "__main__":
    sys.exit(main())
