"""What the decoupled off-policy correction costs a learner step, on the tiny test model.

    python -m loadtest.off_policy_cost                  # tiny model, 30 steps per variant
    python -m loadtest.off_policy_cost --size small --steps 10 --updates 2

Decoupled PPO needs pi_old, the logprobs of the sampled tokens under the weights a step
trains from. The learner takes them from the step's own first forward pass (before its
optimizer update the policy is pi_old), so a correction adds no forward pass: only the
weights' arithmetic on (B, T) tensors. This bench measures, side by side in one process:

- ``none``: a step with the one-ratio loss;
- ``tis``: the same step with truncated importance sampling (pi_old reused);
- ``recompute``: what a separate no-grad forward pass over the batch would add (the way
  verl and NeMo-RL compute pi_old), timed alone, as a share of a ``none`` step.

Times are CPU time of this process (``time.process_time``) on one torch thread, so that
other jobs on a shared machine change them little; steps alternate between the variants so
that what they do change hits all alike; each figure is the median over ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def batch(sequences: int, length: int, vocab: int) -> list[Any]:
    from rlbus.learner.work import Work

    rng = random.Random(0)
    out = []
    for _ in range(sequences):
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        sampled = [i >= length // 4 for i in range(length)]
        logprobs = [-rng.uniform(3.0, 6.0) if s else 0.0 for s in sampled]
        out.append(Work(ids, sampled, logprobs, rng.choice([-1.0, 1.0])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="tiny_model size: tiny, small, h64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--updates", type=int, default=1, help="updates_per_step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args()

    import torch

    from rlbus.learner.grpo import collate
    from rlbus.learner.settings import LearnerSettings, OffPolicySettings
    from rlbus.learner.tiny_model import build_tiny_model
    from rlbus.learner.trainer import Trainer

    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "m", size=a.size, seed=0)
    trainers = {mode: Trainer(LearnerSettings(
        model_path=folder, torch_threads=a.threads, updates_per_step=a.updates,
        off_policy=OffPolicySettings(mode=mode))) for mode in ("none", "tis")}
    work = batch(a.sequences, a.length, trainers["none"].vocab_size)
    times: dict[str, list[float]] = {"none": [], "tis": [], "recompute": []}
    plain = trainers["none"]
    b = collate([w.ids for w in work], [w.sampled for w in work], [w.logprobs for w in work],
                plain.pad_id)
    for step in range(a.steps + 2):  # the first two warm up (allocations, AdamW state)
        for mode, t in trainers.items():
            start = time.process_time()
            t.optimize(work)
            if step >= 2:
                times[mode].append(time.process_time() - start)
        start = time.process_time()
        with torch.no_grad():
            plain.scorer(b.input_ids, b.attention_mask, b.loss_mask)
        if step >= 2:
            times["recompute"].append(time.process_time() - start)
    median = {k: statistics.median(v) * 1000 for k, v in times.items()}
    params = sum(x.numel() for x in plain.model.parameters())
    figures = {
        "model": a.size, "parameters": params, "sequences": a.sequences, "length": a.length,
        "updates_per_step": a.updates, "threads": torch.get_num_threads(),
        "cpu_ms_none": round(median["none"], 2), "cpu_ms_tis": round(median["tis"], 2),
        "tis_overhead_pct": round(100 * (median["tis"] / median["none"] - 1), 1),
        "recompute_forward_cpu_ms": round(median["recompute"], 2),
        "recompute_share_pct": round(100 * median["recompute"] / median["none"], 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
