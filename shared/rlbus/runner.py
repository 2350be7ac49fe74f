"""Start one service: settings and logging first, heavy imports (torch) only after.

``rlbus --help`` and a settings error answer in well under a second because nothing here
imports torch; the service module is imported only once the settings are valid.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from rlbus import logs, telemetry
from rlbus.errors import AccessDeniedError, MissingTopicError
from rlbus.plugins import PluginError
from rlbus.settings import ServiceSettings, UnknownSettingError, tiers
from rlbus.transport import BrokerConnectError


def tier_names() -> tuple[str, ...]:
    """The installed tiers (entry-point group ``rlbus.tiers``; see :func:`rlbus.settings.tiers`)."""
    return tuple(tiers())


def settings_class(name: str) -> type[ServiceSettings]:
    found = tiers()
    if name not in found:
        raise SystemExit(f"rlbus: no tier named {name!r}; installed: {', '.join(found)}")
    return found[name]


def load(path: str) -> Any:
    """``module:attr``, imported."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def configure_logging(level: str) -> None:
    """Before the service module (and torch, transformers) is imported: see :mod:`rlbus.logs`."""
    logs.configure(level)


def loop_factory(kind: str, tls: bool = False) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop if asked for and installed; None: asyncio's default.

    ``tls``: the Kafka clients speak TLS. Closing one then took 30 s now and then on
    uvloop (its TLS shutdown waits out ``ssl_shutdown_timeout`` for the broker's
    close_notify: 1 close in 4 measured, never on asyncio's loop), which stalls a start that
    closes a reader and every drain; so asyncio's loop is used, and said."""
    if kind != "uvloop":
        return None
    if tls:
        logging.getLogger(__name__).warning(
            "Kafka over TLS: using asyncio's event loop, not uvloop, whose TLS close can stall "
            "for 30 s (RLBUS_EVENT_LOOP=asyncio says this without the warning)")
        return None
    try:
        import uvloop
    except ImportError:  # not built for this platform (Windows), or not installed
        logging.getLogger(__name__).warning(
            "RLBUS_EVENT_LOOP=uvloop but uvloop is not installed; using asyncio's loop")
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_service(name: str, **overrides: Any) -> dict[str, Any]:
    """Parse settings (env + overrides), then import and serve the service until it stops."""
    try:
        settings = settings_class(name)(**overrides)
    except (ValidationError, UnknownSettingError) as exc:
        raise SystemExit(f"rlbus {name}: invalid settings:\n{exc}") from None
    configure_logging(settings.log_level)
    telemetry.setup(f"rlbus-{name}")
    try:
        service = load(type(settings).service)(settings)
        tls = settings.kafka.security_protocol in ("SSL", "SASL_SSL")
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop, tls)) as runner:
            summary: dict[str, Any] = runner.run(service.serve())
    except BrokerConnectError as exc:
        raise SystemExit(f"rlbus {name}: cannot reach Kafka: {exc}") from None
    except (AccessDeniedError, MissingTopicError) as exc:  # a missing ACL or topic
        raise SystemExit(f"rlbus {name}: {exc}") from None
    except PluginError as exc:  # a task, agent or verifier that cannot be found or loaded
        raise SystemExit(f"rlbus {name}: {exc}") from None
    finally:
        telemetry.shutdown()
    return summary
