"""A learner fed from the shipped GSM8K-style jsonl: every row trained once per epoch, a bad
row dead-lettered, across a restart mid-epoch; held-out evaluation with pass@k.

In-memory bus, synthetic engine and trainer: properties of the feeder, not of a model."""

import json
from pathlib import Path

import pytest

from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.messages import DeadLetter, Prompt
from rlbus.prompt_data import DatasetSettings
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests.support.services import read_log, run_until

TOPICS = TopicSettings(prefix="ds", partitions=2, result_partitions=2)
T = Topics(TOPICS)
SHIPPED = Path(__file__).parents[2] / "data" / "gsm8k_mini.jsonl"


def _data(tmp_path) -> Path:
    """The shipped rows with one bad row (no answer) in the middle."""
    lines = SHIPPED.read_text().splitlines()
    lines.insert(10, json.dumps({"question": "what has no answer?"}))
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _learner(tmp_path, **kw) -> LearnerSettings:
    return LearnerSettings(**{
        "topics": TOPICS, "trainer": "synthetic", "synthetic_step_s": 0.0,
        "task": "rlbus.math_task:gsm8k",  # the gsm8k entry point, by import string
        "dataset": DatasetSettings(path=_data(tmp_path), shuffle_seed=3),
        "group_size": 2, "groups_per_step": 4, "max_steps": 1000, "max_staleness": 1,
        "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 1,
        "metrics_file": tmp_path / "metrics.jsonl", **kw})


def _others(broker):
    return [Inference(InferenceSettings(topics=TOPICS, engine="synthetic"), MemoryBus(broker)),
            Reward(RewardSettings(topics=TOPICS), MemoryBus(broker)),
            Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"), MemoryBus(broker))]


def _trained_questions(broker, learner) -> list[str]:
    questions = {p.group_id: p.spec["question"] for p in read_log(broker, T.prompts, Prompt)}
    groups = {e.rsplit("/", 1)[0] for step in learner.ledger for e in step}
    assert sum(map(len, learner.ledger)) == 2 * len(groups)  # every group once, whole
    return [questions[g] for g in groups]


@pytest.mark.slow
async def test_a_learner_killed_mid_epoch_trains_every_row_once(tmp_path):
    broker = memory_broker(TOPICS)
    first = Learner(_learner(tmp_path), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([first, *_others(broker)], lambda: first.step >= 3, limit_s=60)
    assert 3 <= first.step < 9  # stopped mid-epoch (36 good rows, 4 groups a step)

    second = Learner(_learner(tmp_path), MemoryBus(broker, dlq_topic=T.dlq))
    others = _others(broker)
    await run_until([second, *others], lambda: second.stopping, limit_s=60)
    assert second.step == 9
    shipped = [json.loads(line)["question"] for line in SHIPPED.read_text().splitlines()]
    assert sorted(_trained_questions(broker, second)) == sorted(shipped)
    letters = read_log(broker, T.dlq, DeadLetter)
    assert letters and all("row 10: missing" in d.error or "row 10:" in d.error
                           for d in letters)
    assert letters[0].source_topic.startswith("dataset:") and letters[0].offset == 10


@pytest.mark.slow
async def test_a_learner_dead_past_its_checkpoint_trains_every_row_once(tmp_path):
    """A crash: the steps trained after the last checkpoint die with the process. The next
    learner resumes from that checkpoint (model, offsets and dataset position): it submits
    the same rows again under the same group ids, drops the copies that were already
    scored, and every row of the epoch ends up trained exactly once."""
    broker = memory_broker(TOPICS)
    checkpoint = tmp_path / "ckpt" / "checkpoint.pt"
    first = Learner(_learner(tmp_path, max_steps=2), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([first, *_others(broker)], lambda: first.stopping, limit_s=60)
    saved, at = checkpoint.read_bytes(), first.step
    assert at == 2

    doomed = Learner(_learner(tmp_path, max_steps=5), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([doomed, *_others(broker)], lambda: doomed.stopping, limit_s=60)
    assert doomed.step == 5
    checkpoint.write_bytes(saved)  # what it trained after step `at` was never checkpointed

    last = Learner(_learner(tmp_path), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([last, *_others(broker)], lambda: last.stopping, limit_s=60)
    assert last.step == 9
    shipped = [json.loads(line)["question"] for line in SHIPPED.read_text().splitlines()]
    assert sorted(_trained_questions(broker, last)) == sorted(shipped)


@pytest.mark.slow
async def test_held_out_rows_are_evaluated_greedily_and_with_pass_at_k(tmp_path):
    broker = memory_broker(TOPICS)
    held_out = DatasetSettings(path=SHIPPED, shuffle_seed=None)
    learner = Learner(_learner(tmp_path, eval_dataset=held_out, eval_every=3, eval_episodes=5,
                               eval_pass_k=2, eval_pass_n=3), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([learner, *_others(broker)], lambda: learner.stopping, limit_s=60)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_at_step" in r]
    assert {r["eval_at_step"] for r in evals} >= {0, 3, 6, 9}
    assert all(r["eval_pass_k"] == 2 and 0.0 <= r["eval_pass_at_k"] <= 1.0 for r in evals)
    trained = [e for step in learner.ledger for e in step]
    assert trained and not any("eval" in e for e in trained)  # measured, never trained
    sent = [p for p in read_log(broker, T.prompts, Prompt) if p.purpose == "eval"]
    assert {p.group_size for p in sent} == {1, 3}  # greedy once, 3 samples for pass@2
    assert {p.sampling.temperature for p in sent if p.group_size == 1} == {0.0}
