"""The sinks a setting names, opened together; every call goes to each of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rlbus.tracking.base import Destination, Param, Tracker, require
from rlbus.tracking.mlflow_sink import MlflowSink
from rlbus.tracking.tensorboard_sink import TensorBoardSink
from rlbus.tracking.wandb_sink import WandbSink

_OPENERS: dict[str, Callable[[Destination], Tracker]] = {
    "tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


class Composite:
    """A :class:`~rlbus.tracking.base.Tracker` over several; none at all is a no-op."""

    def __init__(self, sinks: Sequence[Tracker]) -> None:
        self.sinks = list(sinks)

    def hyperparameters(self, params: Mapping[str, Param]) -> None:
        for sink in self.sinks:
            sink.hyperparameters(params)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.scalars(values, step)

    def histogram(self, name: str, values: Sequence[float], step: int) -> None:
        if values:
            for sink in self.sinks:
                sink.histogram(name, values, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_tracker(names: Sequence[str], where: Destination) -> Composite:
    """The named sinks (see :data:`~rlbus.tracking.base.SINKS`), opened at ``where``."""
    require(names)
    return Composite([_OPENERS[name](where) for name in names])
