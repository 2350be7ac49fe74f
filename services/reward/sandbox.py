"""Run untrusted (model-generated) Python in a throwaway, resource-limited process.

Each run gets a fresh ``python -I`` process in a new temporary directory (always removed),
a minimal environment and its own session, so the whole process group can be killed. In the
forked child, before ``exec``, it also gets:

- a new, empty network namespace (``unshare(CLONE_NEWNET)``; loopback down, no routes);
- ``no_new_privs``, so setuid binaries cannot regain privileges;
- when the service runs as root: an unprivileged uid/gid of its own (``UID_BASE`` + a slot
  per concurrent run). Root ignores ``RLIMIT_NPROC`` and file permissions, so as root a run
  is never started without this drop. A uid per run also lets the final sweep kill every
  process of that uid (children that left the process group with ``setsid``) without
  touching the service or another run;
- rlimits: CPU seconds, address space, file size, open files, processes, no core dumps.

What the host allows is found once by trial runs (``detect_isolation``) and each result says
what applied (``network_isolated``, ``uid``). Without a network namespace the program runs
under an audit hook that refuses sockets other than ``AF_UNIX``, name lookups, ``ctypes`` and
spawning programs: a guard against accidental network use, not against code written to
escape it. A service that is not root creates the network namespace inside a new user
namespace; its runs keep the service's uid, so a program could signal the service, and
children that leave the process group are not swept (the wall timeout does not reach them).

Not contained in any mode: reads of world-readable files, writes to world-writable
directories such as ``/tmp`` (each file bounded by ``RLIMIT_FSIZE``, not their number), and
disk use in the work directory (bounded per file, not in total) until the run ends.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import functools
import itertools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger(__name__)

UID_BASE = 2_000_000_000
"""First sandbox uid. Chosen from a range no distribution, systemd or container tool assigns
(0x70000000-0x7FFEFFFF), because the sweep after a run kills every process of that uid."""

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
_READ_CHUNK = 65536
_FILE_MB = 16
_OPEN_FILES = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]

# Runs before the program when there is no network namespace. Audit hooks cannot be removed
# from Python code; the blocked imports and events close the obvious ways around it (raw
# syscalls through ctypes, running another program that has network access).
_GUARD = """\
import sys
def _sandbox_guard(event, args, _blocked=frozenset((
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
        "socket.gethostbyaddr", "socket.getnameinfo", "ctypes.dlopen", "ctypes.dlsym",
        "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen")),
        _modules=frozenset(("_ctypes", "_posixsubprocess"))):
    if (event in _blocked or (event == "socket.__new__" and args[1] != 1)
            or (event == "import" and args[0] in _modules)):
        raise PermissionError(f"sandbox: {event} is not allowed (no network)")
sys.addaudithook(_sandbox_guard)
del _sandbox_guard
sys.argv = sys.argv[1:]
with open(sys.argv[0], encoding="utf-8") as _f:
    _code = compile(_f.read(), sys.argv[0], "exec")
