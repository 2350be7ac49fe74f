"""TRL's ``GRPOTrainer``, generating through rlbus.

TRL (1.16 and later) lets a ``rollout_func`` replace its generation: ``GRPOTrainer(...,
rollout_func=f)``, its documented extension point for custom rollouts (experimental in TRL;
``TRL_EXPERIMENTAL_SILENCE=1`` hides the warning). TRL calls ``f(prompts, trainer)`` once
per generation batch with the batch's prompts, each repeated ``num_generations`` times in a
row, and trains on the rows it returns, one per prompt, in that order: ``prompt_ids``,
``completion_ids``, per-token ``logprobs``, an optional ``env_mask`` (1: a token the model
sampled, 0: one the environment wrote; TRL's loss mask) and extra fields, which it hands to
the reward functions. :class:`RlbusRollouts` is such a function; its :attr:`~RlbusRollouts.
callback` publishes the trainer's weights after every optimizer step and saves the client's
position in every checkpoint TRL writes::

    config = GRPOConfig(..., num_generations=8, max_steps=100)
    client = SyncRolloutClient(ClientSettings(..., groups_per_step=groups_per_step(config)),
                               position=load_position(checkpoint))
    rollouts = RlbusRollouts(client, task="guess_number")
    trainer = GRPOTrainer(model=model, args=config, processing_class=tokenizer,
                          reward_funcs=[rlbus_reward], rollout_func=rollouts,
                          train_dataset=placeholder_dataset(config),
                          callbacks=[rollouts.callback])
    trainer.train(resume_from_checkpoint=checkpoint)

Two modes.

* Decoupled (``task`` given), rlbus's own way: prompts are sampled from the task as rlbus's
  learner samples them (the n-th group's spec from seed ``<seed>/<n>``) and submitted as far
  ahead as the client's credit window admits, at every call and after every published
  version, so rollout goes on while TRL trains. A call takes the next complete groups
  (:meth:`rlbus.client.RolloutClient.receive`: those at their last chance within the
  staleness bound first, then the oldest weights first). TRL's dataset only paces the calls
  (:func:`placeholder_dataset`); its prompts are not used.
* Lockstep (``task`` None): each of TRL's prompts is a task request made by
  :func:`lockstep_prompt` (:func:`lockstep_dataset`); a call submits one group per prompt
  and waits for exactly those groups. TRL's dataset and sampler decide what is trained;
  rollout idles while TRL trains.

Rows. One episode is one row: ``prompt_ids`` are its first turn's input ids,
``completion_ids`` everything after them (completions and observations, exactly as
sampled), ``env_mask`` its loss mask over those, ``logprobs`` the behaviour logprobs (0.0
off the mask). A group's episodes are consecutive rows, ``num_generations`` of them, which
TRL's per-group reward normalisation relies on. An episode rlbus says not to train on is
masked (``env_mask`` all 0, ``rlbus_reward`` None: TRL leaves it out of its group's baseline
and gives it no advantage), with its cause in ``rlbus_masked``: ``failed`` (its rollout
failed), ``invalid`` (its verifier failed, or it has no turn), ``stale`` (sampled more than
``max_staleness`` versions before the call), ``out_of_vocabulary`` (a token id the model
has no embedding for; replaced by the pad id), ``segmented`` (an episode of several token
sequences, :attr:`rlbus.client.Episode.segments`: a gateway agent whose history was not
linear; TRL trains one prompt and completion per row, and a concatenation of the segments
is a sequence the model never saw, so such a row holds its first segment, masked, and each
call logs how many it masked. To keep them out at the source, run the rollout tier with
``RLBUS_GATEWAY_HISTORY=strict`` (they fail there), or train with rlbus's learner, which
trains every segment).

Extra fields, for reward functions' ``**kwargs``: ``rlbus_reward`` (the reward tier's, what
:func:`rlbus_reward` returns), ``rlbus_masked``, ``rlbus_episode_id``, ``rlbus_group_id``,
``rlbus_task``, ``rlbus_spec``, ``rlbus_policy_version``. In decoupled mode the ``prompts``
TRL passes to reward functions are its placeholders: the episode's task is in ``rlbus_spec``.

Behaviour logprobs. TRL keeps them (``sampling_per_token_logps``) but reads them only in its
vLLM importance-sampling correction (``use_vllm=True``); otherwise it takes the trainer's own
logprobs at the call as the old policy, so samples up to ``max_staleness`` versions old are
trained with no off-policy correction. ``max_staleness=0`` makes decoupled mode on-policy
(up to the engines' numerics), at the cost of overlap.

Delivery contract: exactly once by checkpointed position, the client's. Each checkpoint
folder TRL writes gets ``rlbus_position.json``: the position after the last call whose groups
had all been trained by that step, with the counts of groups submitted and versions published
so far (groups in flight arrive after a restart; none is submitted twice); a new client
started from :func:`load_position` of it resumes there.

Bad input. An unknown task: :class:`~rlbus.errors.PluginError` when the rollouts are made
(lockstep: when the prompt is made). Weights of other names, shapes or dtypes than the served
model's (or the first version's): :class:`~rlbus.errors.WeightsMismatchError` out of
``trainer.train()`` at the step that made them, nothing published. A trainer that stops
calling: nothing is submitted beyond the credit window, nothing read from Kafka (the client
reads only inside ``receive``). No groups within ``receive_timeout_s``: a
:class:`TimeoutError` saying what is in flight.

One process only: rlbus assembles groups in one client per consumer group, and TRL calls
``rollout_func`` on every rank; evaluation (``eval_strategy``) through rlbus is not wired.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from transformers import TrainerCallback

from rlbus import plugins
from rlbus.client import (
    Episode,
    Position,
    ScoredGroup,
    Segment,
    SyncRolloutClient,
    WeightsMismatchError,
)
from rlbus.messages import Sampling

if TYPE_CHECKING:  # the optional extra: imported only where a dataset is made
    from datasets import Dataset

log = logging.getLogger(__name__)

POSITION_FILE: Final = "rlbus_position.json"
"""Saved in each of TRL's checkpoint folders."""
PLACEHOLDER: Final = "(rlbus: the prompt is the task's, see rlbus_spec)"
"""Decoupled mode's dataset prompt: TRL needs rows to pace its calls, not their text."""
CHECKPOINT_PREFIX: Final = "checkpoint"
"""transformers' ``PREFIX_CHECKPOINT_DIR``: TRL's checkpoints are ``checkpoint-<step>``."""


