"""The sandbox contains what model-generated code does wrong (fork bombs, endless loops, memory
hogs, network calls, floods of output) and the python_tests verifier scores through it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from rlbus import sandbox
from rlbus.code_verifier import extract_program, python_tests
from rlbus.sandbox import (
    UID_BASE,
    Isolation,
    SandboxResult,
    detect_isolation,
    run_python_async,
)

ISO = detect_isolation()
WALL_S = 60.0
"""Wall timeout of the runs that set none: the default 5 s is short for starting bwrap and an
interpreter on a loaded machine. A run that ends by itself returns at once."""


def run_python(code: str, **options: Any) -> SandboxResult:
    """``sandbox.run_python`` with ``WALL_S`` unless the test sets its own timeout."""
    return sandbox.run_python(code, **{"timeout_s": WALL_S, **options})

needs_uid_drop = pytest.mark.skipif(
    ISO.uid_base is None, reason=f"runs keep the service's uid here ({ISO})")


def sandbox_processes() -> dict[int, int]:
    """Live processes per sandbox uid (zombies hold no resources but a pid)."""
    found: dict[int, int] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(status["Uid"].split()[0])
        if UID_BASE <= uid < UID_BASE + 1000 and not status["State"].strip().startswith("Z"):
            found[uid] = found.get(uid, 0) + 1
    return found


# --------------------------------------------------------------------------- plain runs


def test_a_normal_program_gets_stdin_and_returns_output_and_exit_code() -> None:
    code = "import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)"
    result = run_python(code, stdin="abc\n")
    assert (result.returncode, result.stdout, result.stderr) == (3, "cba\n", "warn\n")
    assert result.limit is None and not result.ok
    assert run_python("print(6 * 7)").ok


def test_runs_in_a_fresh_directory_that_is_removed_afterwards_even_if_locked() -> None:
    code = ("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
            "os.chmod('a/b', 0)\nos.chmod('a', 0o500)\nprint(os.getcwd(), os.getuid())")
    result = run_python(code)
    workdir, uid = result.stdout.split()
    assert result.ok, result.stderr
    assert not os.path.exists(workdir)
    if ISO.uid_base is not None:
        assert int(uid) == result.uid != 0


def test_huge_output_is_truncated_and_the_program_stopped() -> None:
    result = run_python("while True:\n    print('x' * 1000)", max_output_bytes=10_000)
    assert result.limit == "output" and not result.ok  # stopped for its output, not its time
    assert 0 < len(result.stdout) <= 10_000


def test_a_memory_hog_fails_without_harming_the_caller() -> None:
    result = run_python("data = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.limit == "memory" and "allocated" not in result.stdout
    assert run_python("print('still fine')").stdout == "still fine\n"


async def test_the_async_api_runs_concurrent_programs_under_distinct_uids() -> None:
    results = await asyncio.gather(*(run_python_async(f"print({i})", timeout_s=WALL_S)
                                     for i in range(3)))
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
    if ISO.uid_base is not None:
        assert len({r.uid for r in results}) == 3


# ------------------------------------------------------------------------------ limits


@pytest.mark.slow
def test_an_infinite_loop_is_killed_by_the_cpu_limit() -> None:
    # The wall timeout is far off: even on a loaded machine one CPU second comes first.
    result = run_python("while True:\n    pass", cpu_s=1, timeout_s=30)
    assert result.limit == "cpu_time" and result.returncode < 0


@pytest.mark.slow
def test_a_sleeping_program_is_killed_by_the_wall_timeout() -> None:
    result = run_python("import time\ntime.sleep(60)", timeout_s=1)
    assert result.timed_out and result.returncode < 0
    assert result.duration_s < 30  # a safety net: far below the program's own 60 s


FORK_BOMB = """\
import os
while True:
    try:
        if os.fork() == 0:
            os.setsid()  # leave the process group: only the per-run uid still finds it
    except OSError:
        pass
