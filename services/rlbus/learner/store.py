"""Weight store and checkpoint: files written so that a crash never leaves a torn one.

Weights: ``<weights_dir>/v<version>/model.safetensors`` plus its sha256, which the
WeightVersion carries and the engines verify before loading. Checkpoint:
``<checkpoint_dir>/checkpoint.pt``, a :class:`Checkpoint` saved by ``torch.save`` as a plain
dict of its fields (so that ``torch.load`` alone reads it, as the tests and tools do),
written to a temporary file, fsynced and renamed.

Checkpoint formats: 2 carries ``format_version`` (its dataset position fields came later,
with defaults, so older format-2 files load); 1 is the same fields without it (and, in
the oldest files, without the ledger and counters), with offsets as ``[[topic, partition],
offset]`` pairs. Both load; anything else is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from torch import nn

from rlbus.client import Position
from rlbus.client.tensors import prepare, write_version
from rlbus.errors import FatalError
from rlbus.messages import MASK_CAUSES


def save_weights(model: nn.Module, weights_dir: Path, version: int, keep: int) -> tuple[Path, str]:
    """Write version ``version``; returns (folder, sha256). Keeps the newest ``keep``.
    The store's writer for tools and benchmarks, without the checks: the same writer as
    :meth:`rlbus.client.RolloutClient.publish_weights`, which a trainer (the learner
    included) publishes through."""
    return write_version(prepare(model), weights_dir, version, keep, prefer=set())


CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT: Final = 2
"""The format this learner writes; it reads this one and format 1."""


class CheckpointError(FatalError, ValueError):
    """A checkpoint file this learner cannot resume from: unreadable, of an unknown format,
    or not of the format's shape. The message names the file."""


def _state_dict(value: object) -> dict[str, Any]:
    # kept as it is, not copied: a torch state dict carries _metadata that load_state_dict reads
    if not isinstance(value, dict):
        raise ValueError(f"a torch state dict is a dict, not a {type(value).__name__}")
    return value


StateDict = Annotated[dict[str, Any], PlainValidator(_state_dict)]


@dataclass(frozen=True)
class PolicyState:
    """What a checkpoint keeps of the trainer: its model's and optimizer's state dicts."""

    model: dict[str, Any]
    optimizer: dict[str, Any]


class Checkpoint(BaseModel):
    """Everything a restarted learner resumes from (see :mod:`rlbus.learner.service`).
    ``offsets``, ``trained``, ``next_index``, ``step`` and ``version`` are the fields of the
    client's :class:`~rlbus.client.Position` (:meth:`of`, :meth:`position`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format_version: Literal[2] = CHECKPOINT_FORMAT
    model: StateDict | None = None
    """The policy's state dict; None from the synthetic trainer, which has no model."""
    optimizer: StateDict | None = None
    step: int = Field(ge=0)
    """Optimizer steps taken."""
    version: int = Field(ge=0)
    """The policy version of the weights after ``step``."""
    next_index: int = Field(ge=0)
    """The feeder's next prompt group index."""
    offsets: dict[tuple[str, int], int]
    """Per (topic, partition) of scored: every episode below the offset is trained."""
    trained: list[str]
    """Ids of the groups trained (the newest 100k): later copies are dropped."""
    ledger: list[list[str]]
    """Per step of the last ``ledger_steps``: the episode ids it trained on."""
    ledger_first_step: int
    """The step of ``ledger[0]`` (1-based)."""
    episodes_trained: int = Field(ge=0)
    masked_by_cause: dict[str, int]
    """Episodes masked so far, by cause (:data:`~rlbus.messages.MASK_CAUSES`)."""
    dataset_epoch: int = Field(default=0, ge=0)
    """The training dataset's epoch the feeder is in (0 without a dataset)."""
    dataset_index: int = Field(default=0, ge=0)
    """Rows of that epoch's permutation the feeder has sent or dead-lettered: with
    ``next_index``, where a resumed feeder goes on."""

    @classmethod
    def of(cls, policy: PolicyState | None, position: Position | None = None,
           **fields: Any) -> Checkpoint:
        """A checkpoint of the trainer's ``policy``, the client's ``position`` (its
        offsets, trained group ids, prompt count, steps and version) and the learner's
        other ``fields``."""
        if position is not None:
            topic = position.topic or ""
            fields |= {"offsets": {(topic, p): o for p, o in position.offsets.items()},
                       "trained": list(position.taken), "next_index": position.submitted,
                       "version": position.version}
        if policy is None:
            return cls(**fields)
        return cls(model=policy.model, optimizer=policy.optimizer, **fields)

    def position(self, topic: str) -> Position:
        """The client position this checkpoint holds, for the scored topic ``topic``
        (offsets of any other topic, from a run under another prefix, are left out)."""
        return Position(topic=topic, taken=self.trained, submitted=self.next_index,
                        steps=self.step, version=self.version,
                        offsets={p: o for (t, p), o in self.offsets.items() if t == topic})

    @property
    def policy(self) -> PolicyState | None:
        if self.model is None or self.optimizer is None:
            return None
        return PolicyState(self.model, self.optimizer)


