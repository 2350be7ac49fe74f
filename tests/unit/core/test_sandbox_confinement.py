"""A sandboxed program sees only its own run: no host files (hidden tests, answers, the
checkout), no other process, none of the service's environment, nowhere to write but its work
directory and its private /tmp. Without bubblewrap nothing runs at all."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbus import sandbox, sandbox_uids
from rlbus.sandbox import (
    Isolation,
    SandboxError,
    detect_isolation,
    run_python,
)

ISO = detect_isolation()
CHECKOUT = Path(__file__).resolve().parents[3]
WALL_S = 60.0
"""Wall timeout of every run here: these tests are about what a run sees, not how fast it
starts, and on a loaded machine starting bwrap and the interpreter can take seconds (the
default 5 s made them fail under load). A run that ends by itself returns at once."""

PROBE = """\
import json, os, sys
def attempt(action, *args):
    try:
        return repr(action(*args))
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({path: attempt(%s, path) for path in json.loads(sys.stdin.read())}))
"""


def probe(action: str, paths: list[str]) -> dict[str, str]:
    """``action(path)`` in the sandbox for each path: its repr, or the OSError it raised."""
    result = run_python(PROBE % action, stdin=json.dumps(paths), timeout_s=WALL_S)
    assert result.ok, result
    found: dict[str, str] = json.loads(result.stdout)
    return found


def run_json(code: str) -> Any:
    result = run_python(code, timeout_s=WALL_S)
    assert result.ok, result
    return json.loads(result.stdout)


@pytest.fixture
def planted_answer() -> Iterator[tuple[str, str]]:
    """A world-readable file in the host's /tmp, as another process could leave one there."""
    secret = f"answer-{uuid.uuid4()}"
    fd, path = tempfile.mkstemp(prefix="rlbus-planted-", dir="/tmp")
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.chmod(path, 0o644)
    try:
        yield path, secret
    finally:
        os.unlink(path)


def world_readable(path: Path) -> bool:
    return all(p.stat().st_mode & stat.S_IROTH for p in (path, *path.parents))


# ------------------------------------------------------------------------------ reading


def test_a_planted_answer_and_the_checkout_are_unreadable(
        planted_answer: tuple[str, str]) -> None:
    path, secret = planted_answer
    hidden_test = Path(__file__).resolve()
    assert world_readable(hidden_test)  # on the host any uid could read it
    found = probe("lambda p: open(p).read()",
                  [path, str(hidden_test), str(CHECKOUT / "pyproject.toml")])
    assert set(found.values()) == {"FileNotFoundError"}, found
    assert secret not in json.dumps(found)


