"""GRPO loss pieces against hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from rlbus.learner.grpo import (
    Whole,
    collate,
    group_advantages,
    masked_mean,
    policy_loss,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)

ALL = torch.ones(4, dtype=torch.bool)


def close(actual: Tensor, expected: Tensor | list[float] | float) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- advantages


def test_advantages_are_centred_and_scaled_by_population_std() -> None:
    # mean = 0.5, population std = sqrt(mean((±0.5)²)) = 0.5 → (r - 0.5) / 0.5 = ±1
    close(group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ALL), [1.0, -1.0, -1.0, 1.0])


def test_advantages_without_std_are_only_centred() -> None:
    # Dr. GRPO: r - mean = r - 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ALL, scale_by_std=False)
    close(adv, [0.5, -0.5, -0.5, 0.5])


def test_failed_episodes_get_zero_and_stay_out_of_the_statistics() -> None:
    # valid rewards [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3],
    # std = sqrt((1/9 + 4/9 + 1/9) / 3) = sqrt(2)/3 → [1/sqrt2, -sqrt2, 1/sqrt2]; the
    # failed 4th member (reward 0 by default, not a real 0) gets 0.
    valid = torch.tensor([True, True, True, False])
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), valid)
    close(adv, [1 / math.sqrt(2), -math.sqrt(2), 1 / math.sqrt(2), 0.0])


def test_a_failed_member_does_not_shift_the_others() -> None:
    # Same valid rewards with or without a huge bogus reward on the failed member.
    valid = torch.tensor([True, True, True, False])
    a = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), valid)
    b = group_advantages(torch.tensor([1.0, 0.0, 1.0, 99.0]), valid)
    close(b, a.tolist())


@pytest.mark.parametrize(
    ("rewards", "valid"),
    [
        ([1.0, 1.0, 1.0, 1.0], [True] * 4),  # no spread: std 0 → 0 / (0 + eps) = 0
        ([1.0, 0.0, 1.0, 0.0], [False] * 4),  # nothing valid
        ([1.0, 0.0, 1.0, 0.0], [True, False, False, False]),  # one valid: r - mean = 0
    ],
)
def test_groups_without_signal_give_zero(rewards: list[float], valid: list[bool]) -> None:
    adv = group_advantages(torch.tensor(rewards), torch.tensor(valid))
    close(adv, [0.0] * 4)


# ------------------------------------------------------------------------ policy loss


def one_token(ratio: float, advantage: float, **kwargs: float) -> tuple[Tensor, Tensor, dict]:
    """Loss and d loss / d logprob for a single token with the given ratio."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)  # (1, 1)
    loss, stats = policy_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad[0, 0], stats


def test_ratio_above_one_plus_clip_is_clipped_for_positive_advantage() -> None:
    # rho = 1.5, A = +1: min(1.5 * 1, clip(1.5, 0.8, 1.2) * 1) = 1.2 → loss -1.2, no gradient
    loss, grad, stats = one_token(1.5, 1.0)
    close(loss, -1.2)
    close(grad, 0.0)
    assert stats["clip_frac"] == 1.0


def test_ratio_above_one_plus_clip_is_not_clipped_for_negative_advantage() -> None:
    # rho = 1.5, A = -1: min(-1.5, -1.2) = -1.5 → loss 1.5; d(-rho*A)/dlogp = -A*rho = 1.5
    loss, grad, stats = one_token(1.5, -1.0)
    close(loss, 1.5)
    close(grad, 1.5)
    assert stats["clip_frac"] == 0.0


def test_ratio_below_one_minus_clip_is_clipped_for_negative_advantage() -> None:
    # rho = 0.5, A = -1: min(-0.5, clip(0.5, 0.8, 1.2) * -1 = -0.8) = -0.8 → loss 0.8, no grad
    loss, grad, _ = one_token(0.5, -1.0)
    close(loss, 0.8)
    close(grad, 0.0)
    # ... and not for positive advantage: min(0.5, 0.8) = 0.5 → loss -0.5, grad -A*rho = -0.5
    loss, grad, _ = one_token(0.5, 1.0)
    close(loss, -0.5)
    close(grad, -0.5)


