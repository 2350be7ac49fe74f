"""The GRPO trainer: rank 0 and the followers exchange typed orders, and it resumes only from a
checkpoint that holds a policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlbus.learner.distributed import World
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.store import PolicyState
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.learner.trainer import Trainer
from rlbus.learner.work import Release, TrainOrder, Work


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
