"""The cost benchmark end to end at tiny sizes: every part runs and its figures are
consistent with each other. No timing is checked."""

import json

import pytest

from loadtest.cost_bench import LAYERS, SMOKE_SHAPES, SMOKE_WEIGHT_MB, scenario
from tests.support.benchmarks import run_smoke

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def cost(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("cost")
    stdout = run_smoke("loadtest.cost_bench", kafka_bootstrap, out, timeout_s=180)
    return stdout, json.loads((out / "cost.json").read_text())


def test_every_part_and_the_machine_are_recorded(cost):
    stdout, results = cost
    assert {"cpus", "loadavg", "platform"} <= set(results["machine"])
    assert len(results["trajectories"]["loadavg_after"]) == 3
    assert len(results["weights"]["loadavg_after"]) == 3
    assert "trajectories: codec per message" in stdout and "weight publication" in stdout


def test_trajectory_bytes_grow_with_tokens(cost):
    rows = cost[1]["trajectories"]["rows"]
    assert [r["shape"]["tokens"] for r in rows] == [s.tokens for s in SMOKE_SHAPES]
    for key in (lambda r: r["codec"]["bytes"], lambda r: r["codec"]["last_step"]["bytes"],
                lambda r: r["e2e"]["traffic"]["per_episode"]["step_requests"]["bytes"],
                lambda r: r["e2e"]["traffic"]["per_episode"]["trajectories"]["bytes"]):
        sizes = [key(r) for r in rows]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_every_message_produced_was_consumed_and_decoded(cost):
    for r in cost[1]["trajectories"]["rows"]:
        b = r["broker"]
        assert b["bytes"] == r["codec"]["bytes"]  # what the producer sent is the codec's
        assert b["decoded"] == b["equal_to_sent"] == b["messages"] > 0
        assert set(r["codec_share"]) == {"produce", "consume"}


def test_end_to_end_episodes_have_the_shape_asked_for(cost):
    for shape, r in zip(SMOKE_SHAPES, cost[1]["trajectories"]["rows"], strict=True):
        e, s = r["e2e"], scenario(shape, smoke=True)
        assert e["run"]["samples_trained"] == s.samples
        assert e["run"]["duplicates_dropped"] == 0 and e["run"]["masked"] == 0
        traffic = e["traffic"]
        assert traffic["episodes"] >= s.samples
        assert traffic["tokens_mean"] == e["expected_tokens"]
        per = traffic["per_episode"]
        assert per["step_requests"]["records"] == per["step_results"]["records"] == shape.turns
        assert per["trajectories"]["records"] == per["scored"]["records"] == 1
        assert {"rollout-0", "inference-0", "reward-0"} <= set(e["cpu_ms_per_episode"])


def test_loaded_weights_equal_the_saved_ones(cost):
    rows = cost[1]["weights"]["rows"]
    assert [r["target_mb"] for r in rows] == list(SMOKE_WEIGHT_MB)
    for r in rows:
        assert r["loaded_equal"] is True
        assert r["params"] == LAYERS * r["width"] ** 2
        assert r["bytes"] > 4 * r["params"]  # fp32, plus the safetensors header
    assert [r["bytes"] for r in rows] == sorted(r["bytes"] for r in rows)
