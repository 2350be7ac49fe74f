"""The Kafka jars: resolved once with Maven (``pom.xml`` beside this file) into a cache folder.

Why not Docker: the tests and the demo must run where Docker is unavailable; Java 17 and Maven
are enough.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rlbus.errors import FatalError
from rlbus.processes import die_with_parent

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.4.0"
LOOPBACK = "127.0.0.1"
DEFAULT_CLI_PORT = 9092
BOOTSTRAP_ENV = "RLBUS_KAFKA_BOOTSTRAP"
INSTALL_HINT = (
    "install a Java 17+ runtime and Maven (Debian/Ubuntu: "
    "`apt-get install openjdk-17-jre-headless maven`; macOS: `brew install openjdk@17 maven`), "
    f"or run Kafka with `docker compose up` and set {BOOTSTRAP_ENV}=host:port"
)



class BrokerError(FatalError, RuntimeError):
    """The local Kafka broker could not be provisioned, started, stopped or reached."""


# --------------------------------------------------------------------------------------------
# Jars
# --------------------------------------------------------------------------------------------


def jar_cache_dir(version: str = KAFKA_VERSION) -> Path:
    """The folder holding the broker's jars: ``$RLBUS_KAFKA_CACHE`` or the per-version default."""
    override = os.environ.get("RLBUS_KAFKA_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "rlbus" / f"kafka-{version}" / "lib"


def resolve_jars(version: str = KAFKA_VERSION) -> Path:
    """Return the folder with Kafka ``version`` and its runtime jars, fetching them if needed."""
    lib = jar_cache_dir(version)
    if _has_kafka_jar(lib, version):
        return lib
    _require_tool("mvn")
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Maven writes into a staging folder that is renamed into place only when complete, so an
    # interrupted download never looks like a usable cache, and concurrent runs cannot mix.
    staging = Path(tempfile.mkdtemp(prefix=".lib-staging-", dir=lib.parent))
    try:
        _run_mvn(staging, version)
        _publish(staging, lib, version)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lib


def _has_kafka_jar(lib: Path, version: str) -> bool:
    if (lib / f"kafka_2.13-{version}.jar").is_file():
        return True
    others = sorted(p.name for p in lib.glob("kafka_2.13-*.jar")) if lib.is_dir() else []
    if others:
        raise BrokerError(
            f"{lib} holds {others[0]}, not Kafka {version}; "
            "delete it or point RLBUS_KAFKA_CACHE to another folder"
        )
    return False


def _run_mvn(out: Path, version: str) -> None:
    pom = Path(__file__).parent / "pom.xml"
    if not pom.is_file():
        raise BrokerError(f"missing package data {pom}; reinstall rlbus")
    cmd = [
        "mvn", "-q", "-B", "-Dstyle.color=never", "-f", str(pom), "dependency:copy-dependencies",
        f"-DoutputDirectory={out}", "-DincludeScope=runtime", f"-Dkafka.version={version}",
    ]  # fmt: skip
    log.info("resolving Kafka %s jars with Maven into %s (first run only)", version, out)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          preexec_fn=die_with_parent())  # no Maven JVM outlives us
    if proc.returncode != 0:
        tail = tail_text(proc.stdout + proc.stderr, 30)
        raise BrokerError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    log.info("Maven resolved the jars in %.1f s", time.monotonic() - started)


def _publish(staging: Path, lib: Path, version: str) -> None:
    if not (staging / f"kafka_2.13-{version}.jar").is_file():
        raise BrokerError(f"Maven finished but produced no kafka_2.13-{version}.jar in {staging}")
    if lib.is_dir() and not any(lib.iterdir()):
        lib.rmdir()  # an empty folder (e.g. a fresh RLBUS_KAFKA_CACHE) may be replaced
    try:
        staging.rename(lib)
    except OSError as exc:
        if not _has_kafka_jar(lib, version):  # lost a race to another process: theirs is fine
            raise BrokerError(f"cannot move the jars into {lib}: it is not empty") from exc


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BrokerError(f"`{name}` is not on PATH; {INSTALL_HINT}")
    return path


def require_java() -> str:
    java = _require_tool("java")
    proc = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if match is None:
        raise BrokerError(f"cannot read the Java version from `java -version`: {proc.stderr!r}")
    major = int(match.group(2)) if match.group(1) == "1" else int(match.group(1))
    if major < 17:
        raise BrokerError(f"Kafka 4.x needs Java 17+, found Java {major} at {java}; {INSTALL_HINT}")
    return java


def tail_text(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
