import time

import pytest

from rlbus.tracking.wandb_sink import WandbSink, wandb_mode
from tests.unit.tracking.conftest import PARAMS, ROWS, write
from tests.unit.tracking.readers import wandb_config, wandb_history

pytest.importorskip("wandb")


def test_offline_run_files_read_back(where):
    t0 = time.monotonic()
    write(WandbSink(where))
    assert time.monotonic() - t0 < 20  # measured 0.7 s on the 2-core dev machine
    history = wandb_history(where.folder)
    for step, row in enumerate(ROWS, start=1):
        assert {k: history[step][k] for k in row} == row
    hist = history[2]
    assert hist["staleness/_type"] == "histogram"
    assert hist["staleness/bins"] == [-0.5, 0.5, 1.5, 2.5]  # one bin per version
    assert hist["staleness/values"] == [1, 2, 1]
    config = wandb_config(where.folder)
    assert {k: config[k] for k in PARAMS} == PARAMS


@pytest.mark.parametrize(("configured", "env", "mode"), [
    ("online", {}, "online"),
    (None, {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, None),  # wandb reads it
    (None, {"WANDB_API_KEY": "k"}, "online"),
    (None, {}, "offline"),  # no account: local run files
])
def test_mode_is_offline_unless_an_account_is_configured(monkeypatch, configured, env, mode):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert wandb_mode(configured) == mode