def test_clip_higher_lets_a_positive_token_grow_further() -> None:
    # rho = 1.25, A = +1: symmetric 0.2 clips at 1.2; DAPO's clip_high = 0.28 allows 1.25
    close(one_token(1.25, 1.0, clip_high=0.2)[0], -1.2)
    loss, grad, _ = one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    close(loss, -1.25)
    close(grad, -1.25)


def test_stale_behaviour_logprobs_make_the_ratio_differ_from_one() -> None:
    # log rho = log 2 → rho = 2; k3 approx KL = (2 - 1) - ln 2 = 0.306853
    _, _, stats = one_token(2.0, -1.0)
    assert stats["mean_ratio"] == pytest.approx(2.0)
    assert stats["approx_kl"] == pytest.approx(1.0 - math.log(2.0))


# Two sequences, ratio 1 everywhere, A = [+1, -3]; per-token loss = -A:
# row 0 → [-1, -1, (pad)], row 1 → [3, (pad), (pad)]; masked sum = -1 - 1 + 3 = 1.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # (B=2, T=3)
ADV = torch.tensor([1.0, -3.0])


@pytest.mark.parametrize(
    ("norm", "max_tokens", "expected"),
    [
        ("token", None, 1 / 3),  # sum over the batch's 3 tokens / 3
        ("sequence", None, 1.0),  # mean of per-sequence means: (-1 + 3) / 2
        ("dr_grpo", 4, 1 / 8),  # sum / (B * max_tokens) = 1 / (2 * 4)
        ("dr_grpo", None, 1 / 6),  # max_tokens defaults to T = 3: 1 / (2 * 3)
    ],
)
def test_norms(norm: str, max_tokens: int | None, expected: float) -> None:
    zeros = torch.zeros(2, 3)
    # Garbage under the mask must not leak into the loss.
    logprobs = torch.where(MASK.bool(), zeros, torch.full((2, 3), 5.0))
    loss, _ = policy_loss(logprobs, zeros, ADV, MASK, norm=norm, max_tokens=max_tokens)  # type: ignore[arg-type]
    close(loss, expected)


# Episode 0 samples 5 tokens, episode 1 three (ratio != 1, so the clip is in play too).
SPLIT_LP = [[-1.0, -0.5, -2.0, -0.1, -0.3], [-0.2, -0.7, -1.1]]
SPLIT_ADV = [1.5, -0.5]


