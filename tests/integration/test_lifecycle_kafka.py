"""SIGTERM on a real service process: stop fetching, drain, commit, log one summary, exit 0."""

import signal
import subprocess
import sys

import pytest

from rlbus.ops.launcher import ServiceProcesses
from rlbus.processes import child_env
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from tests.polling import wait_until_sync

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.parametrize("service", ["inference", "reward", "rollout"])
def test_sigterm_drains_and_exits_cleanly(kafka_bootstrap, unique_name, tmp_path, service):
    own = {"inference": {"engine": "synthetic"}, "rollout": {"tokenizer": "synthetic"}}
    env = child_env(settings_env(kafka=KafkaSettings(bootstrap=kafka_bootstrap),
                                 topics=TopicSettings(prefix=unique_name("lc")),
                                 **own.get(service, {})))
    subprocess.run(
        [sys.executable, "-m", "rlbus.ops.cli", "topics", "create"],
        env=env,
        check=True,
        capture_output=True,
    )
    procs = ServiceProcesses(tmp_path)
    log = procs.spawn(service, 0, env).log
    proc = procs.get(f"{service}-0").popen

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        return f"{service}-0 ready" in log.read_text()

    wait_until_sync(ready, f"{service}-0 ready", timeout_s=120)  # importing torch, under load
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()  # a safety net: drain alone may take 30 s
    text = log.read_text()
    assert f"{service}-0 stopping: SIGTERM" in text
    assert "stop_reason=SIGTERM" in text  # the one summary line
    # drained, not cut off: neither the main loop nor the drain ran into drain_timeout_s
    assert "did not return in time" not in text and "drain timed out" not in text, text
    assert "drain failed" not in text, text
