"""One GRPO optimizer step over complete groups (see grpo.py for the loss itself)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rlbus import plugins
from rlbus.client import Episode, ScoredGroup
from rlbus.client.tensors import AdapterWeights
from rlbus.errors import InvalidMessageError
from rlbus.learner import lora
from rlbus.learner.distributed import World, shard
from rlbus.learner.grpo import (
    Whole,
    collate,
    group_advantages,
    policy_loss,
    score_tokens,
)
from rlbus.learner.off_policy import (
    SUMS,
    Correction,
    importance_weights,
    mismatch_stats,
    peak,
    sums,
)
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import MaskCounts, StepStats, UpdateStats
from rlbus.learner.store import PolicyState
from rlbus.learner.work import RankMessage, Release, TrainOrder, Work
from rlbus.limits import check_token_ids
from rlbus.messages import LoraAdapter, ScoredTrajectory, Trajectory


class StepTrainer(Protocol):
    """What the learner service needs of a trainer: the GRPO :class:`Trainer`, or the
    :class:`SyntheticTrainer` of load tests. Every method but ``admit`` runs off the event
    loop (``asyncio.to_thread``)."""

    def admit(self, t: Trajectory) -> None:
        """Raise if ``t`` can take part in no step (it is dead-lettered alone)."""

    def step(self, groups: list[ScoredGroup], version: int) -> StepStats:
        """One training step on complete groups, at policy version ``version``."""

    def weights(self) -> nn.Module | AdapterWeights | None:
        """What the client publishes after a step: the model, its LoRA adapter alone, or
        None (no weights, the synthetic engine's load tests)."""

    def state(self) -> PolicyState | None:
        """What a checkpoint keeps of the trainer (None: it has no state)."""

    def restore(self, state: PolicyState | None) -> None:
        """Rewind to a checkpoint's :meth:`state`."""

    def close(self) -> None:
        """Release what the trainer holds (under torchrun: the follower ranks)."""


def packed(episode: Episode, advantage: float) -> list[Work]:
    """The episode as the client packed it, one sequence per segment (token ids exactly as
    sampled, which of them the policy sampled, the engine's logprobs for those), each with
    the episode's advantage: every segment of an episode is trained on its reward."""
    return [Work(s.token_ids, s.loss_mask, s.logprobs, advantage, episode.episode_id)
            for s in episode.segments]


def episode_counts(work: list[Work]) -> tuple[Whole, list[float]]:
    """The batch's loss tokens and episodes (:class:`Whole`), and each sequence's
    episode's loss tokens: the segments of one episode count as one episode, their tokens
    together (see grpo.py on how each norm weighs a k-segment episode)."""
    keys = [w.episode if w.episode is not None else i for i, w in enumerate(work)]
    tokens: dict[str | int, float] = {}
    for key, w in zip(keys, work, strict=True):  # the first token is never predicted
        tokens[key] = tokens.get(key, 0.0) + float(sum(w.sampled[1:]))
    return Whole(tokens=sum(tokens.values()), episodes=len(tokens)), [tokens[k] for k in keys]


def mask_cause(scored: ScoredTrajectory, staleness: int, max_staleness: int) -> str | None:
    """The reason `scored` is masked (one of :data:`MASK_CAUSES`), or None if it trains."""
    if scored.trajectory.status == "failed":
        return "failed"
    if not scored.valid or not scored.trajectory.turns:
        return "invalid"
    if not behaviour_finite(scored.trajectory):
        return "bad_logprobs"
    if staleness > max_staleness:
        return "stale"
    return None


def behaviour_finite(t: Trajectory) -> bool:
    """Whether every logprob the engine reported for ``t`` is finite: a NaN or infinite one
    would make the loss NaN (an infinite log-ratio), so its episode is masked instead."""
    # a float sum is NaN or infinite exactly when a term is (float32 terms cannot overflow
    # it), and sums in C: about 20 ms for a million logprobs on this machine
    return all(math.isfinite(sum(turn.logprobs)) for turn in t.turns)


@dataclass
class Sample:
    episode: Episode
    advantage: float
    staleness: int
    cause: str | None  # why it is masked; None: it trains

    @property
    def used(self) -> bool:
        return self.cause is None

    @property
    def scored(self) -> ScoredTrajectory:
        return self.episode.scored


class Trainer:
    """Holds the policy and its optimizer; one instance per torchrun rank (see
    :mod:`.distributed`: rank 0 calls ``step``, the others ``follow``)."""

    def __init__(self, cfg: LearnerSettings, world: World | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if cfg.model_path is None:
            raise ValueError("the learner needs RLBUS_MODEL_PATH (the initial policy folder)")
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.world = world if world is not None else World.from_env(cfg.device)
        self.device = self.world.device(cfg.device)
        self.autocast = _autocast_dtype(cfg.dtype, self.device)
        # fp32 master weights whatever the compute dtype (autocast casts per operation)
        model: Any = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32)
        self.model = model.to(self.device)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        if cfg.gradient_checkpointing:
            self.model.config.use_cache = False
            # transformers 5 renamed gradient_ to activation_checkpointing_enable
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = self.model.config.pad_token_id or 0
        self.adapter: LoraAdapter | None = None
        lr = cfg.lr
        if cfg.lora.enabled:  # only the adapter trains: the optimizer holds only its params
            self.model, self.adapter = lora.wrap(self.model, cfg.lora)
            lr = cfg.lora.lr or cfg.lr
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=lr,
            weight_decay=cfg.weight_decay
        )
        # with LoRA, the model peft wrapped (its layers hold the adapter now): the scorer
        # needs a Hugging Face model's own attributes, which PeftModel hides
        scored = self.model if self.adapter is None else self.model.get_base_model()
        self.scorer: nn.Module = _Scorer(scored, cfg)
        self.correction = Correction.of(cfg.off_policy)
        self._replicated = self.world.size == 1

    def samples(self, groups: list[ScoredGroup], version: int) -> list[Sample]:
        """Advantages per group; stale or invalid episodes are masked (advantage 0)."""
        out: list[Sample] = []
        for g in groups:
            members = g.episodes
            stale = [version - m.version_of_age(self.cfg.staleness_from) for m in members]
            causes = [mask_cause(m.scored, s, self.cfg.max_staleness)
                      for m, s in zip(members, stale, strict=True)]
            adv = group_advantages(
                torch.tensor([m.reward for m in members]),
                torch.tensor([c is None for c in causes]),
                scale_by_std=self.cfg.scale_by_std,
            )
            out += [
                Sample(m, float(a), s, c)
                for m, a, s, c in zip(members, adv.tolist(), stale, causes, strict=True)
            ]
        return out

    def admit(self, t: Trajectory) -> None:
        """Raise if ``t`` cannot take part in a step: called per episode on intake, where a
        raise dead-letters that episode alone. Valid on the wire, an episode with a token id
        past the vocabulary (an embedding lookup out of range) or a spec that breaks its
        task's success metric would otherwise fail every step it lands in, at every restart."""
        why = check_token_ids(t, self.vocab_size)
        if why is not None:
            raise InvalidMessageError(why.detail, reason=why.reason)
        episode_success(t)

    def step(self, groups: list[ScoredGroup], version: int) -> StepStats:
        samples = self.samples(groups, version)
        # a zero advantage adds no policy gradient, so those episodes are left out, unless
        # the entropy bonus is on: it is a term of every trained token, not only of the
        # groups that disagreed, and what keeps a converged group exploring
        keep_flat = self.cfg.entropy_coef > 0
        used = [s for s in samples if s.used and (keep_flat or s.advantage != 0.0)]
        update = UpdateStats(loss=0.0, clip_frac=0.0, approx_kl=0.0)
        if used:
            update = self.lead([w for s in used for w in packed(s.episode, s.advantage)])
        return self._describe(samples, update)

    def lead(self, work: list[Work]) -> UpdateStats:
        """Rank 0: order every rank to train on ``work`` and train this rank's share."""
        order = self.world.broadcast(TrainOrder(work))
        assert isinstance(order, TrainOrder)
        return self.optimize(order.work)

    def follow(self) -> int:
        """A follower rank's loop: train on rank 0's broadcast steps until it says stop;
        returns the number of steps taken."""
        steps = 0
        while isinstance(order := self._receive(), TrainOrder):
            self.optimize(order.work)
            steps += 1
        return steps

    def _receive(self) -> RankMessage:
        message = self.world.broadcast()
        if not isinstance(message, TrainOrder | Release):
            raise TypeError(f"rank {self.world.rank} got {type(message).__name__} from rank 0, "
                            "not a TrainOrder or Release (ranks running different code?)")
        return message

    def close(self) -> None:
        """Rank 0: release the followers; then leave the process group."""
        if self.world.main and self.world.size > 1:
            self.world.broadcast(Release())
        self.world.close()

    def weights(self) -> nn.Module | AdapterWeights:
        if self.adapter is not None:
            return lora.adapter_weights(self.model, self.adapter)
        return self.model  # type: ignore[no-any-return]

    def optimize(self, work: list[Work]) -> UpdateStats:
        """``updates_per_step`` optimizer steps on the batch `work` (every rank passes the
        same one and trains its share); the figures are the first update's, whose ratios
        compare the policy that sampled with the one that trains."""
        proximal: list[Tensor] = []  # pi_old per micro-batch, from the first update
        stats = self.update(work, proximal)
        for _ in range(self.cfg.updates_per_step - 1):
            self.update(work, proximal)
        return stats

    def update(self, work: list[Work], proximal: list[Tensor] | None = None) -> UpdateStats:
        """One optimizer step on the whole batch `work`, by micro-batches with gradient
        accumulation.

        ``proximal``: pi_old's logprobs of each micro-batch, for the off-policy correction.
        Empty (or None) on a step's first update: before its optimizer step the policy *is*
        pi_old, so the logprobs its forward pass computes anyway are pi_old's (no extra
        forward pass); they are appended for the step's later updates, whose micro-batches
        are the same."""
        proximal = [] if proximal is None else proximal
        self._replicate()
        lengths = [len(w.ids) for w in work]
        order = sorted(range(len(work)), key=lambda i: lengths[i])  # balanced shards, less pad
        whole, episode_tokens = episode_counts(work)
        mine = shard(order, self.world)
        weight = 1.0
        if not mine:  # more ranks than sequences: join the all-reduce with a zero gradient
            mine, weight = order[:1], 0.0
        micro = micro_batches([lengths[i] for i in mine], self.cfg.micro_batch_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        # loss, clip, ratio, kl, entropy sums, then the off-policy sums (off_policy.sums)
        totals = torch.zeros(5 + SUMS, dtype=torch.float64)
        largest = 0.0  # the largest importance weight pi_old / mu
        for k, part in enumerate(micro):
            items = [work[mine[i]] for i in part]
            last = k == len(micro) - 1
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if not (last or self._plain):  # accumulate locally, all-reduce on the last
                sync = cast(DistributedDataParallel, self.scorer).no_sync()
            with sync:
                step = self._micro_step(items, whole, [episode_tokens[mine[i]] for i in part],
                                        proximal[k] if k < len(proximal) else None)
                # DDP averages gradients over ranks; each rank's share is of the whole batch
                (step.loss * weight * self.world.size).backward()  # type: ignore[no-untyped-call]
            if k == len(proximal):
                proximal.append(step.proximal)
            totals += weight * step.figures
            largest = max(largest, weight * step.peak)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        totals = self.world.all_sum(totals)
        loss_sum, clip, ratio, kl, entropy = totals[:5].tolist()
        tokens = max(whole.tokens, 1.0)
        return UpdateStats(loss=loss_sum, grad_norm=grad_norm.item(), clip_frac=clip / tokens,
                           mean_ratio=ratio / tokens, approx_kl=kl / tokens,
                           micro_batches=len(micro),
                           entropy=entropy / tokens if self.cfg.entropy_coef else None,
                           mismatch=mismatch_stats(totals[5:], self.world.all_max(largest),
                                                   whole.tokens, len(work)))

    def _micro_step(self, items: list[Work], whole: Whole,
                    episode_tokens: list[float], proximal: Tensor | None) -> _MicroStep:
        batch = collate([w.ids for w in items], [w.sampled for w in items],
                        [w.logprobs for w in items], self.pad_id)
        mask = batch.loss_mask.to(self.device)  # (b, t-1)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):
            logprobs, entropy = self.scorer(
                batch.input_ids.to(self.device), batch.attention_mask.to(self.device), mask)
        behaviour = batch.behaviour_logprobs.to(self.device)  # (b, t-1) mu
        old = logprobs.detach() if proximal is None else proximal  # (b, t-1) pi_old
        weights = importance_weights(old, behaviour, mask, self.correction)
        decoupled = self.correction.decoupled
        loss, stats = policy_loss(
            logprobs,  # (b, t-1)
            behaviour,
            torch.tensor([w.advantage for w in items], device=self.device),  # (b,)
            mask,
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            norm=self.cfg.loss_norm,
            max_tokens=self.cfg.dr_grpo_max_tokens,
            whole=whole,
            episode_tokens=torch.tensor(episode_tokens, device=self.device),  # (b,)
            proximal_logprobs=old if decoupled else None,
            weight=weights.weight if decoupled else None,
        )
        entropy_sum = 0.0
        if entropy is not None:
            bonus = (entropy * mask).sum()
            loss = loss - self.cfg.entropy_coef * bonus / max(whole.tokens, 1.0)
            entropy_sum = float(bonus.detach())
        n = float(mask.sum())  # the stats are token means over this micro-batch
        figures = torch.tensor([float(loss.detach()), stats["clip_frac"] * n,
                                stats["mean_ratio"] * n, stats["approx_kl"] * n, entropy_sum],
                               dtype=torch.float64)
        return _MicroStep(loss, torch.cat([figures, sums(weights)]), old, peak(weights))

    @property
    def _plain(self) -> bool:
        return not isinstance(self.scorer, DistributedDataParallel)

    def _replicate(self) -> None:
        """Before the first distributed step: rank 0's parameters (DDP's constructor
        broadcasts them) and optimizer state (a restored checkpoint's) on every rank."""
        if self._replicated:
            return
        state = self.world.broadcast(self.optimizer.state_dict() if self.world.main else None)
        if not self.world.main:
            self.optimizer.load_state_dict(state)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.scorer = DistributedDataParallel(self.scorer, device_ids=ids)
        self._replicated = True

    def _describe(self, samples: list[Sample], update: UpdateStats) -> StepStats:
        valid = [s for s in samples if s.used]
        success = [episode_success(s.scored.trajectory) for s in valid]
        return StepStats(
            episodes=len(samples),
            masks=MaskCounts.of([s.cause for s in samples]),
            zero_advantage=sum(s.used and s.advantage == 0.0 for s in samples),
            reward_mean=_mean([s.scored.reward for s in valid]),
            success_rate=_mean([float(x) for x in success]),
            staleness_mean=_mean([float(s.staleness) for s in valid]),
            staleness_max=float(max((s.staleness for s in valid), default=0)),
            turns_mean=_mean([float(len(s.scored.trajectory.turns)) for s in valid]),
            tokens=sum(s.scored.trajectory.num_tokens for s in samples),
            segments=sum(len(s.episode.segments) for s in valid),
            update=update,
        )

    def state(self) -> PolicyState:
        model = self.model.state_dict() if self.adapter is None else lora.adapter_state(self.model)
        return PolicyState(model=model, optimizer=self.optimizer.state_dict())

    def restore(self, state: PolicyState | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no model (written by a synthetic learner?); "
                             "point RLBUS_CHECKPOINT_DIR elsewhere or remove it")
        if self.adapter is not None:
            lora.restore_adapter(self.model, state.model)
        else:
            self.model.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)


