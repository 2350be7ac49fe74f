"""The GRPO policy loss, for one optimizer step on stale multi-turn rollouts.

Implements the clipped surrogate of GRPO (Shao et al. 2024, DeepSeekMath,
arXiv:2402.03300) with group-relative advantages A_i = (r_i - mean(r)) / std(r), and no
KL-to-reference term (as DAPO and Dr. GRPO drop it), with two later refinements as options:

- DAPO (Yu et al. 2025, arXiv:2503.14476): "clip-higher", an upper clip 1 + clip_high above
  the lower 1 - clip_low so unlikely tokens with positive advantage can still grow, and
  token-level normalisation (every token of the batch weighs the same, norm="token").
- Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): no division by the group std
  (scale_by_std=False) and no per-sequence length normalisation: each sequence's token sum
  is divided by one constant, max_tokens (norm="dr_grpo"). Original GRPO averages tokens
  within a sequence first (norm="sequence").

Per token t of episode i, with rho = exp(logprob - behaviour_logprob):

    loss_it = -min(rho * A_i, clip(rho, 1 - clip_low, 1 + clip_high) * A_i)

The behaviour logprobs are the ones the rollout engine reported while sampling, not a
recomputation by the learner: in an async system the batch is a few versions stale, and with
one gradient step per batch a learner-side recomputation would make rho identically 1 and
the clip a no-op.

A multi-turn episode is one packed sequence: prompt, completion 1, observation 1,
completion 2, ... with token ids exactly as sampled; only completion tokens carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

Norm = Literal["token", "sequence", "dr_grpo"]


def group_advantages(
    rewards: Tensor, valid: Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages (G,) from the rewards (G,) of one prompt's episodes.

    Invalid members (failed episodes: a dead endpoint, a crashed sandbox) get advantage 0
    and stay out of the mean and std, so a failure is never mistaken for a zero reward.
    The std is the population std (divide by n): rewards [1, 0, 0, 1] give exactly ±1.
    """
    valid = valid.bool()
    n = valid.sum()
    if n == 0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.float()
    mean = (r * valid).sum() / n
    centred = torch.where(valid, r - mean, torch.zeros_like(r))  # (G,)
    if scale_by_std:
        std = (centred.square().sum() / n).sqrt()
        centred = centred / (std + eps)
    return centred


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    norm: Norm = "token",
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate loss (scalar) and stats: clip_frac, mean_ratio, approx_kl.

    logprobs, behaviour_logprobs, mask: (B, T), aligned per predicted token; mask is 1.0 on
    completion tokens. advantages: (B,) one per episode (GRPO), or (B, T) per token for
    turn-level credit. max_tokens (norm="dr_grpo" only) defaults to T.
    """
    mask = mask.float()
    log_ratio = logprobs - behaviour_logprobs  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    adv = advantages.float()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)  # (B, T) or (B, 1)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    loss = _reduce(per_token, mask, norm, max_tokens)
    return loss, _stats(ratio.detach(), log_ratio.detach(), adv, mask, clip_low, clip_high)


def _reduce(per_token: Tensor, mask: Tensor, norm: Norm, max_tokens: int | None) -> Tensor:
    """Average the (B, T) token losses into one scalar as `norm` prescribes."""
    summed = (per_token * mask).sum(dim=1)  # (B,)
    if norm == "token":
        return summed.sum() / mask.sum().clamp(min=1.0)
    if norm == "sequence":
        return (summed / mask.sum(dim=1).clamp(min=1.0)).mean()
    if norm == "dr_grpo":
        return summed.sum() / (per_token.shape[0] * (max_tokens or per_token.shape[1]))
    raise ValueError(f"unknown norm {norm!r}")


def _stats(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> dict[str, float]:
    """Token means over the mask. approx_kl is k3 = (rho - 1) - log rho, an unbiased,
    always non-negative estimate of KL(behaviour || current) from behaviour samples."""
    # A token is clipped when the clamp, not the raw ratio, sets its gradient (to zero).
    clipped = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))
    n = mask.sum().clamp(min=1.0)

    def mean(x: Tensor) -> float:
        return float((x.float() * mask).sum() / n)

    return {
        "clip_frac": mean(clipped),
        "mean_ratio": mean(ratio),
        "approx_kl": mean((ratio - 1.0) - log_ratio),
    }


def sequence_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """Log-probability (B, T-1) of each next token input_ids[:, 1:] under `model`.

    Position ids follow the attention mask, so left- or right-padded batches give the same
    values as unpadded ones. `temperature` must match the sampler's, or the ratio against
    the engine's logprobs is off from the first step.
    """
    return sequence_logprobs_and_entropy(model, input_ids, attention_mask, temperature)[0]


def sequence_logprobs_and_entropy(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """`sequence_logprobs` and the policy's entropy (B, T-1) at each position.

    Entropy is the early warning of collapse: once the policy is deterministic in a state,
    every member of a group acts alike there, advantages are 0 and learning stops.
    """
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    logits: Tensor = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits  # (B, T, V)
    logp_all = (logits[:, :-1].float() / temperature).log_softmax(dim=-1)  # (B, T-1, V)
    targets = input_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    logprobs = logp_all.gather(-1, targets).squeeze(-1)  # (B, T-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)  # (B, T-1)
    return logprobs, entropy


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is 1 (e.g. the entropy over completion tokens)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass(frozen=True)
class Batch:
    """Packed episodes, right-padded; token-aligned tensors are shifted by one (targets)."""

    input_ids: Tensor  # (B, T) long
    attention_mask: Tensor  # (B, T) long
    loss_mask: Tensor  # (B, T-1) float: 1.0 where input_ids[:, 1:] was sampled by the policy
    behaviour_logprobs: Tensor  # (B, T-1) float: the engine's logprobs there, else 0


def collate(
    token_ids: Sequence[Sequence[int]],
    sampled: Sequence[Sequence[bool]],
    behaviour_logprobs: Sequence[Sequence[float]],
    pad_id: int,
) -> Batch:
    """Pack episodes (each a flat token list with per-token sampled flags and logprobs)."""
    width = max(len(ids) for ids in token_ids)
    batch = len(token_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((batch, width), dtype=torch.long)  # (B, T)
    flags = torch.zeros((batch, width))  # (B, T)
    logp = torch.zeros((batch, width))  # (B, T)
    for i, (ids, own, lp) in enumerate(zip(token_ids, sampled, behaviour_logprobs, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        flags[i, : len(ids)] = torch.tensor(own, dtype=torch.float32)
        logp[i, : len(ids)] = torch.tensor(lp, dtype=torch.float32)
    # The first token is never predicted, so a sampled flag on it cannot carry loss.
    return Batch(input_ids, attention, flags[:, 1:], logp[:, 1:])

