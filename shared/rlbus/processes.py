"""Starting child processes that never outlive the process that started them.

Every process rlbus starts (the services of the demo, load tests and chaos runs, the broker's
JVMs, Maven, the reward tier's verifier workers) is bound to its parent with
:func:`die_with_parent`, so no run leaves orphans behind however it ends. Core, not ops: the
reward tier starts processes too, and a tier may not import ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
"""Loaded here, not in the child: between fork and exec the child should do as little as it
can (Python's warning on ``preexec_fn`` with threads), so it only makes one libc call."""


def child_env(extra: dict[str, str] | None = None,
              drop: Iterable[str] = ("RLBUS_",)) -> dict[str, str]:
    """This process's environment without any variable starting with one of ``drop``
    (every RLBUS_* by default: settings refuse keys they do not know, and a child must see
    only the ones it is meant to), then ``extra`` on top: the settings it is meant to have
    come from :func:`rlbus.settings.settings_env`."""
    prefixes = tuple(drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**env, **(extra or {})}


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that binds the child's life to ours: Linux's parent-death signal
    SIGKILLs it when the thread that starts it dies (a no-op elsewhere).

    SIGKILL, not SIGTERM: a parent that dies without stopping its children (SIGKILL, a crash)
    has abandoned the run, and a drain would only wait on peers that are dying too (a rollout
    waited its whole ``drain_timeout_s`` for replies from a dead inference member). Every
    tier's contract already holds under SIGKILL of any member; a broker's data survives it.

    The signal is armed in the child between fork and exec, so a parent killed before that
    would leave a child that never gets it; the child therefore checks that its parent is
    still the process that forked it and kills itself if not (it was adopted by init or a
    subreaper in the meantime).
    """
    parent = os.getpid()

    def arm() -> None:  # pragma: no cover - runs in the child between fork and exec
        if _LIBC is None:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def spawn_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own, output appended to ``log``, SIGKILL on our death."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent(),
        )


def tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
