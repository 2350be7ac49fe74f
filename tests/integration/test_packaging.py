"""The built wheel, installed into a fresh venv, works without the checkout.

What the editable install cannot show: that the wheel holds every package and its data, that
the console script works, and that no module needs the folder names ``shared``/``services``
(here dummy packages of those names shadow them and raise on import).

Offline and quick (measured: about 7-13 s in all, most of it importing torch and
transformers; the wheel builds in ~1.5 s, the venv and install take under a second):

* the wheel is built with ``--no-build-isolation --no-index``: hatchling (the build-system
  requirement) is already in the test venv (the dev extra), so nothing is fetched;
* the fresh venv is made ``--without-pip`` (ensurepip alone takes seconds) and the test venv's
  pip installs into it with ``pip --python <fresh python>``: pip then installs for that
  interpreter (its site-packages, console scripts with its shebang), the simplest way to get
  a real install without a second pip;
* dependencies come from the test venv's site-packages, named by a ``.pth`` file holding
  just the path. A plain path line does not run that folder's own .pth files, so the
  editable install's finder (``__editable__.rlbus-*.pth``) stays out and ``rlbus`` can only
  come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = r"""
import importlib, importlib.metadata, json, pkgutil, sys, traceback
import rlbus

failed = {}
def onerror(name):
    failed[name] = traceback.format_exc(limit=-3)

names = ["rlbus"] + [m.name for m in pkgutil.walk_packages(rlbus.__path__, "rlbus.", onerror)]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)

# entry points (console script, plugins) of the installed distribution, which is the
# wheel's: importlib.metadata keeps the first "rlbus" on the path, the fresh site-packages
dist = importlib.metadata.distribution("rlbus")
entry_points = {}
for ep in dist.entry_points:
    key = f"{ep.group}:{ep.name} = {ep.value}"
    try:
        ep.load()
        entry_points[key] = None
    except BaseException:
        entry_points[key] = traceback.format_exc(limit=-3)

from importlib import resources
try:
    pom = resources.files("rlbus.ops.broker") / "pom.xml"
    has_pom = pom.is_file() and "<project" in pom.read_text()
except ImportError:  # the package itself is missing; "failed" already names it
    has_pom = False
print(json.dumps({
    "paths": list(rlbus.__path__),  # a namespace package: folders, no __init__ file
    "dist": str(dist.locate_file("rlbus")),
    "entry_points": entry_points,
    "modules": names,
    "failed": failed,
    "pom": has_pom,
    "shadows": [m for m in ("shared", "services") if m in sys.modules],
}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    shown = " ".join(a if len(a) < 200 else "<script>" for a in cmd)
    assert out.returncode == 0, f"{shown} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed; its paths and the environment to run it in."""
    tmp = tmp_path_factory.mktemp("wheel")
    timings = {}

    # Build from a copy of what the image holds: the wheel must come from shared/ and
    # services/ alone, and nothing a build leaves in the checkout lands under a colleague's
    # feet.
    started = time.perf_counter()
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("shared", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("rlbus-*.whl")
    timings["build"] = time.perf_counter() - started

    started = time.perf_counter()
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    fresh_site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .stdout.strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (fresh_site / "_rlbus_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          "--no-index", str(wheel)])
    timings["install"] = time.perf_counter() - started

    # Shadows: a user's own `shared` and `services`, first on the path and in the cwd.
    shadows = tmp / "shadows"
    for name in ("shared", "services"):
        (shadows / name).mkdir(parents=True)
        (shadows / name / "__init__.py").write_text(
            'raise ImportError("dummy shadow package imported")\n'
        )
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")
    }
    env.update(PYTHONPATH=str(shadows), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return {
        "venv": venv, "python": python, "site": fresh_site, "env": env, "cwd": shadows,
        "wheel": wheel, "timings": timings,
    }


def test_wheel_lists_every_package_and_the_broker_pom(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert "rlbus/ops/broker/pom.xml" in names, (
        "the wheel has no rlbus/ops/broker/pom.xml; packages in it: "
        + ", ".join(sorted({n.rsplit("/", 1)[0] for n in names if n.startswith("rlbus/")}))
    )
    assert not any(n.startswith(("shared/", "services/")) for n in names), sorted(names)[:10]
    assert (installed["site"] / "rlbus" / "ops" / "broker" / "pom.xml").is_file()


def test_console_script_runs_from_the_fresh_venv(installed):
    rlbus = installed["venv"] / "bin" / "rlbus"
    assert rlbus.is_file(), "the wheel installed no `rlbus` console script"
    for args in ([], ["topics"]):
        out = _run([str(rlbus), *args, "--help"], env=installed["env"], cwd=installed["cwd"])
        assert "usage:" in out.stdout.lower(), out.stdout


def test_every_module_imports_from_the_installed_wheel(installed):
    started = time.perf_counter()
    out = _run([str(installed["python"]), "-c", IMPORT_ALL],
               env=installed["env"], cwd=installed["cwd"])
    elapsed = time.perf_counter() - started
    got = json.loads(out.stdout.strip().splitlines()[-1])

    assert not got["failed"], "modules that fail to import when installed:\n" + "\n".join(
        f"--- {name}\n{tb}" for name, tb in got["failed"].items()
    )
    site = installed["site"].resolve()
    paths = [Path(p).resolve() for p in got["paths"]]
    assert paths == [site / "rlbus"], f"rlbus imported from {paths}, not from the fresh venv {site}"
    assert got["shadows"] == []
    assert Path(got["dist"]).resolve() == site / "rlbus", f"metadata from {got['dist']}"
    broken = {k: tb for k, tb in got["entry_points"].items() if tb is not None}
    assert not broken, "entry points that fail to load when installed:\n" + "\n".join(
        f"--- {k}\n{tb}" for k, tb in broken.items()
    )
    assert any(k.startswith("console_scripts:rlbus ") for k in got["entry_points"])
    # the walk saw the whole tree, subpackages included
    modules = set(got["modules"])
    for name in ("rlbus.transport.kafka", "rlbus.ops.cli",
                 "rlbus.ops.broker.cluster", "rlbus.learner.__main__"):
        assert name in modules, f"{name} not found in the installed package"
    assert got["pom"], "rlbus.ops.broker has no pom.xml (package-data) when installed"
    print(f"timings: {installed['timings']}, import all {elapsed:.1f}s "
          f"({len(modules)} modules)")