exec(_code, {"__name__": "__main__", "__file__": sys.argv[0], "__builtins__": __builtins__})
"""


class SandboxError(RuntimeError):
    """The sandbox itself failed, not the program: the sample must not be scored."""


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated on this host (see ``detect_isolation``)."""

    python: str
    """Interpreter the program runs under; it must be executable by the sandbox uid."""
    uid_base: int | None
    """Runs get uid ``uid_base + slot``; None: they keep the service's uid."""
    network_namespace: bool
    """A fresh network namespace; False: only the audit-hook guard."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run of a program did."""

    returncode: int
    """Exit status; negative: killed by that signal."""
    stdout: str
    stderr: str
    """Both decoded as UTF-8 (invalid bytes replaced), each at most ``max_output_bytes``."""
    duration_s: float
    limit: str | None
    """The limit that ended the run: "wall_time", "cpu_time", "memory", "output",
    "file_size", "signal SIG..." (another fatal signal); None: it ended by itself."""
    network_isolated: bool
    """True: a network namespace; False: only the weaker audit-hook guard."""
    uid: int | None
    """The unprivileged uid it ran as; None: it ran as the service's own user."""

    @property
    def timed_out(self) -> bool:
        return self.limit == "wall_time"

    @property
    def ok(self) -> bool:
        """Exited 0 without hitting a limit."""
        return self.returncode == 0 and self.limit is None


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    cpu_s: int
    memory_mb: int
    max_processes: int
    max_output_bytes: int


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: int = 256,
    max_processes: int = 16,
    max_output_bytes: int = 1 << 20,
    isolation: Isolation | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox; blocks for at most about ``timeout_s``.

    A program that fails or hits a limit is a normal result; only a failure of the sandbox
    itself raises (``SandboxError``).
    """
    limits = _Limits(timeout_s, cpu_s, memory_mb, max_processes, max_output_bytes)
    iso = isolation or detect_isolation()
    with _UIDS.lease(iso.uid_base) as uid, _workdir(uid) as work, tempfile.TemporaryFile() as f:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as main:
            main.write(code)
        f.write(stdin.encode())
        f.seek(0)
        return _run(iso, uid, work, f, limits)


async def run_python_async(code: str, **options: Any) -> SandboxResult:
    """``run_python`` in a worker thread (same keywords).

    The run is spent waiting on pipes, so a thread costs nothing next to the interpreter
    start, and one implementation serves both the (synchronous) verifiers and async callers.
    Cancelling the caller does not stop the run; its own wall timeout does.
    """
    return await asyncio.to_thread(run_python, code, **options)


def _run(iso: Isolation, uid: int | None, work: str, stdin: IO[bytes],
         limits: _Limits) -> SandboxResult:
    start = time.monotonic()
    proc = _spawn(iso, uid, work, stdin, limits)
    swept = False

    def sweep() -> None:
        nonlocal swept
        _kill_all(proc.pid, uid)
        swept = True

    try:
        out, err, limit = _collect(proc, start + limits.timeout_s, limits.max_output_bytes, sweep)
    finally:
        if not swept:  # swept after the program exited, nothing of it can be left
            _kill_all(proc.pid, uid)  # before wait(): a reaped leader's pgid could be reused
        proc.wait()
    stderr = err.decode("utf-8", "replace")
    return SandboxResult(
        returncode=proc.returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        duration_s=time.monotonic() - start,
        limit=limit or _limit_of(proc.returncode, stderr),
        network_isolated=iso.network_namespace,
        uid=uid,
    )


def _spawn(iso: Isolation, uid: int | None, work: str, stdin: IO[bytes],
           limits: _Limits) -> subprocess.Popen[bytes]:
    guard = () if iso.network_namespace else ("-c", _GUARD)
    flags = _unshare_flags(iso)
    setup = functools.partial(_enter_sandbox, flags, uid, _rlimits(limits, uid, flags))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    try:
        return subprocess.Popen(
            [iso.python, "-I", *guard, "main.py"], cwd=work, env=env, stdin=stdin,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=setup,  # thread-safe as written: see _enter_sandbox
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"cannot start the sandbox ({iso}): {exc}") from exc


def _enter_sandbox(unshare_flags: int, uid: int | None,
                   rlimits: list[tuple[int, tuple[int, int]]]) -> None:
    """In the forked child, before exec.

    Python warns that ``preexec_fn`` can deadlock in a threaded parent; that happens when the
    child takes a lock another thread held at fork time. This function takes none: no imports
    (ctypes is loaded at module import), no logging, only syscalls on prepared arguments.
    Order matters: unshare needs the root capabilities the uid drop gives up, and the address
    space limit comes last because the child is still a copy of the (large) service.
    """
    if unshare_flags and _libc.unshare(unshare_flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare (network namespace) refused")
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    for which, value in rlimits:
        resource.setrlimit(which, value)


def _unshare_flags(iso: Isolation) -> int:
    if not iso.network_namespace:
        return 0
    # Without root a network namespace needs a user namespace of its own to own it.
    return CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET


def _rlimits(limits: _Limits, uid: int | None,
             unshare_flags: int) -> list[tuple[int, tuple[int, int]]]:
    nproc = limits.max_processes
    if uid is None and not unshare_flags & CLONE_NEWUSER:
        # The limit counts every task of the uid, the service's own included; a new user
        # namespace counts only the tasks created inside it.
        nproc += _tasks_of(os.getuid())
    memory = limits.memory_mb << 20
    return [
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),  # SIGXCPU, then SIGKILL
        (resource.RLIMIT_FSIZE, (_FILE_MB << 20, _FILE_MB << 20)),
        (resource.RLIMIT_NOFILE, (_OPEN_FILES, _OPEN_FILES)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_AS, (memory, memory)),
    ]


def _collect(proc: subprocess.Popen[bytes], deadline: float, cap: int,
             kill: Callable[[], None]) -> tuple[bytes, bytes, str | None]:
    """Both outputs, and the limit that stopped reading ("wall_time", "output") or None."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as sel:
            for fd in (*bufs, pidfd):
                sel.register(fd, selectors.EVENT_READ)
            limit = _pump(sel, bufs, pidfd, deadline, cap, kill)
    finally:
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    out, err = bufs.values()
    return bytes(out[:cap]), bytes(err[:cap]), limit


