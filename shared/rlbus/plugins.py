"""Finding tasks, agents and verifiers: by entry point name or by import string.

A reference is either the name of an entry point in the group of its kind (``rlbus.tasks``,
``rlbus.agents``, ``rlbus.verifiers``; rlbus's own built-ins are declared the same way in its
pyproject) or an import string ``package.module:attr``. The object found may be an instance
or a class (instantiated with no arguments). Loaded plugins are cached per process.

Every failure is a :class:`PluginError` that names the reference, the entry point and, for
an import that raised, the file and line where it did: that message is what a dead letter
or a startup error shows.
"""

from __future__ import annotations

import importlib
import traceback
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Literal, TypeVar, cast

from rlbus.api import Agent, ChatAgent, Task, Verifier
from rlbus.errors import PluginError as PluginError  # still importable from here

Kind = Literal["task", "agent", "verifier"]
GROUPS: dict[Kind, str] = {
    "task": "rlbus.tasks",
    "agent": "rlbus.agents",
    "verifier": "rlbus.verifiers",
}
_BASES: dict[Kind, tuple[type, ...]] = {
    "task": (Task,), "agent": (Agent, ChatAgent), "verifier": (Verifier,)}
T = TypeVar("T")


def installed(kind: Kind) -> list[str]:
    """Entry point names of ``kind``, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUPS[kind])})


def _where(exc: BaseException) -> str:
    """The innermost frame of a failed import: ``file:line``."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import_string(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{ref!r} is not an import string 'package.module:attr'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginError(
            f"importing {module_name!r} for {ref!r} failed: {type(exc).__name__}: {exc}"
            f"{_where(exc)}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{module_name!r} has no attribute {attr!r} ({ref!r})") from None
    return obj


def _entry_point(kind: Kind, name: str) -> EntryPoint:
    found = [ep for ep in entry_points(group=GROUPS[kind]) if ep.name == name]
    if not found:
        raise PluginError(
            f"no {kind} named {name!r}: installed {kind}s are {installed(kind)} (entry point "
            f"group {GROUPS[kind]!r}); or give an import string 'package.module:attr'"
        )
    return found[0]


def _from_entry_point(kind: Kind, ep: EntryPoint) -> Any:
    try:
        return ep.load()
    except Exception as exc:
        raise PluginError(
            f"{kind} {ep.name!r} (entry point {ep.value!r} in group {GROUPS[kind]!r}) failed "
            f"to load: {type(exc).__name__}: {exc}{_where(exc)}"
        ) from exc


def _instance(kind: Kind, ref: str, obj: Any) -> Any:
    base = _BASES[kind]
    wanted = " or ".join(b.__name__ for b in base)
    if isinstance(obj, type):
        if not issubclass(obj, base):
            raise PluginError(f"{ref!r} is {obj.__qualname__}, not a subclass of {wanted}")
        try:
            obj = obj()
        except Exception as exc:
            raise PluginError(
                f"{kind} {ref!r}: {obj.__qualname__}() raised {type(exc).__name__}: {exc}"
                f"{_where(exc)}"
            ) from exc
    if not isinstance(obj, base):
        raise PluginError(f"{ref!r} is a {type(obj).__name__}, not a {wanted}")
    return obj


@cache
def load(kind: Kind, ref: str) -> Any:
    """The ``kind`` plugin named ``ref`` (entry point name or import string)."""
    if not isinstance(ref, str) or not ref:
        raise PluginError(f"a {kind} reference must be a non-empty string, not {ref!r}")
    obj = _import_string(ref) if ":" in ref else _from_entry_point(kind, _entry_point(kind, ref))
    return _instance(kind, ref, obj)


def task(ref: str) -> Task:
    """The task ``ref``; its ``name`` is what prompts use (entry point name or the string)."""
    return cast(Task, load("task", ref))


def agent(ref: str) -> Agent | ChatAgent:
    return cast(Agent | ChatAgent, load("agent", ref))


def verifier(ref: str) -> Verifier:
    return cast(Verifier, load("verifier", ref))


def check_all(kind: Kind) -> list[str]:
    """Load every installed plugin of ``kind``: startup fails here, naming the entry point,
    rather than at the first prompt that uses a broken one. Returns the names loaded."""
    names = installed(kind)
    for name in names:
        load(kind, name)
    return names
