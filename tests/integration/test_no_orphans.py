"""Whatever kills `rlbus demo`, a load test or pytest, nothing it started outlives it: not
the broker JVM, not a service. SIGINT and SIGTERM stop the demo's run in order; SIGKILL
leaves it no say, and the parent-death signal (processes.die_with_parent) kills the rest,
including a child that is still starting at that moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.processes import child_env
from tests.polling import wait_until_sync
from tests.support.processes import alive, cmdline, descendants

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 15.0
"""What "no more than a few seconds" is allowed to be here, on a loaded machine: a service's
drain when idle, a JVM's shutdown, and reaping by this machine's init (about 1.6 s)."""


def _start(argv: list[str], ready: str, log: Path, timeout: float = 180) -> subprocess.Popen:
    env = child_env({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})  # no RLBUS_*: own broker
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_interruptible)
    deadline = time.monotonic() + timeout
    while ready not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    return proc


def _interruptible() -> None:
    """SIGINT acts as Ctrl-C in the victim however pytest was started: a shell starts a
    background job with SIGINT ignored, a child inherits that, and Python then never raises
    KeyboardInterrupt (the demo ran its 500 steps to the end under such a loop)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_and_check(proc: subprocess.Popen, sig: signal.Signals, log: Path,
                    expect_jvm: bool = True) -> None:
    tree = descendants(proc.pid)
    jvms = {p for p in tree if "kafka.Kafka" in cmdline(p)}
    assert not expect_jvm or jvms, f"no broker JVM among {tree}"
    proc.send_signal(sig)
    proc.wait(timeout=120)
    deadline = time.monotonic() + GRACE_S
    while alive(tree):
        if time.monotonic() > deadline:
            left = {p: cmdline(p)[:120] for p in alive(tree)}
            for p in left:  # do not leave them for the next test either
                os.kill(p, signal.SIGKILL)
            raise AssertionError(f"outlived {sig.name} by {GRACE_S}s: {left}\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_the_demo_leaves_nothing_behind(sig, tmp_path):
    log = tmp_path / "demo.log"
    proc = _start([sys.executable, "-m", "rlbus.ops.cli", "demo", "--steps", "500",
                   "--no-progress", "--run-dir", str(tmp_path / "run")], "launched", log)
    # Killed at once: the services were forked a moment ago and are importing torch or
    # connecting: mid-start is the worst case. (A child still between fork and exec when its
    # parent dies: tests/unit/core/test_processes.py.)
    _kill_and_check(proc, sig, log)


PYTEST_VICTIM = '''
import time

def test_holds_the_broker(kafka_bootstrap):
    print("BROKER UP", kafka_bootstrap, flush=True)
    time.sleep(600)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_pytest_leaves_no_broker(sig, tmp_path):
    victim = ROOT / "tests" / "integration" / f"test_zz_victim_{os.getpid()}.py"
    victim.write_text(PYTEST_VICTIM)  # inside tests/: it gets the session broker fixture
    try:
        log = tmp_path / "pytest.log"
        proc = _start([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                       str(victim)], "BROKER UP", log, timeout=120)
        _kill_and_check(proc, sig, log)
    finally:
        victim.unlink()


def test_a_killed_load_test_leaves_nothing_behind(tmp_path):
    log = tmp_path / "loadtest.log"
    proc = _start([sys.executable, "-m", "loadtest", "--smoke", "--out", str(tmp_path / "lt")],
                  "decoupled arm", log, timeout=120)
    logs = tmp_path / "lt"
    wait_until_sync(lambda: any("reads replies on partition" in p.read_text(errors="replace")
                                for p in logs.rglob("rollout-*.log")) or proc.poll() is not None,
                    "the load test's rollout subscribed (its fleet running episodes)", 120)
    _kill_and_check(proc, signal.SIGKILL, log)
