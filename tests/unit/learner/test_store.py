"""The checkpoint is a typed, versioned model read back strictly: a file of another format or
shape is refused with an error naming it; files of format 1 (before the version field) load."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.store import (
    CHECKPOINT,
    Checkpoint,
    CheckpointError,
    PolicyState,
    load_checkpoint,
    save_checkpoint,
)
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus

TOPICS = TopicSettings(prefix="ck", partitions=1, result_partitions=1)


def fields(**over: Any) -> dict[str, Any]:
    """A checkpoint's learner fields, as the learner fills them."""
    return {"step": 3, "version": 4, "next_index": 6, "offsets": {("scored", 0): 12},
            "trained": ["run/0", "run/1"], "ledger": [["run/1/0", "run/1/1"]],
            "ledger_first_step": 3, "episodes_trained": 6,
            "masked_by_cause": {"stale": 1, "failed": 0, "invalid": 2},
            "dataset_epoch": 1, "dataset_index": 5} | over


def write(folder: Path, raw: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(raw, folder / CHECKPOINT)
    return folder / CHECKPOINT


def test_a_checkpoint_round_trips_and_stays_a_plain_dict_on_disk(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    policy = PolicyState(model.state_dict(), optimizer.state_dict())
    path = save_checkpoint(tmp_path, Checkpoint.of(policy, **fields()))
    back = load_checkpoint(tmp_path)
    assert back is not None and back.policy is not None
    assert back.model_dump(exclude={"model", "optimizer"}) == {"format_version": 2, **fields()}
    torch.testing.assert_close(back.policy.model["weight"], model.weight.detach())
    raw = torch.load(path, weights_only=False)  # what tools and tests read without rlbus
    assert type(raw) is dict and raw["format_version"] == 2 and raw["ledger"] == fields()["ledger"]


def test_a_synthetic_learners_checkpoint_has_no_policy(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, Checkpoint.of(None, **fields()))
    back = load_checkpoint(tmp_path)
    assert back is not None and back.policy is None and back.model is None


def test_a_format_2_checkpoint_without_a_dataset_position_loads_at_its_start(
        tmp_path: Path) -> None:
    old = {k: v for k, v in fields().items() if not k.startswith("dataset_")}
    write(tmp_path, {"format_version": 2, **old})
    back = load_checkpoint(tmp_path)
    assert back is not None and (back.dataset_epoch, back.dataset_index) == (0, 0)


def test_no_file_is_no_checkpoint(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None


def test_a_format_1_checkpoint_loads(tmp_path: Path) -> None:
    """As the learner wrote it before the version field: offsets as pairs of lists."""
    v1 = fields(offsets=[[["scored", 0], 12], [["scored", 1], 7]])
    write(tmp_path, {"model": {"w": torch.zeros(1)}, "optimizer": {"state": {}}, **v1})
    back = load_checkpoint(tmp_path)
    assert back is not None and back.format_version == 2
    assert back.offsets == {("scored", 0): 12, ("scored", 1): 7}
    # a cause added since (bad_logprobs) counts from 0
    assert back.policy is not None
    assert back.masked_by_cause == {**v1["masked_by_cause"], "bad_logprobs": 0}


def test_the_oldest_format_1_checkpoint_gets_the_defaults_the_learner_used(
        tmp_path: Path) -> None:
    oldest = {"step": 2, "version": 2, "next_index": 4, "offsets": [], "trained": ["run/0"]}
    write(tmp_path, oldest)
    back = load_checkpoint(tmp_path)
    assert back is not None
    assert back.ledger == [] and back.episodes_trained == 0 and back.ledger_first_step == 3
    assert back.masked_by_cause == {"stale": 0, "failed": 0, "invalid": 0, "bad_logprobs": 0}


@pytest.mark.parametrize(("raw", "says"), [
    ({"format_version": 3, **fields()}, "format_version 3 is not one this learner reads"),
    ({"format_version": 2, **fields(), "learning_rate": 1e-6}, "learning_rate"),
    ({"format_version": 2, **fields(step="3")}, "step"),  # strict: no coercion
    ({k: v for k, v in fields().items() if k != "step"}, "step"),  # format 1, no step
    ({"format_version": 2, **fields(model=[1, 2], optimizer={})}, "model"),
    ([1, 2, 3], "not a list"),
])
def test_a_checkpoint_of_another_format_or_shape_is_refused_naming_the_file(
        tmp_path: Path, raw: object, says: str) -> None:
    path = write(tmp_path, raw)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tmp_path)
    assert str(path) in str(caught.value) and says in str(caught.value)


def test_an_unreadable_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT).write_bytes(b"\x80\x04 torn in half")
    with pytest.raises(CheckpointError, match=CHECKPOINT):
        load_checkpoint(tmp_path)


async def test_a_learner_will_not_start_from_a_checkpoint_it_cannot_read(tmp_path: Path) -> None:
    write(tmp_path / "ckpt", {"format_version": 9})
    settings = LearnerSettings(topics=TOPICS, trainer="synthetic", feed=False,
                               checkpoint_dir=tmp_path / "ckpt")
    learner = Learner(settings, MemoryBus(memory_broker(TOPICS)))
    with pytest.raises(CheckpointError, match="format_version 9"):
        await asyncio.wait_for(learner.run(), 30)


def test_a_checkpoint_holds_the_clients_position_in_its_own_fields(tmp_path: Path) -> None:
    from rlbus.client import Position

    position = Position(topic="ck.trajectories.scored", offsets={0: 12, 1: 7},
                        taken=["run/0", "run/1"], submitted=6, steps=3, version=4)
    learner = {k: v for k, v in fields().items()
               if k not in {"offsets", "trained", "next_index", "version"}}
    save_checkpoint(tmp_path, Checkpoint.of(None, position=position, **learner))
    back = load_checkpoint(tmp_path)
    assert back is not None and back.format_version == 2  # the format is unchanged
    assert back.offsets == {("ck.trajectories.scored", 0): 12, ("ck.trajectories.scored", 1): 7}
    assert back.position("ck.trajectories.scored") == position
    assert back.position("other.trajectories.scored").offsets == {}


class _RunsCode:
    """Unpickling this calls a function of the file's choosing: what a tampered checkpoint
    would do to a reader that trusts pickle."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Path.touch, (str(_RunsCode.marker),))

    marker = Path()


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_none(tmp_path: Path) -> None:
    _RunsCode.marker = tmp_path / "pwned"
    torch.save({**fields(), "model": _RunsCode()}, tmp_path / CHECKPOINT)
    with pytest.raises(CheckpointError, match=CHECKPOINT):
        load_checkpoint(tmp_path)
    assert not _RunsCode.marker.exists()
