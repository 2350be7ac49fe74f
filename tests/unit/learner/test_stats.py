"""A step's typed figures flatten into the metrics row under the names it always had."""

from __future__ import annotations

import math

import pytest

from rlbus.learner.stats import EvalStats, MaskCounts, StepStats, UpdateStats, pass_at_k

MASKS = MaskCounts(trained=3, by_cause={"stale": 1, "failed": 0, "invalid": 0,
                                        "bad_logprobs": 0})


def step(zero_advantage: int | None = None, update: UpdateStats | None = None) -> StepStats:
    return StepStats(episodes=4, masks=MASKS, reward_mean=0.5, success_rate=math.nan,
                     staleness_mean=1.0, staleness_max=2.0, turns_mean=3.0, tokens=40,
                     zero_advantage=zero_advantage, update=update,
                     segments=None if update is None else 5)


def test_a_grpo_step_row_names_every_figure_and_writes_nan_as_null() -> None:
    update = UpdateStats(loss=0.25, clip_frac=0.1, approx_kl=0.01, grad_norm=1.5,
                         mean_ratio=1.0, micro_batches=2)
    row = step(zero_advantage=1, update=update).row()
    assert list(row) == ["loss", "grad_norm", "clip_frac", "mean_ratio", "approx_kl",
                         "micro_batches", "episodes", "trained", "masked", "masked_stale",
                         "masked_failed", "masked_invalid", "masked_bad_logprobs",
                         "zero_advantage", "reward_mean",
                         "success_rate", "staleness_mean", "staleness_max", "turns_mean",
                         "tokens", "segments"]
    assert row["success_rate"] is None and row["masked"] == 1 and row["loss"] == 0.25


def test_a_step_with_nothing_to_train_reports_zero_loss_clip_and_kl_only() -> None:
    idle = UpdateStats(loss=0.0, clip_frac=0.0, approx_kl=0.0)
    assert idle.row() == {"loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
    with_entropy = UpdateStats(loss=0.0, clip_frac=0.0, approx_kl=0.0, entropy=2.0)
    assert with_entropy.row()["entropy"] == 2.0


def test_a_synthetic_step_row_has_a_zero_loss_and_no_advantage_figures() -> None:
    stats = step()
    row = stats.row()
    assert stats.loss == 0.0 and row["loss"] == 0.0
    assert "zero_advantage" not in row and "clip_frac" not in row and "segments" not in row


def test_an_evaluation_round_keeps_its_metrics_names() -> None:
    row = EvalStats(at_step=4, success=0.5, reward=0.75).row()
    assert row == {"eval_at_step": 4, "eval_success": 0.5, "eval_reward": 0.75}


def test_pass_at_k_is_the_unbiased_estimate_and_any_of_k_when_n_is_k() -> None:
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # any of k
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1: the success rate
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError):
        pass_at_k(1, 0, 2)
