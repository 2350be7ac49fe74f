"""Assembling complete GRPO groups from scored trajectories, each episode exactly once.

Trajectories of one group arrive in any order, possibly more than once (rollout is
at-least-once: a restarted instance rolls a prompt out again under the same episode ids).
The first copy of each episode index wins; later copies, and any copy of a group already
complete or trained, are dropped and counted. Deliveries are acked only once their group is
trained or they are dropped, so the consumer's committable offsets never pass an untrained
episode.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rlbus.messages import ScoredTrajectory
from rlbus.transport import Delivery


@dataclass
class Group:
    group_id: str
    size: int
    members: dict[int, ScoredTrajectory] = field(default_factory=dict)
    deliveries: list[Delivery[Any]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    def ordered(self) -> list[ScoredTrajectory]:
        return [self.members[i] for i in sorted(self.members)]


class GroupAssembler:
    """Collects episodes into groups; remembers which groups were trained."""

    def __init__(self, trained: list[str] | None = None, remember: int = 100_000) -> None:
        self.open: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.trained: OrderedDict[str, None] = OrderedDict.fromkeys(trained or [])
        self.remember = remember
        self.duplicates = 0

    def add(self, d: Delivery[ScoredTrajectory]) -> list[Delivery[Any]]:
        """Take one delivery; returns deliveries that are finished with (to ack now)."""
        t = d.message.trajectory
        # A complete group waiting for its step counts as trained: a second full copy of it
        # (two rollout members both ran its prompt across a rebalance) would otherwise
        # assemble into a second group and train beside the first.
        if t.group_id in self.trained or any(g.group_id == t.group_id for g in self.ready):
            self.duplicates += 1
            return [d]
        group = self.open.setdefault(t.group_id, Group(t.group_id, t.group_size))
        if t.index in group.members or t.index >= group.size:
            self.duplicates += 1
            return [d]
        group.members[t.index] = d.message
        group.deliveries.append(d)
        if group.complete:
            self.ready.append(self.open.pop(t.group_id))
        return []

    def take(self, n: int) -> list[Group]:
        """The oldest ``n`` complete groups, marked trained."""
        taken, self.ready = self.ready[:n], self.ready[n:]
        for g in taken:
            self.trained[g.group_id] = None
        while len(self.trained) > self.remember:
            self.trained.popitem(last=False)
        return taken

    def trained_ids(self) -> list[str]:
        return list(self.trained)