"""


@pytest.mark.slow
@needs_uid_drop
def test_a_fork_bomb_is_bounded_and_every_process_is_gone_afterwards() -> None:
    # Per uid: a concurrent test session may run sandboxes under the neighbouring uids.
    peak: dict[int, int] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            for uid, count in sandbox_processes().items():
                peak[uid] = max(peak.get(uid, 0), count)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_python(FORK_BOMB, timeout_s=1.5, max_processes=8)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.uid is not None
    assert 1 < peak[result.uid] <= 8  # it forked, and RLIMIT_NPROC held it at the limit
    assert result.uid not in sandbox_processes()
    machine_ok = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True,
                                timeout=10)
    assert machine_ok.stdout == b"1\n"
    assert run_python("import os\nos.fork() or print('forks again')").ok


# ----------------------------------------------------------------------------- network

CONNECT = """\
import socket
for address in [("127.0.0.1", {port}), ("10.255.255.1", 80)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("connected", address)
    except OSError as exc:
        print("refused", type(exc).__name__)
"""


def _connect_from_sandbox(isolation: Isolation) -> SandboxResult:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.1)
        port = listener.getsockname()[1]
        result = run_python(CONNECT.format(port=port), isolation=isolation)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.ok, result.stderr
    assert "connected" not in result.stdout and result.stdout.count("refused") == 2
    return result


def test_network_calls_fail() -> None:
    result = _connect_from_sandbox(ISO)
    assert result.network_isolated == ISO.network_namespace


def test_without_a_network_namespace_the_guard_refuses_network_and_escape_hatches() -> None:
    guarded = Isolation(ISO.python, ISO.uid_base, network_namespace=False)
    result = _connect_from_sandbox(guarded)
    assert not result.network_isolated and "PermissionError" in result.stdout
    for escape in ("import socket; socket.getaddrinfo('example.com', 80)", "import ctypes",
                   "import subprocess", "import os; os.system('true')"):
        attempt = run_python(escape, isolation=guarded)
        assert "PermissionError: sandbox" in attempt.stderr, escape
    assert run_python("print(sum(range(10)))", isolation=guarded).stdout == "45\n"


# ---------------------------------------------------------------------------- verifier

ADD = {"verifier": "python_tests", "timeout_s": 10.0,  # a run takes ~0.1 s, seconds under load
       "tests": [{"stdin": "1 2\n", "expected": "3\n"}, {"stdin": "5 -5", "expected": "0"}]}


def test_the_verifier_scores_the_fraction_of_tests_passed() -> None:
    right = "a, b = map(int, input().split())\nprint(a + b)"
    half = "a, b = map(int, input().split())\nprint(3)"
    assert python_tests(ADD, [right]) == 1.0
    assert python_tests(ADD, ["thinking", f"here:\n```python\n{right}\n```\ndone"]) == 1.0
    assert python_tests(ADD, [half]) == 0.5
    assert python_tests(ADD, ["print(undefined)"]) == 0.0
    assert python_tests(ADD, ["def broken(:"]) == 0.0
    assert python_tests(ADD, []) == 0.0


def test_a_spec_without_tests_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError):
        python_tests({"verifier": "python_tests", "tests": []}, ["print(1)"])


def test_extract_program_takes_the_last_fenced_block() -> None:
    action = "```py\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```"
    assert extract_program(action) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


@pytest.mark.slow
def test_a_hanging_program_scores_zero_within_the_timeout() -> None:
    start = time.monotonic()
    assert python_tests({**ADD, "timeout_s": 1.0}, ["import time\ntime.sleep(60)"]) == 0.0
    assert time.monotonic() - start < 30  # a safety net: far below the program's own 60 s


def test_the_total_budget_fails_the_tests_it_had_no_time_for() -> None:
    spec = {**ADD, "total_timeout_s": 0.0}
    assert python_tests(spec, ["a, b = map(int, input().split())\nprint(a + b)"]) == 0.0
