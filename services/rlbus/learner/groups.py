"""Assembling complete GRPO groups from scored trajectories, each episode exactly once.

Trajectories of one group arrive in any order, possibly more than once (rollout is
at-least-once: a restarted instance rolls a prompt out again under the same episode ids).
The first copy of each episode index wins; later copies, and any copy of a group already
complete or trained, are dropped and counted. Deliveries are acked only once their group is
trained or they are dropped, so the consumer's committable offsets never pass an untrained
episode.

Complete groups are handed out oldest weights first (the version their first token was
sampled with), and :meth:`GroupAssembler.due` names the groups whose last chance to train
within the staleness bound is the next step: the learner waits for those rather than let
them go stale (docs/performance.md, "Stragglers").
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
    started: int = -1
    """The oldest policy version of any member back so far (-1: none back yet, or only
    failures with no turn). A group's episodes start together, so the first member back
    tells the version of them all; the minimum covers one that was redelivered."""

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    def ordered(self) -> list[ScoredTrajectory]:
        return [self.members[i] for i in sorted(self.members)]

    def add(self, d: Delivery[ScoredTrajectory]) -> None:
        t = d.message.trajectory
        self.members[t.index] = d.message
        self.deliveries.append(d)
        if t.turns:  # a failed episode with no turns says nothing about the weights
            self.started = t.min_version if self.started < 0 else min(self.started,
                                                                      t.min_version)


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
        group.add(d)
        if group.complete:
            self.ready.append(self.open.pop(t.group_id))
        return []

    def abandon(self, group_id: str) -> list[Delivery[Any]]:
        """Give up an incomplete group (a member of it was dead-lettered): it is never
        trained, later copies of its members are dropped like duplicates, and the
        deliveries held for it are returned, to ack now. A complete group is kept: the
        member dead-lettered was a surplus copy."""
        if any(g.group_id == group_id for g in self.ready):
            return []
        self._remember(group_id)  # also with no member back yet: none may follow it
        group = self.open.pop(group_id, None)
        return group.deliveries if group is not None else []

    def take(self, n: int, last_chance: int | None = None) -> list[Group]:
        """``n`` complete groups, marked trained: first those whose last chance to train
        within the staleness bound is this step (sampled at ``last_chance``), then the rest
        oldest weights first (ties: the first completed). Groups already past the bound, or
        with no turn at all, are masked whatever step trains them: they go after the
        last-chance ones, or they would take their places and make them stale too, and
        before the younger ones, so they never wait long to be acked. A step is always
        ``n`` groups, so the feeder's ``max_steps * groups_per_step`` groups make exactly
        ``max_steps`` steps, masked ones included."""
        def key(g: Group) -> tuple[bool, int]:
            return (last_chance is None or g.started != last_chance, g.started)

        self.ready.sort(key=key)  # stable: completion order within a version
        taken, self.ready = self.ready[:n], self.ready[n:]
        for g in taken:
            self._remember(g.group_id)
        return taken

    def _remember(self, group_id: str) -> None:
        self.trained[group_id] = None
        while len(self.trained) > self.remember:
            self.trained.popitem(last=False)

    def due(self, version: int, max_staleness: int, n: int) -> list[str]:
        """Incomplete groups that a step at ``version`` should wait for: sampled exactly
        ``max_staleness`` versions ago, so this step is their last chance to train within
        the bound. Only as many as the step has places left for after the complete groups
        at their last chance too (:meth:`take` gives those the first places)."""
        last_chance = version - max_staleness
        if last_chance < 0:  # no version that old: nothing can go stale yet
            return []
        waiting = [g.group_id for g in self.open.values() if g.started == last_chance]
        claimed = sum(g.started == last_chance for g in self.ready)
        return waiting[:max(0, n - claimed)]

    def trained_ids(self) -> list[str]:
        return list(self.trained)

