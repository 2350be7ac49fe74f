"""A local Kafka broker secured as production ones are: SASL_SSL, SCRAM-SHA-512 and ACLs.

On top of :class:`~rlbus.ops.broker.LocalCluster`, one combined node with:

* a throwaway CA and a broker certificate for 127.0.0.1/localhost, made with
  ``cryptography`` (PEM files; EC P-256);
* one SCRAM-SHA-512 user per role (:class:`rlbus.acl.Role`), created at storage format
  time (``StorageTool format --add-scram``: in KRaft the credentials live in the metadata
  log, and the broker's own inter-broker login must exist before its first start), each
  password in a file of its own (``credentials/<role>.password``, mode 0600);
* the client and inter-broker listener SASL_SSL; the controller listener SSL with client
  certificates required, so that only a holder of the broker's key reaches it (SCRAM cannot
  guard a KRaft controller listener: its users live in the log the controller serves);
* ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false`` and ``User:admin``
  as the only super user; the broker's certificate maps to that principal
  (``ssl.principal.mapping.rules``). The tiers' rights are ACLs: ``rlbus acl apply``.

Nothing secret is logged: passwords are in files and in the JAAS entry of
``server.properties`` (0600), which Kafka itself logs as ``[hidden]``.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.acl import Role
from rlbus.ops.broker.cluster import LocalCluster, free_port_pairs
from rlbus.ops.broker.jars import LOOPBACK, BrokerError
from rlbus.settings import KafkaSettings
from rlbus.transport import client_options

MECHANISM = "SCRAM-SHA-512"
LISTENER = "SASL_SSL"
BROKER_CN = "rlbus-broker"
"""Subject of the broker's certificate, mapped to the admin principal."""


@dataclass(frozen=True)
class Certificates:
    """PEM files of one throwaway CA and the broker certificate it signed."""

    ca: Path
    """The CA certificate: what clients trust (``KafkaSettings.ssl_cafile``)."""
    keystore: Path
    """The broker's PKCS#8 private key followed by its certificate chain."""


def make_certificates(folder: Path, hosts: Sequence[str] = (LOOPBACK, "localhost"),
                      days: float = 2, *, ca_name: str = "rlbus test CA") -> Certificates:
    """Write a new CA and a broker certificate valid for ``hosts`` and ``days`` (negative:
    one that has expired) into ``folder``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise BrokerError("a secured local broker needs the `cryptography` package to make "
                          "its certificates: pip install cryptography") from None

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = sorted([now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)])
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(x509, cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = [_general_name(x509, h) for h in hosts]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
        .issuer_name(ca_subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(x509, cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_file, keystore = folder / "ca.pem", folder / "broker.pem"
    ca_file.write_bytes(ca.public_bytes(pem))
    # PKCS#8, unencrypted: the form Kafka's PEM keystore reads without a key password.
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write_private(keystore, private + cert.public_bytes(pem) + ca.public_bytes(pem))
    return Certificates(ca=ca_file, keystore=keystore)


def _key_usage(x509: Any, *, cert_sign: bool) -> Any:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False)


def _general_name(x509: Any, host: str) -> Any:
    # an IP literal must be an iPAddress entry: clients check an IP host only against those
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


@dataclass(frozen=True)
class Credentials:
    """Where a secured broker's client secrets live: the CA and a password file per role."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    def password_file(self, role: Role | str) -> Path:
        return self.folder / f"{role}.password"

    def kafka(self, bootstrap: str, role: Role | str, **changes: Any) -> KafkaSettings:
        """Settings of a client of ``role`` (its password read from its file)."""
        return KafkaSettings(**{**self.fields(bootstrap, role), **changes})

    def fields(self, bootstrap: str, role: Role | str) -> dict[str, Any]:
        """``KafkaSettings`` fields of a client of ``role``: what ``env_lines`` writes."""
        return {"bootstrap": bootstrap, "security_protocol": LISTENER,
                "sasl_mechanism": MECHANISM, "sasl_username": str(role),
                "sasl_password_file": self.password_file(role), "ssl_cafile": self.ca}

    def env_lines(self, bootstrap: str, role: Role | str) -> str:
        """``export RLBUS_KAFKA__...`` lines for a shell of ``role`` (no secret in them)."""
        return "".join(f"export RLBUS_KAFKA__{k.upper()}={v}\n"
                       for k, v in self.fields(bootstrap, role).items())


