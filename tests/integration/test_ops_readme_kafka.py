"""The README's "Running the services" block, run exactly as written.

Only the environment differs from a reader's shell: ``RLBUS_KAFKA__BOOTSTRAP`` names the test
broker (the block keeps a bootstrap that is already set, instead of starting its own broker),
``RLBUS_TOPICS__PREFIX`` gives the run topics of its own, and ``rlbus`` is on PATH. The four
services must log "ready"; then SIGTERM to the shell (what Ctrl-C does, through the block's
trap) must stop each of them with its summary line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.processes import child_env

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"
SERVICES = ("inference", "reward", "rollout", "learner")


def readme_block(heading: str) -> str:
    """The first fenced shell block under ``## heading``."""
    section = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```(?:sh|bash)\n(.*?)^```", section, re.S | re.M)
    assert match, f"no shell block under {heading!r} in README.md"
    return match.group(1)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(600)
def test_the_running_the_services_block_runs_as_written(kafka_bootstrap, unique_name, tmp_path):
    block = readme_block("Running the services")
    assert "rlbus model init" in block and "&" in block and "wait" in block
    (tmp_path / "block.sh").write_text(block)
    env = child_env({
        "RLBUS_KAFKA__BOOTSTRAP": kafka_bootstrap,
        "RLBUS_TOPICS__PREFIX": unique_name("readme"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
    })  # fmt: skip
    log = tmp_path / "output.log"
    with log.open("wb") as out:
        shell = subprocess.Popen(
            ["bash", "block.sh"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the services can be found and reaped
        )  # fmt: skip
    try:
        ready = wait_for(
            lambda: all(f"{name}-0 ready" in log.read_text() for name in SERVICES)
            or shell.poll() is not None,
            timeout=420,
        )
        text = log.read_text()
        assert ready and shell.poll() is None, f"the services did not all get ready:\n{text}"
        assert "Traceback" not in text, text
        shell.send_signal(signal.SIGTERM)
        shell.wait(30)
        stopped = wait_for(lambda: not group_alive(shell.pid), timeout=90)
        text = log.read_text()
        assert stopped, f"services still running after SIGTERM:\n{text}"
        for name in SERVICES:
            assert re.search(rf"service={name}-0 handled=\d+ .*stop_reason=SIGTERM", text), text
        assert "invalid settings" not in text and "Traceback" not in text, text
        assert "RLBUS_MODEL_PATH is not a setting of RewardSettings" in text  # logged, not fatal
        assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    finally:
        if group_alive(shell.pid):
            os.killpg(shell.pid, signal.SIGKILL)
