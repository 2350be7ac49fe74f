"""A plugin from outside the library, end to end: examples/calculator is pip-installed
(editable), then the four tiers, as processes over the real broker, train on its task for a
few steps with a real (tiny) model, and its own verifier scores every episode in the reward
tier. Nothing in rlbus names the plugin: the learner is told RLBUS_TASK=calculator."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from rlbus.codec import decode
from rlbus.learner.chat_model import build_chat_model
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import ScoredTrajectory
from rlbus.ops.launcher import ServiceProcesses
from rlbus.processes import child_env, tail
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import Topics, ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator"
STEPS, GROUPS, GROUP_SIZE = 3, 2, 4


@pytest.fixture(scope="module")
def installed_example():
    """pip install -e, as a user would (offline: no build isolation, no dependencies)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "-e", str(EXAMPLE)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # processes started from now on import it through the install's .pth; this one, which
    # read its .pth files at start, needs the folder on its path
    sys.path.insert(0, str(EXAMPLE))
    yield
    sys.path.remove(str(EXAMPLE))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "rlbus-calculator"],
                   capture_output=True, timeout=120, check=False)


async def _scored(bootstrap: str, topic: str) -> list[ScoredTrajectory]:
    """Read what the reward tier published with a plain aiokafka consumer (not ours)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                isolation_level="read_committed", enable_auto_commit=False)
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=5000, max_records=10_000)
        return [decode(r.value, ScoredTrajectory) for rs in batches.values() for r in rs]
    finally:
        await consumer.stop()


@pytest.mark.parametrize("agent", ["multi_turn", "calculator_chat"])
def test_an_installed_plugin_trains_through_all_four_tiers(
    installed_example, kafka_bootstrap, unique_name, tmp_path, agent
):
    """multi_turn: rlbus's own agent on the demo's word-level model; calculator_chat: the
    package's agent written with the openai SDK, through the gateway, on a chat model."""
    from rlbus_calculator import WORDS

    if agent == "multi_turn":
        model = build_tiny_model(tmp_path / "model", size="tiny", seed=0, words=WORDS)
    else:
        model = build_chat_model(tmp_path / "model")
    prefix = unique_name("plugin")
    topics = TopicSettings(prefix=prefix, partitions=2, result_partitions=2)
    kafka = KafkaSettings(bootstrap=kafka_bootstrap)
    asyncio.run(ensure_topics(kafka, topics))
    base = child_env({**settings_env(kafka=kafka, topics=topics, instance=0),
                      "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    with_model = {**base, **settings_env(model_path=model)}
    metrics = tmp_path / "metrics.jsonl"
    envs = {
        "inference": with_model,
        "reward": base,
        "rollout": {**with_model, **settings_env(agent=agent)},
        "learner": {
            **with_model,
            **settings_env(
                task="calculator",
                max_steps=STEPS,
                groups_per_step=GROUPS,
                group_size=GROUP_SIZE,
                max_new_tokens=4 if agent == "multi_turn" else 12,
                weights_dir=tmp_path / "weights",
                checkpoint_dir=tmp_path / "checkpoint",
                metrics_file=metrics,
                run_name="calc",
            ),
        },
    }
    procs = ServiceProcesses(tmp_path / "logs")
    try:
        for name in ("inference", "reward", "rollout", "learner"):
            procs.spawn(name, 0, envs[name])
        learner = procs.get("learner-0")
        deadline = time.monotonic() + 240
        while learner.alive:
            dead = [p for p in procs.dead() if p is not learner]
            assert not dead, f"{dead[0].label} exited:\n{tail(dead[0].log, 40)}"
            assert time.monotonic() < deadline, "\n".join(
                f"--- {p.label}\n{tail(p.log, 15)}" for p in procs.procs)
            time.sleep(0.5)
        assert learner.popen.returncode == 0, tail(learner.log, 40)
    finally:
        procs.stop(timeout=20)

    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    assert rows[-1]["episodes_trained"] == STEPS * GROUPS * GROUP_SIZE

    scored = asyncio.run(_scored(kafka_bootstrap, Topics(topics).scored))
    train = [s for s in scored if s.trajectory.purpose == "train"]
    assert len({s.trajectory.episode_id for s in train}) >= STEPS * GROUPS * GROUP_SIZE
    ok = [s for s in train if s.valid]
    assert ok, [s.error for s in train[:3]]
    # the example's own verifier scored them, in the reward tier: its info says so
    assert {s.verifier for s in ok} == {"calculator"}
    assert all({"tool_calls", "tool_errors", "answered"} <= set(s.info) for s in ok)
    assert {s.trajectory.task for s in train} == {"calculator"}
    rollout_log = procs.get("rollout-0").log.read_text()
    assert "calculator" in rollout_log  # listed among the installed tasks at startup
    if agent == "calculator_chat":
        assert "gateway serving http://127.0.0.1:" in rollout_log
        # every turn is a gateway call: the first prompt is the chat template's rendering
        first = ok[0].trajectory.turns[0]
        assert first.input_ids and all(t.action is not None for t in ok[0].trajectory.turns)
