"""Learner: GRPO on complete groups and weight publication; hosts the prompt feeder.

The learner is the first trainer of :mod:`rlbus.client`: the client assembles the groups
(each episode once, duplicates dropped, dead letters replaced by failed stand-ins), keeps
the credit window, waits for stragglers and publishes the weights; the learner takes the
GRPO step, checkpoints, runs the evaluation rounds and records the metrics.

Delivery contract: exactly once by checkpointed offsets. The checkpoint holds the model, the
optimizer, the version, the step, the client's position after the last step (the consumer
offsets below which every episode has been trained, the ids of trained groups, the newest
100k, and the feeder's count of prompts), and the ledger of every episode id each of the
last ``ledger_steps`` steps trained on (an audit trail, not deduplicated), written
atomically. A restarted learner loads it and starts its client from that position, so
nothing is trained twice (same model state, same data) and nothing is skipped. Kafka's own
committed offsets follow the checkpoint (for lag monitoring), never lead it.

Under ``torchrun`` this service is rank 0 and the only one that reads Kafka, checkpoints and
publishes; the other ranks train their share of each step (:mod:`.distributed`).

Staleness: the client's credit window bounds how far ahead the feeder (:mod:`.feeder`) starts
groups; each step trains the groups at their last chance first, then the oldest, and holds
the step (up to ``straggler_wait_s``) for an incomplete group whose last chance it is
(:mod:`rlbus.client.groups`). Samples older than ``max_staleness`` versions that still reach
the learner are masked and counted (``masked_stale``).

Metrics: one row per step and one per evaluation round go to ``metrics_file`` and, with the
same names and values, to the trackers ``tracking`` names (:mod:`rlbus.tracking`), which
also get the resolved settings as hyperparameters and each step's staleness histogram.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from rlbus import plugins, telemetry
from rlbus.api import Task
from rlbus.client import ClientSettings, Position, RolloutClient, ScoredGroup
from rlbus.client.groups import GroupAssembler
from rlbus.learner.feeder import Feeder
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import EvalStats, StepStats
from rlbus.learner.store import Checkpoint, load_checkpoint, save_checkpoint
from rlbus.learner.throughput import TierThroughput
from rlbus.learner.trainer import StepTrainer, SyntheticTrainer, Trainer, episode_success
from rlbus.messages import MASK_CAUSES, ScoredTrajectory, Trajectory
from rlbus.prompt_data import DatasetPosition, PromptSource, dead_letter, load_rows, specs
from rlbus.service import Service
from rlbus.tracking.base import Destination, flatten, require
from rlbus.tracking.composite import Composite, open_tracker
from rlbus.tracking.wandb_sink import wandb_mode
from rlbus.transport import Bus
from rlbus.weights import weights_file

log = logging.getLogger(__name__)


class Learner(Service[LearnerSettings]):
    name = "learner"

    def __init__(self, settings: LearnerSettings, bus: Bus | None = None) -> None:
        super().__init__(settings, bus)
        # an unknown task or a plugin that fails to import: a clear error before any work
        self.task = plugins.task(settings.task) if settings.feed else None
        require(settings.tracking)  # a tracker's library missing: said before any work
        self.tracker = Composite([])  # the named trackers, opened in setup
        self.step = 0
        self.version = 0
        self._progress = asyncio.Event()
        self._t0 = time.monotonic()
        self._last_row_t = self._t0  # throughput: per interval between two steps' rows
        self._publish_s = 0.0
        self._publish_bytes = 0
        self._episodes_trained = 0
        self._masked = dict.fromkeys(MASK_CAUSES, 0)  # episodes masked so far, by cause
        self.ledger: list[list[str]] = []  # per step: the episode ids it trained on
        self._last_eval: EvalStats | None = None
        self.feeder: Feeder | None = None
        self._position = Position()  # after the last step trained: what a checkpoint keeps
        self._dataset_position = DatasetPosition()  # the checkpoint's, for the feeder to resume
        # built in setup; None until then, so that close releases it after a setup that failed
        # later on (under torchrun the follower ranks wait for it)
        self._trainer: StepTrainer | None = None
        self._client: RolloutClient | None = None

    @property
    def trainer(self) -> StepTrainer:
        """The trainer :meth:`setup` built."""
        if self._trainer is None:
            raise RuntimeError("the learner's trainer is built in setup()")
        return self._trainer

    @property
    def client(self) -> RolloutClient:
        """The client :meth:`setup` connected."""
        if self._client is None:
            raise RuntimeError("the learner's client is connected in setup()")
        return self._client

    @property
    def assembler(self) -> GroupAssembler:
        """The client's groups: which were trained, how many duplicates were dropped."""
        return self.client.assembler

    # -- setup and restore

    async def setup(self) -> None:
        # On the loop thread: HF loading is not thread-safe.
        synthetic = self.settings.trainer == "synthetic"
        self._trainer = SyntheticTrainer(self.settings) if synthetic else Trainer(self.settings)
        self._position = self._restore(
            await asyncio.to_thread(load_checkpoint, self.settings.checkpoint_dir))
        self.tracker = await asyncio.to_thread(open_tracker, self.settings.tracking,
                                               self._destination())
        self.tracker.hyperparameters(flatten(self.settings.model_dump(mode="json")))
        self._client = await RolloutClient.connect(
            self._client_settings(), self.bus, position=self._position, admit=self._admit,
            on_count=self._counted)
        self.version = self.client.version
        self.throughput = TierThroughput(self.bus, self.topics,
                                         self.settings.throughput_every_s)
        if self.task is not None:
            self.feeder = await self._make_feeder(self.task)
            self.spawn("feeder", self._feed(self.feeder))
        log.info("learner at step %d, version %d", self.step, self.version)

    def _destination(self) -> Destination:
        """Where the trackers write: by default next to the metrics file, under the run's
        name; secrets never reach them (model_dump masks SecretStr)."""
        s = self.settings
        folder = s.tracking_dir or (s.metrics_file.parent if s.metrics_file is not None
                                    else Path("runs/tracking"))
        folder = folder.resolve()
        return Destination(
            folder=folder, project=s.tracking_project, run=s.tracking_run or s.run_name,
            wandb_mode=wandb_mode(s.tracking_wandb_mode),
            mlflow_uri=s.tracking_mlflow_uri or (folder / "mlruns").as_uri())

    async def _make_feeder(self, task: Task) -> Feeder:
        """The feeder, over the datasets if set (read off the loop; a dataset that cannot
        feed at all fails here, before anything is sent)."""
        s = self.settings
        source = None
        if s.dataset is not None:
            rows = await asyncio.to_thread(load_rows, s.dataset)
            source = PromptSource(rows, s.dataset, task, self._dataset_position)
        eval_specs = None
        if s.eval_dataset is not None:
            rows = await asyncio.to_thread(load_rows, s.eval_dataset)
            eval_specs, bad = specs(rows, s.eval_dataset, task)
            for row in bad:
                log.warning("eval dataset %s", row.error)
                await dead_letter(self.bus, s.eval_dataset, row)
            eval_specs = eval_specs[:s.eval_episodes]
        letter = None if s.dataset is None else partial(dead_letter, self.bus, s.dataset)
        return Feeder(s, task, self.client, source=source, eval_specs=eval_specs,
                      dead_letter=letter)

    def _client_settings(self) -> ClientSettings:
        s = self.settings
        return ClientSettings(
            kafka=s.kafka, topics=s.topics, limits=s.limits, group=self.group,
            member=self.member, run_name=s.run_name, model_name=s.model_name,
            model_path=s.model_path, weights_dir=s.weights_dir, keep_weights=s.keep_weights,
            weights_checksum=s.weights_checksum,
            groups_per_step=s.groups_per_step, max_staleness=s.max_staleness,
            staleness_from=s.staleness_from, straggler_wait_s=s.straggler_wait_s)

    def _restore(self, checkpoint: Checkpoint | None) -> Position:
        """Rewind the trainer and the learner's counts; the client's position to resume."""
        if checkpoint is None:
            return Position()
        self.trainer.restore(checkpoint.policy)
        self.step, self.version = checkpoint.step, checkpoint.version
        self.ledger = [list(step) for step in checkpoint.ledger]
        self._episodes_trained = checkpoint.episodes_trained
        self._masked |= checkpoint.masked_by_cause
        self._dataset_position = DatasetPosition(checkpoint.dataset_epoch,
                                                 checkpoint.dataset_index)
        log.info("restored checkpoint: step %d, version %d", self.step, self.version)
        return checkpoint.position(self.topics.scored)

    def _admit(self, t: Trajectory) -> None:
        """Raise if ``t`` can take part in nothing (the client dead-letters it alone):
        a training episode the trainer cannot step on, an evaluation episode whose task's
        success metric raises on it."""
        if t.purpose == "train":
            self.trainer.admit(t)
        else:
            episode_success(t)

    def _counted(self, name: str, n: int) -> None:
        if name == "records":
            self.count_input(n)
        else:
            self.bump(name, n)

    # -- feeder

    async def _feed(self, feeder: Feeder) -> None:
        while not self.stopping:  # after the last training prompt, evaluations still run
            await feeder.top_up(self.step)
            self._progress.clear()
            await self._wait_progress()

    async def _final_eval(self, timeout_s: float = 120.0) -> None:
        """Evaluate the final weights before stopping (the feeder loop no longer runs)."""
        if self.feeder is None or not self.settings.eval_every:
            return
        await self.feeder.publish_eval(self.step, force=True)  # unless sent
        deadline = time.monotonic() + timeout_s
        while self._last_eval is None or self._last_eval.at_step != self.step:
            if time.monotonic() > deadline:
                log.warning("final evaluation incomplete after %.0fs", timeout_s)
                return
            self._take_evals(await self.client.evaluations(0.5))

    def _take_evals(self, groups: list[ScoredGroup]) -> None:
        for g in groups:
            for e in g.episodes:
                self._take_eval(e.scored)

    def _take_eval(self, scored: ScoredTrajectory) -> None:
        figures = self.feeder.take_eval(scored) if self.feeder is not None else None
        if figures is None:
            return
        self._last_eval = figures
        row = {  # a row of its own: no training figures in it
            "step": self.step,
            "time": round(time.monotonic() - self._t0, 3),
            "episodes_trained": self._episodes_trained,
            **figures.row(),
        }
        self._write_row(row)

    async def _wait_progress(self) -> None:
        waiter = asyncio.create_task(self._progress.wait())
        await asyncio.wait({waiter}, timeout=1.0)
        waiter.cancel()

    # -- training

    async def main(self) -> None:
        while not self.stopping:
            groups = await self.client.receive(self.settings.groups_per_step, timeout_s=0.5)
            self._take_evals(await self.client.evaluations())
            if groups and not self.stopping:  # taken, not trained: the position says so
                self.throughput.scored_received += sum(len(g.episodes) for g in groups)
                await self._train_step(groups)
            if self._dataset_done() and not self.stopping:
                await self._checkpoint()
                await self._final_eval()
                self.request_stop("the dataset's epochs are done")

    def _dataset_done(self) -> bool:
        """The dataset is sent and fewer groups than a step's are left untrained (the
        rest of an epoch that does not fill a step is never trained)."""
        if self.feeder is None or not self.feeder.exhausted:
            return False
        return self.client.submitted - self.step * self.settings.groups_per_step < \
            self.settings.groups_per_step

    async def _train_step(self, groups: list[ScoredGroup]) -> None:
        t0 = time.perf_counter()
        waited = self.client.waited_s
        episodes = [telemetry.sender_context(e.headers) for g in groups for e in g.episodes]
        attrs = {"rlbus.step": self.step + 1}
        with telemetry.span("train_step", self.member, links=episodes, attributes=attrs):
            stats = await asyncio.to_thread(self.trainer.step, groups, self.version)
        staleness = self._record_staleness(groups)
        telemetry.LOSS.record(stats.loss)
        self.step += 1
        self.tracker.histogram("staleness", staleness, self.step)
        # what entered the loss: masked episodes (stale, failed, invalid) are counted apart
        self._episodes_trained += stats.masks.trained
        for cause, n in stats.masks.by_cause.items():
            self._masked[cause] += n
        await self._publish_weights()
        self._position = self.client.position()  # every group taken so far is trained now
        self.ledger.append([e.episode_id for g in groups for e in g.episodes])
        del self.ledger[:-self.settings.ledger_steps]  # bounded: the last ledger_steps steps
        await self.throughput.sample()
        self._record(stats, round(waited, 3), time.perf_counter() - t0)
        if self.step % self.settings.checkpoint_every == 0 or self.step >= self.settings.max_steps:
            await self._checkpoint()
        self._progress.set()
        if self.step >= self.settings.max_steps:
            await self._final_eval()
            self.request_stop(f"reached max_steps={self.settings.max_steps}")

    def _record_staleness(self, groups: list[ScoredGroup]) -> list[float]:
        """Each episode's staleness (versions behind the learner), recorded; returned too."""
        values = [float(self.version - e.policy_version) for g in groups for e in g.episodes]
        for v in values:
            telemetry.STALENESS.record(v)
        return values

    async def _publish_weights(self) -> None:
        t0 = time.perf_counter()
        event = await self.client.publish_weights(
            self.trainer.weights(), step=self.step, samples_trained=self._episodes_trained,
            samples_masked=self._masked)
        self._publish_s = time.perf_counter() - t0
        self.version = event.version
        if event.checksum:  # what the version's file weighs (a LoRA adapter's: its own)
            self._publish_bytes = weights_file(event.uri).stat().st_size

    async def _checkpoint(self) -> None:
        # the prompts sent so far count as sent: a restart does not send them again
        position = self._position.model_copy(update={"submitted": self.client.submitted})
        checkpoint = Checkpoint.of(
            self.trainer.state(),
            position=position,
            step=self.step,
            ledger=self.ledger,
            ledger_first_step=self.step - len(self.ledger) + 1,
            episodes_trained=self._episodes_trained,
            masked_by_cause=self._masked,
            **self._feeder_position(),
        )
        await asyncio.to_thread(save_checkpoint, self.settings.checkpoint_dir, checkpoint)
        await self.client.commit(position)  # Kafka's offsets follow the checkpoint, never lead it
        self.bump("checkpoints")

    def _feeder_position(self) -> dict[str, int]:
        """The dataset position to checkpoint: the feeder's, with the count of groups sent
        (the two move together), else the one restored."""
        pos = self.feeder.position if self.feeder is not None else self._dataset_position
        return {"dataset_epoch": pos.epoch, "dataset_index": pos.index}

    def _record(self, stats: StepStats, waited_s: float, seconds: float) -> None:
        now = time.monotonic()
        interval, self._last_row_t = max(now - self._last_row_t, 1e-9), now
        row = {
            "step": self.step,
            "version": self.version,
            "time": round(now - self._t0, 3),
            "step_seconds": round(seconds, 4),
            "episodes_trained": self._episodes_trained,
            "duplicates_dropped": self.client.assembler.duplicates,
            **stats.row(),
            "waited_s": waited_s,
            "publish_s": round(self._publish_s, 4),
            "publish_bytes": self._publish_bytes,
            # the learner's throughput since the previous step's row (waiting included)
            "episodes_per_s": round(stats.masks.trained / interval, 3),
            "tokens_per_s": round(stats.tokens / interval, 3),
            **self.throughput.rates(),  # the other tiers' (see .throughput)
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
        self._write_row(row)

    def _write_row(self, row: dict[str, Any]) -> None:
        """``row`` to the metrics file and its figures (nulls left out) to the trackers."""
        if self.settings.metrics_file is not None:
            _append_json(self.settings.metrics_file, row)
        figures = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
        self.tracker.scalars(figures, row["step"])

    async def drain(self) -> None:
        """Checkpoint what was trained since the last checkpoint; untrained work stays."""
        if self.step and self.step % self.settings.checkpoint_every:
            await self._checkpoint()

    async def close(self) -> None:
        """Under torchrun: release the follower ranks (they exit) and leave the group."""
        await asyncio.to_thread(self.tracker.close)
        if self._trainer is not None:
            await asyncio.to_thread(self._trainer.close)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "step": self.step, "version": self.version}


def _append_json(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
