"""Assembling complete groups from scored episodes, each episode exactly once, and what a
trainer receives of them.

Episodes of one group arrive in any order, possibly more than once (rollout is
at-least-once: a restarted instance rolls a prompt out again under the same episode ids).
The first copy of each episode index wins; later copies, and any copy of a group already
complete or taken, are dropped and counted. Deliveries are acked only once their group is
taken or they are dropped, so the consumer's committable offsets never pass an episode
that was not handed to the trainer.

Complete training groups are handed out oldest weights first (the version their first
token was sampled with, or with ``staleness_from`` newest, the version of the newest token
of their first member back: what the learner's stale mask counts from), and
:meth:`GroupAssembler.due` names the groups whose last chance to train within the staleness
bound is the next step: the client waits for those rather than let them go stale
(docs/performance.md, "Stragglers"). Evaluation groups are kept
apart: they are handed out as soon as they are complete.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlbus.errors import SegmentedEpisodeError
from rlbus.messages import FinishReason, ScoredTrajectory, Turn
from rlbus.transport import Delivery


@dataclass(frozen=True)
class Segment:
    """One token sequence the model saw: a context and what the policy sampled in it, up to
    the next call whose context did not extend it (:meth:`Trajectory.segments`)."""

    token_ids: list[int]
    """Token ids exactly as sampled: the context, completions and observations in order."""
    loss_mask: list[bool]
    """Which of ``token_ids`` the policy sampled (the tokens a policy loss is over)."""
    logprobs: list[float]
    """The behaviour policy's logprob of each sampled token (0.0 elsewhere), as the
    engine reported it at the prompt's sampling temperature."""
    versions: list[int] = field(default_factory=list, compare=False)
    """The weight version that sampled each of ``token_ids`` (-1 where not sampled): a
    partial rollout's tokens come from several (turns served by different versions, or an
    in-flight update inside one completion). Empty on a Segment built without them; not
    part of equality (two segments of the same tokens are the same sequence)."""

    @classmethod
    def of(cls, turns: Sequence[Turn]) -> Segment:
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for turn in turns:
            ids += turn.input_ids + turn.completion_ids
            mask += [False] * len(turn.input_ids) + [True] * len(turn.completion_ids)
            logprobs += [0.0] * len(turn.input_ids) + turn.logprobs
            versions += [-1] * len(turn.input_ids) + turn.token_versions
        return cls(ids, mask, logprobs, versions)


@dataclass(frozen=True)
class Episode:
    """One scored episode, as the token sequences a trainer trains on: ``segments``, one
    for a linear episode (each call extended the one before), several where an agent's
    history did not (the rollout tier's gateway, docs/extending.md). Every segment of an
    episode trains with the episode's reward; each sampled token is in exactly one.

    ``token_ids``, ``loss_mask`` and ``logprobs`` are the one segment's (empty with none);
    on an episode of several they raise :class:`SegmentedEpisodeError` rather than give a
    concatenation the model never saw."""

    episode_id: str
    """``<group_id>/<index>``; ``rlbus trace`` follows it through every tier."""
    index: int
    """Its place in the group."""
    segments: tuple[Segment, ...]
    """Its token sequences, in the order they were sampled (none: a failed episode with no
    turn)."""
    reward: float
    """The verifier's reward; meaningless where ``valid`` is False (a failed rollout's is
    0.0, a verifier may return any value with ``valid=False``): do not train on it."""
    policy_version: int
    """The oldest weight version that sampled any of its tokens (its staleness is the
    trainer's version minus this, by default: :meth:`version_of_age`)."""
    finish_reason: FinishReason
    """How its last completion ended (``error`` for a failed episode with no turn)."""
    valid: bool
    """False where it must be masked whatever its staleness: the rollout failed, the
    verifier failed, or it has no turn. Its reward means nothing then."""
    scored: ScoredTrajectory
    """The whole record: turns, spec, verifier info, error."""
    headers: Mapping[str, bytes] = field(default_factory=dict)
    """The record's Kafka headers (its trace context), to link a training span to it."""
    newest_version: int = -1
    """The newest weight version that sampled any of its tokens (-1: not given; then
    ``policy_version``)."""

    def version_of_age(self, staleness_from: Literal["oldest", "newest"] = "oldest") -> int:
        """The version its staleness counts from: its oldest token's or its newest's
        (``RLBUS_MAX_STALENESS`` and ``RLBUS_STALENESS_FROM`` of the learner)."""
        if staleness_from == "newest":
            return max(self.newest_version, self.policy_version)
        return self.policy_version

    @classmethod
    def of(cls, scored: ScoredTrajectory, headers: Mapping[str, bytes]) -> Episode:
        t = scored.trajectory
        valid = t.status == "ok" and scored.valid and bool(t.turns)
        return cls(
            episode_id=t.episode_id, index=t.index,
            segments=tuple(Segment.of(s) for s in t.segments()), reward=scored.reward,
            policy_version=t.min_version, newest_version=t.max_version,
            finish_reason=t.turns[-1].finish_reason if t.turns else "error",
            valid=valid, scored=scored, headers=dict(headers))

    @property
    def token_ids(self) -> list[int]:
        """The one segment's token ids (see :attr:`Segment.token_ids`)."""
        return self._only().token_ids

    @property
    def loss_mask(self) -> list[bool]:
        """The one segment's loss mask (see :attr:`Segment.loss_mask`)."""
        return self._only().loss_mask

    @property
    def logprobs(self) -> list[float]:
        """The one segment's behaviour logprobs (see :attr:`Segment.logprobs`)."""
        return self._only().logprobs

    def _only(self) -> Segment:
        if len(self.segments) > 1:
            raise SegmentedEpisodeError(
                f"episode {self.episode_id} has {len(self.segments)} segments (its agent's "
                "history did not extend what the model was given: trimmed, edited, retried); "
                "there is no one token sequence the model saw: train each of "
                "episode.segments with the episode's reward")
        return self.segments[0] if self.segments else Segment([], [], [])


@dataclass(frozen=True)
class ScoredGroup:
    """One complete group: every episode of one submitted prompt, by index."""

    group_id: str
    task: str
    purpose: Literal["train", "eval"]
    episodes: tuple[Episode, ...]
    started: int
    """The oldest weight version of any of its episodes (-1: none has a turn)."""
    eval_round: int | None = None
    """The evaluation round its prompt named (eval groups)."""

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]


@dataclass
class Group:
    """A group being assembled, with the deliveries to ack once it is taken."""

    group_id: str
    size: int
    purpose: Literal["train", "eval"] = "train"
    members: dict[int, ScoredTrajectory] = field(default_factory=dict)
    deliveries: list[Delivery[Any]] = field(default_factory=list)
    started: int = -1
    """The oldest policy version of any member back so far (-1: none back yet, or only
    failures with no turn). A group's episodes start together, so the first member back
    tells the version of them all; the minimum covers one that was redelivered."""
    newest: bool = False
    """Staleness counts from each episode's newest token (``staleness_from`` newest)."""
    counted: int = -1
    """The version the group's staleness counts from: ``started``, or with ``newest`` the
    oldest of its members' newest tokens (the member back that goes stale first; one still
    running samples its last turn later than any member back)."""

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
            mine = t.max_version if self.newest else t.min_version
            self.counted = mine if self.counted < 0 else min(self.counted, mine)

    def scored(self) -> ScoredGroup:
        """The group as a trainer receives it."""
        headers = {d.message.trajectory.index: d.headers for d in self.deliveries}
        episodes = tuple(Episode.of(m, headers.get(m.trajectory.index, {}))
                         for m in self.ordered())
        first = episodes[0].scored.trajectory
        return ScoredGroup(self.group_id, first.task, self.purpose, episodes, self.started,
                           first.eval_round)


class GroupAssembler:
    """Collects episodes into groups; remembers which groups were taken."""

    def __init__(self, taken: list[str] | None = None, remember: int = 100_000,
                 staleness_from: Literal["oldest", "newest"] = "oldest") -> None:
        self.newest = staleness_from == "newest"
        self.open: dict[str, Group] = {}
        self.ready: list[Group] = []
        """Complete training groups, in completion order."""
        self.evals: list[Group] = []
        """Complete evaluation groups, in completion order."""
        self.taken: OrderedDict[str, None] = OrderedDict.fromkeys(taken or [])
        self.remember = remember
        self.duplicates = 0

    def add(self, d: Delivery[ScoredTrajectory]) -> list[Delivery[Any]]:
        """Take one delivery; returns deliveries that are finished with (to ack now)."""
        t = d.message.trajectory
        # A complete group waiting to be taken counts as taken: a second full copy of it
        # (two rollout members both ran its prompt across a rebalance) would otherwise
        # assemble into a second group and train beside the first.
        if t.group_id in self.taken or self._complete(t.group_id) is not None:
            self.duplicates += 1
            return [d]
        group = self.open.setdefault(t.group_id, Group(t.group_id, t.group_size, t.purpose,
                                                       newest=self.newest))
        if t.index in group.members or t.index >= group.size:
            self.duplicates += 1
            return [d]
        group.add(d)
        if group.complete:
            done = self.open.pop(t.group_id)
            (self.evals if done.purpose == "eval" else self.ready).append(done)
        return []

    def _complete(self, group_id: str) -> Group | None:
        return next((g for g in (*self.ready, *self.evals) if g.group_id == group_id), None)

    def abandon(self, group_id: str) -> list[Delivery[Any]]:
        """Give up an incomplete group (a member of it was dead-lettered): it is never
        taken, later copies of its members are dropped like duplicates, and the
        deliveries held for it are returned, to ack now. A complete group is kept: the
        member dead-lettered was a surplus copy."""
        if self._complete(group_id) is not None:
            return []
        self._remember(group_id)  # also with no member back yet: none may follow it
        group = self.open.pop(group_id, None)
        return group.deliveries if group is not None else []

    def take(self, n: int, last_chance: int | None = None) -> list[Group]:
        """``n`` complete training groups, marked taken: first those whose last chance to
        train within the staleness bound is this step (counted from ``last_chance``:
        :attr:`Group.counted`), then the rest oldest first (ties: the first completed).
        Groups already past the bound, or with no turn at all, cannot train within it (the
        trainer masks them; the client masks nothing): they go after the last-chance ones,
        or they would take their places and make them stale too, and before the younger
        ones, so they never wait long to be acked."""
        def key(g: Group) -> tuple[bool, int]:
            return (last_chance is None or g.counted != last_chance, g.counted)

        self.ready.sort(key=key)  # stable: completion order within a version
        taken, self.ready = self.ready[:n], self.ready[n:]
        for g in taken:
            self._remember(g.group_id)
        return taken

    def take_evals(self) -> list[Group]:
        """Every complete evaluation group, marked taken."""
        taken, self.evals = self.evals, []
        for g in taken:
            self._remember(g.group_id)
        return taken

    def _remember(self, group_id: str) -> None:
        self.taken[group_id] = None
        while len(self.taken) > self.remember:
            self.taken.popitem(last=False)

    def due(self, version: int, max_staleness: int, n: int) -> list[str]:
        """Incomplete training groups that a step at ``version`` should wait for: counted
        (:attr:`Group.counted`) exactly ``max_staleness`` versions ago, so this step is
        their last chance to train within the bound. Only as many as the step has places
        left for after the complete groups at their last chance too (:meth:`take` gives
        those the first places)."""
        last_chance = version - max_staleness
        if last_chance < 0:  # no version that old: nothing can go stale yet
            return []
        waiting = [g.group_id for g in self.open.values()
                   if g.counted == last_chance and g.purpose == "train"]
        claimed = sum(g.counted == last_chance for g in self.ready)
        return waiting[:max(0, n - claimed)]

    def taken_ids(self) -> list[str]:
        return list(self.taken)

    def trained_ids(self) -> list[str]:
        """The groups taken (what the learner's checkpoint calls trained)."""
        return self.taken_ids()

    @property
    def held(self) -> int:
        """Episodes held in memory: of open groups and of complete ones not taken yet."""
        return sum(len(g.members) for g in (*self.open.values(), *self.ready, *self.evals))
