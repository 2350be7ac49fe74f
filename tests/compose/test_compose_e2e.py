"""`docker compose up`, for real: the stack scaled, a member of two tiers killed, recovered.

docker-compose.yml with tests/compose/offline.yml (local base and Kafka images; Jaeger left
out), built and started with `--scale rollout=2 --scale inference=2`. Once training is
under way, `docker kill` (SIGKILL) one rollout and one inference container while their
episodes and step requests are in flight, and crash the reward service inside its container
(SIGKILL mid-transaction). Docker restarts the crashed reward (its restart policy) but not
the two killed by hand (a manual stop): the other rollout and inference must carry the run
on alone, then the killed two are started again and rejoin. The learner must reach its max
steps, and its
checkpoint ledger must hold every published episode exactly once, every step a full batch,
no sample masked as failed. `down -v` must leave no container, network or volume behind.

Run by `make compose-test` (scripts/compose_env.sh installs and builds what it needs; it
takes root). A missing daemon is a failure, not a skip: only RLBUS_SKIP_DOCKER=1 skips.
Deselected from plain `pytest` (pyproject addopts); `-m docker` selects it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlbus.ops.broker import KAFKA_VERSION
from tests.support.ledger import check_ledger, expected_episodes, load_ledger

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "docker-compose.yml", ROOT / "tests" / "compose" / "offline.yml"]
PROJECT = "rlbus-e2e"  # not the `rlbus` of docker-compose.yml: a user's own stack is untouched
LOCAL_IMAGES = ["rlbus-local/python:3.11", f"rlbus-local/kafka:{KAFKA_VERSION}"]
# The learner's recipe in docker-compose.yml (RUN_NAME, GROUPS_PER_STEP, GROUP_SIZE).
RUN_NAME, GROUPS_PER_STEP, GROUP_SIZE = "compose", 2, 8
# Measured on 2 cores: the kill lands ~30 s into training, with over a minute still to go.
STEPS, KILL_AT, SURVIVORS_ALONE = 600, 100, 60


def compose_command() -> list[str]:
    """$COMPOSE_CMD (scripts/compose_env.sh prints it), else the `docker compose` plugin."""
    command = os.environ.get("COMPOSE_CMD", "").split() or ["docker", "compose"]
    probe = subprocess.run([*command, "version"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.fail(f"no Docker Compose at {command}: set COMPOSE_CMD or run "
                    f"`make compose-test` (scripts/compose_env.sh builds one)\n{probe.stderr}")
    return command


def require_docker() -> None:
    """Fail (never skip, unless RLBUS_SKIP_DOCKER=1) when the daemon or images are missing."""
    if os.environ.get("RLBUS_SKIP_DOCKER") == "1":
        pytest.skip("RLBUS_SKIP_DOCKER=1: the docker compose end-to-end test is skipped as asked")
    hint = "run `make compose-test` as root (or set RLBUS_SKIP_DOCKER=1 to skip this test)"
    if shutil.which("docker") is None:
        pytest.fail(f"no docker CLI on PATH: {hint}")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        pytest.fail(f"the Docker daemon does not answer ({info.stderr.strip()[-300:]}): {hint}")
    for image in LOCAL_IMAGES:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                          check=False).returncode != 0:
            pytest.fail(f"image {image} is missing: {hint}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Stack:
    """One compose project: compose and docker commands scoped to it, and what it runs."""

    command: list[str]
    env: dict[str, str]
    killed: set[str] = field(default_factory=set)  # by us: their exits and restarts are due
    timings: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def compose(self, *args: str, timeout: float = 600) -> str:
        files = [arg for f in FILES for arg in ("-f", str(f))]
        cmd = [*self.command, "-p", PROJECT, *files, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                              cwd=ROOT, timeout=timeout, check=False)
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
        return proc.stdout

    def mark(self, what: str) -> None:
        self.timings[what] = round(time.monotonic() - self.t0, 1)
        print(f"[compose-e2e +{self.timings[what]:.0f}s] {what}", flush=True)

    def containers(self) -> list[dict[str, Any]]:
        ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}")
        return json.loads(docker("inspect", *ids.split())) if ids.strip() else []

    def names(self, service: str) -> list[str]:
        return sorted(c["Name"].lstrip("/") for c in self.containers()
                      if c["Config"]["Labels"].get("com.docker.compose.service") == service)

    def restarts(self, name: str) -> int:
        (count,) = [c["RestartCount"] for c in self.containers() if c["Name"] == f"/{name}"]
        return int(count)

    def learner(self) -> dict[str, Any]:
        (state,) = [c["State"] for c in self.containers()
                    if c["Config"]["Labels"].get("com.docker.compose.service") == "learner"]
        return state

    def step(self) -> int:
        """The learner's last step, from its metrics file (0 before the first, or once the
        learner has exited); a line still being written is skipped."""
        (name,) = self.names("learner")
        proc = subprocess.run(["docker", "exec", name, "tail", "-n", "2",
                               "/data/learner/metrics.jsonl"],
                              capture_output=True, text=True, check=False)
        steps = []
        for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
            try:
                steps.append(int(json.loads(line)["step"]))
            except ValueError:
                continue
        return max(steps, default=0)

    def check_no_crash(self) -> None:
        """A restart or a failed exit anywhere but in the containers we killed fails."""
        for c in self.containers():
            name, state = c["Name"].lstrip("/"), c["State"]
            if name in self.killed:
                continue
            failed = state["Status"] == "exited" and state["ExitCode"] != 0
            assert not failed and c["RestartCount"] == 0, (
                f"{name} crashed ({state['Status']}, exit {state['ExitCode']}, "
                f"{c['RestartCount']} restarts):\n{docker('logs', '--tail', '40', name, err=True)}"
            )

    def wait(self, what: str, done: Any, timeout: float) -> None:
        """Poll ``done()`` every second, with progress lines, crash checks and a deadline."""
        deadline, last_print = time.monotonic() + timeout, 0.0
        while not done():
            self.check_no_crash()
            if time.monotonic() > deadline:
                logs = self.compose("logs", "--no-color", "--tail", "15", timeout=60)
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")
            if time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                print(f"  waiting for {what}: learner at step {self.step()}", flush=True)
            time.sleep(1)
        self.mark(what)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        found = {kind: docker(*cmd, "--filter", label).split()
                 for kind, cmd in {"containers": ("ps", "-aq"), "networks": ("network", "ls", "-q"),
                                   "volumes": ("volume", "ls", "-q")}.items()}
        return {kind: ids for kind, ids in found.items() if ids}


def docker(*args: str, err: bool = False) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, f"docker {' '.join(args)} failed: {proc.stderr}"
    return proc.stdout + (proc.stderr if err else "")


@pytest.fixture
def stack() -> Iterator[Stack]:
    require_docker()
    env = {**os.environ, "RLBUS_MAX_STEPS": str(STEPS), "RLBUS_KAFKA_PORT": str(free_port())}
    s = Stack(compose_command(), env)
    s.compose("down", "-v", "--remove-orphans", timeout=180)  # a crashed earlier run's leftovers
    try:
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", timeout=180)
        s.mark("down -v")
    assert not s.leftovers(), f"`down -v` left {s.leftovers()} of project {PROJECT}"


def test_scaled_stack_survives_killed_members(stack: Stack, tmp_path: Path) -> None:
    print("building the rlbus image (minutes the first time, seconds from the cache)",
          flush=True)
    stack.compose("build", "topics", timeout=1500)  # every rlbus service shares its image
    stack.mark("rlbus image built")
    size = int(docker("image", "inspect", "-f", "{{.Size}}", "rlbus:cpu"))
    assert size < 8e9, f"rlbus:cpu is {size / 1e9:.1f} GB: is local state in the build context?"
    stack.compose("up", "-d", "--no-build", "--scale", "rollout=2", "--scale", "inference=2")
    stack.mark("up -d returned (kafka healthy, topics and model-init done)")
    assert len(stack.names("rollout")) == len(stack.names("inference")) == 2
    users = {c["Config"]["Image"]: c["Config"]["User"] for c in stack.containers()}
    assert users == {"rlbus:cpu": "rlbus", f"rlbus-local/kafka:{KAFKA_VERSION}": "appuser"}
    stack.wait("first training step", lambda: stack.step() >= 1, timeout=300)
    stack.wait(f"step {KILL_AT}", lambda: stack.step() >= KILL_AT, timeout=300)
    kill_one_of_each(stack)
    reward = crash_reward(stack)
    survived = stack.step() + SURVIVORS_ALONE
    stack.wait(f"{SURVIVORS_ALONE} steps by the survivors alone",
               lambda: stack.step() >= survived, timeout=300)
    assert stack.restarts(reward) == 1, "Docker restarts a member that crashed"
    print(host_status(stack), flush=True)
    docker("start", *sorted(stack.killed - {reward}))  # recovered: they rejoin their groups
    stack.mark("killed containers started again")
    stack.wait("the learner to finish", lambda: stack.learner()["Status"] == "exited", 600)
    assert stack.learner()["ExitCode"] == 0
    states = {c["Name"].lstrip("/"): c["State"]["Status"] for c in stack.containers()}
    assert all(states[name] == "running" for name in stack.killed), states
    assert_trained_exactly_once(stack, tmp_path)


def kill_one_of_each(stack: Stack) -> None:
    step = stack.step()
    assert step < STEPS - SURVIVORS_ALONE, f"too late to kill mid-run: step {step} of {STEPS}"
    victims = [stack.names("rollout")[0], stack.names("inference")[0]]
    docker("kill", *victims)  # SIGKILL: no drain, no commit, no goodbye to the group
    stack.killed.update(victims)
    stack.mark(f"docker kill {' '.join(victims)} at step {step}")
    # `docker kill` counts as a manual stop: restart policies leave them down
    states = {c["Name"].lstrip("/"): c["State"]["Status"] for c in stack.containers()}
    assert all(states[v] == "exited" for v in victims), states


def crash_reward(stack: Stack) -> str:
    """SIGKILL the service process, not the container: a crash, which Docker restarts."""
    (name,) = stack.names("reward")
    # PID 1 is the init process compose's `init: true` adds; the service is its only child
    docker("exec", name, "sh", "-c", "kill -9 $(cat /proc/1/task/1/children)")
    stack.killed.add(name)
    stack.mark(f"reward service crashed (SIGKILL inside {name}) at step {stack.step()}")
    return name


def host_status(stack: Stack) -> str:
    """`rlbus status` from the host, through the EXTERNAL listener compose publishes."""
    env = {**os.environ, "RLBUS_KAFKA__BOOTSTRAP": f"localhost:{stack.env['RLBUS_KAFKA_PORT']}"}
    rlbus = str(Path(sys.executable).with_name("rlbus"))
    proc = subprocess.run([rlbus, "status", "--once"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    # The learner's group shows only after its first checkpoint (its Kafka offsets follow it).
    for name in ("prompts", "steps", "trajectories", "rollout", "inference", "reward"):
        assert name in proc.stdout, proc.stdout
    return proc.stdout


def assert_trained_exactly_once(stack: Stack, tmp_path: Path) -> None:
    for path in ("checkpoint/checkpoint.pt", "metrics.jsonl"):
        stack.compose("cp", f"learner:/data/learner/{path}", str(tmp_path))
    ledger = load_ledger(tmp_path / "checkpoint.pt")
    expected = expected_episodes(RUN_NAME, STEPS * GROUPS_PER_STEP, GROUP_SIZE)
    check = check_ledger(ledger, expected, GROUPS_PER_STEP * GROUP_SIZE)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "version" in r]
    masked = {c: sum(int(r[f"masked_{c}"]) for r in train) for c in ("stale", "failed", "invalid")}
    print(json.dumps({"steps": len(ledger), "episodes_expected": check.expected,
                      "episodes_trained": check.trained, "lost": len(check.lost),
                      "trained_twice": len(check.duplicated), "masked": masked,
                      "redelivered_copies_dropped": train[-1]["duplicates_dropped"],
                      "timings_s": stack.timings}), flush=True)
    assert len(ledger) == STEPS
    check.assert_exactly_once()
    assert masked["failed"] == masked["invalid"] == 0, masked
