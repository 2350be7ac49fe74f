"""Settings shared by every service.

Each service has one settings class (``services/rlbus/<tier>/settings.py``) that subclasses
:class:`ServiceSettings`. Values come from keyword arguments, then ``RLBUS_*`` environment
variables (nested with ``__``, e.g. ``RLBUS_KAFKA__BOOTSTRAP``), then the defaults here.
A variable that no rlbus service reads is an error, so a typo in an environment block fails
loudly at start (with the closest known name); one that only another tier reads is accepted
and logged once as unused, so a single shell can configure every tier.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlbus.errors import UnknownSettingError as UnknownSettingError  # still importable from here
from rlbus.limits import Limits


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaSettings(_Section):
    """How to reach the broker, and as whom.

    With SASL each role connects as its own principal (docs/security.md): the password
    comes from ``sasl_password`` or, better, from ``sasl_password_file`` (a mounted secret),
    read when a client connects. A secret never appears in a repr, a log line or a
    validation error (``hide_input_in_errors``: pydantic would quote a rejected value).
    """

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    bootstrap: str = "127.0.0.1:9092"
    """Comma-separated host:port list of brokers."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol of the client listener."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism, required with SASL_* protocols."""
    sasl_username: str | None = None
    """SASL user."""
    sasl_password: SecretStr | None = None
    """SASL password; never logged. Prefer ``sasl_password_file``."""
    sasl_password_file: Path | None = None
    """File holding the SASL password (trailing newline ignored), e.g. a mounted Secret;
    read when a client connects. ``sasl_password``, if set, is used instead."""
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
                for name in ("sasl_mechanism", "sasl_username")
                if getattr(self, name) is None
            ]
            if self.sasl_password is None and self.sasl_password_file is None:
                missing.append("sasl_password or sasl_password_file")
            if missing:
                raise ValueError(f"{self.security_protocol} needs {', '.join(missing)}")
            self.password()  # an unreadable file fails here, at start, not at connect
        return self

    def password(self) -> str | None:
        """The SASL password, from the setting or its file; None without one."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is None:
            return None
        try:
            text = self.sasl_password_file.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read sasl_password_file {self.sasl_password_file}: "
                             f"{exc.strerror}") from None
        password = text.rstrip("\r\n")
        if not password:
            raise ValueError(f"sasl_password_file {self.sasl_password_file} is empty")
        return password


class TopicSettings(_Section):
    """The topic catalogue's knobs (see shared/rlbus/topics.py)."""

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


LAUNCHER_VARIABLES = frozenset({
    "RLBUS_KAFKA_BOOTSTRAP", "RLBUS_KAFKA_CACHE", "RLBUS_HOME",
    "RLBUS_KAFKA_PORT",  # docker-compose.yml: Kafka's port on the host
    "RLBUS_SKIP_DOCKER",  # make compose-test: skip the Docker end-to-end test, on purpose
})
"""RLBUS_* variables read by the broker launcher, docker compose and tests, not by any
settings class: a shell that sets them for those still runs every rlbus command."""

log = logging.getLogger(__name__)
_REPORTED: set[tuple[str, str]] = set()  # (settings class, variable) already logged as unused


def unknown_env_keys(cls: type[BaseModel], environ: Mapping[str, str] | None = None) -> list[str]:
    """RLBUS_* variables that ``cls`` would silently ignore (pydantic-settings drops them)."""
    env = os.environ if environ is None else environ
    return sorted(
        key
        for key in env
        if key.upper().startswith("RLBUS_")
        and key.upper() not in LAUNCHER_VARIABLES
        and not _names_field(cls, _path(key))
    )


def _path(key: str) -> list[str]:
    return key.upper().removeprefix("RLBUS_").split("__")


def _names_field(cls: type[BaseModel], path: list[str]) -> bool:
    fields = {name.upper(): f for name, f in cls.model_fields.items()}
    field = fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    sub = section_of(field.annotation)
    return sub is not None and _names_field(sub, path[1:])


def section_of(annotation: object) -> type[BaseModel] | None:
    """The section (model) class a field holds, an optional one (``X | None``) included."""
    if isinstance(annotation, type):
        return annotation if issubclass(annotation, BaseModel) else None
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


