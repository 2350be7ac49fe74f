"""Which weights the inference members serve, from their reports on weights.served.

Every inference member reports the version it serves when it starts, after each load or
refusal, every few seconds in between and when it leaves (:class:`rlbus.messages.
WeightsServed`, compacted by member). A member is *live* while its newest report is
younger than ``served_ttl_s`` and does not say it is leaving. Version ``v`` is served once
at least ``min_members`` members are live and every live member serves ``v`` or newer: a
member that joins meanwhile must catch up too, one that vanished stops counting once its
reports go stale. A live member that refused ``v`` ends the wait at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlbus.errors import WeightsRefusedError
from rlbus.messages import WeightsServed


@dataclass(frozen=True)
class Served:
    """Whether a version is served: the live members and the version each serves."""

    version: int
    members: dict[str, int]
    """Live member → the version it serves."""
    min_members: int

    @property
    def lagging(self) -> dict[str, int]:
        return {m: v for m, v in self.members.items() if v < self.version}

    @property
    def done(self) -> bool:
        return len(self.members) >= self.min_members and not self.lagging

    def __str__(self) -> str:
        if not self.members:
            return "no live inference member reports (is the inference tier running?)"
        lag = ", ".join(f"{m} serves v{v}" for m, v in sorted(self.lagging.items()))
        few = (f"{len(self.members)} live members of the {self.min_members} asked for"
               if len(self.members) < self.min_members else "")
        return "; ".join(x for x in (lag, few) if x)


class ServedMembers:
    """The newest report of each member of one model."""

    def __init__(self, model: str, ttl_s: float) -> None:
        self.model = model
        self.ttl_s = ttl_s
        self.reports: dict[str, WeightsServed] = {}

    def note(self, report: WeightsServed) -> None:
        if report.model != self.model:
            return
        old = self.reports.get(report.member)
        if old is None or report.at >= old.at:
            self.reports[report.member] = report

    def live(self, now: float | None = None) -> list[WeightsServed]:
        now = time.time() if now is None else now
        return [r for r in self.reports.values()
                if not r.leaving and now - r.at <= self.ttl_s]

    def state(self, version: int, min_members: int) -> Served:
        """Whether ``version`` is served; raises :class:`WeightsRefusedError` if a live
        member refused it and serves an older one."""
        live = self.live()
        for r in live:
            if r.refused_version == version and r.version < version:
                raise WeightsRefusedError(f"{r.member} refused weights v{version}: "
                                          f"{r.refused_error}")
        return Served(version, {r.member: r.version for r in live}, min_members)
