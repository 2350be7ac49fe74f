"""The machine's process table, read from /proc: what the no-orphans tests look at."""

from __future__ import annotations

import os
from pathlib import Path


def table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(name)] = (int(fields[1]), fields[0])
    return out


def descendants(pid: int) -> set[int]:
    procs = table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has exited: only its reaping is left)."""
    procs = table()
    return {p for p in pids if p in procs and procs[p][1] != "Z"}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def with_token(token: str) -> set[int]:
    """Live processes whose command line holds ``token``, whoever their parent is now."""
    return alive({p for p in table() if p != os.getpid() and token in cmdline(p)})