TIERS_GROUP = "rlbus.tiers"
"""Entry-point group of the tiers: ``<name> = <module>:<ServiceSettings subclass>``, the
subclass naming its service class in :attr:`ServiceSettings.service`. The core names no tier:
the runner, the CLI and the variable checks below find them here."""
SETTINGS_GROUP = "rlbus.settings"
"""Entry-point group of other settings classes that read RLBUS_* variables (the operator
commands'), so that a variable only they read is not reported as unknown."""


def tiers() -> dict[str, type[ServiceSettings]]:
    """Every installed tier's settings class by tier name, sorted by name. Imports the
    settings modules only, never a service module (torch)."""
    found: dict[str, type[ServiceSettings]] = {}
    for ep in entry_points(group=TIERS_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, ServiceSettings) and cls.service):
            raise TypeError(f"entry point {TIERS_GROUP}:{ep.name} = {ep.value} is not a "
                            "ServiceSettings subclass that names its service")
        found.setdefault(ep.name, cls)
    return dict(sorted(found.items()))


def settings_classes() -> list[type[BaseModel]]:
    """The settings class of every tier and of the operator commands (both registries),
    loaded only when a variable needs checking: those modules import this one."""
    others: list[type[BaseModel]] = [ep.load() for ep in entry_points(group=SETTINGS_GROUP)]
    return [*tiers().values(), *others]


def variable_names(cls: type[BaseModel], prefix: str = "RLBUS_") -> list[str]:
    """Every variable that sets a field of ``cls``, sections too (RLBUS_KAFKA, RLBUS_KAFKA__X)."""
    names = []
    for name, field in cls.model_fields.items():
        var = prefix + name.upper()
        names.append(var)
        sub = section_of(field.annotation)
        if sub is not None:
            names += variable_names(sub, var + "__")
    return names


def readers_of(key: str, classes: list[type[BaseModel]]) -> list[str]:
    """Names of the settings classes that have a field for the variable ``key``."""
    return [c.__name__ for c in classes if _names_field(c, _path(key))]


def suggestion(key: str, classes: list[type[BaseModel]]) -> str:
    """`` (did you mean RLBUS_X?)`` for the closest known variable, or nothing."""
    known = {n.removeprefix("RLBUS_") for c in classes for n in variable_names(c)}
    close = difflib.get_close_matches(key.upper().removeprefix("RLBUS_"), sorted(known), n=1)
    return f" (did you mean RLBUS_{close[0]}?)" if close else ""


def check_env(cls: type[ServiceSettings], environ: Mapping[str, str] | None = None) -> list[str]:
    """Raise :class:`UnknownSettingError` for RLBUS_* variables no rlbus service reads;
    return those that only other services read (``cls`` ignores them)."""
    unknown = set(unknown_env_keys(cls, environ))
    for other in cls.also_accepted():
        unknown &= set(unknown_env_keys(other, environ))
    if not unknown:
        return []
    classes = settings_classes()
    strangers = sorted(k for k in unknown if not readers_of(k, classes))
    if strangers:
        raise UnknownSettingError(
            "no rlbus service has a setting for "
            + ", ".join(k + suggestion(k, classes) for k in strangers)
            + "; nested keys use __, e.g. RLBUS_KAFKA__BOOTSTRAP"
        )
    return sorted(unknown)


def _report_unused(cls: type[BaseModel], keys: list[str]) -> None:
    """Log each variable that only other tiers read, once per process and class."""
    fresh = [k for k in keys if (cls.__name__, k) not in _REPORTED]
    classes = settings_classes() if fresh else []
    for key in fresh:
        _REPORTED.add((cls.__name__, key))
        readers = ", ".join(readers_of(key, classes))
        log.warning(
            "%s is not a setting of %s (it is one of %s); ignored", key, cls.__name__, readers
        )


