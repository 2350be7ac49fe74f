"""The decoupled arm: the four services as ``python -m rlbus.<name>`` processes over Kafka.

Each run gets a fresh topic prefix and fresh consumer-group names, so runs sharing one broker
never see each other's records or group members. Every process is stopped when the
:class:`Fleet` context exits, whatever happened inside it: SIGTERM (the services drain and
commit), then SIGKILL for any that outlive the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import pstats
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from loadtest.metrics import ArmResult, masked, read_rows
from loadtest.scenario import Scenario
from rlbus.inference.settings import SyntheticEngineSettings
from rlbus.ops.launcher import Proc, ServiceProcesses
from rlbus.processes import child_env
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import ensure_topics

READY_MARKER = {"rollout": "reads replies on partition"}
"""A log line each service prints once its consumers are subscribed (rollout only: its
group is the one whose rebalances would re-roll prompts)."""
SETTLE_S = 2.0
"""After the last rollout is subscribed: time for its consumer group to finish joining."""


class FleetError(RuntimeError):
    """A service process died or the run did not finish in time."""


@dataclass
class Fleet:
    """Service processes of one run (:class:`ServiceProcesses`); all stopped on exit."""

    run_dir: Path
    bootstrap: str
    partitions: int = 8
    result_partitions: int = 8
    profile: bool = False
    prefix: str = field(default_factory=lambda: f"lt-{uuid.uuid4().hex[:8]}")
    processes: ServiceProcesses = field(init=False)

    def __post_init__(self) -> None:
        self.processes = ServiceProcesses(self.run_dir / "logs",
                                          profile_dir=self.run_dir if self.profile else None)

    @property
    def procs(self) -> list[Proc]:
        return self.processes.procs

    @property
    def topics(self) -> TopicSettings:
        return TopicSettings(prefix=self.prefix, partitions=self.partitions,
                             result_partitions=self.result_partitions)

    def __enter__(self) -> Fleet:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        asyncio.run(ensure_topics(KafkaSettings(bootstrap=self.bootstrap), self.topics))
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def common_env(self, service: str, instance: int) -> dict[str, str]:
        """The settings every service has; the per-tier ones come from ``<tier>_env``."""
        return child_env({"PYTHONUNBUFFERED": "1", **settings_env(
            kafka=KafkaSettings(bootstrap=self.bootstrap), topics=self.topics,
            instance=instance, group=f"{self.prefix}-{service}", drain_timeout_s=10,
        )}, drop=("RLBUS_", "OTEL_"))  # no tracing: measure the path only

    def spawn(self, service: str, instance: int, env: dict[str, str]) -> Proc:
        return self.processes.spawn(service, instance,
                                    {**self.common_env(service, instance), **env})

    def check_alive(self, finished: Proc | None = None) -> None:
        """Raise if a process has exited, unless it is ``finished`` and exited 0."""
        for p in self.procs:
            code = p.popen.poll()
            if code is not None and not (code == 0 and p is finished):
                raise FleetError(f"{p.label} exited with {code}; last lines of {p.log}:\n"
                                 f"{p.tail()}")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every process with a ready marker has logged it, then a short settle."""
        deadline = time.monotonic() + timeout_s
        waiting = [p for p in self.procs if p.service in READY_MARKER]
        while waiting:
            self.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"not ready after {timeout_s:.0f}s: "
                                 f"{', '.join(p.label for p in waiting)}")
            waiting = [p for p in waiting if READY_MARKER[p.service] not in _read(p.log)]
            time.sleep(0.2)
        if sum(p.service == "rollout" for p in self.procs) > 1:
            time.sleep(SETTLE_S)  # one member alone never rebalances

    def wait_exit(self, proc: Proc, timeout_s: float) -> None:
        """Until ``proc`` exits 0; any other process dying first is an error."""
        deadline = time.monotonic() + timeout_s
        while proc.popen.poll() is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"{proc.label} did not finish within {timeout_s:.0f}s")
            time.sleep(0.2)
        self.check_alive(finished=proc)

    def cpu_seconds(self, others: dict[str, int]) -> dict[str, float]:
        """CPU seconds each running process and each of ``others`` (label: pid) has used."""
        pids = {**{p.label: p.popen.pid for p in self.procs if p.alive}, **others}
        return {label: cpu_seconds(pid) for label, pid in pids.items()}

    def profiles(self, top: int = 25) -> dict[str, dict[str, str]]:
        """With ``profile``: each stopped process's top functions by own time, written next
        to its log as ``profile-<name>.txt``; returns their paths by process name."""
        out = {}
        for prof in sorted(self.run_dir.glob("*.prof")):
            text = io.StringIO()
            pstats.Stats(str(prof), stream=text).sort_stats("tottime").print_stats(top)
            report = self.run_dir / f"profile-{prof.stem}.txt"
            report.write_text(text.getvalue())
            out[prof.stem] = str(report)
        return {"profiles": out} if out else {}

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM everyone (the learner first: it checkpoints), SIGKILL stragglers."""
        self.processes.stop(first="learner", timeout=grace_s)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


# --------------------------------------------------------------------------- the four services


def inference_env(s: Scenario) -> dict[str, str]:
    return settings_env(
        engine="synthetic", synthetic=SyntheticEngineSettings(**s.engine.model_dump()),
        max_batch_size=s.inference.max_batch_size, batch_wait_ms=s.inference.batch_wait_ms,
        inflight_updates=s.inflight_updates,
    )


def rollout_env(s: Scenario) -> dict[str, str]:
    env_cap_s = float(s.env.get("max_ms", 10_000)) / 1000
    # Stragglers keep their group in flight long after its other episodes freed their slots.
    groups = s.rollout.max_groups_in_flight or max(
        16, 4 * math.ceil(s.rollout.max_concurrent_episodes / s.group_size))
    return settings_env(
        tokenizer="synthetic",
        max_concurrent_episodes=s.rollout.max_concurrent_episodes,
        max_groups_in_flight=groups,
        env_timeout_s=max(30.0, 2 * env_cap_s),
        max_context_tokens=s.rollout.max_context_tokens,
    )


def learner_env(s: Scenario, run_dir: Path) -> dict[str, str]:
    return settings_env(
        trainer="synthetic",
        synthetic_step_s=s.learner_step_s,
        task="synthetic",
        task_spec=s.env,
        group_size=s.group_size,
        groups_per_step=s.groups_per_step,
        max_steps=s.steps,
        max_staleness=s.max_staleness,
        staleness_from=s.staleness_from,
        straggler_wait_s=s.straggler_wait_s,
        max_new_tokens=s.max_new_tokens,
        metrics_file=run_dir / "metrics.jsonl",
        weights_dir=run_dir / "weights",
        checkpoint_dir=run_dir / "checkpoint",
        checkpoint_every=s.steps,
        run_name=run_dir.name,
    )


def run_decoupled(s: Scenario, bootstrap: str, run_dir: Path, profile: bool = False,
                  watch: dict[str, int] | None = None) -> ArmResult:
    """The four tiers as processes; returns once the learner has taken ``s.steps`` steps.

    ``extra["cpu_s"]``: CPU seconds of each process from the moment all are ready to the
    learner's exit, and of the processes in ``watch`` (label: pid; e.g. the broker) over
    the same window. The learner is not in it: it has exited when the window closes.
    ``run_dir`` is emptied first: a learner finding an earlier run's checkpoint there would
    resume at its last step and wait for groups that never come."""
    shutil.rmtree(run_dir, ignore_errors=True)
    partitions = max(8, s.rollout.instances, s.inference.instances)
    fleet = Fleet(run_dir, bootstrap, partitions, max(8, s.rollout.instances), profile)
    with fleet:
        started = time.monotonic()
        for i in range(s.inference.instances):
            fleet.spawn("inference", i, inference_env(s))
        for i in range(s.reward_instances):
            fleet.spawn("reward", i, {})
        for i in range(s.rollout.instances):
            fleet.spawn("rollout", i, rollout_env(s))
        fleet.wait_ready()
        ready = fleet.cpu_seconds(watch or {})  # start-up (imports, joining groups) left out
        learner = fleet.spawn("learner", 0, learner_env(s, run_dir))
        fleet.wait_exit(learner, s.timeout_s)
        wall = time.monotonic() - started
        cpu = {k: v - ready[k] for k, v in fleet.cpu_seconds(watch or {}).items() if k in ready}
    rows = read_rows(run_dir / "metrics.jsonl")
    extra = {"rollout_instances": s.rollout.instances, "prefix": fleet.prefix, "cpu_s": cpu,
             "duplicates_dropped": rows[-1].get("duplicates_dropped", 0) if rows else 0,
             **masked(rows), **fleet.profiles()}
    return ArmResult("decoupled", s.name, rows, wall, s.warmup_steps, s.cooldown, extra)
