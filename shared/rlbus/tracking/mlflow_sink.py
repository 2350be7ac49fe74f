"""MLflow: a run in a tracking store, a local file store under the run folder by default."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlbus.tracking.base import Destination, Param

_PARAMS_PER_BATCH = 100  # MLflow refuses a log_batch with more params than this


class MlflowSink:
    """One MLflow run in experiment ``project``, written through a client of its own (no
    global active run, so nothing else in the process is affected)."""

    def __init__(self, where: Destination) -> None:
        if where.mlflow_uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode behind this opt-in; it is the
            # one store that needs no database (mlflow-skinny has no SQLAlchemy)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client: Any = MlflowClient(tracking_uri=where.mlflow_uri)
        experiment = self._client.get_experiment_by_name(where.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(where.project))
        self.run_id: str = self._client.create_run(experiment_id, run_name=where.run).info.run_id

    def hyperparameters(self, params: Mapping[str, Param]) -> None:
        from mlflow.entities import Param as MlflowParam

        items = [MlflowParam(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[i:i + _PARAMS_PER_BATCH])

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def histogram(self, name: str, values: Sequence[float], step: int) -> None:
        """MLflow has no histogram: its summary figures instead."""
        self.scalars({f"{name}/min": min(values), f"{name}/mean": statistics.fmean(values),
                      f"{name}/max": max(values)}, step)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