# -- the shape of TRL's calls


@dataclass(frozen=True)
class Shape:
    """What one ``rollout_func`` call asks for and how many optimizer steps train on it."""

    group_size: int
    """TRL's ``num_generations``: the rows of one group."""
    groups: int
    """Groups per call (``generation_batch_size / num_generations``)."""
    steps: int
    """Optimizer steps that train on one call's rows (``steps_per_generation *
    num_iterations / gradient_accumulation_steps``)."""


def shape_of(config: Any) -> Shape:
    """The shape of a ``GRPOConfig``'s calls; a :class:`ValueError` for one this adapter
    cannot pace (more than one process, generation inside an accumulation window)."""
    if config.world_size != 1:
        raise ValueError(f"rlbus.integrations.trl runs in one process (world size "
                         f"{config.world_size}): one client assembles the groups")
    size, batch = config.num_generations, config.generation_batch_size
    passes = config.steps_per_generation * config.num_iterations
    if passes % config.gradient_accumulation_steps:
        raise ValueError(
            f"steps_per_generation ({config.steps_per_generation}) x num_iterations "
            f"({config.num_iterations}) must be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): weights are published at optimizer steps, "
            "and a generation inside an accumulation window has no version to be sampled by")
    return Shape(size, batch // size, passes // config.gradient_accumulation_steps)


def groups_per_step(config: Any) -> int:
    """The client's ``groups_per_step`` for a ``GRPOConfig``: groups one optimizer step
    consumes, what the credit window admits per published version."""
    shape = shape_of(config)
    if shape.groups % shape.steps:
        raise ValueError(f"{shape.groups} groups per generation batch over {shape.steps} "
                         "optimizer steps is not a whole number per step: change "
                         "per_device_train_batch_size or steps_per_generation")
    return shape.groups // shape.steps


# -- episodes as TRL's rows


@dataclass(frozen=True)
class Row:
    """One episode as one row of ``rollout_func``'s answer."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float | None
    """The reward tier's; None where masked."""
    masked: str | None
    """Why it must not train (:func:`mask_cause`), or None."""
    episode_id: str
    group_id: str
    task: str
    spec: dict[str, Any]
    policy_version: int


def mask_cause(episode: Episode, *, version: int, max_staleness: int,
               vocab_size: int | None = None) -> str | None:
    """Why ``episode`` must not train at weights ``version``, or None: the learner's causes
    (:data:`rlbus.messages.MASK_CAUSES`), and a token id past the model's vocabulary."""
    if episode.scored.trajectory.status == "failed":
        return "failed"
    if not episode.valid:
        return "invalid"
    if version - episode.policy_version > max_staleness:
        return "stale"
    if len(episode.segments) > 1:
        return "segmented"
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in episode.token_ids):
        return "out_of_vocabulary"
    return None


