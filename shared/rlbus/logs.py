"""How a service logs: one format on stderr, no progress bars, and a transient condition of
the Kafka client shown once instead of once per retry.

aiokafka logs every retry of a condition it rides out by itself: while a fresh broker elects
a group coordinator, each FindCoordinator try of each consumer logs "Group Coordinator
Request failed: [Error 15] CoordinatorNotAvailableError", and a node that is still connecting
or a topic whose metadata has not spread yet does the same. :class:`FoldRepeats` lets the
first line of a condition through and counts its repeats; a condition that lasts is shown
again once per ``every_s`` with the count, so an outage an hour later is news again, and the
process logs one line of what it folded when it exits. Only the Kafka client's lines are
folded: rlbus's own and every other library's are shown as logged, and a condition is its
exact text, so a different error is never folded into one shown before.

Hugging Face progress bars ("Loading weights", "Loading checkpoint shards") are switched off
through ``HF_HUB_DISABLE_PROGRESS_BARS``, which transformers reads when it is imported, so
this module imports neither (an operator who wants the bars sets the variable to 0).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FOLDED_LOGGERS = ("aiokafka", "kafka")
"""Loggers whose repeated lines are folded: the Kafka client's, which log per retry."""

EVERY_S = 300.0
"""A condition that keeps recurring is shown again, with its count, at most this often."""

MAX_CONDITIONS = 1000
"""Conditions remembered at once; the oldest is forgotten first (a line naming an offset or
a member id is a condition of its own, so a long run could otherwise grow without bound)."""

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class Condition:
    shown_at: float
    folded_since_shown: int = 0
    folded: int = 0


class FoldRepeats(logging.Filter):
    """A handler filter: the first line of each (logger, level, text) of ``loggers`` passes;
    its repeats are counted, and pass again, annotated with the count, once per ``every_s``."""

    def __init__(self, loggers: tuple[str, ...] = FOLDED_LOGGERS, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__()
        self.loggers = loggers
        self.every_s = every_s
        self.clock = clock
        self.conditions: dict[tuple[str, int, str], Condition] = {}
        self._lock = threading.Lock()  # the Kafka client logs from the loop, others may not

    def folds(self, record: logging.LogRecord) -> bool:
        return any(record.name == n or record.name.startswith(n + ".") for n in self.loggers)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.folds(record):
            return True
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        with self._lock:
            seen = self.conditions.get(key)
            if seen is None:
                self._remember(key, Condition(now))
                return True
            if now - seen.shown_at < self.every_s:
                seen.folded_since_shown += 1
                seen.folded += 1
                return False
            repeats, seen.folded_since_shown, seen.shown_at = seen.folded_since_shown, 0, now
        if repeats:
            record.msg, record.args = f"{key[2]} (and {repeats} more like it before)", ()
        return True

    def _remember(self, key: tuple[str, int, str], condition: Condition) -> None:
        if len(self.conditions) >= MAX_CONDITIONS:
            del self.conditions[next(iter(self.conditions))]
        self.conditions[key] = condition

    def summary(self, shown: int = 3, width: int = 100) -> str | None:
        """One line of what was folded, the most repeated first; None if nothing was."""
        with self._lock:
            folded = sorted(
                ((c.folded, key) for key, c in self.conditions.items() if c.folded),
                reverse=True,
            )
        if not folded:
            return None
        total = sum(n for n, _ in folded)
        top = "; ".join(f"{n}x {name}: {_clip(text, width)}"
                        for n, (name, _, text) in folded[:shown])  # fmt: skip
        more = f"; and {len(folded) - shown} more" if len(folded) > shown else ""
        return (f"folded {total} repeated Kafka client log line(s) of {len(folded)} "
                f"condition(s) logged above: {top}{more}")  # fmt: skip


def _clip(text: str, width: int) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def configure(level: str) -> FoldRepeats | None:
    """Log ``level`` and up to stderr, progress bars off, the Kafka client's warnings and
    up with their repeats folded (at DEBUG nothing is folded: every retry is shown)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=level, format=FORMAT, stream=sys.stderr)
    logging.captureWarnings(True)  # a library's warnings.warn gets the format and a logger name
    numeric = logging.getLevelName(level)
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, numeric))
    handlers = logging.getLogger().handlers
    if numeric <= logging.DEBUG or any(isinstance(f, FoldRepeats)
                                       for h in handlers for f in h.filters):  # fmt: skip
        return None  # configured before (a test, or a process that runs two services)
    fold = FoldRepeats()
    for handler in handlers:
        handler.addFilter(fold)
    atexit.register(_log_summary, fold)
    return fold


def _log_summary(fold: FoldRepeats) -> None:
    line = fold.summary()
    if line:
        logging.getLogger(__name__).info(line)
