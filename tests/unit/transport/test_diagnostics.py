"""Why the first connection failed, in one line a user can act on: here, a certificate that
has expired or that the configured CA did not sign, from a real TLS endpoint on loopback
(the handshake fails before any Kafka byte, so no broker is needed)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlbus.errors import BrokerConnectError
from rlbus.ops.broker.secure import Certificates, make_certificates
from rlbus.settings import KafkaSettings
from rlbus.transport import KafkaBus


async def _tls_endpoint(certs: Certificates) -> tuple[asyncio.Server, int]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.keystore)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def expired(tmp_path: Path) -> AsyncIterator[tuple[Certificates, int]]:
    certs = make_certificates(tmp_path / "expired", days=-1)
    server, port = await _tls_endpoint(certs)
    async with server:
        yield certs, port


def _kafka(port: int, ca: Path) -> KafkaSettings:
    return KafkaSettings(bootstrap=f"127.0.0.1:{port}", security_protocol="SASL_SSL",
                         sasl_mechanism="SCRAM-SHA-512", sasl_username="reward",
                         sasl_password="pw", ssl_cafile=ca, request_timeout_s=10)


@pytest.mark.parametrize("ca", ["same", "other"])
async def test_an_expired_or_foreign_certificate_is_one_line_naming_the_fix(
    expired: tuple[Certificates, int], tmp_path: Path, ca: str
) -> None:
    certs, port = expired
    trusted = certs.ca if ca == "same" else make_certificates(tmp_path / "other").ca
    bus = KafkaBus(_kafka(port, trusted), dlq_topic=None, service="t")
    with pytest.raises(BrokerConnectError) as caught:
        async with asyncio.timeout(30):
            await bus.producer()
    message = str(caught.value)
    assert "\n" not in message and "RLBUS_KAFKA__SSL_CAFILE" in message
    assert "certificate verify failed" in message
    assert ("certificate has expired" in message) == (ca == "same")