def episode_row(episode: Episode, *, pad_id: int, cause: str | None = None,
                vocab_size: int | None = None) -> Row:
    """``episode`` split after its first turn's input; masked whole if ``cause``. An id
    outside ``vocab_size`` becomes ``pad_id`` (the row is then masked by its cause), and an
    empty side one masked ``pad_id``, so that TRL's forward pass always has a token. An
    episode of several segments is its first, masked whatever ``cause`` says."""
    t = episode.scored.trajectory
    if len(episode.segments) > 1:
        cause = cause or "segmented"
    first = episode.segments[0] if episode.segments else Segment([], [], [])
    split = len(t.turns[0].input_ids) if t.turns else 0
    ids = first.token_ids
    if vocab_size is not None:
        ids = [i if 0 <= i < vocab_size else pad_id for i in ids]
    completion = ids[split:]
    env_mask = [int(m and cause is None) for m in first.loss_mask[split:]]
    logprobs = first.logprobs[split:]
    if not completion:  # a failed episode with no turn
        completion, env_mask, logprobs = [pad_id], [0], [0.0]
    return Row(prompt_ids=ids[:split] or [pad_id], completion_ids=completion,
               logprobs=list(logprobs), env_mask=env_mask,
               reward=None if cause else episode.reward, masked=cause,
               episode_id=episode.episode_id, group_id=t.group_id, task=t.task,
               spec=dict(t.spec), policy_version=episode.policy_version)


def trl_batch(rows: Sequence[Row]) -> dict[str, list[Any]]:
    """``rollout_func``'s answer: TRL's keys, then the extra fields for reward functions."""
    return {
        "prompt_ids": [r.prompt_ids for r in rows],
        "completion_ids": [r.completion_ids for r in rows],
        "logprobs": [r.logprobs for r in rows],
        "env_mask": [r.env_mask for r in rows],
        "rlbus_reward": [r.reward for r in rows],
        "rlbus_masked": [r.masked for r in rows],
        "rlbus_episode_id": [r.episode_id for r in rows],
        "rlbus_group_id": [r.group_id for r in rows],
        "rlbus_task": [r.task for r in rows],
        "rlbus_spec": [r.spec for r in rows],
        "rlbus_policy_version": [r.policy_version for r in rows],
    }


def rlbus_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float | None]:
    """A TRL reward function: the rlbus reward tier's reward of each row (None where masked,
    which TRL counts as unscored)."""
    if "rlbus_reward" not in kwargs:
        raise ValueError("rlbus_reward scores rows of RlbusRollouts only: the trainer's "
                         "rollout_func must be an RlbusRollouts")
    return list(kwargs["rlbus_reward"])


