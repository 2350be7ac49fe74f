"""A clean `rlbus demo` run logs what an operator should read, and nothing else: no traceback,
no progress bar, and at most one line per transient condition of the Kafka client (a
coordinator still being elected, a node still connecting), however often it was retried.

The demo runs as a user starts it, on the session's broker (``RLBUS_KAFKA_BOOTSTRAP``: no
second JVM), for a few steps: long enough to start every service, train, evaluate and stop.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest

from rlbus.processes import child_env

STEPS = 30
KAFKA_CLIENT_LINE = re.compile(r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) ((?:aio)?kafka\S*): (.*)$")
PROGRESS_BAR = re.compile(r"\d+%\||it/s\]|s/it\]|\r")  # tqdm's bar, its rate, its redraw


def noise(text: str) -> list[str]:
    """What a clean run's log must not hold, as one complaint per finding."""
    found = []
    if "Traceback" in text:
        found.append("a traceback")
    found += [f"a progress bar: {m.group(0)!r}" for m in PROGRESS_BAR.finditer(text)][:1]
    lines = Counter(m.groups() for m in map(KAFKA_CLIENT_LINE.match, text.splitlines()) if m)
    found += [f"{n} lines of {name}: {msg}" for (name, msg), n in lines.items() if n > 1]
    return found


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_clean_demo_run_logs_no_traceback_no_progress_bar_and_no_retry_storm(
    kafka_bootstrap, unique_name, tmp_path
):
    run = tmp_path / unique_name("quiet")  # the demo's topics are demo-<run folder name>
    done = subprocess.run(
        [sys.executable, "-m", "rlbus.ops.cli", "demo", "--steps", str(STEPS),
         "--no-progress", "--run-dir", str(run)],
        env=child_env({"RLBUS_KAFKA_BOOTSTRAP": kafka_bootstrap}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0 and "stopping: finished" in done.stdout, done.stdout
    logs = {p.name: p.read_text(errors="replace") for p in sorted((run / "logs").glob("*.log"))}
    assert sorted(logs) == [f"{s}-0.log" for s in ("inference", "learner", "reward", "rollout")]
    for name, text in logs.items():
        assert re.search(r"service=\S+ handled=\d+", text), f"{name} has no summary line:\n{text}"
    texts = {"demo output": done.stdout, **logs}
    complaints = [f"{name}: {c}" for name, text in texts.items() for c in noise(text)]
    assert not complaints, "\n".join(complaints) + "".join(
        f"\n--- {name}\n{text[-3000:]}" for name, text in texts.items() if noise(text))


def test_the_noise_check_finds_what_it_is_meant_to():
    storm = "\n".join(
        ["2026-12-06 21:16:05,066 ERROR aiokafka.consumer.group_coordinator: Group Coordinator "
         "Request failed: [Error 15] GroupCoordinatorNotAvailableError"] * 2
        + ["Loading weights: 100%|██████████| 20/20 [00:00<00:00, 11348.23it/s]",
           "Traceback (most recent call last):"]
    )  # fmt: skip
    assert noise(storm) == [
        "a traceback",
        "a progress bar: '100%|'",
        "2 lines of aiokafka.consumer.group_coordinator: Group Coordinator Request failed: "
        "[Error 15] GroupCoordinatorNotAvailableError",
    ]
    assert noise("2026-12-06 21:16:05,066 INFO rlbus.service: reward-0 ready\n" * 3) == []
