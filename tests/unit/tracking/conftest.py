import pytest

from rlbus.tracking.base import Destination

# two steps' figures as the learner writes them, the second with a histogram
ROWS = [{"loss": 0.5, "reward_mean": 0.25, "masked_stale": 0.0},
        {"loss": -0.125, "reward_mean": 0.75, "masked_stale": 2.0}]
STALENESS = [0.0, 1.0, 1.0, 2.0]
PARAMS = {"lr": 0.001, "kafka.bootstrap": "h:9092", "kafka.sasl_password": "**********",
          "feed": True, "max_steps": 3}


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A destination in the test's folder; W&B kept off the network and out of $HOME."""
    for name, sub in {"WANDB_CONFIG_DIR": "wandb-config", "WANDB_CACHE_DIR": "wandb-cache",
                      "WANDB_DATA_DIR": "wandb-data"}.items():
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return Destination(folder=tmp_path / "run", project="proj", run="r1", wandb_mode="offline",
                       mlflow_uri=(tmp_path / "run" / "mlruns").as_uri())


def write(sink):
    """Hyperparameters, two steps of scalars and a histogram at step 2, then close."""
    sink.hyperparameters(PARAMS)
    for step, row in enumerate(ROWS, start=1):
        sink.scalars(row, step)
    sink.histogram("staleness", STALENESS, 2)
    sink.close()
