"""Whatever kills `rlbus demo`, a load test or pytest, nothing it started outlives it: not
the broker JVM, not a service. SIGINT and SIGTERM stop the demo's run in order; SIGKILL
leaves it no say, and the parent-death signal (launcher.die_with_parent) stops the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.services.ops.launcher import child_env

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 15.0
"""What "no more than a few seconds" is allowed to be here: a service's drain when idle, a
JVM's shutdown, and reaping by this machine's init (about 1.6 s)."""


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(name)] = (int(fields[1]), fields[0])
    return out


def descendants(pid: int) -> set[int]:
    table = _table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    table = _table()
    return {p for p in pids if p in table and table[p][1] != "Z"}


def _start(argv: list[str], ready: str, log: Path, timeout: float = 180) -> subprocess.Popen:
    env = child_env({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})  # no RLBUS_*: own broker
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while ready not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    return proc


def _kill_and_check(proc: subprocess.Popen, sig: signal.Signals, log: Path,
                    expect_jvm: bool = True) -> None:
    tree = descendants(proc.pid)
    jvms = {p for p in tree if "kafka.Kafka" in _cmdline(p)}
    assert not expect_jvm or jvms, f"no broker JVM among {tree}"
    proc.send_signal(sig)
    proc.wait(timeout=120)
    deadline = time.monotonic() + GRACE_S
    while alive(tree):
        if time.monotonic() > deadline:
            left = {p: _cmdline(p)[:120] for p in alive(tree)}
            for p in left:  # do not leave them for the next test either
                os.kill(p, signal.SIGKILL)
            raise AssertionError(f"outlived {sig.name} by {GRACE_S}s: {left}\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_the_demo_leaves_nothing_behind(sig, tmp_path):
    log = tmp_path / "demo.log"
    proc = _start([sys.executable, "-m", "rlbus.services.ops.cli", "demo", "--steps", "500",
                   "--no-progress", "--run-dir", str(tmp_path / "run")], "launched", log)
    time.sleep(3)  # the services are importing torch, connecting: mid-start is the worst case
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
    time.sleep(5)  # its fleet of services is up and running episodes
    _kill_and_check(proc, signal.SIGKILL, log)
