"""Probes backed by the service's real state: /ready is 503 while it starts and while it drains,
200 in between; /live answers throughout; the probe program exits by the answer."""

import asyncio
from pathlib import Path

import pytest

from rlbus.health import HealthServer, main, probe
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="hp", partitions=1)


async def test_ready_follows_the_callable_and_live_is_always_200():
    state = {"ready": False}
    server = HealthServer(lambda: state["ready"])
    await server.start(port=0, host="127.0.0.1")
    try:
        assert await probe("/ready", port=server.port) == 503
        assert await probe("/live", port=server.port) == 200
        state["ready"] = True
        assert await probe("/ready", port=server.port) == 200
    finally:
        await server.close()
    assert await probe("/live", port=server.port, timeout_s=1) == 0  # closed: nothing answers


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    if not request.endswith(b"\r\n\r\n"):
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /ready HTTP/1.1\r\n\r\n", b"405"),
        (b"HEAD /live HTTP/1.1\r\n\r\n", b"200"),
        (b"GET /ready?verbose=1 HTTP/1.1\r\n\r\n", b"200"),
        (b"GET /ready HTTP/1.1\r\n", b"400"),  # the client gave up before the blank line
        (b"GET /ready HTTP/1.1\r\nX: " + b"a" * 5000 + b"\r\n\r\n", b"400"),  # too long
    ],
)
async def test_what_is_not_a_probe_is_refused_by_status(request_bytes, status):
    server = HealthServer(lambda: True)
    await server.start(port=0, host="127.0.0.1")
    try:
        answer = await _raw(server.port, request_bytes)
        assert answer.split(b" ")[1] == status
        assert b"Content-Length:" in answer
    finally:
        await server.close()


class Gated(Reward):
    """A reward service whose setup and drain each wait for a gate the test opens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.setup_gate = asyncio.Event()
        self.drain_gate = asyncio.Event()
        self.draining = asyncio.Event()

    async def setup(self) -> None:
        await self.setup_gate.wait()
        await super().setup()

    async def drain(self) -> None:
        self.draining.set()
        await self.drain_gate.wait()
        await super().drain()


async def test_a_service_is_ready_only_between_setup_and_the_stop_request(tmp_path: Path):
    sock = tmp_path / "health.sock"
    service = Gated(RewardSettings(topics=TOPICS, health_socket=sock),
                    MemoryBus(memory_broker(TOPICS)))
    run = asyncio.create_task(service.run())
    await wait_until(sock.exists, "the health socket is up")
    assert await probe("/ready", socket=sock) == 503  # starting
    assert await probe("/live", socket=sock) == 200

    service.setup_gate.set()
    await wait_until(service.ready.is_set, "setup finished")
    assert await probe("/ready", socket=sock) == 200

    service.request_stop("SIGTERM")
    await asyncio.wait_for(service.draining.wait(), 30)
    assert await probe("/ready", socket=sock) == 503  # draining: take it out of rotation
    assert await probe("/live", socket=sock) == 200  # ...but do not kill it

    service.drain_gate.set()
    await asyncio.wait_for(run, 30)
    assert await probe("/live", socket=sock, timeout_s=1) == 0  # stopped: nothing answers


async def test_a_socket_left_by_a_killed_predecessor_is_replaced(tmp_path: Path):
    sock = tmp_path / "health.sock"
    sock.write_text("stale")
    server = HealthServer(lambda: True)
    await server.start(socket=sock)
    try:
        assert await probe("/ready", socket=sock) == 200
    finally:
        await server.close()


async def test_the_probe_program_exits_by_the_answer(tmp_path, monkeypatch, capsys):
    state = {"ready": False}
    server = HealthServer(lambda: state["ready"])
    await server.start(socket=tmp_path / "h.sock")
    monkeypatch.setenv("RLBUS_HEALTH_SOCKET", str(tmp_path / "h.sock"))
    try:
        # main() runs its own event loop, so it runs in a thread beside this one
        assert await asyncio.to_thread(main, ["ready"]) == 1
        state["ready"] = True
        assert await asyncio.to_thread(main, ["ready"]) == 0
        assert await asyncio.to_thread(main, ["live"]) == 0
    finally:
        await server.close()
    assert "503" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["ready"]) == 1  # nothing answers
    assert main(["sideways"]) == 2


def test_the_probe_program_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("RLBUS_HEALTH_SOCKET", raising=False)
    monkeypatch.delenv("RLBUS_HEALTH_PORT", raising=False)
    assert main(["ready"]) == 2
    assert "RLBUS_HEALTH_SOCKET" in capsys.readouterr().err
