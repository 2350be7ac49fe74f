"""One learner step on a ~100M-parameter model at 8 x 1k tokens: peak memory and step time,
naive vs micro-batched vs activation-checkpointed (and bf16), side by side in one run.

    python -m loadtest.learner_bench                 # every variant, about 10 min on 2 cores
    python -m loadtest.learner_bench --only naive micro --steps 1

The model is a random-init Qwen3 (a current architecture: grouped-query attention, q/k
norms, SwiGLU) of about 100M parameters, built here from a config: hidden 768, 12 layers,
12 query and 4 key/value heads, MLP 2048, a 32k vocabulary with tied embeddings. The batch
is 8 sequences of 1,024 tokens: a 256-token prompt, then 768 sampled tokens.

Each variant runs in a process of its own so that its peak RSS (``ru_maxrss``: the model,
AdamW's moments and the step's activations) is its own. The step time is the last of
``--steps`` optimizer steps (the first also allocates AdamW's state). Variants:

- ``naive``: the learner before micro-batching: the whole batch in one forward pass, the
  full fp32 (B, T, V) log-softmax materialised, the entropy computed although unused.
- ``micro``: micro-batches of 2,048 tokens with gradient accumulation, chunked logits.
- ``checkpointed``: ``micro`` plus activation checkpointing of the decoder layers.
- ``bf16``: ``checkpointed`` under bfloat16 autocast (fp32 master weights).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlbus.learner.work import Work
from rlbus.processes import die_with_parent

VARIANTS: dict[str, dict[str, Any]] = {
    "naive": {},
    "micro": {"micro_batch_tokens": 2048},
    "checkpointed": {"micro_batch_tokens": 2048, "gradient_checkpointing": True},
    "bf16": {"micro_batch_tokens": 2048, "gradient_checkpointing": True, "dtype": "bfloat16"},
}
SEQUENCES, TOKENS, PROMPT = 8, 1024, 256


def build_model(folder: Path) -> int:
    """A random-init ~100M-parameter Qwen3 saved to `folder`; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=32_000, hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                         intermediate_size=2048, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def batch(vocab: int = 32_000) -> list[Any]:
    rng = random.Random(0)
    out = []
    for _ in range(SEQUENCES):
        ids = [rng.randrange(1, vocab) for _ in range(TOKENS)]
        sampled = [i >= PROMPT for i in range(TOKENS)]
        logprobs = [-rng.uniform(5.0, 15.0) if s else 0.0 for s in sampled]
        out.append(Work(ids, sampled, logprobs, rng.choice([-1.0, 1.0])))
    return out


def child(variant: str, folder: Path, steps: int, threads: int | None) -> dict[str, Any]:
    """One variant's steps in this process; its figures."""
    import torch

    from rlbus.learner.settings import LearnerSettings
    from rlbus.learner.trainer import Trainer

    cfg = LearnerSettings(model_path=folder, torch_threads=threads, **VARIANTS[variant])
    trainer = Trainer(cfg)
    if variant == "naive":
        trainer.optimize = _naive(trainer)  # type: ignore[method-assign]
    work = batch()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = trainer.optimize(work)
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "step_s": times[-1], "steps_s": times,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "micro_batches": stats.micro_batches, "threads": torch.get_num_threads()}


def _naive(trainer: Any) -> Any:
    """The learner's step as it was: one batch, full fp32 logits, entropy always."""
    import torch

    from rlbus.learner.grpo import collate, policy_loss
    from rlbus.learner.stats import UpdateStats

    def optimize(work: list[Any]) -> UpdateStats:
        b = collate([w.ids for w in work], [w.sampled for w in work], [w.logprobs for w in work],
                    0)
        logits = trainer.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        logp = logits[:, :-1].float().log_softmax(-1)  # (B, T-1, V) in fp32
        token_lp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)  # computed and discarded, as before
        del entropy
        loss, _ = policy_loss(token_lp, b.behaviour_logprobs,
                              torch.tensor([w.advantage for w in work]), b.loss_mask,
                              clip_low=0.2, clip_high=0.28, norm="token")
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        trainer.optimizer.step()
        return UpdateStats(loss=float(loss), clip_frac=0.0, approx_kl=0.0, micro_batches=1)

    return optimize


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.learner_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch threads per variant (default: torch's)")
    p.add_argument("--out", type=Path, help="write results.json here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.model, a.steps, a.threads)))
        return
    with tempfile.TemporaryDirectory(prefix="learner-bench-") as tmp:
        folder = Path(tmp) / "model"
        params = build_model(folder)
        print(f"model: random-init Qwen3, {params / 1e6:.1f}M parameters; batch "
              f"{SEQUENCES} x {TOKENS} tokens ({TOKENS - PROMPT} sampled each); "
              f"{os.cpu_count()} CPUs, {a.threads or 'default'} torch threads, {a.steps} "
              "steps per variant", flush=True)
        rows = []
        for variant in a.only:
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "loadtest.learner_bench", "--child", variant,
                 "--model", str(folder), "--steps", str(a.steps),
                 *(["--threads", str(a.threads)] if a.threads else [])],
                capture_output=True, text=True, preexec_fn=die_with_parent())
            if done.returncode != 0:
                print(f"{variant}: failed\n{done.stderr[-2000:]}", flush=True)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{variant:>13}: step {row['step_s']:6.1f} s, peak RSS "
                  f"{row['peak_rss_gib']:5.2f} GiB, {row['micro_batches']:.0f} micro-batches "
                  f"({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    base = next((r for r in rows if r["variant"] == "naive"), None)
    print("\n| variant | step time (s) | peak RSS (GiB) | vs naive: time | vs naive: memory |")
    print("|---|---|---|---|---|")
    for r in rows:
        rel = "- | -"
        if base:
            rel = (f"{r['step_s'] / base['step_s']:.2f}x | "
                   f"{r['peak_rss_gib'] / base['peak_rss_gib']:.2f}x")
        print(f"| {r['variant']} | {r['step_s']:.1f} | {r['peak_rss_gib']:.2f} | {rel} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(
            {"params": params, "loadavg": os.getloadavg(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
