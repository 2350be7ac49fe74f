"""Throughput per tier, as the learner can know it honestly, for its metrics rows.

- rollout: episodes per second, from the end offsets of ``trajectories``;
- inference: model calls answered per second, from the end offsets of ``steps.results``.
  Both topics are written without transactions, so an end offset moves by exactly one per
  record;
- reward: scored episodes per second that reached this learner. ``trajectories.scored`` is
  written in transactions, whose commit markers take offsets too, so its end offsets would
  overcount; what the learner received is exact, and equals the reward tier's output once
  the learner keeps up (its lag is in ``rlbus status``).

Every figure is over the time since the previous sample. End offsets are read at most once
every ``every_s``, by a reader that is opened, asked and closed: it never fetches a record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from rlbus.topics import Topics
from rlbus.transport import TP, Bus


@dataclass
class _Counts:
    at: float
    trajectories: int
    results: int
    scored: int


@dataclass
class TierThroughput:
    """Samples the three counts; :meth:`rates` is the newest figures (empty until the
    second sample)."""

    bus: Bus
    topics: Topics
    every_s: float = 10.0
    scored_received: int = 0
    """Scored episodes this learner received (its caller adds to it)."""
    clock: Callable[[], float] = time.monotonic
    _last: _Counts | None = None
    _rates: dict[str, float] = field(default_factory=dict)

    async def sample(self) -> None:
        """Read the end offsets and update the rates, if ``every_s`` has passed."""
        now = self.clock()
        if self._last is not None and now - self._last.at < self.every_s:
            return
        ends = await self._ends([self.topics.trajectories, self.topics.results])
        counts = _Counts(now, ends[self.topics.trajectories], ends[self.topics.results],
                         self.scored_received)
        if self._last is not None:
            dt = max(counts.at - self._last.at, 1e-9)
            self._rates = {
                "rollout_episodes_per_s": (counts.trajectories - self._last.trajectories) / dt,
                "inference_results_per_s": (counts.results - self._last.results) / dt,
                "reward_scored_per_s": (counts.scored - self._last.scored) / dt,
            }
        self._last = counts

    def rates(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self._rates.items()}

    async def _ends(self, names: list[str]) -> dict[str, int]:
        tps: list[TP] = [(n, p) for n in names for p in await self.bus.partitions(n)]
        reader = await self.bus.consumer(names, BaseModel, assign=tps)
        try:
            ends = await reader.end_offsets(tps)
        finally:
            await reader.close()
        return {n: sum(v for (t, _), v in ends.items() if t == n) for n in names}
