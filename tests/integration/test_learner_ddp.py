"""Data parallel learner under torchrun (gloo on the CPU): the same parameters as one
process with the same global batch, and on the real broker one publisher of weights."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlbus.inference.service import Inference
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import WeightVersion
from rlbus.processes import child_env, spawn_process, tail
from rlbus.reward.service import Reward
from rlbus.rollout.service import Rollout
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import settings

pytestmark = [pytest.mark.slow]

SCRIPT = Path(__file__).parents[1] / "support" / "ddp_steps.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize(("norm", "micro", "off_policy"),
                         [("token", None, "none"), ("dr_grpo", 40, "none"), ("token", 40, "tis")])
def test_two_ranks_train_what_one_process_trains(model: Path, tmp_path: Path, norm: str,
                                                 micro: int | None, off_policy: str) -> None:
    """Three steps of 7, 1 and 4 sequences (rank 1 has nothing in the second: it joins with
    a zero gradient), with gradient accumulation in the dr_grpo and tis cases."""
    args = [str(model), "--loss-norm", norm, "--steps", "3", "--off-policy", off_policy]
    if micro:
        args += ["--micro-batch-tokens", str(micro)]
    _run([sys.executable, str(SCRIPT), args[0], str(tmp_path / "one"), *args[1:]])
    _run([*TORCHRUN, str(SCRIPT), args[0], str(tmp_path / "two"), *args[1:]])
    one = torch.load(tmp_path / "one" / "rank0.pt")
    two = [torch.load(tmp_path / "two" / f"rank{r}.pt") for r in (0, 1)]
    for name, p in one.items():
        torch.testing.assert_close(two[0][name], two[1][name], atol=0, rtol=0)  # replicas
        torch.testing.assert_close(two[0][name], p, atol=2e-5, rtol=1e-4)
    # and the parameters did move: three steps at lr 1e-2
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert max((initial[k] - one[k]).abs().max().item() for k in one) > 1e-3
    follower = json.loads((tmp_path / "two" / "rank1.json").read_text())
    assert follower["stats"] == [{"followed": 3}]
    leader = json.loads((tmp_path / "two" / "rank0.json").read_text())["stats"]
    alone = json.loads((tmp_path / "one" / "rank0.json").read_text())["stats"]
    for a, b in zip(alone, leader, strict=True):  # figures are of the whole batch
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
        assert b["mismatch"] == pytest.approx(a["mismatch"], rel=1e-5)  # max over ranks too


@pytest.mark.kafka
async def test_torchrun_learner_publishes_and_checkpoints_once(
        kafka_bootstrap: str, unique_name, model: Path, tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m rlbus.learner`` against the broker: rank 0
    alone reads, checkpoints and publishes (versions 1 and 2, once each); rank 1 trains both
    steps and exits when rank 0 does."""
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("ddp"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(model, tmp_path, {"kafka": kafka, "topics": topics})
    make = lambda name: KafkaBus(kafka, dlq_topic=Topics(topics).dlq, service=name)  # noqa: E731
    others = [Inference(s["inference"], make("inference")), Reward(s["reward"], make("reward")),
              Rollout(s["rollout"], make("rollout"))]
    tasks = [asyncio.create_task(o.run()) for o in others]
    env = child_env(settings_env(
        kafka=kafka, topics=topics, model_path=model, max_steps=2, groups_per_step=2,
        group_size=4, checkpoint_every=1, checkpoint_dir=tmp_path / "checkpoint",
        weights_dir=tmp_path / "weights", metrics_file=tmp_path / "metrics.jsonl",
        log_level="INFO",
    ))
    log = tmp_path / "learner.log"
    learner = spawn_process([*TORCHRUN, "-m", "rlbus.learner"], env, log)
    try:
        deadline = time.monotonic() + 240
        while learner.poll() is None:
            assert time.monotonic() < deadline, tail(log, 40)
            for t in tasks:
                if t.done():
                    t.result()
            await asyncio.sleep(0.5)
    finally:
        if learner.poll() is None:
            learner.kill()
        for o in others:
            o.request_stop("test over")
        await asyncio.gather(*tasks)
    text = log.read_text()
    assert learner.returncode == 0, tail(log, 40)
    assert "follower rank 1: 2 steps, released by rank 0" in text, tail(log, 40)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one writer of metrics
    state = torch.load(tmp_path / "checkpoint" / "checkpoint.pt", weights_only=False)
    assert len(state["ledger"]) == 2 and sum(len(x) for x in state["ledger"]) == 16
    bus = KafkaBus(kafka, dlq_topic=None, service="check")
    try:
        weights = await bus.consumer([Topics(topics).weights], WeightVersion,
                                     assign=[(Topics(topics).weights, 0)])
        published: list[int] = []
        for _ in range(10):
            published += [d.message.version for d in await weights.poll(0.5)]
        assert published == [1, 2]  # not once per rank
    finally:
        await bus.close()
