"""The staleness sweep end to end on the smoke scenario: both modes run, every step is a
full batch, and what trained and what was masked add up. No timing is checked."""

import json

import pytest

from loadtest.scenario import load
from rlbus.messages import MASK_CAUSES
from tests.support.benchmarks import run_smoke

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_both_modes_run_and_account_for_every_sample(kafka_bootstrap, tmp_path):
    stdout = run_smoke("loadtest.staleness_sweep", kafka_bootstrap, tmp_path, timeout_s=180)
    results = json.loads((tmp_path / "sweep.json").read_text())
    runs = results["runs"]
    assert [(r["max_staleness"], r["mode"]) for r in runs] == [(1, "wait"), (1, "mask")]
    batch = load("smoke").batch
    for r in runs:
        assert len(r["rows"]) == 6
        assert sum(int(x["episodes"]) for x in r["rows"]) == 6 * batch  # every step full
        assert r["trained"] == sum(int(x["trained"]) for x in r["rows"]) > 0
        assert r["masked"] == sum(int(x["masked"]) for x in r["rows"])
        assert set(r["masked_by_cause"]) == set(MASK_CAUSES)
    assert runs[1]["waited_s"] == 0  # masking never holds a step
    assert "max_staleness" in stdout and "of ideal" in stdout
