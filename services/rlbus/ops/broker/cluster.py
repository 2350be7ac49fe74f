"""A real Apache Kafka 4.x broker (KRaft, combined broker+controller) run natively from jars.

Each node is a plain ``java -cp "lib/*" kafka.Kafka server.properties`` process.
``LocalCluster`` runs 1 or 3 loopback nodes with start/stop and fault injection for tests;
``bootstrap_or_start()`` uses ``$RLBUS_KAFKA_BOOTSTRAP`` if set, else starts a cluster.

Only the standard library is imported at module level; aiokafka is imported lazily inside the
readiness check so that importing this module stays cheap.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from rlbus.ops.broker.jars import (
    BOOTSTRAP_ENV,
    KAFKA_VERSION,
    LOOPBACK,
    BrokerError,
    require_java,
    resolve_jars,
    tail_text,
)
from rlbus.processes import die_with_parent

log = logging.getLogger(__name__)

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Node configuration
# --------------------------------------------------------------------------------------------

# Log to a file only: the console of a detached JVM goes to node.out, which should stay short.
_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.state.name = state.change.logger
logger.state.level = WARN
"""

# Settings chosen for a fast, explicit test broker on a small machine (see KAFKA_NOTES.md 1.3).
_COMMON = {
    "process.roles": "broker,controller",
    "controller.listener.names": "CONTROLLER",
    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    "inter.broker.listener.name": "PLAINTEXT",
    "num.recovery.threads.per.data.dir": "1",
    "offsets.topic.num.partitions": "1",  # default 50 makes the first group join slow
    "transaction.state.log.num.partitions": "1",
    "group.initial.rebalance.delay.ms": "0",  # default 3 s delays every first join
    "auto.create.topics.enable": "false",  # services must create their topics explicitly
    "num.network.threads": "2",
    "num.io.threads": "2",
}

_SINGLE = {
    "offsets.topic.replication.factor": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
}

_TRIPLE = {
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
}


@dataclass
class _Node:
    """One combined broker+controller JVM; ``home`` holds its config, data and logs."""

    node_id: int
    port: int
    controller_port: int
    home: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> Path:
        return self.home / "server.properties"

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def console(self) -> Path:
        return self.logs / "node.out"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _properties(node: _Node, nodes: Sequence[_Node], overrides: Mapping[str, str]) -> str:
    props = dict(_COMMON)
    props["node.id"] = str(node.node_id)
    props["listeners"] = (
        f"PLAINTEXT://{LOOPBACK}:{node.port},CONTROLLER://{LOOPBACK}:{node.controller_port}"
    )
    props["advertised.listeners"] = f"PLAINTEXT://{LOOPBACK}:{node.port}"
    props["log.dirs"] = str(node.data)
    if len(nodes) == 1:
        # Dynamic quorum (KIP-853), formatted with --standalone.
        props["controller.quorum.bootstrap.servers"] = f"{LOOPBACK}:{node.controller_port}"
        props.update(_SINGLE)
    else:
        # Static quorum; format must then get no quorum flags (KAFKA-18987).
        voters = ",".join(f"{n.node_id}@{LOOPBACK}:{n.controller_port}" for n in nodes)
        props["controller.quorum.voters"] = voters
        props.update(_TRIPLE)
    props.update(overrides)
    return "".join(f"{key}={value}\n" for key, value in props.items())


def _new_cluster_id() -> str:
    # Kafka's cluster id is a 16-byte UUID in unpadded base64url, as `StorageTool random-uuid`.
    # Like Kafka's Uuid.randomUuid(), reject a leading "-": the storage tool's argument parser
    # would read `-t -abc...` as an unknown flag (seen as a 1-in-64 flaky format failure).
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


# --------------------------------------------------------------------------------------------
# Ports and processes
# --------------------------------------------------------------------------------------------

# Below Linux's ephemeral range (32768-60999), so an outgoing client socket cannot take a node's
# port between kill_node() and restart_node().
_PORT_RANGE = (20000, 32000)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int) -> list[tuple[int, int]]:
    """``count`` (broker, controller) pairs of adjacent free loopback ports."""
    pairs: list[tuple[int, int]] = []
    used: set[int] = set()
    for _ in range(2000):
        port = random.randrange(_PORT_RANGE[0], _PORT_RANGE[1], 2)
        if {port, port + 1} & used or not (_port_free(port) and _port_free(port + 1)):
            continue
        pairs.append((port, port + 1))
        used |= {port, port + 1}
        if len(pairs) == count:
            return pairs
    raise BrokerError(f"no free loopback ports in {_PORT_RANGE}")


