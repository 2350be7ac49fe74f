"""Can a LoRA adapter on the demo's model learn guess-the-number's search, and at which
learning rate? A supervised check, no RL and no Kafka (docs/lora.md, "Learning rate").

    python -m loadtest.lora_fit                       # rank 16; lr 1e-2, 3e-3, 1e-3; full model
    python -m loadtest.lora_fit --lrs 0.001 --steps 300

The data: binary search's guesses (the midpoint of what the answers still allow) for each of
the 16 targets, as the demo's rollouts lay them out (prompt, then per turn the guess's ids
and the answer's ids, one after the other). The loss is cross-entropy on the guesses only.
Each arm starts from the model ``rlbus demo --lora`` builds (a random-init tiny Llama whose
embedding is drawn at std 0.2) and trains with AdamW, one batch of all 16 sequences a step.
Printed per arm every ``--every`` steps: the loss and the share of guesses the model's
argmax gets right (1.0: it plays binary search greedily). A reference arm trains the whole
model at the demo's learning rate. About 1 minute on one core for the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlbus.learner import lora
from rlbus.learner.settings import LoraSettings
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.ops.demo import LORA_EMBEDDING_STD, RECIPE
from rlbus.tasks import CORRECT, GuessNumber, guess_feedback, replay_guesses


def sequences(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of binary search for every target; labels -100 but on the guesses.
    The game is the task's own: what its answers still allow after the guesses so far
    (:func:`rlbus.tasks.replay_guesses`), and its answer to each guess."""
    task = GuessNumber()

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    out = []
    for target in range(task.low, task.high + 1):
        spec = {"target": target, "low": task.low, "high": task.high,
                "max_turns": task.max_turns}
        ids = encode(asyncio.run(task.make_env().reset(spec)))
        labels = [-100] * len(ids)
        guesses: list[str] = []
        while len(guesses) < task.max_turns:
            game = replay_guesses(spec, guesses)
            if game.found:
                break
            guess = str((game.low + game.high) // 2)
            guesses.append(guess)
            g = encode(guess)
            ids, labels = ids + g, labels + g
            answer = guess_feedback(spec, int(guess))
            if answer != CORRECT:
                a = encode(answer)
                ids, labels = ids + a, labels + [-100] * len(a)
        out.append((ids, labels))
    return out


def batch(seqs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in seqs)
    pad = [width - len(ids) for ids, _ in seqs]
    return {
        "input_ids": torch.tensor([ids + [0] * p for (ids, _), p in zip(seqs, pad, strict=True)]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * p
                                        for (ids, _), p in zip(seqs, pad, strict=True)]),
        "labels": torch.tensor([lab + [-100] * p for (_, lab), p in zip(seqs, pad, strict=True)]),
    }


def fit(folder: Path, data: dict[str, torch.Tensor], rank: int, lr: float, steps: int,
        every: int) -> list[tuple[int, float, float]]:
    """(step, loss, greedy accuracy on the guesses) every ``every`` steps; rank 0: the
    whole model trains."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_pretrained(folder)
    if rank:
        model, _ = lora.wrap(model, LoraSettings(rank=rank))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    target = data["labels"][:, 1:]
    rows = []
    for step in range(1, steps + 1):
        loss = model(**data).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            with torch.no_grad():
                logits = model(input_ids=data["input_ids"],
                               attention_mask=data["attention_mask"]).logits[:, :-1]
            right = (logits.argmax(-1) == target)[target != -100].float().mean()
            rows.append((step, float(loss.detach()), float(right)))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.lora_fit",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lrs", default="0.01,0.003,0.001", help="the adapter's learning rates")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--every", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # noise
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", embedding_std=LORA_EMBEDDING_STD)
        from transformers import AutoTokenizer

        data = batch(sequences(AutoTokenizer.from_pretrained(folder)))
        arms = [(f"LoRA r={args.rank} lr={lr}", args.rank, float(lr))
                for lr in args.lrs.split(",")]
        arms.append((f"whole model lr={RECIPE['RLBUS_LR']}", 0, float(RECIPE["RLBUS_LR"])))
        for name, rank, lr in arms:
            rows = fit(folder, data, rank, lr, args.steps, args.every)
            print(f"{name}: " + "  ".join(f"{s}: {loss:.3g}/{acc:.2f}" for s, loss, acc in rows),
                  flush=True)
    print("(step: loss/greedy accuracy on the guesses)")


if __name__ == "__main__":
    main()
