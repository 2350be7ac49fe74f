"""Fixtures of the chart tests: Helm, and the chart rendered with a values file.

Helm is not installed by `make test` (building it takes minutes): `make k8s-test` builds it
(scripts/helm.sh) and passes it as RLBUS_HELM. Without one, these tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "rlbus"
VALUES = Path(__file__).resolve().parent / "values"
HELM_VERSION = "v4.3.2"  # scripts/helm.sh's


def find_helm() -> str | None:
    cache = Path(os.environ.get("RLBUS_CACHE", Path.home() / ".cache" / "rlbus"))
    for candidate in (os.environ.get("RLBUS_HELM"), cache / "bin" / f"helm-{HELM_VERSION}"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("helm")


@pytest.fixture(scope="session")
def helm() -> str:
    found = find_helm()
    if found is None:
        pytest.skip("no helm: `make k8s-test` builds it (scripts/helm.sh), or set RLBUS_HELM")
    return found


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                          check=False)


Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def render(helm: str) -> Render:
    """``render("gpu-vllm.yaml", "--set", "a=b")``: the chart's objects, parsed."""

    def run(*values: str, release: str = "demo", namespace: str = "ml") -> list[dict[str, Any]]:
        args = ["template", release, str(CHART), "--namespace", namespace]
        for v in values:
            args += ["-f", str(VALUES / v)] if v.endswith(".yaml") else [v]
        proc = run_helm(helm, *args)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    return run
