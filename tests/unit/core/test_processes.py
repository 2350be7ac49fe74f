"""Children started through the launcher die with their parent, however the parent dies and
whatever the child was doing then: still being forked, importing, or running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbus.processes import child_env, spawn_process
from tests.polling import wait_until_sync
from tests.support.processes import with_token

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal: Linux")

GRACE_S = 15.0
"""Generous on a loaded machine: SIGKILL is immediate, then init has to reap."""

SPAWN_FOREVER = """
import os, sys
from pathlib import Path
from rlbus.processes import spawn_process
token, log = sys.argv[1], Path(sys.argv[2])
while True:
    spawn_process([sys.executable, "-c", "import time; time.sleep(600)", token],
                  dict(os.environ), log)
"""


@pytest.mark.parametrize("children", [1, 4, 9])
def test_a_parent_killed_while_spawning_leaves_no_child(children, tmp_path):
    """The parent forks children back to back, so its SIGKILL lands while one is between
    fork and exec (or importing): each round catches a different moment."""
    token = f"orphan-probe-{uuid.uuid4().hex}"
    parent = subprocess.Popen([sys.executable, "-c", SPAWN_FOREVER, token,
                               str(tmp_path / "children.log")], env=child_env())
    try:
        _wait(lambda: len(with_token(token) - {parent.pid}) >= children or parent.poll(),
              60, f"{children} children started")
        assert parent.poll() is None, "the spawning parent died on its own"
    finally:
        parent.kill()
        parent.wait()
    _wait(lambda: not with_token(token), GRACE_S,
          f"every child gone after the parent's SIGKILL (left: {with_token(token)})")


ADOPTED = """
import os, sys, time
from rlbus.processes import die_with_parent
token, marker = sys.argv[1], sys.argv[2]
arm = die_with_parent()  # made in this process, as spawn_process does before it forks
middle = os.getpid()
if os.fork() == 0:
    deadline = time.monotonic() + 30
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.01)  # until the parent has died: its death came before the arming
    arm()
    open(marker, "w").write("the parent died before the signal was armed, and I live on")
os._exit(0)
"""


def test_a_child_whose_parent_died_before_the_signal_was_armed_kills_itself(tmp_path):
    """The window a parent-death signal alone leaves open: the parent dies between fork
    and the child's ``prctl``; no signal will ever come, so the child must notice."""
    token = f"orphan-probe-{uuid.uuid4().hex}"
    marker = tmp_path / "survived"
    subprocess.run([sys.executable, "-c", ADOPTED, token, str(marker)], env=child_env(),
                   check=True, timeout=60)
    _wait(lambda: not with_token(token), GRACE_S, "the adopted child gone")
    assert not marker.exists(), marker.read_text()


def test_a_child_of_a_living_parent_is_left_alone(tmp_path):
    """The guard must not fire while the parent lives: a started child keeps running."""
    token = f"orphan-probe-{uuid.uuid4().hex}"
    script = "import sys, time; print('up', flush=True); time.sleep(600)"
    log = tmp_path / "child.log"
    child = spawn_process([sys.executable, "-c", script, token], child_env(), log)
    try:
        _wait(lambda: "up" in _read(log) or child.poll() is not None, 60, "the child up")
        assert child.poll() is None, _read(log)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    wait_until_sync(condition, what, timeout_s, every_s=0.02)
