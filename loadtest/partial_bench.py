"""Bounded staleness with masking against partial rollouts, in-flight updates and TIS, side
by side on the long_tail shape in one run (issue 35, item 6).

    python -m loadtest.partial_bench                  # both parts, about 13 minutes on 2 cores
    python -m loadtest.partial_bench --demo-minutes 5 --one-at-a-time
    python -m loadtest.partial_bench --smoke --out DIR    # the harness only; no figure holds

The arms (:data:`ARMS`):

* **A, masking**: today's default path. Staleness counts from an episode's oldest token,
  the learner never holds a step for a straggler (a group that goes stale is masked),
  inference loads new weights between batches only, the loss is the one-ratio PPO loss
  (``RLBUS_OFF_POLICY__MODE=none``).
* **B, partial rollouts**: staleness counts from the newest token, inference applies new
  weights between decode steps (``RLBUS_INFLIGHT_UPDATES``), the loss is decoupled PPO
  with truncated importance weights (``tis``, C = 2), and the learner holds a step, up to
  ``straggler_wait_s``, for a group at its last chance within the bound (docs/off-policy.md,
  "Masking or partial rollouts": why the waiting, not the per-token versions, is what
  brings the stale share to zero on this shape).

Two parts, each running both arms:

1. **Throughput** on the long_tail scenario itself (:mod:`loadtest.fleet`: synthetic engine
   and trainer, so nothing is learned): trained samples per second in the steady state
   (only samples that entered the loss) and the masked share by cause. The synthetic
   trainer has no loss, so the off-policy mode changes nothing here.
2. **Learning**: ``rlbus demo``'s real stack (hf engine, the tiny model, guess-the-number,
   its recipe) with every environment step delayed by long_tail's lognormal (sigma 1.5,
   capped), its median and cap scaled by the ratio of the demo's learner step to
   long_tail's (:data:`DEMO_SCALE`), so a straggler outlasts as many optimizer steps as it
   does on long_tail. Greedy success on the demo's fixed 128-task evaluation set, against
   the learner's wall-clock seconds, plus trained samples per second and masked shares.
   The two demo arms run at the same time (``--one-at-a-time``: one after the other): on
   a shared machine whose load changes, both then learn under the same load, each with
   half of it.

Writes ``partial.json`` (every figure and every metrics row) and ``partial.png`` (greedy
success and samples trained against seconds, masked shares) into ``--out``. Starts a local
Kafka broker unless ``RLBUS_KAFKA_BOOTSTRAP`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.fleet import run_decoupled
from loadtest.long_tail_task import REF
from loadtest.metrics import ArmResult, masked
from loadtest.scenario import load
from rlbus.messages import MASK_CAUSES

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    staleness_from: str
    straggler_wait_s: float
    inflight: bool
    off_policy: str


ARMS = (
    Arm("A", "A: masking (oldest, no wait, none)", "oldest", 0.0, False, "none"),
    Arm("B", "B: partial rollouts (newest, wait, in-flight, tis)", "newest", 60.0, True, "tis"),
)
LONG_TAIL_STEP_S = 0.8
"""long_tail's learner step (loadtest/scenarios/long_tail.yaml)."""
DEMO_SCALE = 0.1
"""About the demo's learner step over long_tail's (0.08 s for two updates of the tiny model
on 16 one-token episodes on an idle 2-core machine, against 0.8 s): long_tail's environment
latency times this is the learning part's, median 6 ms, cap 500 ms, sigma unchanged. What
matters is that the masking arm masks about the share it masks on long_tail; the report
shows both."""
LONG_TAIL_ENV = {"median_ms": 60.0, "sigma": 1.5, "max_ms": 5000.0}
"""long_tail's environment latency (the scenario's env section, without the turn counts:
guess-the-number ends when the number is found, after at most 5 guesses)."""


def say(text: str) -> None:
    print(f"[partial] {text}", flush=True)


# --------------------------------------------------------------------------- part 1: fleet


def fleet_arm(arm: Arm, scenario: str, steps: int, bound: int, bootstrap: str,
              out: Path) -> dict[str, Any]:
    s = load(scenario).model_copy(update={
        "steps": steps, "max_staleness": bound, "staleness_from": arm.staleness_from,
        "straggler_wait_s": arm.straggler_wait_s, "inflight_updates": arm.inflight})
    r = run_decoupled(s, bootstrap, out / f"fleet-{arm.name}")
    return {"arm": arm.name, "label": arm.label, "scenario": s.name, "max_staleness": bound,
            **_figures(r), "ideal": s.describe()["ideal_samples_per_s"], "rows": r.rows}


