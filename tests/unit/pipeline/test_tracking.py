"""A short learner run on the in-memory bus writes the same rows to every tracker."""

import json

import pytest

from rlbus.learner.tiny_model import build_tiny_model
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from tests.pipeline import bus_factory, run_pipeline, settings
from tests.unit.tracking.readers import (
    mlflow_history,
    mlflow_run,
    tensorboard_histogram,
    tensorboard_hparams,
    tensorboard_scalars,
    wandb_config,
    wandb_history,
)

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.mark.slow
async def test_every_metrics_row_reaches_every_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = build_tiny_model(tmp_path / "model")
    topics = TopicSettings(prefix="trk", partitions=1, result_partitions=1)
    s = settings(model, tmp_path, {"topics": topics, "kafka": {"sasl_password": "hunter2"}},
                 max_steps=2, groups_per_step=1, group_size=2, run_name="trk-run",
                 tracking="tensorboard,wandb,mlflow", eval_every=1, eval_episodes=2)
    await run_pipeline(s, bus_factory(MemoryBus, broker=memory_broker(topics)))

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 2 and any("eval_success" in r for r in rows)
    expected = _by_key(rows)
    assert {"publish_s", "episodes_per_s", "tokens_per_s", "masked_stale"} <= set(expected)

    tb = tensorboard_scalars(tmp_path / "tensorboard" / "trk-run")
    wb = wandb_history(tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    for key, by_step in expected.items():
        assert tb[key] == pytest.approx(by_step), key
        assert {step: wb[step][key] for step in by_step} == pytest.approx(by_step), key
        assert mlflow_history(uri, "rlbus", key) == pytest.approx(by_step), key
    for step in (1, 2):
        hist = tensorboard_histogram(tmp_path / "tensorboard" / "trk-run", "staleness")[step]
        assert hist.num == 2  # one group of two episodes per step
        assert wb[step]["staleness/_type"] == "histogram"
    assert set(mlflow_history(uri, "rlbus", "staleness/max")) == {1, 2}

    hparams = tensorboard_hparams(tmp_path / "tensorboard" / "trk-run")
    _, run = mlflow_run(uri, "rlbus")
    config = wandb_config(tmp_path)
    for params in (hparams, run.data.params, config):
        assert float(params["group_size"]) == 2  # TensorBoard keeps numbers as floats
        assert params["kafka.sasl_password"] == "**********"  # never the secret
        assert "hunter2" not in json.dumps(params, default=str)


def _by_key(rows):
    """{key: {step: value}} of every numeric figure; an eval row and a training row of the
    same step carry different keys, except bookkeeping the trackers see twice."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time", "episodes_trained") and isinstance(value, int | float):
                out.setdefault(key, {})[row["step"]] = value
    return out