@dataclass(frozen=True)
class _MicroStep:
    """One micro-batch's forward pass: its loss and what the update sums of it."""

    loss: Tensor
    """Its share of the whole batch's loss (with the graph, for ``backward``)."""
    figures: Tensor
    """float64 sums: loss, clip, ratio, kl, entropy, then :func:`.off_policy.sums`."""
    proximal: Tensor
    """(b, t-1) the pi_old logprobs it used (kept for the step's later updates)."""
    peak: float
    """Its largest importance weight pi_old / mu."""


class _Scorer(nn.Module):
    """The policy's token logprobs (and entropy when the loss uses it) as one module, so
    that DistributedDataParallel wraps the whole forward pass."""

    def __init__(self, model: nn.Module, cfg: LearnerSettings) -> None:
        super().__init__()
        self.model = model
        self.temperature = cfg.temperature
        self.entropy = cfg.entropy_coef > 0
        self.chunk = cfg.logits_chunk_tokens

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                where: Tensor) -> tuple[Tensor, Tensor | None]:
        return score_tokens(self.model, input_ids, attention_mask, self.temperature,
                            entropy=self.entropy, where=where, chunk_tokens=self.chunk)


def micro_batches(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive runs of `lengths` (ascending) whose padded size (count times longest) stays
    within `budget` tokens; a sequence longer than the budget is a run of its own."""
    if budget is None:
        return [list(range(len(lengths)))]
    out: list[list[int]] = []
    current: list[int] = []
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(n, lengths[current[-1]]) > budget:
            out.append(current)
            current = []
        current.append(i)
    return [*out, current] if current else out


def _autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `dtype` on `device` (None: plain fp32), or a clear error."""
    if dtype == "float32":
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"RLBUS_DTYPE=bfloat16: {torch.cuda.get_device_name(device)} has no "
                         "bfloat16 support; use float32")
    return torch.bfloat16


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


