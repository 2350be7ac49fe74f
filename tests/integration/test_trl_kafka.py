"""TRL's GRPOTrainer, trained through rlbus over the real broker: examples/trl's functions
start inference (hf engine), reward and rollout as processes on the locally built chat
model, and TRL trains in this process on the groups they roll out and score (decoupled
mode, task guess_number: several turns, observations in between), publishing its weights
after every optimizer step.

Checked: TRL made its optimizer steps; inference served at least two of the versions TRL
published; every row TRL trained on (the batch its loss reads) is an episode as rlbus
recorded it on trajectories.scored, read here with a plain Kafka consumer: the same token
ids, the loss mask over them, the behaviour logprobs, the reward tier's reward; each
checkpoint holds the position of the groups trained by its step.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from rlbus.codec import decode
from rlbus.messages import ScoredTrajectory, WeightsServed
from rlbus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
trl = pytest.importorskip("trl", reason="the trl extra is not installed: pip install -e '.[trl]'")

from rlbus.integrations.trl import RlbusRollouts, load_position  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl" / "grpo_rlbus.py"
STEPS = 3


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_rlbus", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def read_topic(bootstrap: str, topic: str) -> list[bytes]:
    """Every committed record of ``topic``, with a plain aiokafka consumer (not ours)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                isolation_level="read_committed", enable_auto_commit=False)
    await consumer.start()
    values: list[bytes] = []
    try:
        while batch := await consumer.getmany(timeout_ms=3000, max_records=10_000):
            values += [r.value for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()
    return values


class Recording(RlbusRollouts):
    """Keeps each answer: the episode id of every row, in TRL's order."""

    answers: list[dict[str, list[Any]]]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = super().__call__(prompts, trainer)
        self.answers.append(out)
        return out


def capturing_trainer(batches: list[dict[str, Any]]) -> type:
    class Capturing(trl.GRPOTrainer):
        """Keeps the batch of each generation: what the loss is computed on."""

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            batches.append({k: v.clone() if hasattr(v, "clone") else v for k, v in out.items()})
            return out

    return Capturing


def test_trl_trains_on_groups_rolled_out_and_scored_by_rlbus(
        kafka_bootstrap: str, unique_name: Any, tmp_path: Path) -> None:
    ex = example()
    model = ex.build_model(tmp_path / "model")
    stack = ex.start_stack(tmp_path, model, kafka_bootstrap, prefix=unique_name("trl"))
    batches: list[dict[str, Any]] = []
    try:
        config = ex.grpo_config(tmp_path / "trl", STEPS)
        with ex.client_for(stack, tmp_path, model, config) as client:
            rollouts = Recording(client, "guess_number", receive_timeout_s=120)
            rollouts.answers = []
            trainer = ex.make_trainer(model, config, rollouts,
                                      trainer_class=capturing_trainer(batches))
            trainer.add_callback(ex.StackWatch(stack))
            trainer.train()
            served = client.wait_served(timeout_s=60)
    finally:
        stack.stop()
    topics = Topics(stack.topics)

    # TRL's optimizer steps happened, each on one generation batch of 2 groups of 2
    assert trainer.state.global_step == STEPS
    assert len([h for h in trainer.state.log_history if "loss" in h]) == STEPS
    assert len(rollouts.answers) == len(batches) == STEPS

    # inference served TRL's weights: the last version, and an earlier one before it
    assert served.members == {"inference-0": STEPS}
    reports = [decode(v, WeightsServed)
               for v in asyncio.run(read_topic(kafka_bootstrap, topics.served))]
    assert len({r.version for r in reports if r.version >= 1}) >= 2, reports

    # every row trained is an episode as rlbus recorded it
    scored = {s.trajectory.episode_id: s for s in map(
        lambda v: decode(v, ScoredTrajectory),
        asyncio.run(read_topic(kafka_bootstrap, topics.scored)))}
    trained_versions = []
    for answer, batch, logged in zip(rollouts.answers, batches,
                                     [h for h in trainer.state.log_history if "loss" in h],
                                     strict=True):
        ids, groups = answer["rlbus_episode_id"], answer["rlbus_group_id"]
        assert [i.rsplit("/", 1)[0] for i in ids] == groups
        assert groups[::2] == groups[1::2]  # a group's members are consecutive rows
        rewards = []
        for row, episode_id in enumerate(ids):
            s = scored[episode_id]
            check_row(batch, row, s, masked=answer["rlbus_masked"][row] is not None)
            trained_versions.append(s.trajectory.min_version)
            if answer["rlbus_masked"][row] is None:
                rewards.append(s.reward)
        assert rewards, answer["rlbus_masked"]
        assert math.isclose(logged["rewards/rlbus_reward/mean"], sum(rewards) / len(rewards),
                            rel_tol=1e-5, abs_tol=1e-6)
    assert max(trained_versions) >= 1  # sampled by weights TRL published

    # each checkpoint's position: the groups trained by its step
    taken = [answer["rlbus_group_id"][::2] for answer in rollouts.answers]
    for step in range(1, STEPS + 1):
        position = load_position(tmp_path / "trl" / f"checkpoint-{step}")
        assert position is not None and position.steps == step
        assert position.taken == [g for groups in taken[:step] for g in groups]


def check_row(batch: dict[str, Any], row: int, s: ScoredTrajectory, masked: bool) -> None:
    """Row ``row`` of TRL's batch holds episode ``s``: ids, loss mask (none if ``masked``),
    behaviour logprobs."""
    t = s.trajectory
    prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
    width = int(batch["completion_mask"][row].sum())
    completion = batch["completion_ids"][row][:width].tolist()
    ids = [i for turn in t.turns for i in (*turn.input_ids, *turn.completion_ids)]
    assert prompt == t.turns[0].input_ids and prompt + completion == ids
    mask = [m for turn in t.turns
            for m in [0] * len(turn.input_ids) + [1] * len(turn.completion_ids)][len(prompt):]
    assert batch["tool_mask"][row][:width].tolist() == ([0] * width if masked else mask)
    logprobs = [x for turn in t.turns
                for x in [0.0] * len(turn.input_ids) + list(turn.logprobs)][len(prompt):]
    got = batch["sampling_per_token_logps"][row][:width].tolist()
    assert got == pytest.approx(logprobs, abs=1e-6)