def _figures(r: ArmResult) -> dict[str, Any]:
    m = masked(r.rows)
    produced = r.samples + m["masked"]
    return {"trained": r.samples, **m, "masked_share": m["masked"] / produced if produced else 0,
            "throughput": r.throughput(), "throughput_overall": r.overall(),
            "staleness_max": r.staleness_max(),
            "waited_s": sum(float(x.get("waited_s") or 0) for x in r.rows)}


# --------------------------------------------------------------------------- part 2: demo


def demo_overrides(arm: Arm, bound: int, scale: float, evaluate: dict[str, int]
                   ) -> dict[str, dict[str, str]]:
    """The arm's settings on top of the demo's recipe, per tier."""
    latency = {**LONG_TAIL_ENV, "median_ms": LONG_TAIL_ENV["median_ms"] * scale,
               "max_ms": LONG_TAIL_ENV["max_ms"] * scale}
    learner = {
        "RLBUS_TASK": REF, "RLBUS_TASK_SPEC": json.dumps(latency),
        "RLBUS_MAX_STALENESS": str(bound), "RLBUS_STALENESS_FROM": arm.staleness_from,
        "RLBUS_STRAGGLER_WAIT_S": str(arm.straggler_wait_s),
        "RLBUS_OFF_POLICY__MODE": arm.off_policy,
        **{f"RLBUS_{k.upper()}": str(v) for k, v in evaluate.items()},
    }
    inference = {"RLBUS_INFLIGHT_UPDATES": "true" if arm.inflight else "false"}
    return {"learner": learner, "inference": inference}