def save_checkpoint(checkpoint_dir: Path, checkpoint: Checkpoint) -> Path:
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / CHECKPOINT
    tmp = checkpoint_dir / f".{CHECKPOINT}.tmp"
    with tmp.open("wb") as f:
        torch.save(dict(checkpoint), f)  # the fields, not the class: torch.load reads it
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(checkpoint_dir: Path) -> Checkpoint | None:
    """The checkpoint in ``checkpoint_dir``, None if there is none; a
    :class:`CheckpointError` if it cannot be resumed from."""
    path = checkpoint_dir / CHECKPOINT
    if not path.exists():
        return None
    try:
        # weights_only: tensors, containers and numbers only; a checkpoint file that would
        # run code when unpickled (a tampered or foreign one) is refused, not executed
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint: {exc}") from exc
    return read_checkpoint(raw, path)


def read_checkpoint(raw: object, path: Path) -> Checkpoint:
    """``raw`` (what ``torch.load`` gave from ``path``) as a :class:`Checkpoint`, of any
    format this learner reads."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: a checkpoint holds a dict, not a {type(raw).__name__}")
    version = raw.get("format_version", 1)
    if not isinstance(version, int) or version not in _UPGRADES:
        raise CheckpointError(f"{path}: checkpoint format_version {version!r} is not one this "
                              f"learner reads ({', '.join(map(str, _UPGRADES))})")
    try:
        return Checkpoint.model_validate(_UPGRADES[version](raw))
    except ValidationError as exc:
        raise CheckpointError(f"{path}: not a format {version} learner checkpoint: {exc}") from exc


def _upgrade_v1(raw: dict[str, Any]) -> dict[str, Any]:
    """Format 1 as format 2: the version field, offsets as a mapping, and the defaults the
    learner used for the fields the oldest format-1 files lack."""
    ledger, step = raw.get("ledger", []), raw.get("step")
    out = {**raw, "format_version": CHECKPOINT_FORMAT, "ledger": ledger,
           "offsets": _offset_pairs(raw.get("offsets"))}
    masked = raw.get("masked_by_cause", {})
    if isinstance(masked, dict):
        out["masked_by_cause"] = {**dict.fromkeys(MASK_CAUSES, 0), **masked}
    if "episodes_trained" not in raw and isinstance(ledger, list):
        out["episodes_trained"] = sum(len(s) for s in ledger if isinstance(s, list))
    if "ledger_first_step" not in raw and isinstance(step, int) and isinstance(ledger, list):
        out["ledger_first_step"] = step - len(ledger) + 1
    return out


def _offset_pairs(offsets: object) -> object:
    """``[[topic, partition], offset]`` pairs as a mapping; anything else unchanged, for
    validation to refuse."""
    if not isinstance(offsets, list):
        return offsets
    pairs: dict[tuple[str, int], int] = {}
    for pair in offsets:
        if not (isinstance(pair, list | tuple) and len(pair) == 2
                and isinstance(pair[0], list | tuple) and len(pair[0]) == 2):
            return offsets
        pairs[(pair[0][0], pair[0][1])] = pair[1]
    return pairs


_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _upgrade_v1,
    CHECKPOINT_FORMAT: lambda raw: raw,
}
