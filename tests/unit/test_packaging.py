"""The layout, checked from the source tree (fast: no network, no wheel build).

``rlbus`` is one namespace package laid over two source roots: ``shared/rlbus`` (the core) and
``services/rlbus`` (the tiers and ops). A module's file is ``<root>/<its import path>.py``, so
any tool that maps a module to a file (mypy, coverage, an IDE, grep) follows an import with no
mapping of ours. What could break that: an ``__init__.py`` at a root's ``rlbus/`` (it would
hide the other root), the same module in both roots, a package folder without its
``__init__.py``, a root the wheel does not list, or code that imports the root folders' own
names (``shared``, ``services``), which exist only in a checkout.
tests/integration/test_packaging.py checks the built wheel itself.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
ROOTS = ("shared", "services")
SOURCE_DIRS = (*ROOTS, "tests", "loadtest")
LAYOUT_NAMES = frozenset(ROOTS)


def _modules() -> dict[str, Path]:
    """Every module under the two roots, by the import name its path gives it."""
    found: dict[str, Path] = {}
    for root in ROOTS:
        for path in sorted((ROOT / root / "rlbus").rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.setdefault(name, path)
    return found


def _py_files() -> list[Path]:
    return sorted(
        p
        for d in SOURCE_DIRS
        for p in (ROOT / d).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def test_rlbus_is_a_namespace_over_both_roots():
    for root in ROOTS:
        assert not (ROOT / root / "rlbus" / "__init__.py").exists(), (
            f"{root}/rlbus/__init__.py would make rlbus a regular package and hide the other root")
    spec = importlib.util.find_spec("rlbus")
    assert spec is not None and spec.origin is None  # a namespace package has no file
    assert {Path(p) for p in spec.submodule_search_locations or []} == {
        ROOT / root / "rlbus" for root in ROOTS}


def test_the_wheel_and_the_editable_install_list_both_roots():
    hatch = tomllib.loads(PYPROJECT.read_text())["tool"]["hatch"]["build"]
    assert hatch["targets"]["wheel"]["packages"] == [f"{root}/rlbus" for root in ROOTS]
    assert hatch["dev-mode-dirs"] == list(ROOTS)


def test_no_module_is_in_both_roots():
    seen: dict[str, str] = {}
    for root in ROOTS:
        for path in (ROOT / root / "rlbus").rglob("*.py"):
            rel = str(path.relative_to(ROOT / root))
            assert rel not in seen, f"{rel} is in both {seen[rel]}/ and {root}/"
            seen[rel] = root


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_module_imports_from_the_file_its_name_names(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} does not import"
    assert Path(spec.origin) == _modules()[name]


def test_no_package_folder_lacks_an_init():
    for root in ROOTS:
        for folder in (ROOT / root / "rlbus").iterdir():
            if not folder.is_dir() or folder.name == "__pycache__":
                continue
            for sub in [folder, *(d for d in folder.rglob("*") if d.is_dir())]:
                if sub.name != "__pycache__" and any(sub.glob("*.py")):
                    assert (sub / "__init__.py").exists(), (
                        f"{sub.relative_to(ROOT)} lacks __init__.py")


_LAYOUT_MODULE = re.compile(r"^(shared|services)(\.[A-Za-z_][\w.]*)?$")
_DASH_M = re.compile(r"-m\s+[\"']?(shared|services)\b")


def _layout_uses(path: Path) -> list[str]:
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in LAYOUT_NAMES
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] in LAYOUT_NAMES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # dotted names in strings: mock.patch("services.x.y"), import_module("shared.z"),
            # [sys.executable, "-m", "services.rollout"]. The bare words are left alone
            # ("services" is also a docker-compose key), except as import_module's argument.
            if "." in node.value and _LAYOUT_MODULE.match(node.value):
                found.append(f"line {node.lineno}: string {node.value!r}")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and arg.value in LAYOUT_NAMES
            ):
                found.append(f"line {node.lineno}: {name}({arg.value!r})")
    for lineno, line in enumerate(source.splitlines(), 1):
        if _DASH_M.search(line):
            found.append(f"line {lineno}: {line.strip()}")
    return found


def test_layout_scanner_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import shared\nimport services.rollout as r\nfrom shared.codec import encode\n"
        "from services import ops\nimport importlib\nimportlib.import_module('services')\n"
        "patch('shared.codec.encode')\ncmd = [sys.executable, '-m', 'services.reward']\n"
        "'''run python DASH_M services.learner'''\n".replace("DASH_M", "-m")
    )  # (spelt DASH_M so that this file's own scan stays clean)
    flagged = {int(use.split(":")[0].removeprefix("line ")) for use in _layout_uses(bad)}
    assert flagged == {1, 2, 3, 4, 6, 7, 8, 9}
    good = tmp_path / "good.py"
    good.write_text(
        "import rlbus.rollout\nfrom rlbus import codec\nfrom . import shared\n"
        "cfg = {'services': 1}\n'''python -m rlbus.learner; see shared/rlbus/topics.py'''\n"
    )
    assert _layout_uses(good) == []


@pytest.mark.parametrize("path", _py_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_imports_the_layout_folder_names(path):
    uses = _layout_uses(path)
    assert not uses, (
        f"{path.relative_to(ROOT)} uses the folder names shared/services as modules; they are "
        "source roots, not packages; code imports rlbus only: " + "; ".join(uses)
    )
