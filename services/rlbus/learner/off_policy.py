"""Decoupled off-policy correction: the per-token weights the policy loss multiplies by.

Three policies meet in one asynchronous step (decoupled PPO: Fu et al. 2025, AReaL,
arXiv:2505.24298; Hilton et al. 2022, "Batch size-invariance for policy optimization"):

- mu, the behaviour policy: the logprobs the engine reported while it sampled. They differ
  from the learner's for two reasons at once: the weights were a few versions old, and the
  engine's numerics are not the trainer's (kernels, precision, a top-p nucleus).
- pi_old, the proximal policy: the weights the learner trains from, before this step's
  update.
- pi_theta: the policy being updated.

The loss clips r = pi_theta / pi_old as PPO does, and weights each token by
w = pi_old / mu (a constant: no gradient flows through it):

    loss_t = -w_t * min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)

so the trust region is around the policy the learner holds, and the gap to the sampler is
corrected by importance sampling instead of being clipped as if it were an update. Modes
(``OffPolicySettings.mode``; docs/off-policy.md):

- none: no w and r = pi_theta / mu (the loss rlbus always had; :func:`importance_weights`
  still measures w, for the metrics).
- decoupled: w as it is.
- tis: w truncated at C (truncated importance sampling; verl, slime and SkyRL: C = 2).
- token_mask: w, but 0 outside [alpha, beta] (IcePop; NeMo-RL: [0.5, 5]).
- seq_mask: w, but 0 for the whole sequence where exp(mean_t log w_t) is outside the band
  (geometric-mean rejection; verl [0.999, 1.001], SkyRL [0.99, 1.01]).

A masked token keeps its place in the loss's normaliser (its weight is 0, as NeMo-RL does):
the micro-batch losses then still sum to the one-batch loss, with counts known before any
forward pass. Where mu == pi_old every mode gives w = 1 on every token and r = pi_theta / mu:
the loss of mode none, exactly.

Log-ratios are clamped to +-:data:`LOG_RATIO_BOUND` before ``exp`` (as verl does), so a
token the engine found impossible cannot make an infinite weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlbus.learner.grpo import LOG_RATIO_BOUND
from rlbus.learner.settings import OffPolicyMode, OffPolicySettings
from rlbus.learner.stats import MismatchStats


@dataclass(frozen=True)
class Correction:
    """The correction a loss applies: a mode and its knobs (see the module docstring)."""

    mode: OffPolicyMode = "none"
    tis_cap: float = 2.0
    token_band: tuple[float, float] = (0.5, 5.0)
    seq_band: tuple[float, float] = (0.999, 1.001)

    @classmethod
    def of(cls, settings: OffPolicySettings) -> Correction:
        return cls(settings.mode, settings.tis_cap, (settings.token_low, settings.token_high),
                   (settings.seq_low, settings.seq_high))

    @property
    def decoupled(self) -> bool:
        """Whether the loss clips around pi_old and weights by w (every mode but none)."""
        return self.mode != "none"


@dataclass(frozen=True)
class Weights:
    """What the correction made of one micro-batch's tokens."""

    weight: Tensor
    """(B, T) the weight each token's loss is multiplied by: w, truncated or 0 where masked;
    0 off the loss mask."""
    raw: Tensor
    """(B, T) w = pi_old / mu itself (log-ratio clamped), 0 off the loss mask."""
    log_raw: Tensor
    """(B, T) log w, clamped, 0 off the loss mask."""
    corrected: Tensor
    """(B, T) bool: loss tokens whose weight the mode truncated or masked."""
    sequence_masked: Tensor
    """(B,) bool: sequences seq_mask masked whole (all False in the other modes)."""


def importance_weights(proximal: Tensor, behaviour: Tensor, mask: Tensor,
                       correction: Correction) -> Weights:
    """The weights of tokens whose pi_old logprobs are ``proximal`` (B, T) and engine
    logprobs ``behaviour`` (B, T), over the loss ``mask`` (B, T)."""
    on = mask.bool()
    log_raw = torch.where(on, proximal - behaviour, 0.0).clamp(-LOG_RATIO_BOUND,
                                                               LOG_RATIO_BOUND)  # (B, T)
    raw = torch.where(on, log_raw.exp(), 0.0)  # (B, T)
    rows = torch.zeros(on.shape[0], dtype=torch.bool, device=on.device)  # (B,)
    if correction.mode == "tis":
        return Weights(raw.clamp(max=correction.tis_cap), raw, log_raw,
                       on & (raw > correction.tis_cap), rows)
    if correction.mode == "token_mask":
        low, high = correction.token_band
        keep = (raw >= low) & (raw <= high)  # (B, T)
        return Weights(torch.where(keep, raw, 0.0), raw, log_raw, on & ~keep, rows)
    if correction.mode == "seq_mask":
        low, high = correction.seq_band
        tokens = on.sum(dim=1)  # (B,)
        geometric = (log_raw.sum(dim=1) / tokens.clamp(min=1)).exp()  # (B,)
        rows = (tokens > 0) & ((geometric < low) | (geometric > high))  # (B,)
        return Weights(torch.where(rows.unsqueeze(1), 0.0, raw), raw, log_raw,
                       on & rows.unsqueeze(1), rows)
    return Weights(raw, raw, log_raw, torch.zeros_like(on), rows)  # none, decoupled


SUMS = 4
"""Length of :func:`sums`: weight, corrected tokens, k3 KL, masked sequences."""


def sums(w: Weights) -> Tensor:
    """This micro-batch's sums (float64, (SUMS,)) for :func:`mismatch_stats`: they add up
    over micro-batches and ranks."""
    r = w.raw.double()
    k3 = torch.where(r > 0, (r - 1.0) - w.log_raw.double(), 0.0)  # 0 off the mask
    return torch.stack([r.sum(), w.corrected.sum().double(), k3.sum(),
                        w.sequence_masked.sum().double()]).cpu()


def peak(w: Weights) -> float:
    """The largest w of this micro-batch (0.0 with no loss token)."""
    return float(w.raw.max()) if w.raw.numel() else 0.0


def mismatch_stats(totals: Tensor, largest: float, tokens: float,
                   sequences: int) -> MismatchStats:
    """A step's figures from its :func:`sums` (over every micro-batch and rank), its
    largest :func:`peak`, and its loss-token and sequence counts."""
    weight, corrected, kl, masked = totals.tolist()
    n = max(tokens, 1.0)
    return MismatchStats(weight_mean=weight / n, weight_max=largest,
                         corrected_frac=corrected / n, kl=kl / n,
                         seq_masked_frac=masked / max(sequences, 1))
