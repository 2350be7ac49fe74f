"""What the staleness bound costs: the decoupled arm at several ``max_staleness``, with the
learner waiting for stragglers and with it masking them, side by side in one run.

    python -m loadtest.staleness_sweep                          # long_tail, bounds 4,6,8
    python -m loadtest.staleness_sweep --bounds 2,4 --steps 24 --modes wait
    python -m loadtest.staleness_sweep --smoke --out DIR    # seconds; checks no timing
    python -m loadtest.staleness_sweep --bounds 4 --modes mask --staleness-from oldest,newest
    python -m loadtest.staleness_sweep --bounds 4 --staleness-from newest --inflight off,on

Each combination is one :func:`loadtest.fleet.run_decoupled` run of the scenario with that
``max_staleness`` and ``straggler_wait_s`` (``wait``: the scenario's, 60 s by default;
``mask``: 0, a group that would go stale trains without waiting and its late members are
masked), with staleness counted from each episode's oldest or newest token
(``--staleness-from``; partial rollouts, docs/internals.md), and with or without in-flight
weight updates at inference (``--inflight``). Prints one row per run:
samples trained and masked (by cause), steady samples/s
counting only what trained and its share of the ideal bound, the staleness of what trained,
the learner's busy share and the seconds it held steps for stragglers. Writes
``sweep.json`` (every figure and the per-step rows) into ``--out``. Starts a local Kafka
broker unless ``RLBUS_KAFKA_BOOTSTRAP`` names one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.fleet import run_decoupled
from loadtest.scenario import load

MODES = ("wait", "mask")


def say(text: str) -> None:
    print(f"[sweep] {text}", flush=True)


def one(scenario_name: str, bound: int, mode: str, steps: int, bootstrap: str,
        out: Path, staleness_from: str = "oldest", inflight: bool = False) -> dict[str, Any]:
    base = load(scenario_name)
    update: dict[str, Any] = {"max_staleness": bound, "steps": steps,
                              "staleness_from": staleness_from, "inflight_updates": inflight}
    if mode == "mask":
        update["straggler_wait_s"] = 0.0
    s = base.model_copy(update=update)
    ideal = s.describe()["ideal_samples_per_s"]
    name = f"{bound}-{mode}-{staleness_from}" + ("-inflight" if inflight else "")
    r = run_decoupled(s, bootstrap, out / name)
    return {
        "max_staleness": bound,
        "mode": mode,
        "staleness_from": staleness_from,
        "inflight": inflight,
        "trained": r.samples,
        "masked": r.extra["masked"],
        "masked_by_cause": r.extra["masked_by_cause"],
        "throughput": r.throughput(),
        "ideal": ideal,
        "of_ideal": r.throughput() / ideal if ideal else 0.0,
        "staleness_max": r.staleness_max(),
        "learner_busy": r.busy(),
        "waited_s": sum(float(x.get("waited_s") or 0) for x in r.rows),
        "rows": r.rows,
    }


def render(runs: list[dict[str, Any]]) -> str:
    rows = []
    for x in runs:
        produced = x["trained"] + x["masked"]
        share = x["masked"] / produced if produced else 0.0
        causes = x["masked_by_cause"]
        rows.append([
            str(x["max_staleness"]), x["mode"], x.get("staleness_from", "oldest"),
            "on" if x.get("inflight") else "off",
            str(x["trained"]),
            f"{x['masked']} ({100 * share:.1f}%)",
            f"{causes['stale']} / {causes['failed']} / {causes['invalid']}",
            f"{x['throughput']:.2f}", f"{100 * x['of_ideal']:.0f}%",
            f"{x['staleness_max']:.0f}", f"{x['learner_busy']:.2f}", f"{x['waited_s']:.1f}",
        ])
    return report.table(["max_staleness", "stragglers", "from", "in-flight", "trained",
                         "masked",
                         "stale / failed / invalid",
                         "trained/s", "of ideal", "staleness max", "learner busy",
                         "waited s"], rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.staleness_sweep",
                                description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="long_tail", help="scenario name or YAML file")
    p.add_argument("--bounds", default="4,6,8", help="max_staleness values, comma-separated")
    p.add_argument("--modes", default="wait,mask",
                   help="wait (hold the step for stragglers) and/or mask (do not wait)")
    p.add_argument("--staleness-from", default="oldest",
                   help="oldest and/or newest: which token an episode's staleness counts from")
    p.add_argument("--inflight", default="off",
                   help="off and/or on: in-flight weight updates at inference")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--out", type=Path, help="output folder (default runs/sweep-<time>)")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny smoke scenario at bound 1, 6 steps: checks the harness")
    args = p.parse_args(argv)
    if args.smoke:
        args.scenario, args.bounds, args.steps = "smoke", "1", 6
    try:
        args.bounds = [int(b) for b in args.bounds.split(",")]
    except ValueError:
        p.error(f"--bounds: integers separated by commas, not {args.bounds!r}")
    args.modes = args.modes.split(",")
    args.staleness_from = args.staleness_from.split(",")
    if bad := [f for f in args.staleness_from if f not in ("oldest", "newest")]:
        p.error(f"--staleness-from: {', '.join(bad)} is not oldest or newest")
    if bad := [f for f in args.inflight.split(",") if f not in ("off", "on")]:
        p.error(f"--inflight: {', '.join(bad)} is not off or on")
    args.inflight = [f == "on" for f in args.inflight.split(",")]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: {', '.join(bad)} is not one of {', '.join(MODES)}")
    try:
        base = load(args.scenario)
    except (OSError, ValueError) as e:
        p.error(f"--scenario {args.scenario}: {e}")
    if any(b < 0 for b in args.bounds):
        p.error("--bounds: max_staleness is at least 0")
    # the steady window leaves out the warm-up and max_staleness + 1 drain steps
    need = base.warmup_steps + max(args.bounds) + 1 + 2
    if base.cooldown_steps is None and args.steps < need:
        p.error(f"--steps {args.steps}: at bound {max(args.bounds)} the steady window needs "
                f"at least {need} steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "sweep")
    from rlbus.ops.broker import bootstrap_or_start

    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:], "runs": []}
    say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    try:
        for bound in args.bounds:
            for mode in args.modes:
                for since in args.staleness_from:
                    for inflight in args.inflight:
                        say(f"max_staleness {bound}, {mode}, staleness from the {since} "
                            f"token, in-flight updates {'on' if inflight else 'off'}")
                        results["runs"].append(one(args.scenario, bound, mode, args.steps,
                                                   bootstrap, out, since, inflight))
                        report.write_json(out, results, "sweep.json")  # a failure keeps these
    finally:
        if cluster is not None:
            cluster.stop()
    print(render(results["runs"]), flush=True)
    say(f"wrote {report.write_json(out, results, 'sweep.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
