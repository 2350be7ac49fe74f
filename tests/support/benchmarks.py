"""Running a load-test module's ``--smoke`` version as a user would, on the session's broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlbus.processes import child_env

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(module: str, bootstrap: str, out: Path, timeout_s: float) -> str:
    """``python -m <module> --smoke --out <out>`` from the repository root; its stdout.
    ``RLBUS_KAFKA_BOOTSTRAP`` points it at ``bootstrap`` so it starts no broker of its own."""
    env = child_env()
    env["RLBUS_KAFKA_BOOTSTRAP"] = bootstrap
    proc = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
