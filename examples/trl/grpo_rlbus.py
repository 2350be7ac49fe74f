"""TRL's GRPOTrainer, generating through rlbus: a runnable example on the CPU.

What runs: a Kafka broker (rlbus's local one, or RLBUS_KAFKA_BOOTSTRAP's), rlbus's
inference (hf engine), reward and rollout tiers as processes, and, in this process, TRL's
``GRPOTrainer`` in place of rlbus's learner. Prompts are sampled from an rlbus task
(``guess_number`` by default: several turns, the environment's answers in between) and
rolled out by the rollout tier while TRL trains; each optimizer step's weights go back to
inference through rlbus's weight store. The model is a small random-init chat model built
here (no download), so the point is the wiring, not the reward curve.

    .venv/bin/pip install -e '.[trl]'
    .venv/bin/python examples/trl/grpo_rlbus.py --steps 10

Options: ``--reward trl`` scores with a TRL reward function in this process instead of
rlbus's reward tier; ``--wait-served`` makes each step wait until inference serves its
weights; ``--resume`` goes on from the run folder's last checkpoint (model, optimizer and
rlbus's position). Everything lands in ``--run-dir`` (default ``runs/trl-<time>``): the
model, TRL's checkpoints (each with ``rlbus_position.json``), the weight store, the
services' logs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rlbus.client import ClientSettings, SyncRolloutClient
from rlbus.integrations.trl import (
    RlbusRollouts,
    groups_per_step,
    load_position,
    placeholder_dataset,
    rlbus_reward,
)
from rlbus.ops.launcher import ServiceProcesses
from rlbus.processes import child_env
from rlbus.settings import KafkaSettings, TopicSettings, settings_env

TIERS = ("inference", "reward", "rollout")
"""The learner's place is TRL's."""


@dataclass
class Stack:
    """The rlbus services of one run, and how a client reaches them."""

    kafka: KafkaSettings
    topics: TopicSettings
    procs: ServiceProcesses
    cluster: Any = None

    def check(self) -> None:
        """Raise if a service has exited, with the end of its log."""
        for p in self.procs.dead():
            raise RuntimeError(f"{p.label} exited with {p.popen.returncode}:\n{p.tail(30)}")

    def stop(self) -> None:
        self.procs.stop(timeout=20)
        if self.cluster is not None:
            self.cluster.stop()


def build_model(folder: Path) -> Path:
    """The small chat model the services serve and TRL trains (built once per run folder)."""
    if not (folder / "config.json").exists():
        from rlbus.learner.chat_model import build_chat_model

        build_chat_model(folder)
    return folder


def start_stack(run_dir: Path, model: Path, bootstrap: str | None = None,
                prefix: str | None = None) -> Stack:
    """A broker (``bootstrap``, else a local one started for the run), the run's topics
    (``prefix``, default the run folder's name; created if missing), and inference, reward
    and rollout as processes serving ``model``."""
    from rlbus.ops.broker import bootstrap_or_start
    from rlbus.topics import ensure_topics

    cluster = None
    if bootstrap is None:
        bootstrap, cluster = bootstrap_or_start()
    kafka = KafkaSettings(bootstrap=bootstrap)
    topics = TopicSettings(prefix=prefix or run_dir.name, partitions=2,
                           result_partitions=2)
    asyncio.run(ensure_topics(kafka, topics))
    base = child_env({**settings_env(kafka=kafka, topics=topics, instance=0),
                      "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                      "TRANSFORMERS_VERBOSITY": "error"})
    served = settings_env(model_path=model)
    extra = {"inference": {**served, **settings_env(engine="hf", served_report_s=1.0)},
             "reward": {}, "rollout": served}
    procs = ServiceProcesses(run_dir / "logs")
    for name in TIERS:
        procs.spawn(name, 0, {**base, **extra[name]})
    return Stack(kafka, topics, procs, cluster)


def grpo_config(out_dir: Path, steps: int, *, max_completion_length: int = 4) -> Any:
    """GRPO on the CPU, two groups of two episodes per optimizer step. ``max_completion_length``
    is per turn (rlbus's ``max_new_tokens``); a multi-turn completion is longer, and TRL
    must not mask it as truncated (``mask_truncated_completions`` stays False)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, mask_truncated_completions=False,
        max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to="none",
        save_strategy="steps", save_steps=max(1, steps // 2), dataloader_num_workers=0,
        eval_strategy="no", seed=0)


def said_the_target(prompts: list[Any], completions: list[Any],
                    completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    """A TRL reward function (``--reward trl``): 1.0 if the episode's text names the
    target anywhere (a toy), None for a row rlbus masked (TRL then leaves it unscored)."""
    return [None if masked else float(str(spec["target"]) in str(text))
            for text, spec, masked in zip(completions, kwargs["rlbus_spec"],
                                          kwargs["rlbus_masked"], strict=True)]


def client_for(stack: Stack, run_dir: Path, model: Path, config: Any,
               checkpoint: str | None = None) -> SyncRolloutClient:
    """A client paced for ``config``, resuming from ``checkpoint``'s position if any."""
    settings = ClientSettings(
        kafka=stack.kafka, topics=stack.topics, model_path=model,
        weights_dir=run_dir / "weights", run_name=run_dir.name,
        groups_per_step=groups_per_step(config), max_staleness=1, straggler_wait_s=10)
    return SyncRolloutClient(settings, position=load_position(checkpoint))


def make_trainer(model: Path, config: Any, rollouts: RlbusRollouts, reward: str = "rlbus",
                 trainer_class: Any = None) -> Any:
    """TRL's GRPOTrainer (or ``trainer_class``) generating through ``rollouts``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return (trainer_class or GRPOTrainer)(
        model=policy, args=config, processing_class=AutoTokenizer.from_pretrained(model),
        reward_funcs=[rlbus_reward if reward == "rlbus" else said_the_target],
        train_dataset=placeholder_dataset(config), rollout_func=rollouts,
        callbacks=[rollouts.callback])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--task", default="guess_number", help="an rlbus task (entry point name)")
    p.add_argument("--reward", choices=("rlbus", "trl"), default="rlbus",
                   help="rlbus's reward tier, or a TRL reward function in this process")
    p.add_argument("--wait-served", action="store_true",
                   help="each step waits until inference serves its weights")
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="from the run folder's last checkpoint")
    p.add_argument("--bootstrap", default=os.environ.get("RLBUS_KAFKA__BOOTSTRAP"),
                   help="a Kafka broker (default $RLBUS_KAFKA__BOOTSTRAP, else a local one "
                        "started for the run)")
    args = p.parse_args(argv)
    run_dir = (args.run_dir or Path("runs") / time.strftime("trl-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch_threads()
    model = build_model(run_dir / "model")
    stack = start_stack(run_dir, model, args.bootstrap)
    print(f"rlbus services started; logs in {run_dir / 'logs'}", flush=True)
    try:
        return train(args, run_dir, model, stack)
    finally:
        stack.stop()


def train(args: argparse.Namespace, run_dir: Path, model: Path, stack: Stack) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    config = grpo_config(run_dir / "trl", args.steps)
    checkpoint = get_last_checkpoint(config.output_dir) if args.resume else None
    with client_for(stack, run_dir, model, config, checkpoint) as client:
        rollouts = RlbusRollouts(client, args.task, wait_served=args.wait_served,
                                 receive_timeout_s=120)
        trainer = make_trainer(model, config, rollouts, args.reward)
        trainer.add_callback(StackWatch(stack))
        trainer.train(resume_from_checkpoint=checkpoint)
        stack.check()
        served = client.wait_served(timeout_s=60)
        print(f"trained {trainer.state.global_step} steps; inference serves "
              f"{served.members}; {dict(rollouts.counters)}", flush=True)
    return 0


class StackWatch(TrainerCallback):
    """Stops training at the first step after a service died, showing its log."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stack.check()


def torch_threads() -> None:
    """Leave CPU to the services: the trainer's forward passes are small."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


if __name__ == "__main__":
    sys.exit(main())
