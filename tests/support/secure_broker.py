"""A local Kafka broker that only speaks SASL_SSL with SCRAM-SHA-512, for security tests.

Why a separate module: services/rlbus/ops/broker/ runs a PLAINTEXT broker; production brokers
require TLS and SCRAM, so the services must be proven against that too. This module adds, on
top of ``LocalCluster``:

  * a throwaway CA and a broker certificate for 127.0.0.1/localhost (``openssl`` CLI, PEM),
  * a SCRAM-SHA-512 user created at format time (``StorageTool format --add-scram``),
  * the server.properties overrides for a single combined node whose broker listener (client
    and inter-broker traffic) is SASL_SSL; the controller listener stays PLAINTEXT on
    loopback, as it carries no client traffic.

``SecureCluster(...).start()`` then gives ``bootstrap`` and ``settings()``: keyword arguments
for ``rlbus.settings.KafkaSettings``.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.ops.broker import LOOPBACK, BrokerError, LocalCluster, free_port_pairs
from rlbus.settings import KafkaSettings
from rlbus.transport import client_options

MECHANISM = "SCRAM-SHA-512"
LISTENER = "SASL_SSL"

# A config of our own, so the result does not depend on the system's openssl.cnf (whose
# default v3_ca section would clash with, or add to, the extensions below).
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = rlbus
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = {san}
"""


@dataclass(frozen=True)
class Certificates:
    """PEM files of one throwaway CA and the broker certificate it signed."""

    ca: Path
    """The CA certificate: what clients trust (``KafkaSettings.ssl_cafile``)."""
    keystore: Path
    """The broker's PKCS#8 private key followed by its certificate chain."""


def _openssl(*args: str | Path) -> None:
    cmd = ["openssl", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BrokerError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _san(hosts: Sequence[str]) -> str:
    # IP literals must be iPAddress entries: clients check an IP host only against those.
    return ",".join(
        f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts
    )


def make_certificates(
    folder: Path, hosts: Sequence[str] = (LOOPBACK, "localhost"), days: int = 2
) -> Certificates:
    """Write a new CA and a broker certificate valid for ``hosts`` into ``folder``."""
    if shutil.which("openssl") is None:
        raise BrokerError("`openssl` is not on PATH; it is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    cnf, ca_key, ca = folder / "openssl.cnf", folder / "ca.key", folder / "ca.pem"
    key, csr, crt = folder / "broker.key", folder / "broker.csr", folder / "broker.crt"
    cnf.write_text(_OPENSSL_CNF.format(san=_san(hosts)))
    # EC P-256: instant to generate; genpkey writes PKCS#8, the form Kafka's PEM reader wants.
    for k in (ca_key, key):
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", k)
    _openssl("req", "-x509", "-new", "-key", ca_key, "-config", cnf, "-extensions", "ca_ext",
             "-subj", "/CN=rlbus test CA", "-days", str(days), "-out", ca)  # fmt: skip
    _openssl("req", "-new", "-key", key, "-config", cnf, "-subj", "/CN=localhost", "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
             "-set_serial", str(secrets.randbits(63)), "-days", str(days),
             "-extfile", cnf, "-extensions", "server_ext", "-out", crt)  # fmt: skip
    keystore = folder / "broker.pem"
    keystore.write_text(key.read_text() + crt.read_text() + ca.read_text())
    keystore.chmod(0o600)
    return Certificates(ca=ca, keystore=keystore)


def scram_format_args(username: str, password: str) -> list[str]:
    """``StorageTool format`` arguments that create the SCRAM user before the first start.

    In KRaft, SCRAM credentials live in the metadata log; the broker authenticates to itself
    over the SASL_SSL inter-broker listener, so its own user must exist before it can start.
    """
    return ["--add-scram", f"{MECHANISM}=[name={username},password={password}]"]


def sasl_ssl_overrides(
    port: int, controller_port: int, certs: Certificates, username: str, password: str
) -> dict[str, str]:
    """server.properties entries for one node whose broker listener is SASL_SSL + SCRAM."""
    prefix = f"listener.name.{LISTENER.lower()}"
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{username}" password="{password}";'
    )
    return {
        "listeners": f"{LISTENER}://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"{LISTENER}://{LOOPBACK}:{port}",
        "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{LISTENER}:{LISTENER}",
        "inter.broker.listener.name": LISTENER,
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        # The broker side of SCRAM reads users from metadata; this login is the broker's own,
        # used when it connects to the inter-broker listener as a client.
        f"{prefix}.{MECHANISM.lower()}.sasl.jaas.config": jaas,
        f"{prefix}.ssl.keystore.type": "PEM",
        f"{prefix}.ssl.keystore.location": str(certs.keystore),
        f"{prefix}.ssl.truststore.type": "PEM",  # for the broker's own inter-broker client
        f"{prefix}.ssl.truststore.location": str(certs.ca),
    }


class SecureCluster:
    """One combined Kafka node reachable only through SASL_SSL with a SCRAM-SHA-512 user.

    Certificates and data live in one temporary folder that ``stop()`` deletes.
    """

    def __init__(
        self,
        *,
        username: str = "admin",
        password: str | None = None,
        heap_mb: int | None = None,
    ) -> None:
        self.username = username
        # Hex only: the --add-scram parser and the JAAS string need no quoting then.
        self.password = password or secrets.token_hex(16)
        self.root = Path(tempfile.mkdtemp(prefix="rlbus-secure-kafka-")).resolve()
        try:
            self.certs = make_certificates(self.root / "tls")
            self.cluster = self._cluster(heap_mb)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _cluster(self, heap_mb: int | None) -> LocalCluster:
        [(port, controller_port)] = free_port_pairs(1)
        overrides = sasl_ssl_overrides(
            port, controller_port, self.certs, self.username, self.password
        )
        # The readiness check must speak the same protocol as the services do.
        probe = client_options(KafkaSettings(**self.settings(f"{LOOPBACK}:{port}")))
        return LocalCluster(
            data_dir=self.root / "cluster",
            base_port=port,
            heap_mb=heap_mb,
            overrides=overrides,
            format_args=scram_format_args(self.username, self.password),
            client_options=probe,
        )

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    def settings(
        self, bootstrap: str | None = None, *, password: str | None = None
    ) -> dict[str, Any]:
        """``KafkaSettings`` keyword arguments for this cluster (``password`` to test a bad one)."""
        return {
            "bootstrap": bootstrap or self.bootstrap,
            "security_protocol": LISTENER,
            "sasl_mechanism": MECHANISM,
            "sasl_username": self.username,
            "sasl_password": self.password if password is None else password,
            "ssl_cafile": self.certs.ca,
        }

    def start(self, timeout: float = 90.0) -> SecureCluster:
        try:
            self.cluster.start(timeout=timeout)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        return self

    def stop(self, timeout: float = 20.0) -> None:
        try:
            self.cluster.stop(timeout=timeout)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SecureCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
