"""The TRL benchmark end to end on the smoke scenario: both arms train, and what they
trained is counted from the batches TRL's loss read. No timing is checked."""

import json

import pytest

from loadtest.scenario import load
from tests.support.benchmarks import run_smoke

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
pytest.importorskip("trl", reason="the trl extra is not installed: pip install -e '.[trl]'")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 4  # the smoke mode's


def test_both_arms_train_and_are_reported_side_by_side(kafka_bootstrap, tmp_path):
    stdout = run_smoke("loadtest.trl_bench", kafka_bootstrap, tmp_path, timeout_s=240)
    results = json.loads((tmp_path / "results.json").read_text())
    batch = load("smoke").batch
    for arm in ("trl", "rlbus"):
        rows, summary = results[arm]["rows"], results[arm]["summary"]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        # every row TRL got either trained or was masked, a full batch per step
        assert summary["trained"] + summary["masked"] == STEPS * batch
        assert summary["trained"] > 0 and summary["trained_per_s"] > 0
        assert summary["steps_per_s"] > 0
    assert results["trl"]["summary"]["masked"] == 0  # nothing fails or goes stale in process
    assert results["trl"]["summary"]["staleness_mean"] == 0
    assert results["rlbus"]["adapter"]["calls"] == STEPS
    assert results["ratio_trained_per_s"] > 0
    assert "trl alone" in stdout and "trl + rlbus" in stdout and "trained/s" in stdout
    assert (tmp_path / "trained_over_time.png").read_bytes()[:8] == PNG_MAGIC
