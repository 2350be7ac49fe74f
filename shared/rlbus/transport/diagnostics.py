"""Why the first connection to the cluster failed, in words a user can act on."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from rlbus.settings import KafkaSettings


async def explain_connect_failure(kafka: KafkaSettings, options: dict[str, Any]) -> str:
    """Why the first bootstrap broker refuses us.

    aiokafka logs the cause of a failed bootstrap and raises only "Unable to bootstrap"; one
    direct connection surfaces the real error (wrong password, untrusted certificate, wrong
    protocol), which is what a user needs to fix their settings.
    """
    from aiokafka.conn import create_conn
    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    host, _, port = kafka.bootstrap.split(",")[0].strip().rpartition(":")
    opts = {k: v for k, v in options.items() if k != "bootstrap_servers"}
    where = f"Kafka at {kafka.bootstrap}"
    try:
        conn = await asyncio.wait_for(create_conn(host, int(port), **opts), kafka.request_timeout_s)
    except SaslAuthenticationFailed as exc:
        return (
            f"{where}: authentication failed for user {kafka.sasl_username!r} with "
            f"{kafka.sasl_mechanism}; check RLBUS_KAFKA__SASL_USERNAME and "
            f"SASL_PASSWORD or SASL_PASSWORD_FILE ({exc})"
        )
    except UnsupportedSaslMechanismError as exc:
        return f"{where} does not accept SASL mechanism {kafka.sasl_mechanism} ({exc})"
    except ssl.SSLError as exc:
        return (f"TLS to {where} failed: {exc}; the broker's certificate must be current, "
                "name this host and be signed by the CA in RLBUS_KAFKA__SSL_CAFILE")
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port}; is the broker running?"
    except (OSError, TimeoutError, Exception) as exc:
        return (
            f"{where} closed the connection ({type(exc).__name__}: {exc}); does its listener "
            f"expect security_protocol={kafka.security_protocol}?"
        )
    conn.close()
    return f"{where} accepted a direct connection but not the client's bootstrap"
