"""``python -m loadtest``: decoupled vs synchronous, Kafka path overhead, rollout scaling.

    python -m loadtest                        # all three parts, about 6 minutes
    python -m loadtest --only comparison      # one part (comparison | overhead | scaling)
    python -m loadtest --smoke                # every part on a tiny scenario, under a minute
    python -m loadtest --only overhead --profile   # cProfile of the service processes

Starts a local Kafka broker unless ``RLBUS_KAFKA_BOOTSTRAP`` names one, and stops it (and
every service process) on the way out, also on failure or SIGTERM. Writes ``results.json``,
``throughput_over_time.png`` and ``scaling.png`` into ``--out`` (default
``runs/loadtest-<time>``) and prints one table per part. The figures are only comparable
side by side within one run: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest import report, suite
from loadtest.scenario import load

SCENARIOS = {"comparison": "long_tail", "overhead": "zero_latency", "scaling": "rollout_bound"}
"""Each part's scenario file (``loadtest/scenarios/<name>.yaml``)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="every part on the smoke scenario: checks the harness, not timings")
    p.add_argument("--only", choices=sorted(SCENARIOS), action="append",
                   help="run only this part (repeatable)")
    p.add_argument("--scenario", help="a scenario name or YAML path for every selected part")
    p.add_argument("--out", type=Path, help="output folder (default runs/loadtest-<time>)")
    p.add_argument("--profile", action="store_true",
                   help="run the service processes under cProfile (slower; for hot spots)")
    return p.parse_args(argv)


def run_part(part: str, args: argparse.Namespace, bootstrap: str, out: Path) -> dict[str, Any]:
    s = load(args.scenario or ("smoke" if args.smoke else SCENARIOS[part]))
    if part == "comparison":
        return suite.comparison(s, bootstrap, out, args.profile)
    if part == "overhead":
        return suite.overhead(s, bootstrap, out, args.profile, args.smoke)
    return suite.scaling(s, bootstrap, out, args.profile)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "loadtest")
    from rlbus.ops.broker import bootstrap_or_start

    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:], "out": str(out)}
    suite.say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    try:
        for part in args.only or list(SCENARIOS):
            results[part] = run_part(part, args, bootstrap, out)
            report.write_json(out, results)  # after each part: a later failure keeps these
    finally:
        if cluster is not None:
            cluster.stop()
    suite.say(f"wrote {report.write_json(out, results)} and the plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
