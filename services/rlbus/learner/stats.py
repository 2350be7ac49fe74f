"""What a training step reports: typed figures, flattened into the metrics row only at the
edge (:meth:`StepStats.row`), under the names the metrics file has always used."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlbus.messages import MASK_CAUSES


@dataclass(frozen=True)
class EvalStats:
    """One evaluation round's figures: greedy episodes on the held-out specs."""

    at_step: int
    """The step whose weights the round evaluated."""
    success: float
    """Fraction of the round's episodes that met the task's success metric."""
    reward: float
    """Mean reward of the round's greedy episodes."""
    pass_at_k: float | None = None
    """Mean over the problems of the unbiased pass@k estimate (:func:`pass_at_k`) from the
    round's samples at the training temperature; None: not measured."""
    pass_k: int | None = None
    """The k of ``pass_at_k``."""

    def row(self) -> dict[str, float]:
        """The figures by their metrics names (pass@k as ``eval_pass_at_k`` with its k in
        ``eval_pass_k``: names every tracking sink accepts)."""
        row = {"eval_at_step": self.at_step, "eval_success": self.success,
               "eval_reward": self.reward}
        if self.pass_at_k is not None and self.pass_k is not None:
            row |= {"eval_pass_at_k": self.pass_at_k, "eval_pass_k": self.pass_k}
        return row


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` succeeded (Chen et
    al. 2021, "Evaluating Large Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k);
    with n = k, whether any of the k succeeded."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class MismatchStats:
    """How far the engine's behaviour policy mu was from pi_old, the weights a step trained
    from, over the step's loss tokens (docs/off-policy.md), with w = pi_old / mu per token."""

    weight_mean: float
    """Mean of w (before any truncation or mask): about 1 when the engine agrees."""
    weight_max: float
    """Largest w of the step: what truncation or a mask would have to deal with."""
    corrected_frac: float
    """Fraction of loss tokens whose weight the mode truncated (tis) or masked (token_mask,
    seq_mask); 0 in modes none and decoupled."""
    kl: float
    """KL(mu || pi_old), the k3 estimator's token mean: (w - 1) - log w, unbiased over
    tokens sampled from mu and never negative."""
    seq_masked_frac: float
    """Fraction of the step's sequences (rows: a linear episode, or one segment of an
    episode) that seq_mask masked whole; 0 in the other modes."""

    def row(self) -> dict[str, float]:
        return {"is_weight_mean": self.weight_mean, "is_weight_max": self.weight_max,
                "is_corrected_frac": self.corrected_frac, "mismatch_kl": self.kl,
                "is_seq_masked_frac": self.seq_masked_frac}


@dataclass(frozen=True)
class UpdateStats:
    """The figures of one optimizer update, summed over the ranks; ratios are token means.

    A step with nothing to train on reports zero loss, clip fraction and KL and leaves the
    others unmeasured (None: absent from the metrics row)."""

    loss: float
    clip_frac: float
    approx_kl: float
    grad_norm: float | None = None
    mean_ratio: float | None = None
    micro_batches: int | None = None
    entropy: float | None = None
    """Mean entropy of the sampled tokens; only when the loss has an entropy bonus."""
    mismatch: MismatchStats | None = None
    """The gap between the engine's logprobs and pi_old, and what the off-policy
    correction did about it; None: not measured (a step with nothing to train on)."""

    def row(self) -> dict[str, float]:
        """The measured figures by their metrics names, in the metrics file's order."""
        figures = {"loss": self.loss, "grad_norm": self.grad_norm, "clip_frac": self.clip_frac,
                   "mean_ratio": self.mean_ratio, "approx_kl": self.approx_kl,
                   "micro_batches": self.micro_batches, "entropy": self.entropy}
        mismatch = self.mismatch.row() if self.mismatch is not None else {}
        return {k: v for k, v in figures.items() if v is not None} | mismatch


@dataclass(frozen=True)
class MaskCounts:
    """How many episodes of a step entered the loss, and why the others did not."""

    trained: int
    by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MASK_CAUSES, 0))
    """Masked episodes per cause, every one of :data:`~rlbus.messages.MASK_CAUSES`."""

    @classmethod
    def of(cls, causes: list[str | None]) -> MaskCounts:
        """Counts of a step's episodes, each given by its mask cause (None: it trains)."""
        return cls(trained=causes.count(None),
                   by_cause={c: causes.count(c) for c in MASK_CAUSES})

    @property
    def masked(self) -> int:
        return sum(self.by_cause.values())

    def row(self) -> dict[str, float]:
        """``trained``, ``masked`` and one ``masked_<cause>`` per cause."""
        return {"trained": self.trained, "masked": self.masked,
                **{f"masked_{c}": n for c, n in self.by_cause.items()}}


@dataclass(frozen=True)
class StepStats:
    """One training step's figures: its batch, and the update it made (None: a trainer
    with no model, which reports a zero loss)."""

    episodes: int
    masks: MaskCounts
    reward_mean: float
    """Means are NaN where there is nothing to average."""
    success_rate: float
    staleness_mean: float
    staleness_max: float
    turns_mean: float
    tokens: int
    """Tokens of the batch's episodes, each segment's counted (a context two segments share
    is a trainer's work twice)."""
    zero_advantage: int | None = None
    """Episodes that trained with nothing to learn (their whole group scored the same);
    None from a trainer that computes no advantages."""
    update: UpdateStats | None = None
    segments: int | None = None
    """Token sequences of the episodes that trained: one per linear episode, one per
    segment of an episode whose agent's history was not; None from a trainer that packs
    none."""

    @property
    def loss(self) -> float:
        return self.update.loss if self.update is not None else 0.0

    def row(self) -> dict[str, float | None]:
        """The metrics row's training figures (NaN written as null), named as ever."""
        update = self.update.row() if self.update is not None else {"loss": 0.0}
        advantage = {} if self.zero_advantage is None else {"zero_advantage": self.zero_advantage}
        figures: dict[str, float] = {
            **update, "episodes": self.episodes, **self.masks.row(), **advantage,
            "reward_mean": self.reward_mean, "success_rate": self.success_rate,
            "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max,
            "turns_mean": self.turns_mean, "tokens": self.tokens,
        }
        if self.segments is not None:
            figures["segments"] = self.segments
        return {k: None if math.isnan(v) else v for k, v in figures.items()}
