"""TensorBoard event files, written with torch's SummaryWriter (torch is the learner's own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlbus.tracking.base import Destination, Param, integer_bins


class TensorBoardSink:
    """One event-file folder per run: ``<folder>/tensorboard/<run>``."""

    def __init__(self, where: Destination) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = where.folder / "tensorboard" / where.run
        self._writer: Any = SummaryWriter(log_dir=str(self.folder))

    def hyperparameters(self, params: Mapping[str, Param]) -> None:
        # the HParams dashboard's summaries in the run's own folder; add_hparams would
        # open a second run folder for them
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(dict(params), {}):  # type: ignore[no-untyped-call]
            self._writer.file_writer.add_summary(summary)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def histogram(self, name: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        edges, _ = integer_bins(values)
        self._writer.add_histogram(name, np.asarray(values, dtype=float), step, bins=edges)

    def close(self) -> None:
        self._writer.close()
