"""Tables on stdout, ``results.json`` and PNG plots of a load-test run."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any

from loadtest.metrics import ArmResult
from rlbus.messages import MASK_CAUSES


def _f(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "-" * len(line), *body])


# --------------------------------------------------------------------------- comparison


def comparison_summary(
    decoupled: ArmResult, sync: ArmResult, bounds: dict[str, Any]
) -> dict[str, Any]:
    ideal = bounds["ideal_samples_per_s"]
    a, b = decoupled.throughput(), sync.throughput()
    return {
        "scenario": decoupled.scenario,
        "bounds": bounds,
        "decoupled": decoupled.to_json(),
        "synchronous": sync.to_json(),
        "ratio": a / b if b else None,
        "decoupled_vs_ideal": a / ideal if ideal else None,
    }


def comparison_table(c: dict[str, Any]) -> str:
    rows = []
    for arm in ("decoupled", "synchronous"):
        r = c[arm]
        rows.append([arm, str(r["samples_trained"]), _by_cause(r.get("masked_by_cause") or {}),
                     _f(r["throughput"]), _f(r["throughput_overall"]), _f(r["learner_busy"]),
                     _f(r["staleness_max"], 0), _f(r["wall_s"], 1)])
    b = c["bounds"]
    caps = ", ".join(f"{k} {v:.1f}" for k, v in b["capacities"].items())
    return "\n".join([
        f"comparison on scenario {c['scenario']!r} (samples that trained, and per second; "
        "steady state = warm-up and drain steps left out)",
        table(["arm", "trained", "masked " + "/".join(MASK_CAUSES), "steady/s", "overall/s",
               "learner busy", "stale max", "wall s"], rows),
        f"ratio decoupled/synchronous: {_f(c['ratio'] or 0)}x",
        f"ideal bound: {_f(b['ideal_samples_per_s'])} samples/s ({b['bottleneck']}-bound; "
        f"capacities: {caps}; the distribution's mean gives "
        f"{_f(b['expected_ideal_samples_per_s'])}); "
        f"decoupled reaches {_f(100 * (c['decoupled_vs_ideal'] or 0), 0)}%",
        f"environment step: median {_f(b['env_median_ms'], 0)} ms, p99 {_f(b['env_p99_ms'], 0)}"
        f" ms, mean {_f(b['env_mean_ms'], 0)} ms; {_f(b['turns_mean'], 1)} turns per episode",
    ])


# --------------------------------------------------------------------------- overhead


def overhead_table(o: dict[str, Any]) -> str:
    rtt, rate = o["round_trip"], o["sustained"]
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in rate["cpu_cores"].items())
    per_step = ", ".join(f"{k} {v:.3f}" for k, v in rate["cpu_ms_per_step"].items())
    return "\n".join([
        "Kafka path, zero-latency engine and environment",
        f"step round trip over loopback (n={rtt['n']}): p50 {_f(rtt['p50_ms'])} ms, "
        f"p99 {_f(rtt['p99_ms'])} ms, mean {_f(rtt['mean_ms'])} ms",
        f"one rollout + one inference process: {_f(rate['steps_per_s'], 0)} steps/s "
        f"(CPU cores busy, of {rate['cpus']}: {cpu})",
        f"CPU ms per step: {per_step} (machine - the two = broker and harness)",
    ])


# --------------------------------------------------------------------------- scaling


def scaling_rows(runs: list[tuple[ArmResult, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        {"rollout_instances": r.extra["rollout_instances"], "throughput": r.throughput(),
         "ideal": b["ideal_samples_per_s"], "bottleneck": b["bottleneck"],
         "learner_busy": r.busy(), "masked_by_cause": r.extra.get("masked_by_cause", {}),
         "capacities": b["capacities"], "run": r.to_json()}
        for r, b in runs
    ]


def scaling_table(scenario: str, rows: list[dict[str, Any]]) -> str:
    body = [[str(r["rollout_instances"]), _f(r["throughput"]), _f(r["ideal"]),
             _f(100 * r["throughput"] / r["ideal"], 0), r["bottleneck"], _f(r["learner_busy"]),
             _by_cause(r["masked_by_cause"])]
            for r in rows]
    return "\n".join([
        f"scaling the rollout tier on scenario {scenario!r} (samples that trained per second)",
        table(["rollouts", "steady/s", "ideal/s", "% ideal", "bound by", "learner busy",
               "masked " + "/".join(MASK_CAUSES)], body),
    ])


def _by_cause(masked: dict[str, int]) -> str:
    return "/".join(str(masked.get(k, 0)) for k in MASK_CAUSES)


# --------------------------------------------------------------------------- files


def output_folder(out: Path | None, stem: str) -> Path:
    """The run's folder (default ``runs/<stem>-<time>``), made; and SIGTERM made to unwind
    like Ctrl-C, through the ``finally`` blocks that stop the broker and every process."""
    folder = (out or Path("runs") / time.strftime(f"{stem}-%Y%m%d-%H%M%S")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    return folder


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def machine() -> dict[str, Any]:
    """What the figures were measured on, and how loaded it was when the run began."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "loadavg": os.getloadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(out: Path, results: dict[str, Any], name: str = "results.json") -> Path:
    path = out / name
    path.write_text(json.dumps(_strict(results), indent=2, default=str) + "\n")
    return path