class SyntheticTrainer:
    """No model: a step takes ``synthetic_step_s`` of wall time (load tests)."""

    def __init__(self, cfg: LearnerSettings) -> None:
        self.cfg = cfg

    def admit(self, t: Trajectory) -> None:
        """No model, no metric: every episode can take part."""

    def step(self, groups: list[ScoredGroup], version: int) -> StepStats:
        time.sleep(self.cfg.synthetic_step_s)  # stands in for GPU work, off the event loop
        samples = [e.scored for g in groups for e in g.episodes]
        ages = [version - m.trajectory.version_of_age(self.cfg.staleness_from)
                for m in samples]
        # the same mask as the GRPO trainer
        causes = [mask_cause(m, a, self.cfg.max_staleness)
                  for m, a in zip(samples, ages, strict=True)]
        valid = [m for m, c in zip(samples, causes, strict=True) if c is None]
        stale = [float(a) for a, c in zip(ages, causes, strict=True) if c is None]
        return StepStats(
            episodes=len(samples),
            masks=MaskCounts.of(causes),
            reward_mean=_mean([m.reward for m in valid]),
            success_rate=math.nan,
            staleness_mean=_mean(stale),
            staleness_max=max(stale, default=0.0),
            turns_mean=_mean([float(len(m.trajectory.turns)) for m in samples]),
            tokens=sum(m.trajectory.num_tokens for m in samples),
        )

    def weights(self) -> None:
        return None

    def state(self) -> None:
        return None

    def restore(self, state: PolicyState | None) -> None:
        return None

    def close(self) -> None:
        return None


def episode_success(t: Trajectory) -> bool:
    """The task's success metric of an episode; False for a task this process cannot load.
    Anything else the task's code raises propagates: the learner calls this on intake, where
    it dead-letters the episode, so that a step never meets it."""
    if t.status == "failed":  # a failed episode succeeds at nothing (a stand-in has no spec)
        return False
    actions = [turn.action for turn in t.turns if turn.tool_call is None]
    try:
        return plugins.task(t.task).success(t.spec, actions)
    except plugins.PluginError:
        return False