def port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


def signal_group(pid: int, sig: signal.Signals) -> None:
    # Each node runs in its own session, so its process group id is its pid; signalling the
    # group also reaches anything the JVM may have forked.
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail_file(path: Path, lines: int = 25) -> str:
    try:
        return tail_text(path.read_text(errors="replace"), lines)
    except OSError:
        return f"(no {path})"


def _run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, even when called inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


async def _broker_ids(
    bootstrap: str, wait_s: float, client_options: Mapping[str, Any] | None = None
) -> set[int]:
    """Ids of the brokers the cluster reports as serving (KRaft lists only unfenced brokers)."""
    from aiokafka.admin import AIOKafkaAdminClient

    timeout_ms = max(500, int(wait_s * 1000))
    # Our address and deadline win over any in client_options (e.g. a copied request timeout).
    kwargs = {**(client_options or {}), "bootstrap_servers": bootstrap}
    kwargs["request_timeout_ms"] = timeout_ms
    admin = AIOKafkaAdminClient(**kwargs)
    try:
        async with asyncio.timeout(wait_s):
            await admin.start()
            described = await admin.describe_cluster()
    finally:
        await admin.close()
    return {int(broker["node_id"]) for broker in described["brokers"]}


def describe_broker_ids(
    bootstrap: str, timeout: float = 5.0, client_options: Mapping[str, Any] | None = None
) -> set[int]:
    """Broker ids that answer a metadata request at ``bootstrap``; raises on any failure.

    ``client_options``: extra aiokafka client arguments, e.g. security settings (SASL_SSL).
    """
    return _run_sync(lambda: _broker_ids(bootstrap, timeout, client_options))


# --------------------------------------------------------------------------------------------
# LocalCluster
# --------------------------------------------------------------------------------------------