def _strict(value: Any) -> Any:
    """Infinite or NaN figures (a tier with no limit) as null: strict JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def plot_over_time(c: dict[str, Any], path: Path) -> Path:
    """Left: cumulative trained samples; right: throughput over a sliding window of steps."""
    plt = _pyplot()
    fig, (cum, rate) = plt.subplots(1, 2, figsize=(11, 4.5))
    ideal = c["bounds"]["ideal_samples_per_s"]
    for arm in ("decoupled", "synchronous"):
        rows = [{"time": 0.0, "episodes_trained": 0}, *c[arm]["rows"]]
        t = [r["time"] for r in rows]
        n = [r["episodes_trained"] for r in rows]
        cum.step(t, n, where="post", label=f"{arm} ({c[arm]['throughput']:.1f}/s steady)")
        k = 3  # steps per window: single steps of the decoupled arm arrive in bursts
        rate.plot(t[k:], [(n[i] - n[i - k]) / (t[i] - t[i - k]) for i in range(k, len(t))],
                  "o-", ms=3, label=arm)
    top = max(c[arm]["samples_trained"] for arm in ("decoupled", "synchronous"))
    cum.plot([0, top / ideal], [0, top], "k--", lw=1, label=f"ideal bound ({ideal:.1f}/s)")
    rate.axhline(ideal, color="k", ls="--", lw=1, label="ideal bound")
    cum.set(xlabel="seconds since the learner started", ylabel="samples trained")
    rate.set(xlabel="seconds since the learner started", ylabel="samples/s (3-step window)",
             ylim=(0, None))
    cum.legend()
    rate.legend()
    fig.suptitle(f"throughput over time — {c['scenario']} "
                 f"(decoupled/synchronous {c['ratio'] or 0:.1f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(scenario: str, rows: list[dict[str, Any]], path: Path) -> Path:
    """Steady-state throughput against rollout processes, with the ideal bound."""
    plt = _pyplot()
    n = [r["rollout_instances"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(n, [r["throughput"] for r in rows], "o-", label="measured (steady state)")
    ax.plot(n, [r["ideal"] for r in rows], "k--", label="ideal bound")
    top = max(r["ideal"] for r in rows)
    for tier, cap in rows[0]["capacities"].items():  # the other tiers do not change with n
        if tier != "rollout" and cap < 2 * top:
            ax.axhline(cap, color="grey", lw=0.8, ls=":")
            ax.annotate(f"{tier} capacity", (n[0], cap), va="bottom", fontsize=8)
    ax.set(xscale="log", xlabel="rollout processes", ylabel="samples/s", ylim=(0, None),
           title=f"rollout scaling — {scenario}")
    ax.set_xticks(n, [str(x) for x in n])
    ax.minorticks_off()
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on CI machines
    import matplotlib.pyplot as plt

    return plt
