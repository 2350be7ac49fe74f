"""Settings shared by every service.

Each service has one settings class (``services/<x>/settings.py``) that subclasses
:class:`ServiceSettings`. Values come from keyword arguments, then ``RLBUS_*`` environment
variables (nested with ``__``, e.g. ``RLBUS_KAFKA__BOOTSTRAP``), then the defaults here.
Unknown keys are an error, so a typo in an environment block fails loudly at start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlbus.limits import Limits


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaSettings(_Section):
    """How to reach the broker; security settings are here from the start."""

    bootstrap: str = "127.0.0.1:9092"
    """Comma-separated host:port list of brokers."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol of the client listener."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism, required with SASL_* protocols."""
    sasl_username: str | None = None
    """SASL user."""
    sasl_password: SecretStr | None = None
    """SASL password; never logged."""
    ssl_cafile: Path | None = None
    """CA bundle that signed the broker certificate (SSL, SASL_SSL)."""
    ssl_certfile: Path | None = None
    """Client certificate for mutual TLS."""
    ssl_keyfile: Path | None = None
    """Private key of the client certificate."""
    request_timeout_s: float = 30.0
    """Upper bound on any single broker call; aiokafka can otherwise hang forever
    while the broker is down (aiokafka #1101)."""

    @model_validator(mode="after")
    def _sasl_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL_"):
            missing = [
                name
                for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"{self.security_protocol} needs {', '.join(missing)}")
        return self


class TopicSettings(_Section):
    """The topic catalogue's knobs (see shared/topics.py)."""

    prefix: str = "rlbus"
    """Every topic is named ``<prefix>.<name>``, so several runs can share a cluster."""
    partitions: int = Field(default=8, ge=1)
    """Partitions of the work topics; the most members a consumer group can use."""
    result_partitions: int = Field(default=16, ge=1)
    """Partitions of steps.results; each rollout instance owns one (its instance index)."""
    replication: int = Field(default=1, ge=1)
    """Replication factor; 3 in production with min_insync_replicas 2."""
    min_insync_replicas: int = Field(default=1, ge=1)
    """Replicas that must acknowledge a write (acks=all)."""
    retention_ms: int = 7 * 24 * 3600 * 1000
    """How long work topics keep messages; long enough to replay a run."""
    max_message_bytes: int = 8 * 1024 * 1024
    """Largest message a topic accepts; trajectories of long episodes are large."""


LAUNCHER_VARIABLES = frozenset({"RLBUS_KAFKA_BOOTSTRAP", "RLBUS_KAFKA_CACHE", "RLBUS_HOME"})
"""RLBUS_* variables read by the broker launcher and tests, not by any settings class."""


class UnknownSettingError(ValueError):
    """An RLBUS_* environment variable names no setting of this service."""


def unknown_env_keys(cls: type[BaseModel], environ: dict[str, str] | None = None) -> list[str]:
    """RLBUS_* variables that ``cls`` would silently ignore (pydantic-settings drops them)."""
    env = os.environ if environ is None else environ
    return sorted(
        key
        for key in env
        if key.upper().startswith("RLBUS_")
        and key.upper() not in LAUNCHER_VARIABLES
        and not _names_field(cls, key.upper().removeprefix("RLBUS_").split("__"))
    )


def _names_field(cls: type[BaseModel], path: list[str]) -> bool:
    fields = {name.upper(): f for name, f in cls.model_fields.items()}
    field = fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    sub = field.annotation
    return isinstance(sub, type) and issubclass(sub, BaseModel) and _names_field(sub, path[1:])


class ServiceSettings(BaseSettings):
    """The part of every service's settings that is the same everywhere."""

    model_config = SettingsConfigDict(
        env_prefix="RLBUS_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    kafka: KafkaSettings = KafkaSettings()
    """Broker connection."""
    topics: TopicSettings = TopicSettings()
    """Topic names and shapes."""
    instance: str = "0"
    """This member's name within its tier; appears in logs and transactional ids."""
    group: str = ""
    """Consumer group; default ``<topic prefix>.<tier>``, so runs under different prefixes
    on one cluster never share a group."""
    limits: Limits = Limits()
    """Operator limits on what a message may ask for (``RLBUS_LIMITS__*``); over one, the
    message is dead-lettered before any work starts."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level."""
    max_messages: int | None = None
    """Stop after handling this many input messages (bounded runs for tests)."""
    until_idle_s: float | None = None
    """Stop after this many seconds without input (bounded runs for tests)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long to finish in-flight work before giving it back."""

    @classmethod
    def also_accepted(cls) -> list[type[BaseModel]]:
        """Settings classes whose RLBUS_* variables this one tolerates (operator commands
        run in shells configured for a service)."""
        return []

    def __init__(self, **values: Any) -> None:
        unknown = set(unknown_env_keys(type(self)))
        for other in self.also_accepted():
            unknown &= set(unknown_env_keys(other))
        if unknown:
            raise UnknownSettingError(
                f"{type(self).__name__} has no setting for {', '.join(sorted(unknown))}; "
                "check the spelling (nested keys use __, e.g. RLBUS_KAFKA__BOOTSTRAP)"
            )
        super().__init__(**values)
