"""What confining a sandbox run with bubblewrap costs, measured side by side.

    python -m loadtest.sandbox_bench [--runs 30]

Runs a trivial passing program (the shape of one ``python_tests`` test: read a line, print
the sum) alternately with and without bwrap, and prints the median and 90th percentile wall
time per run of each, and their difference. "unconfined" is the sandbox as it was before
bwrap (network namespace, uid drop and rlimits, but the host's filesystem and processes in
view); it exists only for this measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rlbus import sandbox

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"
LIMITS = sandbox._Limits(timeout_s=5.0, cpu_s=5, memory_mb=256, max_processes=16,
                         max_output_bytes=1 << 20)


def one_run(iso: sandbox.Isolation, confine: bool) -> float:
    start = time.perf_counter()
    result = sandbox._run_program(PROGRAM, "1 2\n", LIMITS, iso, confine=confine)
    elapsed = time.perf_counter() - start
    assert result.ok and result.stdout == "3\n", result
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.sandbox_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=30, help="runs per arm (default 30)")
    runs = p.parse_args().runs
    iso = sandbox.detect_isolation()
    arms = {"unconfined": False, "bwrap": True}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(runs + 3):  # interleaved, so drift in the machine's load hits both alike
        for name, confine in arms.items():
            elapsed = one_run(iso, confine)
            if i >= 3:  # the first runs warm the page cache
                times[name].append(elapsed)
    print(f"sandbox run of a trivial passing program, {runs} runs per arm, {iso}")
    print(f"{'arm':<11} {'median ms':>10} {'p90 ms':>8}")
    medians = {}
    for name, values in times.items():
        medians[name] = statistics.median(values) * 1e3
        p90 = statistics.quantiles(values, n=10)[-1] * 1e3
        print(f"{name:<11} {medians[name]:>10.1f} {p90:>8.1f}")
    extra = medians["bwrap"] - medians["unconfined"]
    print(f"bwrap adds {extra:.1f} ms per run ({medians['bwrap'] / medians['unconfined']:.2f}x)")


if __name__ == "__main__":
    main()
