"""The trainer-side client: submit groups, receive scored groups, publish weights.

Delivery contract: exactly once by checkpointed position. Scored episodes are read with
read_committed (reward publishes in transactions), assembled into groups (each episode
once, duplicates dropped: :mod:`.groups`) and acked when their group is taken by
:meth:`RolloutClient.receive` or :meth:`RolloutClient.evaluations`. :meth:`position` then
holds, per partition, the offset below which every record was taken or dropped, and the ids
of the groups taken. A client started from a position seeks its partitions there and drops
the groups it names, so a trainer that saves each position with a model that has trained on
every group taken before it gets nothing twice and loses nothing. Kafka's committed offsets
are only moved by :meth:`commit`, with a position the trainer has saved.

A scored episode over a limit, or one the trainer's ``admit`` check refuses, is
dead-lettered, and a failed stand-in takes its place so that its group completes with it
masked; one that can be no group's member ends its group (abandoned, counted).

Flow control: training groups are admitted only while the credit window has room,
``submitted < (max_staleness + steps + 1) * groups_per_step``, where ``steps`` counts the
weight versions this trainer published. The client reads scored records only inside
:meth:`receive` and :meth:`evaluations`, and only until it can answer, so a trainer that
stops asking leaves the records in Kafka, and rollout stops once the window is spent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from rlbus import plugins
from rlbus.client.groups import GroupAssembler, ScoredGroup
from rlbus.client.position import Position
from rlbus.client.served import Served, ServedMembers
from rlbus.client.settings import ClientSettings
from rlbus.client.tensors import (
    AdapterWeights,
    Reference,
    check,
    folder_specs,
    preallocate,
    prepare,
    read_header,
    write_version,
)
from rlbus.errors import NoCreditError, NotServedError, PositionError
from rlbus.limits import check_identity, check_scored
from rlbus.messages import (
    Prompt,
    Sampling,
    ScoredTrajectory,
    Trajectory,
    WeightsServed,
    WeightVersion,
)
from rlbus.topics import Topics
from rlbus.transport import TP, Bus, Consumer, Delivery, KafkaBus, Producer
from rlbus.weights import ADAPTER_FILE, WEIGHTS_FILE, weights_file

log = logging.getLogger(__name__)

POLL_S = 0.5
"""Longest single read of scored records; a call with a deadline checks it this often."""

Purpose = Literal["train", "eval"]


def credit(submitted: int, steps: int, max_staleness: int, groups_per_step: int) -> int:
    """How many more training groups may be submitted now (never negative)."""
    return max(0, (max_staleness + steps + 1) * groups_per_step - submitted)


class RolloutClient:
    """One trainer's connection to rlbus. Build it with :meth:`connect` (or construct it
    and ``await start()``); one client per consumer group, used from one event loop."""

    def __init__(self, settings: ClientSettings, bus: Bus | None = None, *,
                 position: Position | None = None,
                 admit: Callable[[Trajectory], None] | None = None,
                 on_count: Callable[[str, int], None] | None = None) -> None:
        """``bus``: the caller's (closed by the caller), else a Kafka bus of the client's
        own. ``position``: where a restarted trainer resumes. ``admit``: called with each
        scored episode on intake; raising refuses that episode (dead-lettered, a failed
        stand-in takes its place). ``on_count``: called with each count the client makes
        (``records`` read, ``rejected``, ``abandoned_groups``, ``straggler_waits``,
        ``straggler_timeouts``), besides :attr:`counters`."""
        self.settings = settings
        self.topics = Topics(settings.topics)
        self._owns_bus = bus is None
        if bus is None:
            bus = KafkaBus(settings.kafka, dlq_topic=self.topics.dlq, service=settings.member)
            bus.max_message_bytes = settings.topics.max_message_bytes
            bus.limits = settings.limits
        self.bus = bus
        start = position or Position()
        if start.topic is not None and start.offsets and start.topic != self.topics.scored:
            raise PositionError(f"the position is of topic {start.topic}; this client reads "
                                f"{self.topics.scored} (RLBUS_TOPICS__PREFIX?)")
        self._offsets = dict(start.offsets)
        self.assembler = GroupAssembler(start.taken, settings.remember_groups,
                                        settings.staleness_from)
        """The groups being assembled (to inspect: ``duplicates`` dropped, ``held``)."""
        self.submitted = start.submitted
        """Training groups submitted, over the trainer's whole run."""
        self.steps = start.steps
        """Weight versions this trainer published, over its whole run."""
        self.version = start.version
        """The newest weight version of this model (published by anyone, after start)."""
        self.waited_s = 0.0
        """How long the last :meth:`receive` held its groups back for a straggler."""
        self.counters: dict[str, int] = {}
        self._admit = admit
        self._on_count = on_count
        self._held_since: float | None = None
        self._evals_submitted = 0
        self._credit = asyncio.Event()
        self._submitting = asyncio.Lock()
        self._publishing = asyncio.Lock()
        self._preallocating: asyncio.Task[None] | None = None
        self._latest: WeightVersion | None = None
        self._reference: Reference | None = None
        self._adapter_reference: Reference | None = None
        self._served = ServedMembers(settings.model_name, settings.served_ttl_s)
        self._served_reader: Consumer[WeightsServed] | None = None
        self._scored: Consumer[ScoredTrajectory] | None = None
        self._producer: Producer | None = None

    @classmethod
    async def connect(cls, settings: ClientSettings, bus: Bus | None = None, *,
                      position: Position | None = None,
                      admit: Callable[[Trajectory], None] | None = None,
                      on_count: Callable[[str, int], None] | None = None) -> RolloutClient:
        """A started client (see :meth:`__init__` for the arguments)."""
        client = cls(settings, bus, position=position, admit=admit, on_count=on_count)
        await client.start()
        return client

    async def start(self) -> None:
        """Connect: the producer, the newest published version, the scored consumer."""
        self._producer = await self.bus.producer()
        await self._catch_up_weights()
        self._scored = await self.bus.consumer(
            [self.topics.scored], ScoredTrajectory, group_id=self.settings.consumer_group,
            read_committed=True,  # reward publishes in transactions
            on_assign=self._seek_to_position)

    async def close(self) -> None:
        """Close the Kafka clients, if the bus is the client's own."""
        if self._preallocating is not None:
            await self._preallocating
        if self._owns_bus:
            await self.bus.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def scored(self) -> Consumer[ScoredTrajectory]:
        """The consumer of trajectories.scored (after :meth:`start`)."""
        if self._scored is None:
            raise RuntimeError("the client is not started: await start() (or connect())")
        return self._scored

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            raise RuntimeError("the client is not started: await start() (or connect())")
        return self._producer

    async def _catch_up_weights(self) -> None:
        """Versions only grow: a trainer rewound to a checkpoint publishes after the newest
        version any member may hold, or the members would ignore its weights."""
        weights = await self.bus.consumer(
            [self.topics.weights], WeightVersion, assign=[(self.topics.weights, 0)])
        announced = await weights.read_to_end((self.topics.weights, 0))
        await weights.close()
        for d in announced:
            if d.message.model == self.settings.model_name and d.message.version >= max(
                    self.version, self._latest.version if self._latest else 0):
                self._latest = d.message
        self.version = max(self.version, self._latest.version if self._latest else 0)

    async def _seek_to_position(self, scored: Consumer[Any], assigned: list[TP]) -> None:
        for topic, partition in assigned:
            if topic == self.topics.scored and partition in self._offsets:
                await scored.seek((topic, partition), self._offsets[partition])

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        if self._on_count is not None:
            self._on_count(name, n)

    # -- submitting

    def credit(self) -> int:
        """How many more training groups the credit window admits now."""
        s = self.settings
        return credit(self.submitted, self.steps, s.max_staleness, s.groups_per_step)

    async def submit(self, task: str, spec: Mapping[str, Any], *, group_size: int,
                     sampling: Sampling | None = None, purpose: Purpose = "train",
                     group_id: str | None = None, eval_round: int | None = None,
                     wait_s: float = 0.0) -> Prompt:
        """Publish one group to roll out: ``group_size`` episodes of ``task`` (an
        ``rlbus.tasks`` entry point or ``package.module:attr``) on ``spec``, sampled with
        ``sampling`` by weights of the current version or newer. Returns the prompt sent.

        A training group takes one credit: with none left, waits up to ``wait_s`` (``inf``:
        until :meth:`publish_weights` opens the window) and then raises
        :class:`~rlbus.errors.NoCreditError`. An evaluation group takes none. An unknown
        task is a :class:`~rlbus.errors.PluginError` here, nothing sent. ``group_id``
        defaults to ``<run_name>/<n>`` for the n-th training group (``<run_name>/eval<steps>/
        <n>`` for evaluation), which makes a re-sent prompt recognisable."""
        plugins.task(task)
        if purpose == "eval":
            prompt = self._prompt(task, spec, group_size, sampling, purpose,
                                  group_id or self._eval_group_id(), eval_round)
            await self.producer.send(self.topics.prompts, prompt, key=prompt.group_id)
            self._evals_submitted += 1
            return prompt
        async with self._submitting:  # one credit check and send at a time
            await self._wait_credit(wait_s)
            prompt = self._prompt(task, spec, group_size, sampling, purpose,
                                  group_id or f"{self.settings.run_name}/{self.submitted}",
                                  eval_round)
            await self.producer.send(self.topics.prompts, prompt, key=prompt.group_id)
            self.submitted += 1
        return prompt

    def _prompt(self, task: str, spec: Mapping[str, Any], group_size: int,
                sampling: Sampling | None, purpose: Purpose, group_id: str,
                eval_round: int | None) -> Prompt:
        return Prompt(group_id=group_id, task=task, spec=dict(spec), group_size=group_size,
                      sampling=sampling or Sampling(), min_version=self.version,
                      purpose=purpose, eval_round=eval_round)

    def _eval_group_id(self) -> str:
        return f"{self.settings.run_name}/eval{self.steps}/{self._evals_submitted}"

    async def _wait_credit(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self.credit() <= 0:
            left = deadline - time.monotonic()
            if left <= 0:
                s = self.settings
                raise NoCreditError(
                    f"the credit window is full: {self.submitted} training groups submitted "
                    f"and {self.steps} versions published admit (max_staleness {s.max_staleness}"
                    f" + steps + 1) x groups_per_step {s.groups_per_step}; publish the next "
                    "weights to open it")
            self._credit.clear()
            waiter = asyncio.create_task(self._credit.wait())
            await asyncio.wait({waiter}, timeout=None if math.isinf(left) else left)
            waiter.cancel()

    # -- receiving

    async def receive(self, n: int | None = None, *,
                      timeout_s: float | None = None) -> list[ScoredGroup]:
        """``n`` complete training groups (default ``groups_per_step``), taken: those whose
        last chance to train within the staleness bound is the next step first, then the
        oldest weights first. Holds back (up to ``straggler_wait_s``) while an incomplete
        group's last chance is the next step. Returns ``[]`` if ``timeout_s`` passes
        first (None: wait as long as it takes)."""
        n = n or self.settings.groups_per_step
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if len(self.assembler.ready) >= n and not self._holding(n):
                return self._take(n)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return []
            await self._fetch(POLL_S if left is None else min(POLL_S, left))

    async def evaluations(self, timeout_s: float = 0.0) -> list[ScoredGroup]:
        """Every complete evaluation group, taken; reads for up to ``timeout_s`` while
        there is none. Evaluation groups are never handed out by :meth:`receive`."""
        deadline = time.monotonic() + timeout_s
        while not self.assembler.evals:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self._fetch(min(POLL_S, left))
        taken = self.assembler.take_evals()
        for g in taken:
            self._ack(g.deliveries)
        return [g.scored() for g in taken]

    def _take(self, n: int) -> list[ScoredGroup]:
        groups = self.assembler.take(n, self.version - self.settings.max_staleness)
        held, self._held_since = self._held_since, None
        self.waited_s = 0.0 if held is None else time.monotonic() - held
        for g in groups:
            self._ack(g.deliveries)
        return [g.scored() for g in groups]

    def _ack(self, deliveries: list[Delivery[Any]]) -> None:
        for d in deliveries:
            self.scored.ack(d)

    async def _fetch(self, timeout_s: float) -> None:
        deliveries = await self.scored.poll(max(0.0, timeout_s))
        for d in deliveries:
            await self._intake(d)
        if deliveries:
            self._count("records", len(deliveries))

    async def _intake(self, d: Delivery[ScoredTrajectory]) -> None:
        """One scored episode into its group. Dead-lettered (over a limit, or refused by
        ``admit``, or its handling raised), a failed stand-in takes its place, so that the
        group completes with this member masked instead of holding the others, and every
        later commit, for ever; the record is acked with its group, so a restart before
        that makes the same stand-in again. One that can be no group's member (a group of
        10^9) ends its group."""
        async with self.scored.handling(d, ack=False) as outcome:
            outcome.refusal = check_scored(d.message, self.settings.limits)
            if outcome.refusal is not None:
                await self.scored.reject(d, outcome.refusal, ack=False)
                self._count("rejected")
            else:
                with d.processing():
                    self._add(d)
        if outcome.error is not None:
            self._stand_in(d, outcome.error)

    def _add(self, d: Delivery[ScoredTrajectory]) -> None:
        if self._admit is not None:
            self._admit(d.message.trajectory)  # raises: a dead letter, not a failed step
        self._ack(self.assembler.add(d))

    def _stand_in(self, d: Delivery[ScoredTrajectory], error: str) -> None:
        t = d.message.trajectory
        if check_identity(t, self.settings.limits) is not None:
            self.scored.ack(d)
            self._abandon(t.group_id)
            return
        stand_in = ScoredTrajectory.failed_stand_in(t, error)
        self._ack(self.assembler.add(dataclasses.replace(d, message=stand_in)))

    def _abandon(self, group_id: str) -> None:
        held = self.assembler.abandon(group_id)
        self._ack(held)
        if held:
            log.warning("group %s abandoned: a member was dead-lettered; %d episodes of it "
                        "dropped", group_id, len(held))
            self._count("abandoned_groups")

    def _holding(self, n: int) -> bool:
        """Hold the step back while a straggling group's last chance to train within the
        staleness bound is this step, up to ``straggler_wait_s``; past that, go on (the
        group arrives past the bound; masking it is the trainer's job)."""
        s = self.settings
        if s.straggler_wait_s <= 0:
            return False
        due = self.assembler.due(self.version, s.max_staleness, n)
        if not due:
            return False
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
            self._count("straggler_waits")
            log.debug("step %d waits for %s", self.steps + 1, ", ".join(due))
        if now - self._held_since < s.straggler_wait_s:
            return True
        log.warning("step %d waited %.0fs for %s; going on without them (they will "
                    "arrive past the staleness bound)", self.steps + 1,
                    now - self._held_since, ", ".join(due))
        self._count("straggler_timeouts")
        return False

    # -- the position

    def position(self) -> Position:
        """Where the trainer stands now: every group taken so far counts as trained. Save
        it with a model that has trained on all of them (a trainer that prefetches takes
        it right after the :meth:`receive` of the last batch it has trained on)."""
        for (topic, partition), offset in self.scored.tracker.committable().items():
            if topic == self.topics.scored:
                self._offsets[partition] = offset
        return Position(topic=self.topics.scored, offsets=dict(self._offsets),
                        taken=self.assembler.taken_ids(), submitted=self.submitted,
                        steps=self.steps, version=self.version)

    async def commit(self, position: Position) -> None:
        """Move the consumer group's committed offsets to ``position`` (one the trainer
        has saved): what lag monitoring reads. Resuming never depends on it."""
        await self.scored.commit({(self.topics.scored, p): o
                                  for p, o in position.offsets.items()})

    # -- weights

    async def publish_weights(self, weights: Any, *, step: int | None = None,
                              samples_trained: int = 0,
                              samples_masked: Mapping[str, int] | None = None,
                              wait_served: bool = False, timeout_s: float = 120.0,
                              min_members: int = 1) -> WeightVersion:
        """Publish ``weights`` as the next version: a torch state dict, a torch module (a
        Hugging Face model is one), a folder (or file) of safetensors, or a LoRA adapter
        (:class:`~rlbus.client.tensors.AdapterWeights`: only the adapter's folder is written,
        and the event carries its shape); None announces a version with no files (the
        synthetic engine's load tests). An adapter must have the previous adapter version's
        tensors (the first one is unchecked: the trainer built it on the model). A model wrapped in
        DistributedDataParallel or compiled by ``torch.compile`` may be passed as it is: the
        prefix the wrapper puts on every name is taken off.

        The tensors must have the names, shapes and dtypes of the previous version (or,
        before the first, of the served model folder ``model_path``; a floating-point
        tensor may then be of any dtype the engines load): otherwise a
        :class:`~rlbus.errors.WeightsMismatchError`, and nothing is written or announced.
        The version counts as one step of the credit window. ``wait_served``: then
        :meth:`wait_served` for it. ``step``, ``samples_trained`` and ``samples_masked``
        travel in the event, for ``rlbus status``. Publishes run one at a time."""
        async with self._publishing:
            version = self.version + 1
            if self._preallocating is not None:
                await self._preallocating
            adapter = weights.adapter if isinstance(weights, AdapterWeights) else None
            uri, digest = await asyncio.to_thread(self._write, weights, version)
            if adapter is None:  # an adapter is small: no file to reserve ahead
                self._preallocating = asyncio.create_task(asyncio.to_thread(
                    self._preallocate_next, uri, version + 1))
            event = WeightVersion(
                model=self.settings.model_name, version=version, uri=uri, checksum=digest,
                step=self.steps + 1 if step is None else step,
                samples_trained=samples_trained, samples_masked=dict(samples_masked or {}),
                adapter=adapter)
            await self.producer.send(self.topics.weights, event, key=self.settings.model_name)
            self.version, self.steps, self._latest = version, self.steps + 1, event
            self._credit.set()
        if wait_served:
            await self.wait_served(version, timeout_s=timeout_s, min_members=min_members)
        return event

    def _write(self, weights: Any, version: int) -> tuple[str, str]:
        if weights is None:
            return "synthetic://", ""
        if isinstance(weights, AdapterWeights):
            return self._write_adapter(weights, version)
        prepared = prepare(weights)
        reference = self._reference_now()
        check(prepared, reference, version)
        prefer = set(reference.specs) if reference is not None else set()
        s = self.settings
        folder, digest = write_version(prepared, s.weights_dir, version, s.keep_weights, prefer,
                                       s.weights_checksum)
        self._reference = Reference(read_header(folder / WEIGHTS_FILE),
                                    f"v{version} ({folder})", exact_dtypes=True)
        return str(folder.resolve()), digest

    def _write_adapter(self, weights: AdapterWeights, version: int) -> tuple[str, str]:
        prepared = prepare(weights.tensors)
        check(prepared, self._adapter_reference_now(), version)
        s = self.settings
        folder, digest = write_version(prepared, s.weights_dir, version, s.keep_weights, set(),
                                       s.weights_checksum, adapter_config=weights.config)
        path = folder / ADAPTER_FILE
        self._adapter_reference = Reference(read_header(path), f"v{version} ({folder})",
                                            exact_dtypes=True)
        log.info("published LoRA adapter v%d: %d bytes (rank %d)", version,
                 path.stat().st_size, weights.adapter.rank)
        return str(folder.resolve()), digest

    def _adapter_reference_now(self) -> Reference | None:
        """What the next adapter must hold: the previous adapter version's file (this
        process's, else the newest announced one's); None before the first."""
        latest = self._latest
        if self._adapter_reference is None and latest is not None and latest.adapter:
            path = weights_file(latest.uri)
            if path.exists():
                return Reference(read_header(path), f"v{latest.version} ({path})", True)
        return self._adapter_reference

    def _preallocate_next(self, uri: str, version: int) -> None:
        """The next version's file, reserved at this one's size off the publish path."""
        if uri.startswith("synthetic://"):
            return
        try:
            preallocate(self.settings.weights_dir, version, weights_file(uri).stat().st_size)
        except OSError as exc:  # the next write allocates as it goes
            log.warning("could not preallocate weights v%d: %s", version, exc)

    def _reference_now(self) -> Reference | None:
        """What the next version must hold: the previous version's file, else the served
        model folder's; None (unchecked) if neither can be read."""
        if self._reference is not None:
            return self._reference
        latest = self._latest
        if latest is not None and latest.checksum and latest.adapter is None:
            path = weights_file(latest.uri)
            if path.exists():
                return Reference(read_header(path), f"v{latest.version} ({path})", True)
        model_path = self.settings.model_path
        if model_path is not None:
            return Reference(folder_specs(Path(model_path)), f"the served model {model_path}",
                             False)
        log.warning("no weights to check new ones against (no previous version on disk, no "
                    "model_path): published unchecked")
        return None

    async def wait_served(self, version: int | None = None, *, timeout_s: float = 120.0,
                          min_members: int = 1) -> Served:
        """Wait until the inference members serve ``version`` (default: the newest
        published): at least ``min_members`` members live (reported within
        ``served_ttl_s``) and every live one at ``version`` or newer. Raises
        :class:`~rlbus.errors.NotServedError` after ``timeout_s``, naming each
        lagging member's version, and :class:`~rlbus.errors.WeightsRefusedError` at once if a live
        member refused the version."""
        version = self.version if version is None else version
        reader = await self._served_members()
        deadline = time.monotonic() + timeout_s
        while True:
            state = self._served.state(version, min_members)
            if state.done:
                return state
            if time.monotonic() >= deadline:
                raise NotServedError(f"weights v{version} not served within {timeout_s:.0f}s:"
                                     f" {state}")
            for d in await reader.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                self._served.note(d.message)

    async def _served_members(self) -> Consumer[WeightsServed]:
        """The reader of weights.served, caught up on every member's newest report as of
        now (so a wait never decides on reports older than the call)."""
        tp = (self.topics.served, 0)
        if self._served_reader is None:
            self._served_reader = await self.bus.consumer([self.topics.served], WeightsServed,
                                                          assign=[tp])
        for d in await self._served_reader.read_to_end(tp):
            self._served.note(d.message)
        return self._served_reader
