"""The load-test harness end to end on the smoke scenario (no timing is checked)."""

import json

import pytest

from loadtest.scenario import load
from tests.support.benchmarks import run_smoke

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke_run(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("loadtest")
    stdout = run_smoke("loadtest", kafka_bootstrap, out, timeout_s=240)
    return out, stdout, json.loads((out / "results.json").read_text())


def test_both_arms_train_every_sample_once(smoke_run):
    _, stdout, results = smoke_run
    s = load("smoke")
    comparison = results["comparison"]
    for arm in ("decoupled", "synchronous"):
        assert comparison[arm]["samples_trained"] == s.steps * s.groups_per_step * s.group_size
        assert [r["step"] for r in comparison[arm]["rows"]] == list(range(1, s.steps + 1))
        assert 0.0 <= comparison[arm]["learner_busy"] <= 1.0
    assert comparison["decoupled"]["duplicates_dropped"] == 0
    assert comparison["ratio"] > 0
    assert comparison["bounds"]["bottleneck"] in ("rollout", "inference", "learner")
    assert "ratio decoupled/synchronous" in stdout


def test_overhead_and_scaling_are_reported(smoke_run):
    _, stdout, results = smoke_run
    rtt, rate = results["overhead"]["round_trip"], results["overhead"]["sustained"]
    assert rtt["n"] == 50 and 0 < rtt["p50_ms"] <= rtt["p99_ms"]
    assert rate["steps_per_s"] >= 0
    assert set(rate["cpu_cores"]) == {"inference-0", "rollout-0", "machine"}
    runs = results["scaling"]["runs"]
    assert [r["rollout_instances"] for r in runs] == load("smoke").scaling
    assert all(r["run"]["samples_trained"] == load("smoke").samples for r in runs)
    assert "scaling the rollout tier" in stdout and "steps/s" in stdout


def test_plots_are_png_files(smoke_run):
    out, _, results = smoke_run
    for name in ("throughput_over_time.png", "scaling.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert results["comparison"]["plot"] == str(out / "throughput_over_time.png")
