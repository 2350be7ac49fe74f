"""The tracking interface: what the learner hands a sink, and the helpers every sink uses."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args

from rlbus.errors import FatalError

TrackingSink = Literal["tensorboard", "wandb", "mlflow"]
"""The sinks ``RLBUS_TRACKING`` may name."""
SINKS: tuple[str, ...] = get_args(TrackingSink)
WandbMode = Literal["offline", "online", "disabled"]

# the module each sink needs, and the extra that installs it
_LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

Param = str | int | float | bool
"""A hyperparameter's value as every sink stores it."""


class TrackingUnavailableError(FatalError, ImportError):
    """A sink is named whose library is not installed; the message says which extra to add."""


class Tracker(Protocol):
    """Where a run's figures go besides ``metrics.jsonl``. Calls come from one thread."""

    def hyperparameters(self, params: Mapping[str, Param]) -> None:
        """The run's resolved settings, once, before the first step."""

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Figures of one optimizer step (a metrics row), by their metrics names."""

    def histogram(self, name: str, values: Sequence[float], step: int) -> None:
        """A distribution at a step (the staleness of the step's episodes)."""

    def close(self) -> None:
        """Flush everything written and end the run."""


@dataclass(frozen=True)
class Destination:
    """Where and under which names the sinks write."""

    folder: Path
    """Each sink writes below it by default: ``tensorboard/``, ``wandb/``, ``mlruns/``."""
    project: str
    """W&B project, MLflow experiment."""
    run: str
    """The run's name in every sink (TensorBoard: its folder under ``tensorboard/``)."""
    wandb_mode: WandbMode | None
    """offline, online or disabled; None: wandb's own ``WANDB_MODE``."""
    mlflow_uri: str
    """MLflow tracking URI."""


def require(names: Sequence[str]) -> None:
    """Raise :class:`TrackingUnavailableError` for the first named sink whose library is not
    installed, before any work starts (a run should not train for an hour, then fail)."""
    for name in names:
        if importlib.util.find_spec(_LIBRARIES[name]) is None:
            raise TrackingUnavailableError(
                f"RLBUS_TRACKING names {name}, but its library is not installed: "
                f"pip install 'rlbus[{name}]'")


def flatten(tree: Mapping[str, object], prefix: str = "") -> dict[str, Param]:
    """Nested settings as ``section.field`` keys; None and lists as text (no sink takes them)."""
    flat: dict[str, Param] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, name + ".")
        elif isinstance(value, str | int | float | bool):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def integer_bins(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Edges and counts of one bin per integer from min to max: staleness is a whole number
    of versions, and a bin per version reads exactly where default bins would smear."""
    low, high = int(min(values)), int(max(values))
    edges = [k - 0.5 for k in range(low, high + 2)]
    counts = [0] * (high - low + 1)
    for v in values:
        counts[int(v) - low] += 1
    return edges, counts
