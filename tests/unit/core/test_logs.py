"""A transient condition of the Kafka client is one log line, not one per retry; every other
line, and every different condition, is shown as logged."""

from __future__ import annotations

import logging
import subprocess
import sys

from rlbus.logs import FoldRepeats

COORDINATOR = "Group Coordinator Request failed: [Error 15] CoordinatorNotAvailableError"


def record(name: str, msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_kafka_client_condition_passes_once_and_its_repeats_are_counted():
    fold = FoldRepeats(every_s=300, clock=Clock())
    name = "aiokafka.consumer.group_coordinator"
    passed = [fold.filter(record(name, "Group Coordinator Request failed: %s", "[Error 15] "
                                 "CoordinatorNotAvailableError")) for _ in range(20)]  # fmt: skip
    assert passed == [True] + [False] * 19
    assert fold.filter(record(name, "Heartbeat failed for group %s because it is rebalancing",
                              "g"))  # another condition: shown  # fmt: skip
    assert fold.filter(record(name, COORDINATOR, level=logging.WARNING))  # another level
    summary = fold.summary()
    assert summary is not None
    assert summary.startswith("folded 19 repeated Kafka client log line(s) of 1 condition(s)")
    assert f"19x {name}: {COORDINATOR}" in summary


def test_rlbus_and_other_libraries_lines_are_never_folded():
    fold = FoldRepeats(clock=Clock())
    for name in ("rlbus.rollout.service", "transformers.modeling_utils", "aiokafkax"):
        assert all(fold.filter(record(name, "the same line")) for _ in range(5)), name
    assert fold.summary() is None


def test_a_lasting_condition_is_shown_again_with_its_count_once_per_interval():
    clock = Clock()
    fold = FoldRepeats(every_s=300, clock=clock)
    assert fold.filter(record("aiokafka.client", COORDINATOR))
    clock.now = 299.0
    assert not fold.filter(record("aiokafka.client", COORDINATOR))
    assert not fold.filter(record("aiokafka.client", COORDINATOR))
    clock.now = 300.0
    again = record("aiokafka.client", COORDINATOR)
    assert fold.filter(again)
    assert again.getMessage() == f"{COORDINATOR} (and 2 more like it before)"
    clock.now = 700.0
    alone = record("aiokafka.client", COORDINATOR)
    assert fold.filter(alone) and alone.getMessage() == COORDINATOR  # nothing folded since


SERVICE_LIKE = """
import logging, os
from rlbus.runner import configure_logging
configure_logging("INFO")
for _ in range(30):
    logging.getLogger("aiokafka.cluster").error("Topic %s not found in cluster metadata", "t")
logging.getLogger("rlbus.x").info("ready")
print(os.environ["HF_HUB_DISABLE_PROGRESS_BARS"])
"""


def test_a_service_process_logs_a_condition_once_and_what_it_folded_on_exit():
    done = subprocess.run([sys.executable, "-c", SERVICE_LIKE], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    lines = done.stderr.splitlines()
    assert sum("Topic t not found in cluster metadata" in line for line in lines) == 2, lines
    assert "ERROR aiokafka.cluster: Topic t not found in cluster metadata" in lines[0]
    assert "INFO rlbus.x: ready" in lines[1]
    assert lines[2].endswith("folded 29 repeated Kafka client log line(s) of 1 condition(s) "
                             "logged above: 29x aiokafka.cluster: Topic t not found in "
                             "cluster metadata")  # fmt: skip
    assert len(lines) == 3 and done.stdout == "1\n"  # progress bars off unless asked for