class LocalCluster:
    """One or three Kafka nodes on loopback, each a detached JVM in combined KRaft mode.

    Node indexes ``i`` in the fault-injection methods are 0-based; node ids are ``i + 1``.
    ``data_dir`` defaults to a temporary folder that ``stop()`` deletes; a given one is kept.
    ``base_port`` P gives node i broker port P+2i and controller port P+2i+1.
    ``format_args`` are added to ``StorageTool format`` (e.g. ``--add-scram``: in KRaft, SCRAM
    users needed by the brokers themselves must exist before the first start);
    ``client_options`` are the aiokafka security arguments of the readiness check, for
    clusters whose broker listener is not PLAINTEXT (see :mod:`rlbus.ops.broker.secure`).
    """

    def __init__(
        self,
        nodes: int = 1,
        *,
        data_dir: Path | str | None = None,
        base_port: int | None = None,
        heap_mb: int | None = None,
        version: str = KAFKA_VERSION,
        overrides: Mapping[str, str] | None = None,
        jvm_opts: Sequence[str] = (),
        format_args: Sequence[str] = (),
        client_options: Mapping[str, Any] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        """``die_with_parent``: the nodes are SIGKILLed when the thread that started them
        dies, however it dies (SIGKILL included), so a killed demo, load test or pytest leaves
        no JVM behind; False only for ``rlbus broker start``, whose broker outlives it."""
        if nodes not in (1, 3):
            raise ValueError(f"nodes must be 1 or 3, got {nodes}")
        self.version = version
        self.die_with_parent = die_with_parent
        # 512 MiB for one node, 384 MiB each for three (measured stable for the test suite).
        self.heap_mb = heap_mb or (512 if nodes == 1 else 384)
        self.overrides = dict(overrides or {})
        self.jvm_opts = list(jvm_opts)
        self.format_args = list(format_args)
        self.client_options = dict(client_options or {})
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="rlbus-kafka-")).resolve()
        self.cluster_id = _new_cluster_id()
        self.startup_seconds: float | None = None
        self.format_seconds: float | None = None
        self._lib: Path | None = None
        self._java = "java"
        self._nodes = [
            _Node(i + 1, port, cport, self.data_dir / f"node-{i + 1}")
            for i, (port, cport) in enumerate(self._port_pairs(nodes, base_port))
        ]

    @staticmethod
    def _port_pairs(nodes: int, base_port: int | None) -> list[tuple[int, int]]:
        if base_port is None:
            return free_port_pairs(nodes)
        return [(base_port + 2 * i, base_port + 2 * i + 1) for i in range(nodes)]

    # ---- properties ------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{LOOPBACK}:{n.port}" for n in self._nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self._nodes]

    @property
    def pids(self) -> list[int | None]:
        return [n.proc.pid if n.proc else None for n in self._nodes]

    @property
    def size(self) -> int:
        return len(self._nodes)

    def node_alive(self, i: int) -> bool:
        return self._nodes[i].alive()

    def log_path(self, i: int) -> Path:
        return self._nodes[i].logs / "server.log"

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Format storage, launch every node and return once all brokers serve requests."""
        if any(n.alive() for n in self._nodes):
            raise BrokerError("cluster already started")
        atexit.register(self._stop_at_exit)
        try:  # on any failure stop() kills what started and removes a temporary data dir
            self._java = require_java()
            self._lib = resolve_jars(self.version)
            self._check_ports_free()
            self._format_all()
            started = time.monotonic()
            for node in self._nodes:
                self._launch(node)
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop(timeout=5.0)
            raise
        self.startup_seconds = time.monotonic() - started
        log.info(
            "Kafka %s: %d node(s) ready at %s in %.1f s (format %.1f s)",
            self.version, self.size, self.bootstrap, self.startup_seconds, self.format_seconds,
        )  # fmt: skip
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every node, SIGKILL those still running after ``timeout`` s, tidy up."""
        atexit.unregister(self._stop_at_exit)
        running = [n for n in self._nodes if n.alive()]
        for node in running:
            signal_group(self._pid(node), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in running:
            self._reap(node, deadline)
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def detach(self) -> None:
        """Leave the nodes running after this process exits (used by ``rlbus broker start``)."""
        atexit.unregister(self._stop_at_exit)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- fault injection -------------------------------------------------------------------

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` (0-based): a crash with no controlled shutdown."""
        node = self._nodes[i]
        if node.alive():
            signal_group(self._pid(node), signal.SIGKILL)
            self._reap(node, time.monotonic() + 10.0)

    def stop_node(self, i: int, timeout: float = 20.0) -> None:
        """Gracefully stop node ``i`` (SIGTERM, SIGKILL after ``timeout`` s)."""
        node = self._nodes[i]
        if node.alive():
            signal_group(self._pid(node), signal.SIGTERM)
            self._reap(node, time.monotonic() + timeout)

    def restart_node(self, i: int, timeout: float = 60.0) -> None:
        """Start node ``i`` again on its ports and data (no reformat); wait for the full cluster."""
        self.stop_node(i)
        self._launch(self._nodes[i])
        self._wait_ready(time.monotonic() + timeout)

    def ensure_running(self, timeout: float = 60.0) -> None:
        """Restart any node that is down, e.g. after a fault test that forgot to."""
        down = [n for n in self._nodes if not n.alive()]
        for node in down:
            self._launch(node)
        if down:
            self._wait_ready(time.monotonic() + timeout)

    # ---- internals -------------------------------------------------------------------------

    def _check_ports_free(self) -> None:
        for node in self._nodes:
            for port in (node.port, node.controller_port):
                if not _port_free(port):
                    raise BrokerError(f"port {LOOPBACK}:{port} is already in use")

    def _jvm(self, node: _Node, heap_mb: int) -> list[str]:
        # -XX:TieredStopAtLevel=1 (C1 only) measured: ~1 s faster start and ~400 MB instead of
        # ~690 MB RSS, with the same throughput through aiokafka on 2 cores.
        return [
            self._java, f"-Xms{heap_mb}m", f"-Xmx{heap_mb}m",
            "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExplicitGCInvokesConcurrent",
            "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile=file:{node.home / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={node.logs}", *self.jvm_opts,
            "-cp", f"{self._lib}{os.sep}*",
        ]  # fmt: skip

    def _format_all(self) -> None:
        started = time.monotonic()
        procs = [self._format(node) for node in self._nodes]  # in parallel: one JVM start each
        for node, proc in zip(self._nodes, procs, strict=True):
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise BrokerError(f"formatting node {node.node_id} failed:\n{tail_text(out, 20)}")
        self.format_seconds = time.monotonic() - started

    def _format(self, node: _Node) -> subprocess.Popen[str]:
        shutil.rmtree(node.home, ignore_errors=True)
        node.logs.mkdir(parents=True)
        node.config.touch(mode=0o600)  # may hold a SCRAM password (ops/broker/secure.py)
        node.config.write_text(_properties(node, self._nodes, self.overrides))
        (node.home / "log4j2.properties").write_text(_LOG4J2)
        cmd = [*self._jvm(node, 256), "kafka.tools.StorageTool", "format"]
        cmd += ["--standalone"] if self.size == 1 else []
        cmd += ["-t", self.cluster_id, "-c", str(node.config), *self.format_args]
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, preexec_fn=die_with_parent(),
        )  # fmt: skip

    def _launch(self, node: _Node) -> None:
        cmd = [*self._jvm(node, self.heap_mb), "kafka.Kafka", str(node.config)]
        with node.console.open("ab") as console:
            # A new session keeps the node alive when the launching shell or terminal goes away
            # (needed by `rlbus broker start`) and lets us signal its whole process group.
            node.proc = subprocess.Popen(
                cmd, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent() if self.die_with_parent else None,
            )  # fmt: skip

    def _wait_ready(self, deadline: float) -> None:
        for node in self._nodes:
            while not port_open(node.port, timeout=0.2):
                self._check_alive(node)
                self._check_deadline(deadline, f"port {node.port} of node {node.node_id}")
                time.sleep(0.1)
        expected = {n.node_id for n in self._nodes}
        while True:
            for node in self._nodes:
                self._check_alive(node)
            try:
                ids = describe_broker_ids(self.bootstrap, 2.0, self.client_options)
                if ids >= expected:
                    return
            except Exception as exc:  # not serving yet: any client error means "retry"
                log.debug("broker not ready yet: %r", exc)
            self._check_deadline(deadline, f"brokers {sorted(expected)} registered")
            time.sleep(0.2)

    def _check_alive(self, node: _Node) -> None:
        if node.proc is not None and node.proc.poll() is not None:
            raise BrokerError(
                f"Kafka node {node.node_id} exited with code {node.proc.returncode}.\n"
                f"--- {node.console}:\n{_tail_file(node.console)}\n"
                f"--- {node.logs / 'server.log'}:\n{_tail_file(node.logs / 'server.log')}"
            )

    def _check_deadline(self, deadline: float, waiting_for: str) -> None:
        if time.monotonic() > deadline:
            logs = "\n".join(f"  {n.logs / 'server.log'}" for n in self._nodes)
            raise BrokerError(f"timed out waiting for {waiting_for}; see\n{logs}")

    @staticmethod
    def _pid(node: _Node) -> int:
        assert node.proc is not None
        return node.proc.pid

    @staticmethod
    def _reap(node: _Node, deadline: float) -> None:
        assert node.proc is not None
        try:
            node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("node %d ignored SIGTERM; sending SIGKILL", node.node_id)
            signal_group(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=10.0)

    def _stop_at_exit(self) -> None:
        # Last resort so a crashed test run does not leave JVMs behind; SIGKILL is not caught.
        self.stop(timeout=5.0)


def bootstrap_or_start(nodes: int = 1, timeout: float = 60.0) -> tuple[str, LocalCluster | None]:
    """``($RLBUS_KAFKA_BOOTSTRAP, None)`` if that is set, else ``(bootstrap, started cluster)``.

    The caller owns a returned cluster and must ``stop()`` it.
    """
    external = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if external:
        log.info("using the Kafka at %s=%s", BOOTSTRAP_ENV, external)
        return external, None
    cluster = LocalCluster(nodes=nodes).start(timeout=timeout)
    return cluster.bootstrap, cluster


# --------------------------------------------------------------------------------------------
# CLI: rlbus broker start|stop|status
# --------------------------------------------------------------------------------------------