def demo_arm(arm: Arm, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run of the demo's real stack under ``arm``; its figures and metrics rows."""
    from rlbus.ops.demo import Demo, read_metrics
    from rlbus.ops.progress import evaluations, first_at_target

    demo = Demo(out / f"demo-{arm.name}", args.demo_steps, args.demo_minutes, rollouts=1,
                inference=1, live=False,
                overrides=demo_overrides(arm, args.bound, args.scale, args.evaluate))
    reason = "interrupted"
    try:
        env = demo.prepare()
        # the task is named by import string: every tier imports it from this repository
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        demo.launch(env)
        reason = demo.watch()
    finally:
        demo.stop()
    rows = read_metrics(demo.metrics)
    train = [r for r in rows if "eval_at_step" not in r]
    at = {r["step"]: r["time"] for r in train}
    curve = [(at.get(step, 0.0), success) for step, success in sorted(evaluations(rows).items())]
    result = ArmResult(arm.name, "demo", train, 0.0, warmup=2)
    return {"arm": arm.name, "label": arm.label, "ended": reason, "steps": len(train),
            **_figures(result), "greedy": curve, "greedy_target": first_at_target(rows),
            "rows": rows}


def demo_arms(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Every arm's demo run: at the same time, or with ``one_at_a_time`` one by one."""
    def run(arm: Arm) -> dict[str, Any]:
        say(f"demo, long-tail environment x{args.scale:g}: {arm.label}")
        return demo_arm(arm, args, out)

    if args.one_at_a_time:
        return [run(arm) for arm in ARMS]
    # a thread per arm, alive until its processes are stopped: they die with the thread
    # that started them (rlbus.processes.die_with_parent)
    with ThreadPoolExecutor(len(ARMS)) as pool:
        return list(pool.map(run, ARMS))


# --------------------------------------------------------------------------- report


def render(part: str, runs: list[dict[str, Any]]) -> str:
    rows = []
    for x in runs:
        causes = " / ".join(str(x["masked_by_cause"][c]) for c in MASK_CAUSES)
        greedy = x.get("greedy") or []
        last = f"{greedy[-1][1]:.2f} at {greedy[-1][0]:.0f} s" if greedy else "-"
        hit = x.get("greedy_target")
        first = f"{hit['training_seconds']:.0f} s" if hit and hit.get("training_seconds") \
            else "-"
        rows.append([x["label"], str(x["trained"]),
                     f"{x['masked']} ({100 * x['masked_share']:.1f}%)", causes,
                     f"{x['throughput']:.2f}", f"{x['staleness_max']:.0f}",
                     f"{x['waited_s']:.1f}", last, first])
    return f"{part}\n" + report.table(
        ["arm", "trained", "masked", " / ".join(MASK_CAUSES), "trained/s", "staleness max",
         "waited s", "greedy (last)", "greedy 0.8 at"], rows)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Greedy success and samples trained against seconds (learning part); masked shares
    of both parts, by cause."""
    plt = report._pyplot()
    fig, (greedy, trained, shares) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, x in enumerate(results["demo"]):
        t, s = zip(*x["greedy"], strict=True) if x["greedy"] else ((), ())
        greedy.plot(t, s, "o-", ms=3, color=f"C{i}", label=x["label"])
        rows = [{"time": 0.0, "episodes_trained": 0}, *(r for r in x["rows"]
                                                        if "eval_at_step" not in r)]
        trained.step([r["time"] for r in rows], [r["episodes_trained"] for r in rows],
                     where="post", color=f"C{i}",
                     label=f"{x['arm']} ({x['throughput']:.0f}/s steady)")
    greedy.axhline(0.8, color="grey", ls=":", lw=1)
    greedy.set(xlabel="seconds since the learner started", ylabel="greedy success (eval set)",
               ylim=(-0.02, 1.02), title="demo task, long-tail environment")
    trained.set(xlabel="seconds since the learner started", ylabel="samples trained",
                title="demo: samples that entered the loss")
    greedy.legend(loc="upper left", fontsize=8)
    trained.legend(loc="upper left", fontsize=8)
    bars = [(f"{part} {x['arm']}", x) for part in ("fleet", "demo") for x in results[part]]
    bottom = [0.0] * len(bars)
    for k, cause in enumerate(MASK_CAUSES):
        share = [100 * x["masked_by_cause"][cause] / max(1, x["trained"] + x["masked"])
                 for _, x in bars]
        shares.bar([n for n, _ in bars], share, bottom=bottom, color=f"C{k + 2}",
                   label=cause if any(share) else None)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    for i, total in enumerate(bottom):
        shares.annotate(f"{total:.1f}%", (i, total), ha="center", va="bottom", fontsize=8)
    shares.set(ylabel="% of samples masked", ylim=(0, max(5.0, 1.2 * max(bottom))),
               title="masked, by cause (fleet: long_tail scenario)")
    if any(bottom):
        shares.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.partial_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="long_tail", help="scenario of the throughput part")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps per fleet arm")
    p.add_argument("--bound", type=int, default=4, help="max_staleness of every arm")
    p.add_argument("--demo-steps", type=int, default=4800, help="most steps per demo arm")
    p.add_argument("--demo-minutes", type=float, default=10.0,
                   help="longest one demo arm runs (start-up included)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="run the demo arms one after the other, not at the same time")
    p.add_argument("--scale", type=float, default=DEMO_SCALE,
                   help="long_tail's environment latency times this, in the demo arms")
    p.add_argument("--parts", default="fleet,demo", help="fleet and/or demo")
    p.add_argument("--out", type=Path, help="output folder (default runs/partial-<time>)")
    p.add_argument("--smoke", action="store_true",
                   help="the smoke scenario, bound 1, and a few demo steps: the harness only")
    args = p.parse_args(argv)
    args.evaluate = {"eval_every": 100}
    if args.smoke:
        args.scenario, args.steps, args.bound = "smoke", 6, 1
        args.demo_steps, args.demo_minutes = 12, 2.0
        args.evaluate = {"eval_every": 5, "eval_episodes": 8}
    args.parts = args.parts.split(",")
    if bad := [x for x in args.parts if x not in ("fleet", "demo")]:
        p.error(f"--parts: {', '.join(bad)} is not fleet or demo")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "partial")
    from rlbus.ops.broker import bootstrap_or_start

    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:],
                               "arms": [a.__dict__ for a in ARMS], "bound": args.bound,
                               "scale": args.scale, "fleet": [], "demo": []}
    say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    os.environ["RLBUS_KAFKA_BOOTSTRAP"] = bootstrap  # the demo arms use this one too
    started = time.monotonic()
    try:
        for arm in ARMS if "fleet" in args.parts else ():
            say(f"fleet, {args.scenario}: {arm.label}")
            results["fleet"].append(fleet_arm(arm, args.scenario, args.steps, args.bound,
                                              bootstrap, out))
            report.write_json(out, results, "partial.json")  # a failure keeps these
        if "demo" in args.parts:
            results["demo"] = demo_arms(args, out)
            report.write_json(out, results, "partial.json")
    finally:
        if cluster is not None:
            cluster.stop()
    results["wall_s"] = time.monotonic() - started
    for part in ("fleet", "demo"):
        if results[part]:
            print(render(part, results[part]), flush=True)
    if results["demo"]:
        say(f"wrote {plot(results, out / 'partial.png')}")
    say(f"wrote {report.write_json(out, results, 'partial.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