def _pump(sel: selectors.BaseSelector, bufs: dict[int, bytearray], pidfd: int, deadline: float,
          cap: int, kill: Callable[[], None]) -> str | None:
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            return "wall_time"
        for key, _ in sel.select(left):
            if key.fd == pidfd:
                # Children that still hold the pipes must not keep the run alive.
                sel.unregister(pidfd)
                kill()
                continue
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                sel.unregister(key.fd)
            bufs[key.fd] += chunk
            if len(bufs[key.fd]) > cap:
                return "output"
    return None


def _limit_of(returncode: int, stderr: str) -> str | None:
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGXFSZ:
        return "file_size"
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    if returncode != 0 and "MemoryError" in stderr[-2000:]:
        return "memory"  # RLIMIT_AS makes allocations fail; Python reports MemoryError
    return None


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


def _pids_of(uid: int, *, zombies: bool = False) -> list[int]:
    """Processes whose real uid is ``uid``; zombies only if asked (they cannot be killed)."""
    return [pid for pid, owner, state, _ in _statuses()
            if owner == uid and (zombies or state != b"Z")]


def _tasks_of(uid: int) -> int:
    """Tasks (threads) of ``uid``: what RLIMIT_NPROC counts."""
    return sum(threads for _, owner, _, threads in _statuses() if owner == uid)


class _UidPool:
    """A uid per concurrent run: limits, file permissions and the sweep never cross runs.

    Other processes on the host (a second reward instance, a test run) draw from the same
    uids, so a slot is also held by an ``flock`` on a file named after it; the kernel drops
    the lock when its holder dies. A uid whose killed processes are still zombies (PID 1
    reaps them in its own time) is set aside until they are gone, because RLIMIT_NPROC
    counts zombies too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._unreaped: set[int] = set()

    @contextmanager
    def lease(self, base: int | None) -> Iterator[int | None]:
        if base is None:
            yield None
            return
        with self._lock:
            self._unreaped = {u for u in self._unreaped if _pids_of(u, zombies=True)}
            uid, fd = self._claim(base)
        try:
            yield uid
        finally:
            with self._lock:
                self._busy.discard(uid)
                if _pids_of(uid, zombies=True):
                    self._unreaped.add(uid)
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


@contextmanager
def _workdir(uid: int | None) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="rlbus-sandbox-")
    try:
        if uid is not None:
            os.chown(path, uid, uid)
        yield path
    finally:
        if uid is None:
            _make_removable(path)
        shutil.rmtree(path)


def _make_removable(path: str) -> None:
    # Not root: a directory the program made unreadable would stop rmtree. Links are not
    # followed, so the program cannot point the chmod at the service's own files.
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            if not os.path.islink(os.path.join(root, d)):
                os.chmod(os.path.join(root, d), 0o700)


@functools.cache
def detect_isolation() -> Isolation:
    """The strongest isolation this host allows, found once by trial runs (~20 ms each)."""
    for iso in _candidates():
        if _works(iso):
            level = log.info if iso.network_namespace and iso.uid_base is not None else log.warning
            level("sandbox isolation: %s", iso)
            return iso
    raise SandboxError(
        "no Python interpreter runs in the sandbox on this host (as root it must be "
        f"executable by an unprivileged uid: tried {[c.python for c in _candidates()]})")


def _candidates() -> Iterator[Isolation]:
    # The venv's interpreter resolved to its base install: sandboxed code must not import
    # the service's packages, and a root-only home (pyenv under /root) may hide it from the
    # sandbox uid, hence the system interpreters as alternatives.
    found = [sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
    pythons = list(dict.fromkeys(os.path.realpath(p) for p in found if p))
    # Root never runs a program as itself: it ignores RLIMIT_NPROC, so a fork bomb would
    # only stop at the wall timeout and children that left the process group never.
    base = UID_BASE if os.geteuid() == 0 else None
    for net in (True, False):
        for python in pythons:
            yield Isolation(python, base, net)


def _works(iso: Isolation) -> bool:
    try:
        result = run_python("import math, json", timeout_s=10, isolation=iso)
    except SandboxError as exc:
        log.debug("sandbox candidate %s fails: %s", iso, exc)
        return False
    return result.ok