def test_the_checkout_and_the_host_directories_cannot_be_listed() -> None:
    found = probe("os.listdir", [str(CHECKOUT), str(CHECKOUT.parent), "/root", "/home",
                                 "/opt", "/var", "/sys"])
    if CHECKOUT.parent == Path(tempfile.gettempdir()):  # a checkout in /tmp (a fresh clone):
        # the run's /tmp is its own, holding only its work dir, not the host's /tmp
        listing = found.pop(str(CHECKOUT.parent))
        assert CHECKOUT.name not in listing and "rlbus-sandbox-" in listing, listing
    assert set(found.values()) == {"FileNotFoundError"}, found
    seen = run_json("import json, os\nprint(json.dumps({d: sorted(os.listdir(d)) for d in "
                    "('/', '/etc', '/tmp')} | {'cwd': os.getcwd()}))")
    assert set(seen["/"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc",
                              "proc", "dev", "tmp"}, seen
    assert seen["/etc"] == ["ld.so.cache"]
    assert seen["/tmp"] == [os.path.basename(seen["cwd"])]  # only its own work directory


def test_a_file_the_program_writes_to_tmp_stays_private() -> None:
    name = f"rlbus-private-{uuid.uuid4()}"
    result = run_python(f"import os\nopen('/tmp/{name}', 'w').write('x')\n"
                        "print(os.listdir('/tmp'))", timeout_s=WALL_S)
    assert result.ok, result
    assert name in result.stdout and not os.path.exists(f"/tmp/{name}")


def test_nothing_outside_the_work_directory_and_tmp_is_writable() -> None:
    targets = ["/x", "/usr/x", "/etc/x", "/dev/x", "/proc/x", "/bin/x",
               str(CHECKOUT / "x"), str(Path(tempfile.gettempdir()).parent / "x")]
    found = probe("lambda p: open(p, 'w').close()", targets)
    assert "None" not in found.values(), found
    assert not any(os.path.exists(t) for t in targets[-2:])
    assert probe("lambda p: open(p, 'w').close()", ["/tmp/x", "/dev/shm/x", "x"]) == {
        "/tmp/x": "None", "/dev/shm/x": "None", "x": "None"}


# ------------------------------------------------------------------- processes, environment


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    """A secret in this process's environment and in a host process's /proc/<pid>/environ."""
    secret = f"secret-{uuid.uuid4()}"
    monkeypatch.setenv("RLBUS_SANDBOX_TEST_SECRET", secret)
    holder = subprocess.Popen(["sleep", "60"])  # inherits the secret; runs as this uid
    try:
        yield secret, holder.pid
    finally:
        holder.kill()
        holder.wait()


READ_PROC = """\
import json, os
def read(path):
    try:
        with open(path, 'rb') as f:
            return f.read().decode('utf-8', 'replace')
    except OSError as exc:
        return type(exc).__name__
pids = sorted(p for p in os.listdir('/proc') if p.isdigit())
print(json.dumps({'env': dict(os.environ), 'pids': pids,
                  'environs': {p: read(f'/proc/{p}/environ') for p in pids},
                  'host': {p: read(f'/proc/{p}/environ') for p in (%d, %d)}}))
"""


def test_no_other_process_and_none_of_the_services_environment_is_visible(
        secret_env: tuple[str, int]) -> None:
    secret, holder_pid = secret_env
    with open(f"/proc/{holder_pid}/environ", "rb") as f:
        assert secret.encode() in f.read()  # readable here, by this uid
    seen = run_json(READ_PROC % (holder_pid, os.getpid()))
    assert seen["pids"] == ["1", "2"], seen["pids"]  # bwrap's reaper and the program
    assert set(seen["host"].values()) == {"FileNotFoundError"}, seen["host"]
    assert "RLBUS_SANDBOX_TEST_SECRET" not in seen["env"]
    assert secret not in json.dumps(seen)


def test_a_process_that_outlives_the_program_dies_with_the_run() -> None:
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.close(1)\n"
            "    os.close(2)\n    time.sleep(600)\nprint('parent exits')")
    result = run_python(code, timeout_s=WALL_S)
    # ended by itself (no "wall_time" limit) long before the child's 600 s: nothing waited
    # for the child, however slow the machine
    assert result.ok and result.stdout == "parent exits\n", result
    if result.uid is not None:
        assert not sandbox_uids._pids_of(result.uid)


@pytest.mark.skipif(not ISO.network_namespace, reason="the no-network guard blocks ctypes")
def test_the_program_cannot_create_user_namespaces() -> None:
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))")
    result = run_python(code, timeout_s=WALL_S)
    assert result.ok and result.stdout.startswith("-1 "), result


# ------------------------------------------------------------------------------- no bwrap


def test_without_bwrap_nothing_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sandbox, "SEARCH_PATH", str(tmp_path))  # bwrap is not in there
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    with pytest.raises(SandboxError, match="bubblewrap"):
        run_python(f"open({str(marker)!r}, 'w')", isolation=ISO)
    with pytest.raises(SandboxError, match="bubblewrap"):
        detect_isolation.__wrapped__()
    with pytest.raises(SandboxError, match="bubblewrap"):
        run_python("print(1)", isolation=Isolation(ISO.python, ISO.uid_base, False))
    assert not marker.exists()
