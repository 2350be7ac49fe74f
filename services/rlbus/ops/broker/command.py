"""``rlbus broker start|stop|status``: a local cluster that outlives the command (state in JSON)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbus.ops.broker.cluster import LocalCluster, port_open, signal_group
from rlbus.ops.broker.jars import DEFAULT_CLI_PORT, LOOPBACK, BrokerError


def state_dir() -> Path:
    """Where ``rlbus broker`` keeps its state file and data: ``$RLBUS_HOME/broker``."""
    home = os.environ.get("RLBUS_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "rlbus"
    return root / "broker"


def _state_file() -> Path:
    return state_dir() / "state.json"


def _load_state() -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(_state_file().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise BrokerError(f"unreadable state file {_state_file()}: {exc}") from exc
    return state


def _save_state(cluster: LocalCluster, credentials: Path | None = None) -> None:
    nodes = [
        {"node_id": n.node_id, "pid": n.proc.pid if n.proc else None, "port": n.port,
         "controller_port": n.controller_port, "config": str(n.config)}
        for n in cluster._nodes
    ]  # fmt: skip
    state = {
        "bootstrap": cluster.bootstrap, "kafka_version": cluster.version,
        "data_dir": str(cluster.data_dir), "started_at": time.time(),
        "startup_seconds": cluster.startup_seconds, "nodes": nodes,
        "credentials": str(credentials) if credentials else None,
    }  # fmt: skip
    tmp = _state_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(_state_file())  # atomic: a reader never sees half a file


def _pid_is_node(pid: int | None, config: str) -> bool:
    """True if ``pid`` runs and is our Kafka node, not an unrelated process that reused it."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: certainly not a node we started
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return True  # no /proc (macOS): trust the pid
    try:
        return config in cmdline.read_bytes().decode(errors="replace")
    except OSError:
        return False


def _live_nodes(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [n for n in state["nodes"] if _pid_is_node(n["pid"], n["config"])]


def _cmd_start(nodes: int, port: int | None, secure: bool = False) -> int:
    state = _load_state()
    if state is not None and _live_nodes(state):
        print(state["bootstrap"])
        print("rlbus broker: already running", file=sys.stderr)
        return 0
    state_dir().mkdir(parents=True, exist_ok=True)
    base = DEFAULT_CLI_PORT if port is None else port
    if secure:
        return _start_secure(nodes, base)
    # Each start is a fresh, empty cluster: dev data is disposable and a reformat avoids
    # stale quorum state when the node count or ports change.
    data = state_dir() / "cluster"
    shutil.rmtree(data, ignore_errors=True)
    cluster = LocalCluster(nodes=nodes, data_dir=data, base_port=base, die_with_parent=False)
    cluster.start()
    _save_state(cluster)
    cluster.detach()
    print(cluster.bootstrap)
    print(
        f"rlbus broker: {nodes} node(s) up in {cluster.startup_seconds:.1f} s; "
        f"logs in {data}; stop with `rlbus broker stop`",
        file=sys.stderr,
    )
    return 0


def _start_secure(nodes: int, base: int) -> int:
    """One node with SASL_SSL, a SCRAM user per role and ACLs enforced; each role's
    settings (no secret in them: the passwords stay in their files) in ``<role>.env``."""
    from rlbus.acl import Role
    from rlbus.ops.broker.secure import SecureCluster

    if nodes != 1:
        raise BrokerError("--secure runs one node")
    root = state_dir() / "secure"
    shutil.rmtree(root, ignore_errors=True)
    secure = SecureCluster(data_dir=root, base_port=base, die_with_parent=False).start()
    creds = secure.credentials
    for role in Role:
        (creds.folder / f"{role}.env").write_text(creds.env_lines(secure.bootstrap, role))
    _save_state(secure.cluster, creds.folder)
    secure.detach()
    print(secure.bootstrap)
    print(
        f"rlbus broker: 1 secured node (SASL_SSL, SCRAM-SHA-512, ACLs) up in "
        f"{secure.cluster.startup_seconds:.1f} s; each role's settings: `source "
        f"{creds.folder}/<role>.env` (admin, rollout, inference, reward, learner); as admin, "
        "`rlbus topics create` then `rlbus acl apply`; stop with `rlbus broker stop`",
        file=sys.stderr,
    )
    return 0


def _cmd_stop(timeout: float = 30.0) -> int:
    state = _load_state()
    if state is None:
        print("rlbus broker: not running")
        return 0
    live = _live_nodes(state)
    for node in live:
        signal_group(node["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_is_node(n["pid"], n["config"]) for n in live):
        time.sleep(0.2)
    for node in live:
        if _pid_is_node(node["pid"], node["config"]):
            signal_group(node["pid"], signal.SIGKILL)
    _state_file().unlink(missing_ok=True)
    print(f"rlbus broker: stopped {len(live)} node(s)")
    return 0


def _cmd_status() -> int:
    state = _load_state()
    if state is None:
        print("rlbus broker: not running")
        return 1
    print(state["bootstrap"])
    if state.get("credentials"):
        print(f"secured: each role's settings in {state['credentials']}/<role>.env")
    healthy = True
    for node in state["nodes"]:
        alive = _pid_is_node(node["pid"], node["config"])
        reachable = alive and port_open(int(node["port"]))
        healthy = healthy and reachable
        print(
            f"node {node['node_id']}: pid {node['pid']} {'alive' if alive else 'dead'}, "
            f"{LOOPBACK}:{node['port']} {'reachable' if reachable else 'unreachable'}"
        )
    return 0 if healthy else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlbus broker", description="Run a local Apache Kafka broker (needs Java 17+, Maven)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start in the background and print the bootstrap address")
    start.add_argument("--nodes", type=int, choices=(1, 3), default=1)
    start.add_argument(
        "--secure", action="store_true",
        help="SASL_SSL with a SCRAM user per role, ACLs enforced (docs/security.md)",
    )  # fmt: skip
    start.add_argument(
        "--port", type=int, default=None,
        help=f"first broker port (default {DEFAULT_CLI_PORT}); node i uses P+2i and P+2i+1",
    )  # fmt: skip
    sub.add_parser("stop", help="stop the broker started by `start`")
    sub.add_parser("status", help="print the bootstrap address and each node's health")
    return parser


def main(argv: Sequence[str]) -> int:
    """``rlbus broker start|stop|status``; returns the process exit code."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "start":
            return _cmd_start(args.nodes, args.port, args.secure)
        if args.command == "stop":
            return _cmd_stop()
        return _cmd_status()
    except BrokerError as exc:
        print(f"rlbus broker: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