# -- datasets and prompts


def placeholder_dataset(config: Any) -> Dataset:
    """Decoupled mode's ``train_dataset``: one generation batch of placeholder prompts (TRL
    goes round it until ``max_steps``)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PLACEHOLDER] * shape_of(config).groups})


def lockstep_prompt(task: str, spec: Mapping[str, Any]) -> str:
    """A lockstep prompt: a request for one group of ``task`` on ``spec``, as TRL carries
    it (its sampler repeats it ``num_generations`` times). An unknown task is a
    :class:`~rlbus.errors.PluginError` here."""
    plugins.task(task)
    return json.dumps({"rlbus_task": task, "spec": dict(spec)}, sort_keys=True)


def lockstep_dataset(task: str, specs: Iterable[Mapping[str, Any]]) -> Dataset:
    """Lockstep mode's ``train_dataset``: one prompt per spec."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [lockstep_prompt(task, s) for s in specs]})


def _request(prompt: Any) -> tuple[str, dict[str, Any]]:
    try:
        request = json.loads(prompt)
        return str(request["rlbus_task"]), dict(request["spec"])
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"lockstep mode: a prompt must be made by lockstep_prompt() "
                         f"(lockstep_dataset), not {str(prompt)[:80]!r}") from exc


def load_position(checkpoint: str | Path | None) -> Position | None:
    """The client's position saved in TRL's ``checkpoint`` folder (None: no checkpoint, or
    one saved without rlbus)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / POSITION_FILE
    return Position.from_json(path.read_text()) if path.exists() else None


# -- the rollout function


class RlbusRollouts:
    """TRL's ``rollout_func``, answered by rlbus through ``client``; pass :attr:`callback`
    to the trainer too. Decoupled with ``task`` (an ``rlbus.tasks`` entry point or
    ``package.module:attr``), lockstep without.

    ``spec``: merged into each sampled spec (decoupled). ``sampling``: default TRL's
    ``temperature``, ``top_p`` and ``max_completion_length`` (per turn). ``seed``: of the
    decoupled specs. ``wait_served``: each optimizer step waits (up to
    ``served_timeout_s``) until inference serves the weights it published; default, training
    goes on and the staleness bound does the rest."""

    def __init__(self, client: SyncRolloutClient, task: str | None = None, *,
                 spec: Mapping[str, Any] | None = None, sampling: Sampling | None = None,
                 seed: int | str = 0, receive_timeout_s: float = 600.0,
                 wait_served: bool = False, served_timeout_s: float = 120.0) -> None:
        self.client = client
        self.task = task
        self._task = plugins.task(task) if task is not None else None  # unknown: raises now
        self.spec = dict(spec or {})
        self.sampling = sampling
        self.seed = seed
        self.receive_timeout_s = receive_timeout_s
        self.wait_served = wait_served
        self.served_timeout_s = served_timeout_s
        self.callback = RlbusCallback(self)
        self.counters: Counter[str] = Counter()
        """``calls``, ``groups``, ``rows``, ``trained_rows``, ``masked_<cause>``,
        ``foreign_groups`` (lockstep: groups of another run, dropped)."""
        self.shape: Shape | None = None
        self._sampling = sampling or Sampling()
        self._trained: list[tuple[int, Position]] = []
        """(optimizer step, position): every group taken before the position is trained once
        that step is done."""

    @property
    def decoupled(self) -> bool:
        return self._task is not None

    def begin(self, config: Any, step: int) -> None:
        """Check ``config`` against the client's pace, note where training starts and, in
        decoupled mode, submit the first groups (the callback calls this at train begin)."""
        if self.shape is not None:
            return
        shape = shape_of(config)
        s = self.client.client.settings
        if s.groups_per_step != groups_per_step(config):
            raise ValueError(f"ClientSettings.groups_per_step is {s.groups_per_step}; this "
                             f"GRPOConfig trains {groups_per_step(config)} groups per "
                             "optimizer step: pass groups_per_step(config)")
        if shape.steps > s.max_staleness + 1:
            raise ValueError(f"one generation batch trains {shape.steps} optimizer steps; the "
                             f"credit window then needs max_staleness >= {shape.steps - 1} "
                             f"(it is {s.max_staleness}) or it would never admit the next one")
        self._sampling = self.sampling or Sampling(
            temperature=config.temperature, top_p=config.top_p,
            max_new_tokens=config.max_completion_length)
        if self._sampling.temperature != config.temperature:
            log.warning("rlbus samples at temperature %g and TRL's loss divides logits by %g",
                        self._sampling.temperature, config.temperature)
        self._trained = [(step, self.client.position())]
        self.shape = shape
        self.top_up()

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """One generation batch: ``len(prompts)`` rows, a group per ``num_generations``."""
        shape = self._check(prompts, trainer)
        groups = self._take(shape.groups) if self.decoupled else self._lockstep(prompts, shape)
        rows = self._rows(groups, trainer)
        self._note_trained(trainer.state.global_step, shape.steps)
        self.counters.update(calls=1, groups=len(groups), rows=len(rows))
        return trl_batch(rows)

    def _note_trained(self, step: int, steps: int) -> None:
        """The groups taken so far are trained once ``steps`` more optimizer steps are done;
        of the positions noted before, the newest already trained is all a save needs."""
        done = [x for x in self._trained if x[0] <= step][-1:]
        self._trained = [*done, *(x for x in self._trained if x[0] > step),
                         (step + steps, self.client.position())]

    def _check(self, prompts: list[Any], trainer: Any) -> Shape:
        if self.callback not in trainer.callback_handler.callbacks:
            raise ValueError("RlbusRollouts needs its callback on the trainer "
                             "(GRPOTrainer(..., callbacks=[rollouts.callback])): it publishes "
                             "the weights that open the credit window")
        if not trainer.model.training:
            raise NotImplementedError("evaluation through rlbus is not wired into TRL: set "
                                      "eval_strategy='no' (rlbus evaluates with "
                                      "client.submit(purpose='eval'))")
        self.begin(trainer.args, trainer.state.global_step)
        assert self.shape is not None
        if len(prompts) != self.shape.groups * self.shape.group_size:
            raise ValueError(f"TRL asked for {len(prompts)} rows; its config says "
                             f"{self.shape.groups} groups of {self.shape.group_size}")
        return self.shape

    def _rows(self, groups: Sequence[ScoredGroup], trainer: Any) -> list[Row]:
        version = self.client.client.version
        max_staleness = self.client.client.settings.max_staleness
        vocab = trainer.model.get_input_embeddings().num_embeddings
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = []
        for g in groups:
            for e in g.episodes:
                cause = mask_cause(e, version=version, max_staleness=max_staleness,
                                   vocab_size=vocab)
                rows.append(episode_row(e, pad_id=pad_id, cause=cause, vocab_size=vocab))
                self.counters[f"masked_{cause}" if cause else "trained_rows"] += 1
        segmented = [r.episode_id for r in rows if r.masked == "segmented"]
        if segmented:
            log.warning("masked %d of %d episodes with several token sequences (a gateway "
                        "agent's history was not linear; TRL trains one per row), e.g. %s: "
                        "RLBUS_GATEWAY_HISTORY=strict on the rollout tier fails them there "
                        "instead", len(segmented), len(rows), segmented[0])
        return rows

    # -- decoupled

    def top_up(self) -> int:
        """Decoupled: submit as many groups as the credit window admits; returns how many."""
        if self._task is None or self.shape is None:
            return 0
        assert self.task is not None
        n = self.client.credit()
        for _ in range(n):
            i = self.client.client.submitted  # the client names the group <run_name>/<i>
            spec = {**self._task.sample(random.Random(f"{self.seed}/{i}")), **self.spec}
            self.client.submit(self.task, spec, group_size=self.shape.group_size,
                               sampling=self._sampling)
        return n

    def _take(self, n: int) -> list[ScoredGroup]:
        self.top_up()
        groups = self.client.receive(n, timeout_s=self.receive_timeout_s)
        if not groups:
            raise TimeoutError(self._starved(n))
        return groups

    def _starved(self, n: int) -> str:
        c = self.client.client
        return (f"no {n} complete groups within {self.receive_timeout_s:g}s: "
                f"{c.submitted} submitted in all, {c.assembler.held} episodes held, trainer "
                f"at version {c.version}; are rollout, inference and reward running on topic "
                f"prefix {c.settings.topics.prefix!r}?")

    # -- lockstep

    def _lockstep(self, prompts: list[Any], shape: Shape) -> list[ScoredGroup]:
        size = shape.group_size
        blocks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
        if any(b.count(b[0]) != size for b in blocks):
            raise ValueError("lockstep mode: TRL's rows must come num_generations at a time "
                             "per prompt (its RepeatSampler); these do not")
        wanted = []
        for block in blocks:
            task, spec = _request(block[0])
            prompt = self.client.submit(task, spec, group_size=size, sampling=self._sampling,
                                        wait_s=self.receive_timeout_s)
            wanted.append(prompt.group_id)
        return self._collect(wanted)

    def _collect(self, wanted: list[str]) -> list[ScoredGroup]:
        got: dict[str, ScoredGroup] = {}
        deadline = time.monotonic() + self.receive_timeout_s
        while len(got) < len(wanted):
            left = deadline - time.monotonic()
            groups = self.client.receive(len(wanted) - len(got), timeout_s=max(0.0, left))
            if not groups and left <= 0:
                raise TimeoutError(self._starved(len(wanted) - len(got)))
            for g in groups:
                if g.group_id in wanted:
                    got[g.group_id] = g
                else:  # a group of another run on the same topics and consumer group
                    log.warning("lockstep: group %s was not asked for; dropped", g.group_id)
                    self.counters["foreign_groups"] += 1
        return [got[gid] for gid in wanted]

    # -- weights and position (from the callback)

    def publish(self, model: Any, step: int) -> None:
        """Publish ``model``'s weights as the next version, then top up."""
        masked = {k.removeprefix("masked_"): v for k, v in self.counters.items()
                  if k.startswith("masked_")}
        try:
            self.client.publish_weights(
                model, step=step, samples_trained=self.counters["trained_rows"],
                samples_masked=masked, wait_served=self.wait_served,
                timeout_s=self.served_timeout_s)
        except WeightsMismatchError as exc:
            exc.add_note(f"rlbus.integrations.trl: TRL's model after optimizer step {step}; "
                         "inference serves the model at ClientSettings.model_path, and each "
                         "version must match it (names, shapes; the dtype of the first)")
            raise
        self.top_up()

    def save_position(self, folder: Path, step: int) -> Position:
        """Write the position of a checkpoint at optimizer ``step`` into ``folder``, and
        move the consumer group's committed offsets to it."""
        trained = [p for s, p in self._trained if s <= step]
        c = self.client.client
        position = (trained[-1] if trained else self.client.position()).model_copy(
            update={"submitted": c.submitted, "steps": c.steps, "version": c.version})
        folder.mkdir(parents=True, exist_ok=True)
        (folder / POSITION_FILE).write_text(position.to_json())
        self.client.commit(position)
        return position


class RlbusCallback(TrainerCallback):
    """Begins the rollouts at train begin, publishes the weights after every optimizer step,
    saves the position with every checkpoint."""

    def __init__(self, rollouts: RlbusRollouts) -> None:
        self.rollouts = rollouts

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rollouts.begin(args, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
        self.rollouts.publish(model, state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{state.global_step}"
        self.rollouts.save_position(folder, state.global_step)
