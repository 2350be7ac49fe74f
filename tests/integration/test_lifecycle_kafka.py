"""SIGTERM on a real service process: stop fetching, drain, commit, log one summary, exit 0."""

import signal
import subprocess
import sys
import time

import pytest

from rlbus.services.ops.launcher import ServiceProcesses, child_env

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.parametrize("service", ["inference", "reward", "rollout"])
def test_sigterm_drains_and_exits_cleanly(kafka_bootstrap, unique_name, tmp_path, service):
    env = child_env()
    env.update(
        {"RLBUS_KAFKA__BOOTSTRAP": kafka_bootstrap, "RLBUS_TOPICS__PREFIX": unique_name("lc")}
    )
    env.update(
        {
            "inference": {"RLBUS_ENGINE": "synthetic"},
            "rollout": {"RLBUS_TOKENIZER": "synthetic"},
        }.get(service, {})
    )
    subprocess.run(
        [sys.executable, "-m", "rlbus.services.ops.cli", "topics", "create"],
        env=env,
        check=True,
        capture_output=True,
    )
    procs = ServiceProcesses(tmp_path)
    log = procs.spawn(service, 0, env).log
    proc = procs.get(f"{service}-0").popen
    deadline = time.monotonic() + 60
    while f"{service}-0 ready" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 0, log.read_text()
    text = log.read_text()
    assert f"{service}-0 stopping: SIGTERM" in text
    assert "stop_reason=SIGTERM" in text  # the one summary line
    assert time.monotonic() - started < 30  # well inside drain_timeout_s + close