def _jaas(username: str, password: str) -> str:
    return ("org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{username}" password="{password}";')


def secure_overrides(port: int, controller_port: int, certs: Certificates,
                     admin_password: str) -> dict[str, str]:
    """server.properties entries of one node secured as the module docstring says."""
    sasl, ctl = f"listener.name.{LISTENER.lower()}", "listener.name.controller"
    return {
        "listeners": f"{LISTENER}://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"{LISTENER}://{LOOPBACK}:{port}",
        "listener.security.protocol.map": f"CONTROLLER:SSL,{LISTENER}:{LISTENER}",
        "inter.broker.listener.name": LISTENER,
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        # the broker's own login when it connects to its inter-broker listener as a client
        f"{sasl}.{MECHANISM.lower()}.sasl.jaas.config": _jaas(Role.ADMIN, admin_password),
        f"{sasl}.ssl.keystore.type": "PEM",
        f"{sasl}.ssl.keystore.location": str(certs.keystore),
        f"{sasl}.ssl.truststore.type": "PEM",
        f"{sasl}.ssl.truststore.location": str(certs.ca),
        f"{ctl}.ssl.keystore.type": "PEM",
        f"{ctl}.ssl.keystore.location": str(certs.keystore),
        f"{ctl}.ssl.truststore.type": "PEM",
        f"{ctl}.ssl.truststore.location": str(certs.ca),
        f"{ctl}.ssl.client.auth": "required",
        "ssl.principal.mapping.rules": f"RULE:^CN={BROKER_CN}$/{Role.ADMIN}/,DEFAULT",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{Role.ADMIN}",
    }


def scram_format_args(passwords: dict[Role, str]) -> list[str]:
    """``StorageTool format`` arguments that create every role's SCRAM user."""
    args = []
    for role, password in passwords.items():
        args += ["--add-scram", f"{MECHANISM}=[name={role},password={password}]"]
    return args


class SecureCluster:
    """One combined Kafka node reachable only through SASL_SSL with a SCRAM user per role,
    enforcing ACLs. ``data_dir``: where certificates, credentials and data live (default: a
    temporary folder that ``stop()`` deletes)."""

    def __init__(self, *, data_dir: Path | None = None, base_port: int | None = None,
                 heap_mb: int | None = None, die_with_parent: bool = True) -> None:
        self._owns_dir = data_dir is None
        self.root = Path(data_dir or tempfile.mkdtemp(prefix="rlbus-secure-kafka-")).resolve()
        # hex only: the --add-scram parser and the JAAS string need no quoting then
        self.passwords = {role: secrets.token_hex(16) for role in Role}
        try:
            self.credentials = self._write_credentials()
            self.certs = make_certificates(self.root / "tls")
            shutil.copyfile(self.certs.ca, self.credentials.ca)
            self.cluster = self._cluster(base_port, heap_mb, die_with_parent)
        except BaseException:
            self._remove()
            raise

    def _write_credentials(self) -> Credentials:
        credentials = Credentials(self.root / "credentials")
        credentials.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for role, password in self.passwords.items():
            _write_private(credentials.password_file(role), password.encode())
        return credentials

    def _cluster(self, base_port: int | None, heap_mb: int | None,
                 die_with_parent: bool) -> LocalCluster:
        [(port, controller_port)] = (free_port_pairs(1) if base_port is None
                                     else [(base_port, base_port + 1)])
        overrides = secure_overrides(port, controller_port, self.certs,
                                     self.passwords[Role.ADMIN])
        # the readiness check speaks the same protocol as the services do
        probe = client_options(self.credentials.kafka(f"{LOOPBACK}:{port}", Role.ADMIN))
        cluster = LocalCluster(data_dir=self.root / "cluster", base_port=port,
                               heap_mb=heap_mb, overrides=overrides,
                               format_args=scram_format_args(self.passwords),
                               client_options=probe, die_with_parent=die_with_parent)
        return cluster

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    def kafka(self, role: Role | str = Role.ADMIN, **changes: Any) -> KafkaSettings:
        """Settings of a client of ``role`` on this broker."""
        return self.credentials.kafka(self.bootstrap, role, **changes)

    def start(self, timeout: float = 90.0) -> SecureCluster:
        try:
            self.cluster.start(timeout=timeout)
        except BaseException:
            self._remove()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> None:
        try:
            self.cluster.stop(timeout=timeout)
        finally:
            self._remove()

    def detach(self) -> None:
        """Leave the node running after this process exits (``rlbus broker start --secure``)."""
        self.cluster.detach()

    def _remove(self) -> None:
        if self._owns_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SecureCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
