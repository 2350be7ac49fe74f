"""The three parts of a load test; each returns its results and prints its table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.baseline import run_synchronous
from loadtest.fleet import run_decoupled
from loadtest.overhead import measure
from loadtest.scenario import Scenario


def say(text: str) -> None:
    print(f"[loadtest] {text}", flush=True)


def comparison(s: Scenario, bootstrap: str, out: Path, profile: bool) -> dict[str, Any]:
    """Decoupled over Kafka, then the synchronous baseline, on the same scenario."""
    say(f"comparison on {s.name}: decoupled arm ({s.steps} steps of {s.batch} samples)")
    decoupled = run_decoupled(s, bootstrap, out / "comparison-decoupled", profile)
    say(f"comparison on {s.name}: synchronous arm")
    sync = run_synchronous(s)
    result = report.comparison_summary(decoupled, sync, s.describe())
    result["plot"] = str(report.plot_over_time(result, out / "throughput_over_time.png"))
    print(report.comparison_table(result), flush=True)
    return result


def overhead(s: Scenario, bootstrap: str, out: Path, profile: bool, smoke: bool) -> dict[str, Any]:
    """Round trip and sustained steps/s of the Kafka path (shorter with ``smoke``)."""
    say(f"Kafka path overhead on {s.name}")
    result = measure(s, bootstrap, out / "overhead", trips=50 if smoke else 2000,
                     window_s=2.0 if smoke else 10.0, warmup_s=0.5 if smoke else 3.0,
                     profile=profile)
    print(report.overhead_table(result), flush=True)
    return result


def scaling(s: Scenario, bootstrap: str, out: Path, profile: bool) -> dict[str, Any]:
    """The decoupled arm once per rollout process count in ``s.scaling``."""
    runs = []
    for n in s.scaling:
        say(f"scaling on {s.name}: {n} rollout process(es)")
        scaled = s.with_rollouts(n)
        runs.append((run_decoupled(scaled, bootstrap, out / f"scaling-{n}", profile),
                     scaled.describe()))
    rows = report.scaling_rows(runs)
    plot = report.plot_scaling(s.name, rows, out / "scaling.png")
    print(report.scaling_table(s.name, rows), flush=True)
    return {"scenario": s.name, "runs": rows, "plot": str(plot)}
