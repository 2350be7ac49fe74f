"""Packaging, checked from the source tree (fast: no network, no wheel build).

pyproject.toml maps the folders onto one import namespace (``shared/`` -> ``rlbus``,
``services/`` -> ``rlbus.services``) and lists every package explicitly, so a new package
folder that is not added to ``[tool.setuptools] packages`` works in the editable checkout's
tests yet is missing from the wheel. And code that imports the folders' own names
(``shared``, ``services``) works only from the checkout, where a user's package of that name
would shadow ours. tests/integration/test_packaging.py checks the built wheel itself.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
SOURCE_DIRS = ("shared", "services", "tests", "loadtest")
LAYOUT_NAMES = frozenset({"shared", "services"})


def _setuptools() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]


def _package_dir() -> dict[str, Path]:
    return {pkg: ROOT / folder for pkg, folder in _setuptools()["package-dir"].items()}


def _name_of(folder: Path) -> str:
    """The import name setuptools gives ``folder``: the most specific package-dir mapping."""
    best: tuple[int, str] | None = None
    for pkg, base in _package_dir().items():
        if folder == base or base in folder.parents:
            depth = len(base.parts)
            if best is None or depth > best[0]:
                rel = folder.relative_to(base).parts
                best = (depth, ".".join((pkg, *rel)))
    assert best is not None, f"{folder} is under no package-dir entry of pyproject.toml"
    return best[1]


def _folder_of(package: str) -> Path:
    """The folder setuptools builds ``package`` from (longest matching package-dir key)."""
    mapping = _package_dir()
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return mapping[prefix].joinpath(*parts[n:])
    return ROOT.joinpath(*parts)  # setuptools' default: the name as a path from the root


def _package_folders() -> list[Path]:
    folders = set()
    for base in _package_dir().values():
        folders.update(p.parent for p in base.rglob("__init__.py") if "__pycache__" not in p.parts)
    return sorted(folders)


def _py_files() -> list[Path]:
    return sorted(
        p
        for d in SOURCE_DIRS
        for p in (ROOT / d).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def test_package_dir_mapping_is_the_one_this_test_knows():
    # the other checks derive names from this mapping; fail loudly if its shape changes
    assert set(_setuptools()["package-dir"]) >= {"rlbus", "rlbus.services"}


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(_setuptools()["packages"])
    missing = [
        f"{_name_of(folder)} ({folder.relative_to(ROOT)}/)"
        for folder in _package_folders()
        if _name_of(folder) not in listed
    ]
    assert not missing, (
        "package folders missing from the wheel: add "
        + ", ".join(missing)
        + ' to [tool.setuptools] packages = [...] in pyproject.toml'
    )


def test_every_listed_package_exists():
    absent = [
        f"{pkg} (expected {_folder_of(pkg).relative_to(ROOT)}/__init__.py)"
        for pkg in _setuptools()["packages"]
        if not (_folder_of(pkg) / "__init__.py").is_file()
    ]
    assert not absent, (
        "pyproject.toml [tool.setuptools] packages lists packages that do not exist: "
        + ", ".join(absent)
        + "; remove them from pyproject.toml or add the folder"
    )


def test_no_module_folder_lacks_an_init():
    # A folder of .py files without __init__.py is a namespace package, which an explicit
    # `packages` list never picks up: its modules would be missing from the wheel.
    bare = sorted(
        str(folder.relative_to(ROOT))
        for base in _package_dir().values()
        for folder in {p.parent for p in base.rglob("*.py") if "__pycache__" not in p.parts}
        if not (folder / "__init__.py").is_file()
    )
    assert not bare, (
        f"folders with modules but no __init__.py (left out of the wheel): {bare}; add an "
        "__init__.py and list the package in pyproject.toml [tool.setuptools] packages"
    )


def test_package_data_files_exist():
    for pkg, patterns in _setuptools().get("package-data", {}).items():
        for pattern in patterns:
            assert list(_folder_of(pkg).glob(pattern)), (
                f"pyproject.toml package-data {pkg!r}: {pattern!r} matches no file in "
                f"{_folder_of(pkg).relative_to(ROOT)}/"
            )


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
        "import rlbus.services.rollout\nfrom rlbus import codec\nfrom . import shared\n"
        "cfg = {'services': 1}\n'''python -m rlbus.services.learner; see shared/topics.py'''\n"
    )
    assert _layout_uses(good) == []


@pytest.mark.parametrize("path", _py_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_imports_the_layout_folder_names(path):
    uses = _layout_uses(path)
    assert not uses, (
        f"{path.relative_to(ROOT)} uses the folder names shared/services as modules; installed "
        "code only has rlbus / rlbus.services: " + "; ".join(uses)
    )
