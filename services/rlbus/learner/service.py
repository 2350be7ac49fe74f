"""Learner: GRPO on complete groups and weight publication; hosts the prompt feeder.

Delivery contract: exactly once by checkpointed offsets. The checkpoint holds the model, the
optimizer, the version, the step, the consumer offsets below which every episode has been
trained, the ids of trained groups (the newest 100k), the ledger of every episode id each of
the last ``ledger_steps`` steps trained on (an audit trail, not deduplicated) and the
feeder's position, written atomically. A restarted
learner loads it, seeks its partitions to those offsets and rewinds the model with them, so
nothing is trained twice (same model state, same data) and nothing is skipped. Kafka's own
committed offsets follow the checkpoint (for lag monitoring), never lead it.

Under ``torchrun`` this service is rank 0 and the only one that reads Kafka, checkpoints and
publishes; the other ranks train their share of each step (:mod:`.distributed`).

Staleness: the feeder's credit window (:mod:`.feeder`) bounds how far ahead groups start;
each step trains the groups at their last chance first, then the oldest, and holds the step
(up to ``straggler_wait_s``) for an incomplete group whose last chance it is
(:mod:`.groups`). Samples older than ``max_staleness`` versions that still reach the
learner are masked and counted (``masked_stale``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from rlbus import plugins, telemetry
from rlbus.learner.feeder import Feeder
from rlbus.learner.groups import GroupAssembler
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import EvalStats, StepStats
from rlbus.learner.store import Checkpoint, load_checkpoint, save_checkpoint
from rlbus.learner.trainer import StepTrainer, SyntheticTrainer, Trainer
from rlbus.limits import check_identity, check_scored
from rlbus.messages import MASK_CAUSES, ScoredTrajectory, WeightVersion
from rlbus.service import Service
from rlbus.transport import TP, Bus, Consumer, Delivery, Producer

log = logging.getLogger(__name__)


class Learner(Service[LearnerSettings]):
    name = "learner"

    def __init__(self, settings: LearnerSettings, bus: Bus | None = None) -> None:
        super().__init__(settings, bus)
        # an unknown task or a plugin that fails to import: a clear error before any work
        self.task = plugins.task(settings.task) if settings.feed else None
        self.step = 0
        self.version = 0
        self.next_index = 0
        self.offsets: dict[TP, int] = {}
        self.assembler = GroupAssembler()
        self._progress = asyncio.Event()
        self._t0 = time.monotonic()
        self._episodes_trained = 0
        self._masked = dict.fromkeys(MASK_CAUSES, 0)  # episodes masked so far, by cause
        self.ledger: list[list[str]] = []  # per step: the episode ids it trained on
        self._last_eval: EvalStats | None = None
        self.feeder: Feeder | None = None
        self._held_since: float | None = None  # when the pending step began to wait
        # built in setup; None until then, so that close releases it after a setup that failed
        # later on (under torchrun the follower ranks wait for it)
        self._trainer: StepTrainer | None = None

    @property
    def trainer(self) -> StepTrainer:
        """The trainer :meth:`setup` built."""
        if self._trainer is None:
            raise RuntimeError("the learner's trainer is built in setup()")
        return self._trainer

    # -- setup and restore

    async def setup(self) -> None:
        # On the loop thread: HF loading is not thread-safe.
        synthetic = self.settings.trainer == "synthetic"
        self._trainer = SyntheticTrainer(self.settings) if synthetic else Trainer(self.settings)
        self._restore(await asyncio.to_thread(load_checkpoint, self.settings.checkpoint_dir))
        self.producer: Producer = await self.bus.producer()
        self.version = max(self.version, await self._published_version())
        self.scored: Consumer[ScoredTrajectory] = await self.bus.consumer(
            [self.topics.scored],
            ScoredTrajectory,
            group_id=self.group,
            read_committed=True,  # reward publishes in transactions
            on_assign=self._seek_to_checkpoint,
        )
        if self.task is not None:
            self.feeder = Feeder(self.settings, self.task, self.producer,
                                 self.topics.prompts, self.next_index)
            self.spawn("feeder", self._feed(self.feeder))
        log.info("learner at step %d, version %d", self.step, self.version)

    def _restore(self, checkpoint: Checkpoint | None) -> None:
        if checkpoint is None:
            return
        self.trainer.restore(checkpoint.policy)
        self.step, self.version = checkpoint.step, checkpoint.version
        self.next_index = checkpoint.next_index
        self.offsets = dict(checkpoint.offsets)
        self.assembler = GroupAssembler(checkpoint.trained)
        self.ledger = [list(step) for step in checkpoint.ledger]
        self._episodes_trained = checkpoint.episodes_trained
        self._masked |= checkpoint.masked_by_cause
        log.info("restored checkpoint: step %d, version %d", self.step, self.version)

    async def _published_version(self) -> int:
        """Versions only grow: a learner rewound to a checkpoint publishes after the newest
        version any replica may hold, or replicas would ignore its weights."""
        weights = await self.bus.consumer(
            [self.topics.weights], WeightVersion, assign=[(self.topics.weights, 0)]
        )
        announced = await weights.read_to_end((self.topics.weights, 0))
        await weights.close()
        mine = [d.message.version for d in announced
                if d.message.model == self.settings.model_name]
        return max(mine, default=0)

    async def _seek_to_checkpoint(self, scored: Consumer[Any], assigned: list[TP]) -> None:
        for tp in assigned:
            if tp in self.offsets:
                await scored.seek(tp, self.offsets[tp])

    # -- feeder

    async def _feed(self, feeder: Feeder) -> None:
        while not self.stopping:  # after the last training prompt, evaluations still run
            await feeder.top_up(self.step, self.version)
            self._progress.clear()
            await self._wait_progress()

    async def _final_eval(self, timeout_s: float = 120.0) -> None:
        """Evaluate the final weights before stopping (the feeder loop no longer runs)."""
        if self.feeder is None or not self.settings.eval_every:
            return
        await self.feeder.publish_eval(self.step, self.version, force=True)  # unless sent
        deadline = time.monotonic() + timeout_s
        while self._last_eval is None or self._last_eval.at_step != self.step:
            if time.monotonic() > deadline:
                log.warning("final evaluation incomplete after %.0fs", timeout_s)
                return
            for d in await self.scored.poll(0.5):
                if d.message.trajectory.purpose == "eval":
                    self._take_eval(d.message)

    def _take_eval(self, scored: ScoredTrajectory) -> None:
        figures = self.feeder.take_eval(scored) if self.feeder is not None else None
        if figures is None:
            return
        self._last_eval = figures
        if self.settings.metrics_file is not None:  # a row of its own: no training figures in it
            row = {
                "step": self.step,
                "time": round(time.monotonic() - self._t0, 3),
                "episodes_trained": self._episodes_trained,
                **figures.row(),
            }
            _append_json(self.settings.metrics_file, row)

    async def _wait_progress(self) -> None:
        waiter = asyncio.create_task(self._progress.wait())
        await asyncio.wait({waiter}, timeout=1.0)
        waiter.cancel()

    # -- training

    async def main(self) -> None:
        while not self.stopping:
            for d in await self.scored.poll(0.5):
                await self._handle(d)
            while (len(self.assembler.ready) >= self.settings.groups_per_step
                   and not self._waiting() and not self.stopping):
                await self._train_step()

    async def _handle(self, d: Delivery[ScoredTrajectory]) -> None:
        """One scored episode into its group or its evaluation round. Dead-lettered (over
        a limit, or its handling raised), a failed stand-in takes its place, so that the
        group completes with this member masked instead of holding the others, and every
        later commit, for ever; the record is acked with its group, so a restart before
        that makes the same stand-in again. One that can be no group's member (a group of
        10^9) ends its group."""
        async with self.scored.handling(d, ack=False) as outcome:
            outcome.refusal = check_scored(d.message, self.settings.limits)
            if outcome.refusal is not None:
                await self.scored.reject(d, outcome.refusal, ack=False)
                self.bump("rejected")
            else:
                with d.processing():
                    self._take(d)
        if outcome.error is not None:
            self._stand_in(d, outcome.error)
        self.count_input()

    def _stand_in(self, d: Delivery[ScoredTrajectory], error: str) -> None:
        t = d.message.trajectory
        if check_identity(t, self.settings.limits) is not None:
            self.scored.ack(d)
            self._abandon(t.group_id)
            return
        stand_in = ScoredTrajectory.failed_stand_in(t, error)
        self._take(dataclasses.replace(d, message=stand_in))

    def _take(self, d: Delivery[ScoredTrajectory]) -> None:
        if d.message.trajectory.purpose == "eval":
            self._take_eval(d.message)
            self.scored.ack(d)
        else:
            self.trainer.admit(d.message.trajectory)  # raises: a dead letter, not a failed step
            for done in self.assembler.add(d):
                self.scored.ack(done)

    def _abandon(self, group_id: str) -> None:
        held = self.assembler.abandon(group_id)
        for d in held:
            self.scored.ack(d)
        if held:
            log.warning("group %s abandoned: a member was dead-lettered; %d episodes of it "
                        "dropped", group_id, len(held))
            self.bump("abandoned_groups")

    def _waiting(self) -> bool:
        """Hold the step back while a straggling group's last chance to train within the
        staleness bound is this step, up to ``straggler_wait_s``; past that, go on (the
        group is masked as stale when it arrives)."""
        s = self.settings
        if s.straggler_wait_s <= 0:
            return False
        due = self.assembler.due(self.version, s.max_staleness, s.groups_per_step)
        now = time.monotonic()
        if not due:
            return False
        if self._held_since is None:
            self._held_since = now
            self.bump("straggler_waits")
            log.debug("step %d waits for %s", self.step + 1, ", ".join(due))
        if now - self._held_since < s.straggler_wait_s:
            return True
        log.warning("step %d waited %.0fs for %s; going on without them (they will be "
                    "masked as stale)", self.step + 1, now - self._held_since, ", ".join(due))
        self.bump("straggler_timeouts")
        return False

    async def _train_step(self) -> None:
        groups = self.assembler.take(self.settings.groups_per_step,
                                     self.version - self.settings.max_staleness)
        held, self._held_since = self._held_since, None
        t0 = time.perf_counter()
        waited = 0.0 if held is None else time.monotonic() - held
        episodes = [telemetry.sender_context(d.headers) for g in groups for d in g.deliveries]
        attrs = {"rlbus.step": self.step + 1}
        with telemetry.span("train_step", self.member, links=episodes, attributes=attrs):
            stats = await asyncio.to_thread(self.trainer.step, groups, self.version)
        self._record_staleness(groups)
        telemetry.LOSS.record(stats.loss)
        self.step += 1
        self.version += 1
        for g in groups:
            for d in g.deliveries:
                self.scored.ack(d)
        # what entered the loss: masked episodes (stale, failed, invalid) are counted apart
        self._episodes_trained += stats.masks.trained
        for cause, n in stats.masks.by_cause.items():
            self._masked[cause] += n
        await self._publish_weights()
        self.ledger.append([m.trajectory.episode_id for g in groups for m in g.ordered()])
        del self.ledger[:-self.settings.ledger_steps]  # bounded: the last ledger_steps steps
        self._record(stats, round(waited, 3), time.perf_counter() - t0)
        if self.step % self.settings.checkpoint_every == 0 or self.step >= self.settings.max_steps:
            await self._checkpoint()
        self._progress.set()
        if self.step >= self.settings.max_steps:
            await self._final_eval()
            self.request_stop(f"reached max_steps={self.settings.max_steps}")

    def _record_staleness(self, groups: list[Any]) -> None:
        for g in groups:
            for m in g.members.values():
                telemetry.STALENESS.record(self.version - m.trajectory.min_version)

    async def _publish_weights(self) -> None:
        uri, digest = await asyncio.to_thread(self.trainer.save_weights, self.version)
        event = WeightVersion(
            model=self.settings.model_name,
            version=self.version,
            uri=uri,
            checksum=digest,
            step=self.step,
            samples_trained=self._episodes_trained,
            samples_masked=dict(self._masked),
        )
        await self.producer.send(self.topics.weights, event, key=self.settings.model_name)

    async def _checkpoint(self) -> None:
        offsets = {**self.offsets, **self.scored.tracker.committable()}
        checkpoint = Checkpoint.of(
            self.trainer.state(),
            step=self.step,
            version=self.version,
            next_index=self.feeder.next_index if self.feeder else self.next_index,
            offsets=offsets,
            trained=self.assembler.trained_ids(),
            ledger=self.ledger,
            ledger_first_step=self.step - len(self.ledger) + 1,
            episodes_trained=self._episodes_trained,
            masked_by_cause=self._masked,
        )
        await asyncio.to_thread(save_checkpoint, self.settings.checkpoint_dir, checkpoint)
        self.offsets = offsets
        await self.scored.commit()  # Kafka's offsets follow the checkpoint, never lead it
        self.bump("checkpoints")

    def _record(self, stats: StepStats, waited_s: float, seconds: float) -> None:
        row = {
            "step": self.step,
            "version": self.version,
            "time": round(time.monotonic() - self._t0, 3),
            "step_seconds": round(seconds, 4),
            "episodes_trained": self._episodes_trained,
            "duplicates_dropped": self.assembler.duplicates,
            **stats.row(),
            "waited_s": waited_s,
        }
        log.info(
            "step %d v%d reward=%.3f success=%.2f staleness<=%d loss=%.4f",
            self.step,
            self.version,
            stats.reward_mean,
            stats.success_rate,
            int(stats.staleness_max),
            stats.loss,
        )
        if self.settings.metrics_file is not None:
            _append_json(self.settings.metrics_file, row)

    async def drain(self) -> None:
        """Checkpoint what was trained since the last checkpoint; untrained work stays."""
        if self.step and self.step % self.settings.checkpoint_every:
            await self._checkpoint()

    async def close(self) -> None:
        """Under torchrun: release the follower ranks (they exit) and leave the group."""
        if self._trainer is not None:
            await asyncio.to_thread(self._trainer.close)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "step": self.step, "version": self.version}


def _append_json(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
