"""Faults injected for real: SIGKILL a member of each tier, restart the broker, lose a broker
of a 3-node cluster. Each run must still train every group exactly once.

The services run as separate processes over a real broker with the synthetic engine and
trainer (the contract is about data flow, not about the model). "Exactly once" is counted
from the learner's checkpoint ledger: the episode ids of every optimizer step the final
model went through, not deduplicated.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlbus.ops.broker import LocalCluster
from rlbus.ops.launcher import ServiceProcesses
from rlbus.processes import child_env, tail
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import ensure_topics
from tests.support.ledger import LedgerCheck, check_ledger, expected_episodes, load_ledger

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STEPS, GROUPS_PER_STEP, GROUP_SIZE = 8, 2, 4


@dataclass
class Run:
    dir: Path
    procs: ServiceProcesses

    @property
    def metrics(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(r["step"] >= step for r in self.metrics):
            self._check(deadline, f"step {step}")
            time.sleep(0.3)

    def wait_finished(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        learner = self.procs.get("learner-0")
        while learner.alive:
            self._check(deadline, "the learner to finish")
            time.sleep(0.5)
        assert learner.popen.returncode == 0, tail(learner.log, 40)

    def _check(self, deadline: float, what: str) -> None:
        crashed = [p for p in self.procs.dead() if p.popen.returncode not in (0, -9)]
        assert not crashed, f"{crashed[0].label} crashed:\n{tail(crashed[0].log, 40)}"
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.label}\n{tail(p.log, 15)}" for p in self.procs.procs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def ledger(self) -> list[list[str]]:
        return load_ledger(self.dir / "checkpoint" / "checkpoint.pt")


def _env(bootstrap: str, topics: TopicSettings, run_dir: Path) -> dict[str, dict[str, str]]:
    kafka = KafkaSettings(bootstrap=bootstrap, request_timeout_s=60)
    base = child_env(settings_env(kafka=kafka, topics=topics, instance=0))
    return {
        "inference": {**base, **settings_env(engine="synthetic")},
        "reward": base,
        "rollout": {
            **base,
            **settings_env(
                tokenizer="synthetic",
                step_timeout_s=3,
                step_retries=40,  # outlives any outage these tests cause
            ),
        },
        "learner": {
            **base,
            **settings_env(
                trainer="synthetic",
                synthetic_step_s=0.3,
                max_steps=STEPS,
                groups_per_step=GROUPS_PER_STEP,
                group_size=GROUP_SIZE,
                checkpoint_every=2,
                max_staleness=2,
                checkpoint_dir=run_dir / "checkpoint",
                weights_dir=run_dir / "weights",
                metrics_file=run_dir / "metrics.jsonl",
                run_name="run",
            ),
        },
    }


@pytest.fixture
def start_run(tmp_path: Path, unique_name) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(bootstrap: str, replication: int = 1) -> Run:
        prefix = unique_name("f")
        topics = TopicSettings(
            prefix=prefix,
            partitions=2,
            result_partitions=2,
            replication=replication,
            min_insync_replicas=min(2, replication),
        )
        asyncio.run(ensure_topics(KafkaSettings(bootstrap=bootstrap), topics))
        run = Run(tmp_path, ServiceProcesses(tmp_path / "logs"))
        envs = _env(bootstrap, topics, tmp_path)
        for name in ("inference", "reward", "rollout", "learner"):
            run.procs.spawn(name, 0, envs[name])
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.procs.stop(timeout=20)


def assert_exactly_once(run: Run, fault: str) -> None:
    expected = expected_episodes("run", STEPS * GROUPS_PER_STEP, GROUP_SIZE)
    check = check_ledger(run.ledger(), expected, GROUPS_PER_STEP * GROUP_SIZE)
    _report(run, fault, check)
    check.assert_exactly_once()


def _report(run: Run, fault: str, check: LedgerCheck) -> None:
    """One line per fault for docs/reliability.md (RLBUS_FAULT_REPORT=path to collect)."""
    last = run.metrics[-1] if run.metrics else {}
    row = {
        "fault": fault,
        "episodes_expected": check.expected,
        "episodes_trained": check.trained,
        "lost": len(check.lost),
        "trained_twice": len(check.duplicated),
        "redelivered_copies_dropped": last.get("duplicates_dropped", 0),
        "samples_masked": sum(int(r.get("masked") or 0) for r in run.metrics),
    }
    print(json.dumps(row))
    target = os.environ.get("RLBUS_FAULT_REPORT")
    if target:
        with open(target, "a") as f:
            f.write(json.dumps(row) + "\n")


def test_no_fault_baseline(kafka_bootstrap, start_run):
    run = start_run(kafka_bootstrap)
    run.wait_finished()
    assert_exactly_once(run, "none")


@pytest.mark.parametrize("member", ["rollout-0", "inference-0", "reward-0"])
def test_sigkill_a_member_mid_run_and_restart_it(kafka_bootstrap, start_run, member):
    run = start_run(kafka_bootstrap)
    run.wait_step(2)
    run.procs.kill(member)  # mid-episode / mid-batch / mid-transaction: work is in flight
    time.sleep(1.0)
    run.procs.restart(member)
    run.wait_finished()
    assert_exactly_once(run, f"SIGKILL {member} at step 2, restart")


def test_sigkill_the_learner_between_checkpoints(kafka_bootstrap, start_run):
    run = start_run(kafka_bootstrap)
    run.wait_step(3)  # checkpoints at 2 and 4: step 3 is trained but not checkpointed
    run.procs.kill("learner-0")
    run.procs.restart("learner-0")
    run.wait_finished()
    assert_exactly_once(run, "SIGKILL learner-0 at step 3 (checkpoint at 2), restart")
    steps = [r["step"] for r in run.metrics]
    assert steps.count(3) == 2  # step 3 was trained again, from the rewound checkpoint


def test_broker_restart_mid_run(start_run, tmp_path):
    cluster = LocalCluster(nodes=1, data_dir=tmp_path / "broker").start()
    try:
        run = start_run(cluster.bootstrap)
        run.wait_step(2)
        cluster.stop_node(0)
        time.sleep(3.0)
        cluster.restart_node(0)
        run.wait_finished()
        assert_exactly_once(run, "stop the only broker at step 2, restart it 3 s later")
    finally:
        cluster.stop()


def test_losing_one_of_three_brokers_loses_nothing(kafka_cluster3, start_run):
    run = start_run(kafka_cluster3.bootstrap, replication=3)
    run.wait_step(2)
    kafka_cluster3.kill_node(2)
    run.wait_finished()
    assert_exactly_once(run, "SIGKILL 1 of 3 brokers at step 2 (replication 3, min ISR 2)")
