"""The sandbox's processes by uid: the uid leased to each run, and the sweep that kills
every process of that uid when the run ends (see :mod:`.sandbox`)."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from rlbus.errors import SandboxError as SandboxError  # still importable from here

_RESCAN_S = 0.5
"""How often the uids set aside for their zombies are checked again."""


def _kill_all(pgid: int | None, uid: int | None) -> None:
    """SIGKILL the run's process group and, with a uid of its own, every process of that uid."""
    if pgid is not None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if uid is None:
        return
    for _ in range(100):  # a fork bomb forks between scans; killed processes fork no more
        pids = _pids_of(uid)
        if not pids:
            return
        for pid in pids:
            _kill_if_owned(pid, uid)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL")


def _kill_if_owned(pid: int, uid: int) -> None:
    # The pidfd pins the process, so a pid reused after the scan is never signalled.
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if _status_uid(pid) == uid:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _proc_status(pid: str | int) -> tuple[int, bytes, int] | None:
    """(real uid, state letter, threads) of a process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:  # exited since the listing
        return None
    return int(_field(data, b"Uid")), _field(data, b"State"), int(_field(data, b"Threads"))


def _field(status: bytes, name: bytes) -> bytes:
    start = status.index(b"\n" + name + b":") + len(name) + 2
    return status[start:status.index(b"\n", start)].split()[0]


def _status_uid(pid: int) -> int | None:
    status = _proc_status(pid)
    return status[0] if status else None


def _statuses() -> Iterator[tuple[int, int, bytes, int]]:
    """(pid, real uid, state letter, threads) of every process."""
    for name in os.listdir("/proc"):
        status = _proc_status(name) if name.isdigit() else None
        if status:
            yield (int(name), *status)


def _pids_of(uid: int) -> list[int]:
    """Live processes whose real uid is ``uid`` (not zombies: they cannot be killed)."""
    return [pid for pid, owner, state, _ in _statuses() if owner == uid and state != b"Z"]


def _uids_with_processes() -> set[int]:
    """Real uids of every process, zombies included."""
    return {owner for _, owner, _, _ in _statuses()}


def _tasks_of(uid: int) -> int:
    """Tasks (threads) of ``uid``: what RLIMIT_NPROC counts."""
    return sum(threads for _, owner, _, threads in _statuses() if owner == uid)


class _UidPool:
    """A uid per concurrent run: limits, file permissions and the sweep never cross runs.

    Other processes on the host (a second reward instance, a test run) draw from the same
    uids, so a slot is also held by an ``flock`` on a file named after it; the kernel drops
    the lock when its holder dies. A uid with processes left, if only zombies, is set aside
    until they are gone, because RLIMIT_NPROC counts zombies too. Every run leaves one:
    bwrap returns when the program exits, so its pid 1 ends as a child of the host's PID 1,
    which reaps it in its own time (tini at once; some inits only every second or two).
    The uids set aside are checked again at most every ``_RESCAN_S``: until then a run just
    takes a higher uid.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._unreaped: set[int] = set()
        self._rescan_at = 0.0

    @contextmanager
    def lease(self, base: int | None) -> Iterator[int | None]:
        if base is None:
            yield None
            return
        with self._lock:
            now = time.monotonic()
            if self._unreaped and now >= self._rescan_at:  # a scan of /proc takes ~2 ms
                self._unreaped &= _uids_with_processes()
                self._rescan_at = now + _RESCAN_S
            uid, fd = self._claim(base)
        try:
            yield uid
        finally:
            with self._lock:
                self._busy.discard(uid)
                self._unreaped.add(uid)  # checked at the next lease
                os.close(fd)  # releases the flock

    def _claim(self, base: int) -> tuple[int, int]:
        for uid in itertools.count(base):
            if uid in self._busy or uid in self._unreaped:
                continue
            fd = _flock(os.path.join(tempfile.gettempdir(), f"rlbus-sandbox-uid-{uid}.lock"))
            if fd is not None:
                self._busy.add(uid)
                return uid, fd
        raise AssertionError("unreachable")


def _flock(path: str) -> int | None:
    """An fd holding an exclusive lock on ``path``; None if another process holds it."""
    try:
        # O_NOFOLLOW: a program could plant a link here, /tmp being writable by everyone.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


_UIDS = _UidPool()
