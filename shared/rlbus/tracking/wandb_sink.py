"""Weights & Biases: offline run files unless the user has an account configured."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlbus.tracking.base import Destination, Param, WandbMode, integer_bins


def wandb_mode(configured: WandbMode | None) -> WandbMode | None:
    """``configured``, else None where ``WANDB_MODE`` is set (wandb reads it), else online
    where an API key is set, else offline: a run with no account writes its files locally
    (``wandb sync`` uploads them later)."""
    if configured or os.environ.get("WANDB_MODE"):
        return configured
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """One W&B run under ``<folder>/wandb``."""

    def __init__(self, where: Destination) -> None:
        import wandb

        where.folder.mkdir(parents=True, exist_ok=True)
        # no console capture, system stats, git or code snapshot: the learner's log is its own
        # and a run should not pay W&B's probes of the machine
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, disable_code=True, silent=True)
        self._run: Any = wandb.init(project=where.project, name=where.run, dir=str(where.folder),
                                    mode=where.wandb_mode, settings=settings, reinit="create_new")
        self._wandb = wandb

    def hyperparameters(self, params: Mapping[str, Param]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def histogram(self, name: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        edges, counts = integer_bins(values)
        histogram = self._wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))
        self._run.log({name: histogram}, step=step)

    def close(self) -> None:
        # offline, finish() returns before wandb's service process has written the run file
        # (measured: records missing under load); teardown waits for that process to end
        self._run.finish()
        self._wandb.teardown()
