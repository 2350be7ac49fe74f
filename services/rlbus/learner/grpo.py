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

That one ratio mixes two gaps: how many versions old the sampling weights were, and how the
engine's numbers differ from the trainer's. ``RLBUS_OFF_POLICY__MODE`` splits them
(decoupled PPO, :mod:`.off_policy`): the ratio is taken against pi_old, the learner's own
logprobs before this step's update, and each token is weighted by pi_old / mu, truncated or
masked as the mode says.

A multi-turn episode is one packed sequence: prompt, completion 1, observation 1,
completion 2, ... with token ids exactly as sampled; only completion tokens carry loss. An
episode whose agent's history was not linear (the gateway's segments) is several such rows,
one per segment, each with the episode's advantage; every sampled token is in exactly one
of them. The norms count episodes, not rows, so that a k-segment episode weighs what the
same turns would weigh as one linear episode: "token" is unchanged (each sampled token
weighs the same), "sequence" averages over all of an episode's segments' tokens
(``episode_tokens``), and "dr_grpo" divides by the number of episodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Norm = Literal["token", "sequence", "dr_grpo"]

LOG_RATIO_BOUND = 20.0
"""Decoupled losses clamp |log ratio| to this before ``exp`` (ratios in [2e-9, 5e8])."""


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
    whole: Whole | None = None,
    episode_tokens: Tensor | None = None,
    *,
    proximal_logprobs: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate loss (scalar) and stats: clip_frac, mean_ratio, approx_kl.

    logprobs, behaviour_logprobs, mask: (B, T), aligned per predicted token; mask is 1.0 on
    completion tokens. advantages: (B,) one per episode (GRPO), or (B, T) per token for
    turn-level credit. max_tokens (norm="dr_grpo" only) defaults to T.

    ``whole``: when these B sequences are one micro-batch of a larger batch, the batch's
    token and episode counts; the loss is then this micro-batch's share of the whole
    batch's loss, so the micro-batch losses sum (and their gradients accumulate) to exactly
    the one-batch values. Without it every row is an episode of its own.

    ``episode_tokens`` (B,): where rows are segments of episodes, the loss tokens of each
    row's whole episode, which norm="sequence" averages over (default: the row's own).

    Decoupled PPO (:mod:`.off_policy`): with ``proximal_logprobs`` (B, T), pi_old's, the
    ratio is pi_theta / pi_old (its log clamped before ``exp``) instead of pi_theta / mu,
    and the stats are of that ratio; ``weight`` (B, T), constant, multiplies each token's
    loss. Without either, the loss is the one-ratio loss above, operation for operation.
    """
    mask = mask.float()
    if proximal_logprobs is None:
        log_ratio = logprobs - behaviour_logprobs  # (B, T)
    else:
        log_ratio = (logprobs - proximal_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()  # (B, T)
    adv = advantages.float()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)  # (B, T) or (B, 1)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    if weight is not None:
        per_token = per_token * weight.detach()
    loss = _reduce(per_token, mask, norm, max_tokens, whole, episode_tokens)
    return loss, _stats(ratio.detach(), log_ratio.detach(), adv, mask, clip_low, clip_high)


@dataclass(frozen=True)
class Whole:
    """Counts over the whole batch that a micro-batch's loss is normalised by."""

    tokens: float  # loss-mask tokens of the whole batch
    episodes: int  # episodes of the whole batch (a k-segment episode is k rows, one episode)


def _reduce(
    per_token: Tensor, mask: Tensor, norm: Norm, max_tokens: int | None, whole: Whole | None,
    episode_tokens: Tensor | None = None,
) -> Tensor:
    """Average the (B, T) token losses into one scalar as `norm` prescribes."""
    summed = (per_token * mask).sum(dim=1)  # (B,)
    tokens = mask.sum().clamp(min=1.0) if whole is None else max(whole.tokens, 1.0)
    episodes = per_token.shape[0] if whole is None else whole.episodes
    if norm == "token":
        return summed.sum() / tokens
    if norm == "sequence":
        own = mask.sum(dim=1) if episode_tokens is None else episode_tokens.float()  # (B,)
        return (summed / own.clamp(min=1.0)).sum() / episodes
    if norm == "dr_grpo":
        return summed.sum() / (episodes * (max_tokens or per_token.shape[1]))
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
    return score_tokens(model, input_ids, attention_mask, temperature)[0]