class ServiceSettings(BaseSettings):
    """The part of every service's settings that is the same everywhere."""

    service: ClassVar[str] = ""
    """A tier's service class as ``module:Class``, imported only once its settings are valid
    (the runner; see :data:`TIERS_GROUP`); empty for settings that run no service."""

    model_config = SettingsConfigDict(
        env_prefix="RLBUS_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        # a rejected section is quoted whole otherwise, a password in it (KafkaSettings)
        hide_input_in_errors=True,
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
    health_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve ``GET /ready`` and ``/live`` on this TCP port, all interfaces, for an
    orchestrator's probes (:mod:`rlbus.health`); off when unset."""
    health_socket: Path | None = None
    """The same on a unix socket at this path: for pods on the host network, where replicas
    on one node would all want one port (probe: ``python -m rlbus.health ready``)."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The asyncio event loop: uvloop (faster per message; docs/performance.md) where it is
    installed (not on Windows, which falls back to asyncio's own) and Kafka is not spoken
    over TLS (:func:`rlbus.runner.loop_factory`), or asyncio's own."""

    @classmethod
    def also_accepted(cls) -> list[type[BaseModel]]:
        """Settings classes whose RLBUS_* variables this one takes without logging them as
        unused (operator commands run in shells configured for a service)."""
        return []

    def __init__(self, **values: Any) -> None:
        _report_unused(type(self), check_env(type(self)))
        super().__init__(**values)


def settings_env(settings: BaseModel | None = None, /, **fields: object) -> dict[str, str]:
    """The RLBUS_* variables that give a child process these settings, for
    :func:`rlbus.processes.child_env`'s ``extra``.

    ``settings``: a settings object (a tier's, or :class:`ServiceSettings`); each field that
    differs from its default becomes a variable, sections field by field
    (``RLBUS_KAFKA__BOOTSTRAP``). The rest is left out: the child, which inherits no RLBUS_*
    variable (child_env drops them), takes the same defaults, so it builds an equal object.
    ``fields``: top-level settings by name, on top of those: a section (KafkaSettings,
    TopicSettings, Limits, ...) becomes its non-default fields, any other value one variable.
    Values are written as pydantic-settings reads them back (lists and dicts as JSON, bools
    as true/false, secrets in clear). A name no rlbus settings class has is an
    :class:`UnknownSettingError` here, not in a child's log; a section must be an instance of
    its field's class (its defaults are the ones left out).
    """
    env = _model_env(settings, "RLBUS_", None) if settings is not None else {}
    named: dict[str, str] = {}
    for name, value in fields.items():
        named |= _value_env("RLBUS_" + name.upper(), value)
    if fields:
        _check_named(fields, named, settings_classes())
    return env | named


def _model_env(model: BaseModel, prefix: str, defaults: BaseModel | None) -> dict[str, str]:
    """``model``'s fields that differ from ``defaults`` (a section's default instance) or,
    without it, from the class's defaults."""
    env: dict[str, str] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        default = (getattr(defaults, name) if defaults is not None
                   else field.get_default(call_default_factory=True))
        key = prefix + name.upper()
        if isinstance(value, BaseModel) and isinstance(default, type(value)):
            env |= _model_env(value, key + "__", default)
        elif value != default:
            env |= _value_env(key, value)
    return env


def _value_env(key: str, value: object) -> dict[str, str]:
    if isinstance(value, BaseModel):
        return _model_env(value, key + "__", None)
    if value is None:  # pydantic-settings reads no string as None (env_parse_none_str unset)
        raise ValueError(f"{key}: None cannot be set through the environment; leave it out "
                         "to get the default")
    return {key: _render(value)}


def _render(value: object) -> str:
    """``value`` as pydantic-settings parses it back: complex fields (dict, list) from JSON,
    the rest by pydantic's lax string coercion."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)
    return str(value)


def _check_named(fields: Mapping[str, object], env: Mapping[str, str],
                 classes: list[type[BaseModel]]) -> None:
    """Every variable names a setting, and every section is of its field's class: a look-alike
    (another model with the same field names) has other defaults, which would be left out."""
    strangers = [k for k in env if not readers_of(k, classes)]
    if strangers:
        raise UnknownSettingError(
            "no rlbus service has a setting for "
            + ", ".join(k + suggestion(k, classes) for k in strangers)
        )
    for name, value in fields.items():
        kinds = [f.annotation for c in classes if (f := c.model_fields.get(name)) is not None]
        if isinstance(value, BaseModel) and not any(
            (sub := section_of(k)) is not None and isinstance(value, sub) for k in kinds
        ):
            raise TypeError(f"{name}: a {type(value).__name__} is not the {name} section of "
                            "any settings class")
