"""The GRPO trainer: rank 0 and the followers exchange typed orders, and it resumes only from a
checkpoint that holds a policy."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rlbus import plugins
from rlbus.client import Episode, ScoredGroup
from rlbus.learner.distributed import World
from rlbus.learner.grpo import Whole
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.store import PolicyState
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.learner.trainer import Trainer, episode_counts, packed
from rlbus.learner.work import Release, TrainOrder, Work
from rlbus.messages import ScoredTrajectory, Trajectory, Turn


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@dataclass(frozen=True)
class Scripted(World):
    """A world of one whose broadcasts return what rank 0 is scripted to have sent."""

    script: list[object] = field(default_factory=list)
    sent: list[object] = field(default_factory=list)

    def broadcast(self, obj: object = None) -> object:
        if obj is not None:
            self.sent.append(obj)
            return obj
        return self.script.pop(0)


def trainer(folder: Path, world: World) -> Trainer:
    return Trainer(LearnerSettings(model_path=folder, torch_threads=None), world)


WORK = [Work([3, 4, 5, 6], [False, False, True, True], [0.0, 0.0, -1.0, -2.0], 1.0)]


def test_a_follower_trains_each_order_until_released(folder: Path) -> None:
    world = Scripted(script=[TrainOrder(WORK), TrainOrder(WORK), Release()])
    assert trainer(folder, world).follow() == 2


def test_a_follower_refuses_what_is_not_an_order(folder: Path) -> None:
    world = Scripted(script=[("step", WORK)])  # the tuple of an older rank 0
    with pytest.raises(TypeError, match="not a TrainOrder or Release"):
        trainer(folder, world).follow()


def test_rank_0_leads_with_an_order_of_the_work(folder: Path) -> None:
    world = Scripted()
    stats = trainer(folder, world).lead(WORK)
    assert world.sent == [TrainOrder(WORK)] and stats.micro_batches == 1


def test_restore_needs_a_policy_and_rewinds_to_it(folder: Path) -> None:
    a, b = trainer(folder, World()), trainer(folder, World())
    a.optimize(WORK)
    b.restore(a.state())
    assert isinstance(a.state(), PolicyState)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert bool((pa == pb).all())
    with pytest.raises(ValueError, match="no model"):
        b.restore(None)


# -- an episode of several segments (a gateway agent whose history was not linear)


def _turn(input_ids: list[int], completion: list[int], fresh: bool = False) -> Turn:
    return Turn(input_ids=input_ids, completion_ids=completion,
                logprobs=[-1.0 - 0.25 * i for i in range(len(completion))], policy_version=0,
                fresh_context=fresh)


SPEC = plugins.task("guess_number").sample(random.Random(0))


def _episode(index: int, turns: list[Turn], reward: float) -> Episode:
    t = Trajectory(episode_id=f"g/{index}", group_id="g", index=index, group_size=2,
                   task="guess_number", spec=SPEC, turns=turns)
    return Episode.of(ScoredTrajectory(trajectory=t, reward=reward), {})


# two calls extending each other, then one whose context was trimmed, and one extending it
SEGMENTED = [_turn([3, 4, 5], [6, 7]), _turn([8], [9, 10]),
             _turn([3, 4, 11, 12], [13, 14], fresh=True), _turn([15], [16])]


def test_each_segment_is_a_sequence_with_the_episodes_advantage() -> None:
    work = packed(_episode(0, SEGMENTED, 1.0), 0.5)
    lp = [-1.0, -1.25]
    assert work == [
        Work([3, 4, 5, 6, 7, 8, 9, 10], [False] * 3 + [True] * 2 + [False] + [True] * 2,
             [0.0] * 3 + lp + [0.0] + lp, 0.5, "g/0"),
        Work([3, 4, 11, 12, 13, 14, 15, 16], [False] * 4 + [True] * 2 + [False, True],
             [0.0] * 4 + lp + [0.0, -1.0], 0.5, "g/0"),
    ]
    linear = packed(_episode(1, SEGMENTED[:2], 0.0), -0.5)
    whole, per_sequence = episode_counts(work + linear)
    assert whole == Whole(tokens=4 + 3 + 4, episodes=2)
    assert per_sequence == [7.0, 7.0, 4.0]


@pytest.mark.parametrize("norm", ["token", "sequence", "dr_grpo"])
def test_a_step_trains_every_segment_of_an_episode(folder: Path, norm: str) -> None:
    world = Scripted()
    t = Trainer(LearnerSettings(model_path=folder, torch_threads=None, loss_norm=norm), world)
    before = [p.detach().clone() for p in t.model.parameters()]
    group = ScoredGroup("g", "guess_number", "train",
                        (_episode(0, SEGMENTED, 1.0), _episode(1, SEGMENTED[:2], 0.0)), 0)
    stats = t.step([group], version=0)
    (order,) = world.sent
    assert isinstance(order, TrainOrder)
    assert [(len(w.ids), w.advantage > 0) for w in order.work] == [(8, True), (8, True),
                                                                  (8, False)]
    assert stats.segments == 3 and stats.masks.trained == 2 and stats.episodes == 2
    assert stats.update is not None and math.isfinite(stats.update.loss)
    assert stats.tokens == 8 + 8 + 8
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))


def _spanning_group() -> ScoredGroup:
    """Two episodes begun at v0; one's second turn was sampled by v1 (first token) and v4
    (the rest: an in-flight update inside the completion), the other stayed at v0."""
    def episode(index: int, spans: list[tuple[int, int]] | None) -> Episode:
        turns = [_turn([3, 4, 5], [6, 7])]
        first = spans[0][0] if spans else 0
        turns.append(Turn(input_ids=[8], completion_ids=[9, 10], logprobs=[-1.0, -1.25],
                          policy_version=first, version_spans=spans))
        t = Trajectory(episode_id=f"g/{index}", group_id="g", index=index, group_size=2,
                       task="guess_number", spec=SPEC, turns=turns)
        return Episode.of(ScoredTrajectory(trajectory=t, reward=float(index)), {})
    return ScoredGroup("g", "guess_number", "train",
                       (episode(0, [(1, 1), (4, 1)]), episode(1, None)), 0)


def test_staleness_counts_from_the_oldest_token_unless_set_to_the_newest(folder: Path) -> None:
    group = _spanning_group()
    oldest = trainer(folder, Scripted())
    # learner at v5, bound 2: both episodes' oldest token (v0) is 5 behind: both stale
    assert [s.cause for s in oldest.samples([group], version=5)] == ["stale", "stale"]
    # within the bound from the oldest token: a multi-version episode trains as it is
    assert [s.cause for s in oldest.samples([group], version=2)] == [None, None]
    newest = Trainer(LearnerSettings(model_path=folder, torch_threads=None,
                                     staleness_from="newest"), Scripted())
    got = newest.samples([group], version=5)
    # the spanning episode's newest token is v4 (1 behind): it trains; the other is all v0
    assert [(s.cause, s.staleness) for s in got] == [(None, 1), ("stale", 5)]