def sequence_logprobs_and_entropy(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """`sequence_logprobs` and the policy's entropy (B, T-1) at each position.

    Entropy is the early warning of collapse: once the policy is deterministic in a state,
    every member of a group acts alike there, advantages are 0 and learning stops.
    """
    logprobs, entropy = score_tokens(model, input_ids, attention_mask, temperature, entropy=True)
    assert entropy is not None
    return logprobs, entropy


def score_tokens(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    where: Tensor | None = None,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (B, T-1) of the next tokens, and their entropy if asked, at temperature T.

    Never holds the logits of the whole batch in fp32: for a Hugging Face causal LM the
    decoder's hidden states go through the output head ``chunk_tokens`` positions at a time,
    each chunk's logits cast to fp32 for the log-softmax and, when gradients are on,
    recomputed in the backward pass instead of kept (activation checkpointing of the head),
    so the peak is one chunk's (chunk_tokens, V) however long the batch. ``where`` (B, T-1)
    restricts the work to the positions that carry loss (0 elsewhere in the results): the
    prompt's and the observations' positions never go through the head at all. Entropy
    costs one more pass over the vocabulary and is only computed when asked.

    A model without a separate output head (anything with just ``forward(...).logits``) is
    scored from its logits, chunk by chunk in the same way.
    """
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    targets = input_ids[:, 1:]  # (B, T-1)
    keep = torch.ones_like(targets, dtype=torch.bool) if where is None else where.bool()
    head = _output_head(model)
    if head is None:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits  # (B, T, V) in the model's dtype
        rows, project = logits[:, :-1][keep], None  # (N, V)
    else:
        base = getattr(model, str(model.base_model_prefix))
        hidden = base(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # (B, T, H)
        rows, project = hidden[:, :-1][keep], head  # (N, H)
    picked = targets[keep]  # (N,)
    lp_parts: list[Tensor] = []
    ent_parts: list[Tensor] = []
    for start in range(0, rows.shape[0], chunk_tokens):
        part = (rows[start : start + chunk_tokens], picked[start : start + chunk_tokens])
        if torch.is_grad_enabled() and rows.requires_grad:
            out = checkpoint(_score_chunk, *part, project, temperature, entropy,
                             use_reentrant=False)
        else:
            out = _score_chunk(*part, project, temperature, entropy)
        lp_parts.append(out[0])
        ent_parts.append(out[1])
    logprobs = torch.zeros(targets.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.masked_scatter(keep, _cat(lp_parts, rows))
    if not entropy:
        return logprobs, None
    ent = torch.zeros(targets.shape, dtype=torch.float32, device=input_ids.device)
    return logprobs, ent.masked_scatter(keep, _cat(ent_parts, rows))


def _output_head(model: nn.Module) -> nn.Module | None:
    """The output projection of a Hugging Face causal LM whose logits are exactly
    ``head(last_hidden_state)``; None for anything else (scored from its logits)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    config = getattr(model, "config", None)
    transformed = any(  # logits post-processed after the head: use the model's own forward
        getattr(config, key, None) not in (None, 1.0, 0.0)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )
    if head is None or transformed or not hasattr(model, getattr(model, "base_model_prefix", "")):
        return None
    return head  # type: ignore[no-any-return]


def _score_chunk(
    rows: Tensor, picked: Tensor, project: nn.Module | None, temperature: float, entropy: bool
) -> tuple[Tensor, Tensor]:
    logits = (rows if project is None else project(rows)).float() / temperature  # (n, V)
    norm = logits.logsumexp(dim=-1)  # (n,)
    logprobs = logits.gather(-1, picked.unsqueeze(-1)).squeeze(-1) - norm  # (n,)
    if not entropy:
        return logprobs, logprobs.new_zeros(())
    probs = (logits - norm.unsqueeze(-1)).exp()  # (n, V)
    return logprobs, norm - (probs * logits).sum(dim=-1)  # H = logZ - E_p[logit]


def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(parts) if parts else like.new_zeros((0,), dtype=torch.float32)


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

