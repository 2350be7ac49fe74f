"""The demo's summary: when greedy success first reached the target, and at what cost."""

from rlbus.ops.progress import first_at_target, summarize


def rows() -> list[dict]:
    train = [{"step": s, "time": 10.0 * s, "episodes_trained": 16 * s, "success_rate": 0.5,
              "reward_mean": 1.0} for s in range(1, 7)]
    evals = [{"step": 3, "time": 31.5, "episodes_trained": 48, "eval_at_step": 2,
              "eval_success": 0.79},
             {"step": 5, "time": 51.0, "episodes_trained": 80, "eval_at_step": 4,
              "eval_success": 0.81},
             {"step": 6, "time": 61.0, "episodes_trained": 96, "eval_at_step": 6,
              "eval_success": 0.9}]
    return sorted(train + evals, key=lambda r: r["time"])


def test_first_eval_at_the_target_counts_the_training_up_to_its_step() -> None:
    # the round of step 4 came back during step 5: the cost is step 4's, not the arrival's
    assert first_at_target(rows()) == {"step": 4, "success": 0.81, "training_seconds": 40.0,
                                       "episodes_trained": 64}
    assert first_at_target(rows(), target=0.95) is None
    summary = summarize(rows(), "finished", 70.0, {})
    assert summary["greedy_target"]["step"] == 4
    assert summary["eval_success"] == {2: 0.79, 4: 0.81, 6: 0.9}
