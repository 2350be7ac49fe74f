"""What one arm of a load test measured, from its per-step rows.

Both arms write the rows the learner writes (``step``, ``time``, ``episodes_trained``,
``step_seconds``), so one function computes throughput and busy fraction for both. The
steady state leaves out the first ``warmup`` steps, whose time is spent filling the pipeline
(for the decoupled arm also starting processes and joining consumer groups), and the last
``cooldown`` steps: once the feeder has admitted its last group (``max_staleness + 1`` steps
before the end) the rollout tier runs dry, which a long training run never sees.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.messages import MASK_CAUSES


@dataclass
class ArmResult:
    """One run of one arm (decoupled or synchronous) on one scenario."""

    arm: str
    scenario: str
    rows: list[dict[str, Any]]
    wall_s: float
    """From launch to the last step, including start-up."""
    warmup: int
    cooldown: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        """Samples that entered the loss; masked ones are counted apart (:func:`masked`)."""
        return int(self.rows[-1]["episodes_trained"]) if self.rows else 0

    def _window(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The row the steady state starts from, and the rows of the steps inside it."""
        origin = {"time": 0.0, "episodes_trained": 0}
        end = max(len(self.rows) - self.cooldown, 1)
        start = min(self.warmup, end - 1)
        return (self.rows[start - 1] if start else origin), self.rows[start:end]

    def throughput(self) -> float:
        """Trained samples per second in the steady state."""
        origin, steps = self._window()
        if not steps or steps[-1]["time"] <= origin["time"]:
            return 0.0
        return float((steps[-1]["episodes_trained"] - origin["episodes_trained"])
                     / (steps[-1]["time"] - origin["time"]))

    def busy(self) -> float:
        """Share of the steady-state wall time the learner spent in optimizer steps."""
        origin, steps = self._window()
        if not steps or steps[-1]["time"] <= origin["time"]:
            return 0.0
        return float(sum(r["step_seconds"] for r in steps) / (steps[-1]["time"] - origin["time"]))

    def overall(self) -> float:
        """Trained samples per second over the whole run, fill and drain included."""
        return self.samples / self.rows[-1]["time"] if self.rows else 0.0

    def staleness_max(self) -> float:
        return max((float(r.get("staleness_max") or 0) for r in self.rows), default=0.0)

    def summary(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "scenario": self.scenario,
            "steps": len(self.rows),
            "samples_trained": self.samples,
            "throughput": self.throughput(),
            "learner_busy": self.busy(),
            "throughput_overall": self.overall(),
            "wall_s": self.wall_s,
            "staleness_max": self.staleness_max(),
            **self.extra,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "rows": self.rows}


def masked(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples that reached the learner and did not train: in all, and by cause."""
    by_cause = {c: sum(int(r.get(f"masked_{c}") or 0) for r in rows) for c in MASK_CAUSES}
    return {"masked": sum(by_cause.values()), "masked_by_cause": by_cause}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """JSON lines; a half-written last line (the writer still running) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows
