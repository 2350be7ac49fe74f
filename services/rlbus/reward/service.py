"""Reward: scores each Trajectory and publishes a ScoredTrajectory, exactly once.

Delivery contract: consume-transform-produce in one Kafka transaction per batch. The scored
trajectories and the consumer offsets of the inputs they came from commit together or not
at all, so a member killed mid-transaction leaves neither output nor progress behind and
its successor (same ``transactional_id``, which fences the zombie) redoes the batch.
Verifiers run in worker processes (:mod:`.pool`), killed at ``verifier_timeout_s``; those
that raise or time out, failed episodes and unknown tasks produce a masked (``valid=False``)
sample rather than a zero reward: the learner must not learn from them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from rlbus import acl, plugins, telemetry
from rlbus.limits import check_identity, check_trajectory
from rlbus.messages import ScoredTrajectory, Trajectory
from rlbus.reward.pool import VerifierFailed, VerifierPool
from rlbus.reward.settings import RewardSettings
from rlbus.service import Service
from rlbus.transport import (
    Bus,
    Consumer,
    Delivery,
    MessageTooLargeError,
    Producer,
    refusal_for,
)

log = logging.getLogger(__name__)


class Reward(Service[RewardSettings]):
    name = "reward"

    def __init__(self, settings: RewardSettings, bus: Bus | None = None) -> None:
        super().__init__(settings, bus)
        self.pool = VerifierPool(settings.verifier_workers, settings.verifier_timeout_s)

    async def setup(self) -> None:
        # a broken plugin is a startup error naming its entry point, not a masked sample each
        for kind in ("task", "verifier"):
            log.info("%ss: %s", kind, ", ".join(plugins.check_all(kind)))
        self.pool.start()
        [txn_id] = self.transactional_ids()
        self.producer: Producer = await self.bus.producer(transactional_id=txn_id)
        self.trajectories: Consumer[Trajectory] = await self.bus.consumer(
            [self.topics.trajectories], Trajectory, group_id=self.group
        )

    def transactional_ids(self) -> list[str]:
        prefix = self.settings.topics.prefix
        return [self.settings.transactional_id or acl.transactional_id(prefix, self.member)]

    async def main(self) -> None:
        while not self.stopping:
            batch = await self.trajectories.poll(0.5, self.settings.batch_size)
            offsets = self.trajectories.tracker.committable()
            if batch or offsets:  # offsets alone: dead letters to step past
                await self._publish(batch)

    async def _publish(self, batch: list[Delivery[Trajectory]]) -> None:
        handled = await asyncio.gather(*(self._handle(d) for d in batch))
        done = [(d, *h) for d, h in zip(batch, handled, strict=True) if h is not None]
        for d in batch:  # the dead-lettered too: their offsets go with this transaction
            self.trajectories.ack(d)
        offsets = self.trajectories.tracker.committable()
        async with self.producer.transaction():
            for d, s, span in done:
                with telemetry.use(span):
                    await self._send(d, s)
            if offsets:
                await self.producer.send_offsets(offsets, self.group)
        self.trajectories.tracker.committed(offsets)
        self.count_input(len(batch))
        self.bump("masked", sum(not s.valid for _, s, _ in done))
        self.bump("reward_sum", sum(s.reward for _, s, _ in done if s.valid))

    async def _handle(self, d: Delivery[Trajectory]) -> tuple[ScoredTrajectory, Any] | None:
        """One trajectory scored. Over a limit, or its handling raised, it is dead-lettered
        and acked (its offset commits with the batch's), and a failed stand-in is scored in
        its place, so that its group completes at the learner with this member masked
        rather than hold the others there for ever; None for one that can be no group's
        member (a group of 10^9, an index past its group)."""
        async with self.trajectories.handling(d) as outcome:
            outcome.refusal = check_trajectory(d.message, self.settings.limits)
            if outcome.refusal is None:
                span = d.start_span()
                return await self._score(d, span), span
            self.bump("rejected")
            await self.trajectories.reject(d, outcome.refusal)
        return self._stand_in(d, outcome.error or "")

    def _stand_in(self, d: Delivery[Trajectory], error: str
                  ) -> tuple[ScoredTrajectory, Any] | None:
        if check_identity(d.message, self.settings.limits) is not None:
            return None
        return ScoredTrajectory.failed_stand_in(d.message, error), d.start_span()

    async def _send(self, d: Delivery[Trajectory], s: ScoredTrajectory) -> None:
        """Into the open transaction. A sample too large to publish (the verifier's info
        on top of a trajectory at the size limit) is refused before anything is sent, so
        the transaction goes on without it; a broker error aborts the whole batch."""
        try:
            await self.producer.send(self.topics.scored, s, key=s.trajectory.group_id)
        except MessageTooLargeError as exc:
            refusal = refusal_for(exc)
            await self.trajectories.reject(d, refusal)
            stand_in = ScoredTrajectory.failed_stand_in(s.trajectory, refusal.detail)
            await self.producer.send(self.topics.scored, stand_in, key=s.trajectory.group_id)

    async def _score(self, d: Delivery[Trajectory], span: Any) -> ScoredTrajectory:
        with telemetry.use(span, end=False), telemetry.span("score", self.member) as s:
            scored = await self.score(d.message)
            s.set_attribute("rlbus.reward", scored.reward)
            s.set_attribute("rlbus.valid", scored.valid)
            if scored.valid:
                telemetry.REWARD.record(scored.reward, {"rlbus.task": d.message.task})
            return scored

    async def score(self, t: Trajectory) -> ScoredTrajectory:
        if t.status == "failed":
            return ScoredTrajectory(trajectory=t, reward=0.0, valid=False, error=t.error)
        try:
            name, reward, valid, info = await self.pool.verify(t)
            if not math.isfinite(reward):
                raise ValueError(f"verifier {name} returned {reward}")
        except (VerifierFailed, ValueError) as exc:
            error = str(exc) if isinstance(exc, VerifierFailed) else f"ValueError: {exc}"
            log.warning("episode %s masked: %s", t.episode_id, error[:500])
            return ScoredTrajectory(trajectory=t, reward=0.0, valid=False, error=error[:500])
        return ScoredTrajectory(trajectory=t, reward=reward, valid=valid, verifier=name,
                                info=info)

    async def close(self) -> None:
        self.pool.close()

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "verifier_kills": self.pool.killed}
