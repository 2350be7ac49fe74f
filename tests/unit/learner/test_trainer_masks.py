"""Masked episodes are counted by cause; only the rest count as trained."""

import math

import pytest

from rlbus.learner.stats import MaskCounts
from rlbus.learner.trainer import behaviour_finite, mask_cause
from tests import factories


class _Turn:
    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs


class _T:
    def __init__(self, status: str = "ok", turns: int = 1,
                 logprobs: tuple[float, ...] = (-0.5,)) -> None:
        self.status, self.turns = status, [_Turn(list(logprobs))] * turns


class _S:
    def __init__(self, valid: bool = True, **kw: object) -> None:
        self.valid, self.trajectory = valid, _T(**kw)  # type: ignore[arg-type]


def test_each_cause_is_told_apart_and_counted() -> None:
    causes = [
        mask_cause(_S(), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(), 3, 2),  # type: ignore[arg-type]
        mask_cause(_S(valid=False, status="failed"), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(valid=False), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(turns=0), 5, 2),  # type: ignore[arg-type]
        mask_cause(_S(logprobs=(-0.5, math.nan)), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(turns=2, logprobs=(-math.inf,)), 3, 2),  # type: ignore[arg-type]
    ]
    assert causes == [None, "stale", "failed", "invalid", "invalid", "bad_logprobs",
                      "bad_logprobs"]
    counts = MaskCounts.of(causes)
    assert counts.trained == 1 and counts.masked == 6
    assert counts.row() == {"trained": 1, "masked": 6, "masked_stale": 1, "masked_failed": 1,
                            "masked_invalid": 2, "masked_bad_logprobs": 2}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_behaviour_logprob_anywhere_in_the_episode_masks_it(bad: float) -> None:
    t = factories.trajectory()
    turn = t.turns[0]
    assert behaviour_finite(t)
    # the wire refuses NaN and +inf (StepResult, Turn), but -inf passes it, and so does
    # anything that skips validation (model_copy, model_construct)
    broken = turn.model_copy(update={"logprobs": [-0.25, bad]})
    episode = t.model_copy(update={"turns": [turn, broken, turn]})
    assert not behaviour_finite(episode)
    assert mask_cause(factories.scored().model_copy(update={"trajectory": episode}), 0, 2) \
        == "bad_logprobs"
    huge = turn.model_copy(update={"logprobs": [-3.4e38, -3.4e38]})  # float32's most negative
    assert behaviour_finite(t.model_copy(update={"turns": [huge] * 100}))


@pytest.mark.parametrize(("since", "masked"), [("oldest", 1), ("newest", 0)])
def test_the_synthetic_trainer_counts_staleness_from_the_token_set(since: str,
                                                                    masked: int) -> None:
    """A two-turn episode begun at v0 whose second turn v3 sampled: at v5 with bound 2 it is
    stale from its oldest token, fresh enough from its newest."""
    from rlbus.client import Episode, ScoredGroup
    from rlbus.learner.settings import LearnerSettings
    from rlbus.learner.trainer import SyntheticTrainer
    from rlbus.messages import ScoredTrajectory, Turn

    t = factories.trajectory(version=0)
    later = Turn(input_ids=[4], completion_ids=[5], logprobs=[-1.0], policy_version=3)
    t = t.model_copy(update={"turns": [*t.turns, later]})
    episode = Episode.of(ScoredTrajectory(trajectory=t, reward=1.0), {})
    trainer = SyntheticTrainer(LearnerSettings(trainer="synthetic", synthetic_step_s=0.0,
                                               max_staleness=2, staleness_from=since))
    stats = trainer.step([ScoredGroup("run/0", "x", "train", (episode,), 0)], version=5)
    assert stats.masks.by_cause["stale"] == masked