def _rows(spans: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(episode, start, end) spans of SPLIT_LP as right-padded rows, in policy_loss's order:
    logprobs, behaviour logprobs, advantages, mask."""
    logprobs, behaviour, mask = (torch.zeros(len(spans), 5) for _ in range(3))
    for r, (e, a, b) in enumerate(spans):
        logprobs[r, : b - a] = torch.tensor(SPLIT_LP[e][a:b])
        behaviour[r, : b - a] = torch.tensor([x - 0.1 * i for i, x in
                                              enumerate(SPLIT_LP[e])][a:b])
        mask[r, : b - a] = 1.0
    return logprobs, behaviour, torch.tensor([SPLIT_ADV[e] for e, _, _ in spans]), mask


@pytest.mark.parametrize("norm", ["token", "sequence", "dr_grpo"])
def test_an_episode_split_into_segments_weighs_what_it_weighs_as_one_row(norm: str) -> None:
    # As rows [e0, e1], or with e0 in two segments [e0 tokens 0-1, e0 tokens 2-4, e1]: the
    # same tokens, so the same loss under each norm, once the norm counts episodes (2, not
    # 3 rows) and averages e0 over its 5 tokens together.
    kw: dict = {"norm": norm, "max_tokens": 8, "whole": Whole(tokens=8, episodes=2)}
    one_row = policy_loss(*_rows([(0, 0, 5), (1, 0, 3)]), **kw)[0]
    split = [(0, 0, 2), (0, 2, 5), (1, 0, 3)]
    segments = policy_loss(*_rows(split), **kw, episode_tokens=torch.tensor([5.0, 5.0, 3.0]))
    close(segments[0], one_row)
    if norm == "sequence":  # rows counted as episodes would weigh episode 0 twice
        assert not torch.isclose(policy_loss(*_rows(split), norm=norm)[0], one_row)


def test_per_token_advantages_equal_broadcast_episode_advantages() -> None:
    # (B,) advantages are (B, T) advantages constant along T: [[1, 1, 1], [-3, -3, -3]]
    zeros = torch.zeros(2, 3)
    per_token = ADV[:, None].expand(2, 3)
    close(policy_loss(zeros, zeros, per_token, MASK)[0], policy_loss(zeros, zeros, ADV, MASK)[0])
    # turn-level credit: row 0 gets [+1, -1] on its two tokens → token sum -1 + 1 + 3 = 3 → 3/3
    turns = torch.tensor([[1.0, -1.0, 0.0], [-3.0, 0.0, 0.0]])
    close(policy_loss(zeros, zeros, turns, MASK)[0], 1.0)


def test_unknown_norm_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown norm"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                    norm="mean")  # type: ignore[arg-type]


# ------------------------------------------------------------------- logprobs, collate


class BigramModel(nn.Module):
    """logits[b, t] = TABLE[input_ids[b, t]]: next-token logits depend on the current one."""

    TABLE = torch.tensor(
        [
            [0.0, 0.0, 0.0],  # after token 0: uniform, p = 1/3 each
            [0.0, math.log(2.0), 0.0],  # after token 1: p = [1/4, 1/2, 1/4]
            [0.0, 0.0, 0.0],
        ]
    )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
    ) -> SimpleNamespace:
        return SimpleNamespace(logits=self.TABLE[input_ids])  # (B, T, V)


def test_sequence_logprobs_gathers_the_next_token() -> None:
    ids = torch.tensor([[0, 1, 1]])  # p(1 | 0) = 1/3, p(1 | 1) = 1/2
    lp = sequence_logprobs(BigramModel(), ids, torch.ones_like(ids))
    close(lp, [[math.log(1 / 3), math.log(1 / 2)]])


def test_sequence_logprobs_divides_logits_by_the_temperature() -> None:
    # after token 1 at temperature 2: logits [0, ln2 / 2, 0] → p(1) = sqrt2 / (2 + sqrt2)
    ids = torch.tensor([[1, 1]])
    lp = sequence_logprobs(BigramModel(), ids, torch.ones_like(ids), temperature=2.0)
    close(lp, [[math.log(math.sqrt(2) / (2 + math.sqrt(2)))]])


def test_entropy_of_the_next_token_distribution() -> None:
    # after token 0: uniform over 3 → ln 3; after token 1: [1/4, 1/2, 1/4] → 1.5 ln 2
    ids = torch.tensor([[0, 1, 2]])
    _, entropy = sequence_logprobs_and_entropy(BigramModel(), ids, torch.ones_like(ids))
    close(entropy, [[math.log(3.0), 1.5 * math.log(2.0)]])
    # only the second position counts
    close(masked_mean(entropy, torch.tensor([[0.0, 1.0]])), 1.5 * math.log(2.0))


def test_collate_pads_right_and_shifts_flags_to_targets() -> None:
    batch = collate(
        token_ids=[[5, 6, 7], [5, 8]],
        sampled=[[False, True, True], [False, True]],
        behaviour_logprobs=[[0.0, -0.5, -0.7], [0.0, -0.2]],
        pad_id=0,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7], [5, 8, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    # position t of the (B, T-1) tensors is about predicting input_ids[:, t + 1]
    assert batch.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    close(batch.behaviour_logprobs, [[-0.5, -0.7], [-0.2, 0.0]])
