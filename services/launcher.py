"""Run services as separate OS processes: what the demo and the fault tests use.

Each process is ``python -m services.<name>`` in its own session (Ctrl-C reaches only the
launcher, which stops them in order) with exactly the RLBUS_* variables its settings class
accepts, and its output in ``<log_dir>/<name>-<i>.log``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Proc:
    name: str
    index: int
    env: dict[str, str]
    popen: subprocess.Popen[bytes]
    log: Path
    restarts: int = 0

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class ServiceProcesses:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, index: int, env: dict[str, str]) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}-{index}.log"
        proc = Proc(name, index, env, self._popen(name, env, log), log)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _popen(name: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def get(self, label: str) -> Proc:
        return next(p for p in self.procs if p.label == label)

    def kill(self, label: str) -> None:
        """SIGKILL: no drain, no commit, no flush — the fault the contract must survive."""
        proc = self.get(label)
        proc.popen.kill()
        proc.popen.wait()

    def restart(self, label: str) -> Proc:
        """Start the same member again (same instance name, same environment)."""
        proc = self.get(label)
        if proc.alive:
            raise RuntimeError(f"{label} is still running")
        proc.popen = self._popen(proc.name, proc.env, proc.log)
        proc.restarts += 1
        return proc

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if not p.alive]

    def stop(self, first: str = "learner", timeout: float = 40.0) -> None:
        """SIGTERM ``first`` (the learner checkpoints on the way out), then the rest;
        SIGKILL whatever has not exited by ``timeout``."""
        order = sorted(self.procs, key=lambda p: p.name != first)
        for p in order:
            if p.alive:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            if p.alive:
                p.popen.kill()
                p.popen.wait()


def tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
