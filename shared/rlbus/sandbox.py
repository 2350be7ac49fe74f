"""Run untrusted (model-generated) Python in a throwaway, resource-limited process.

Each run gets a fresh ``python -I`` process under bubblewrap (``bwrap``), in a new temporary
directory (always removed), with a minimal environment and its own session, so the whole
process group can be killed. In the forked child, before ``exec``, it gets:

- ``no_new_privs``, so setuid binaries cannot regain privileges;
- when the service runs as root: an unprivileged uid/gid of its own (``UID_BASE`` + a slot
  per concurrent run). Root ignores ``RLIMIT_NPROC`` and file permissions, so as root a run
  is never started without this drop. A uid per run also lets the final sweep kill every
  process of that uid without touching the service or another run;
- rlimits: CPU seconds, address space, file size, open files, processes (bwrap's own two
  processes count), no core dumps.

bwrap then puts the program in new user, mount, pid, network, IPC, UTS and cgroup
namespaces (no further user namespaces allowed inside) and it sees only:

- ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` that lead into it), ``/etc/ld.so.cache``
  and the interpreter's own install prefix when it lies outside ``/usr``, all read-only,
  on a root that is itself read-only;
- its work directory (the program; ``HOME`` and ``TMPDIR``), a private ``/tmp`` and
  ``/dev/shm`` (tmpfs, ``_TMP_MB`` each), a minimal ``/dev``;
- a fresh ``/proc`` of its own pid namespace: no other process is visible, so none can be
  signalled or have its environment read, and every process of the run dies with it;
- no network: a namespace with only its own loopback.

Without ``bwrap`` (or where it cannot create its namespaces) nothing runs: ``SandboxError``.
What the host allows is found once by trial runs (``detect_isolation``) and each result says
what applied (``network_isolated``, ``uid``). Without a network namespace the program runs
under an audit hook that refuses sockets other than ``AF_UNIX``, name lookups, ``ctypes`` and
spawning programs: a guard against accidental network use, not against code written to
escape it. A service that is not root keeps its uid for its runs; their pid namespace still
hides the service from them.

Not contained: disk use in the work directory (bounded per file by ``RLIMIT_FSIZE``, not in
total) until the run ends, and reads of what the read-only system directories hold (the
interpreter's installed packages, for one).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from rlbus.sandbox_uids import (
    _UIDS,
    SandboxError,
    _kill_all,
    _tasks_of,
)

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
_TMP_MB = 64
"""Size of the private ``/tmp`` and of ``/dev/shm``: both are memory no rlimit counts."""

SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
"""Where ``bwrap`` and the system ``python3`` are looked up (never the service's ``PATH``)."""
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""What a run sees of the host, read-only; on a merged-/usr system all but /usr are links."""

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


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated on this host (see ``detect_isolation``)."""

    python: str
    """Interpreter the program runs under; the sandbox uid must be able to reach it (bwrap
    binds it into the run as that uid)."""
    uid_base: int | None
    """Runs get uid ``uid_base + slot``; None: they keep the service's uid."""
    network_namespace: bool
    """A fresh network namespace; False: only the audit-hook guard."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run of a program did."""

    returncode: int
    """Exit status; negative: killed by that signal (bwrap reports that as 128 + signal, so a
    program's own exit status above 128 reads as a signal too)."""
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
    return _run_program(code, stdin, limits, isolation or detect_isolation(), confine=True)


def _run_program(code: str, stdin: str, limits: _Limits, iso: Isolation, *,
                 confine: bool) -> SandboxResult:
    """``confine=False`` leaves out bwrap (no mount or pid namespace): only
    ``loadtest/sandbox_bench.py`` uses it, to measure what the confinement costs."""
    with _UIDS.lease(iso.uid_base) as uid, _workdir(uid) as work, tempfile.TemporaryFile() as f:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as main:
            main.write(code)
        f.write(stdin.encode())
        f.seek(0)
        return _run(iso, uid, work, f, limits, confine)


async def run_python_async(code: str, **options: Any) -> SandboxResult:
    """``run_python`` in a worker thread (same keywords).

    The run is spent waiting on pipes, so a thread costs nothing next to the interpreter
    start, and one implementation serves both the (synchronous) verifiers and async callers.
    Cancelling the caller does not stop the run; its own wall timeout does.
    """
    return await asyncio.to_thread(run_python, code, **options)


def _run(iso: Isolation, uid: int | None, work: str, stdin: IO[bytes], limits: _Limits,
         confine: bool) -> SandboxResult:
    start = time.monotonic()
    proc = _spawn(iso, uid, work, stdin, limits, confine)
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
    returncode = _program_status(proc.returncode) if confine else proc.returncode
    return SandboxResult(
        returncode=returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        duration_s=time.monotonic() - start,
        limit=limit or _limit_of(returncode, stderr),
        network_isolated=iso.network_namespace,
        uid=uid,
    )


def _program_status(status: int) -> int:
    """The program's exit status from bwrap's, which reports death by signal N as 128 + N
    (so an exit status above 128 reads as that signal, as in a shell)."""
    if 128 < status <= 128 + signal.NSIG:
        return -(status - 128)
    return status


def _spawn(iso: Isolation, uid: int | None, work: str, stdin: IO[bytes], limits: _Limits,
           confine: bool) -> subprocess.Popen[bytes]:
    guard = () if iso.network_namespace else ("-c", _GUARD)
    confinement = [_find_bwrap(), *_bwrap_options(iso, work), "--"] if confine else []
    flags = 0 if confine else _unshare_flags(iso)
    setup = functools.partial(_enter_sandbox, flags, uid, _rlimits(limits, uid, flags))
    env = {"PATH": SEARCH_PATH, "HOME": work, "TMPDIR": work,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    try:
        return subprocess.Popen(
            [*confinement, iso.python, "-I", *guard, "main.py"], cwd=work, env=env, stdin=stdin,
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


def _find_bwrap() -> str:
    """Path of ``bwrap``; without it no program runs (``SandboxError``), never unconfined."""
    path = shutil.which("bwrap", path=SEARCH_PATH)
    if path is None:
        raise SandboxError(
            f"bubblewrap (bwrap) is not installed (looked in {SEARCH_PATH}): the sandbox does "
            "not run programs without it; install it with `apt-get install bubblewrap`")
    return path


def _bwrap_options(iso: Isolation, work: str) -> list[str]:
    """bwrap's namespaces and the run's whole filesystem (see the module docstring)."""
    tmpfs_size = str(_TMP_MB << 20)
    return [
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", *(["--unshare-net"] if iso.network_namespace else []),
        "--disable-userns", "--die-with-parent", "--hostname", "sandbox",
        *_host_mounts(iso.python),
        "--proc", "/proc", "--dev", "/dev",
        "--size", tmpfs_size, "--tmpfs", "/tmp", "--size", tmpfs_size, "--tmpfs", "/dev/shm",
        "--bind", work, work, "--chdir", work,
        "--remount-ro", "/dev", "--remount-ro", "/",  # not recursive: the mounts above stay
    ]


@functools.cache
def _host_mounts(python: str) -> tuple[str, ...]:
    mounts: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            mounts += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            mounts += ["--ro-bind", path, path]
    # An interpreter outside the system directories (conda, pyenv) brings its prefix, unless
    # that is "/" itself.
    prefix = os.path.dirname(os.path.dirname(python))
    if prefix != "/" and not any(_is_under(python, path) for path in _SYSTEM_DIRS):
        mounts += ["--ro-bind", prefix, prefix]
    return (*mounts, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache")


def _is_under(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def _unshare_flags(iso: Isolation) -> int:
    """Namespaces the forked child creates itself: only on the unconfined path (benchmark),
    as the sandbox did before bwrap; bwrap creates them otherwise."""
    if not iso.network_namespace:
        return 0
    # Without root a network namespace needs a user namespace of its own to own it.
    return CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET


def _rlimits(limits: _Limits, uid: int | None,
             unshare_flags: int) -> list[tuple[int, tuple[int, int]]]:
    nproc = limits.max_processes
    if uid is None and not unshare_flags & CLONE_NEWUSER:
        # The limit counts every task of the uid, the service's own included. bwrap's user
        # namespace does not change that: it is made after the limit is set, and the kernel
        # checks the count of each enclosing namespace against the limit its creator had.
        # Only a user namespace made before the limit is set counts just its own tasks.
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
    """The strongest isolation this host allows, found once by trial runs (~25 ms each).

    Raises ``SandboxError`` when bwrap is missing or no trial run works: programs then go
    unscored, never unconfined.
    """
    _find_bwrap()
    failures = []
    for iso in _candidates():
        failure = _trial(iso)
        if failure is None:
            level = log.info if iso.network_namespace and iso.uid_base is not None else log.warning
            level("sandbox isolation: %s", iso)
            return iso
        log.debug("sandbox candidate %s fails: %s", iso, failure)
        failures.append(f"{iso}: {failure}")
    raise SandboxError(
        "no Python interpreter runs in the sandbox on this host (bwrap binds it as the "
        "sandbox uid, so as root that uid must be able to reach it); tried:\n"
        + "\n".join(failures))


def _candidates() -> Iterator[Isolation]:
    # The venv's interpreter resolved to its base install: sandboxed code must not import
    # the service's packages, and a root-only home (pyenv under /root) may hide it from the
    # sandbox uid, hence the system interpreters as alternatives.
    found = [sys.executable, shutil.which("python3", path=SEARCH_PATH)]
    pythons = list(dict.fromkeys(os.path.realpath(p) for p in found if p))
    # Root never runs a program as itself: it ignores RLIMIT_NPROC, so a fork bomb would
    # only stop at the wall timeout.
    base = UID_BASE if os.geteuid() == 0 else None
    for net in (True, False):
        for python in pythons:
            yield Isolation(python, base, net)


_TRIAL_TIMEOUT_S = 60.0
"""Wall timeout of a trial run. A candidate that cannot work fails at once (bwrap refuses);
only a loaded host makes a working one slow, and a trial cut short there would settle the
process on weaker isolation, or none, for good."""


def _trial(iso: Isolation) -> str | None:
    """Why a trial run under ``iso`` fails (bwrap's own message, typically); None: it works."""
    try:
        result = run_python("import math, json", timeout_s=_TRIAL_TIMEOUT_S, isolation=iso)
    except SandboxError as exc:
        return str(exc)
    return None if result.ok else (result.stderr.strip() or f"exit status {result.returncode}")
