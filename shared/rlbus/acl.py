"""Least privilege on the broker: the Kafka ACLs each role needs, derived from the code.

One source of truth: topic names come from the topic catalogue (:class:`rlbus.topics.Topics`),
consumer-group and transactional-id names from :func:`group_name` and
:func:`transactional_id`, which the services use to name theirs. :func:`acls` turns them
into rows (principal, resource type, name, pattern, operation, why); ``rlbus acl apply``
creates them on the broker and docs/security.md prints them as a table.

Roles: ``rollout`` (agent, environment and tool code; the OpenAI gateway runs inside it),
``inference``, ``reward`` (verifiers), ``learner`` (or any trainer on :mod:`rlbus.client`),
and ``admin``, the broker's only super user (topics, ACLs, ``rlbus feed``, ``replay``,
``status``), which needs no rows. Every right is ALLOW; anything not listed is denied
(``allow.everyone.if.no.acl.found=false``). READ and WRITE imply DESCRIBE in Kafka's
authorizer, so DESCRIBE is listed only where nothing else is granted.

Topics are LITERAL: a prefix would leak, since ``rlbus.steps`` is a prefix of
``rlbus.steps.results`` and ``rlbus.weights`` of ``rlbus.weights.served``. Reward's
transactional ids are PREFIXED (``<prefix>.reward-``): one per member, named by instance.

:func:`check_access` is the start-up check of one role: it asks the broker which of these
operations the connected principal holds (KIP-430's authorized operations) and raises an
:class:`~rlbus.errors.AccessDeniedError` naming the first one missing, so that a service
never starts half-authorized and fails later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from rlbus.errors import AccessDeniedError, MissingTopicError
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics
from rlbus.transport import admin_client, with_timeout
from rlbus.transport.authorized import (
    AUTHORIZATION_CODES,
    NotAuthorized,
    coordinator,
    group_operations,
    topic_operations,
)


class Role(StrEnum):
    """A principal per role; the default SCRAM user name is the role's name."""

    ROLLOUT = "rollout"
    INFERENCE = "inference"
    REWARD = "reward"
    LEARNER = "learner"
    ADMIN = "admin"


TIER_ROLES = (Role.ROLLOUT, Role.INFERENCE, Role.REWARD, Role.LEARNER)
"""The roles that get ACL rows (admin is a super user)."""


class ResourceType(IntEnum):
    """Kafka's resource type codes (org.apache.kafka.common.resource.ResourceType)."""

    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class PatternType(IntEnum):
    """Kafka's pattern type codes (PatternType)."""

    LITERAL = 3
    PREFIXED = 4


class Operation(IntEnum):
    """Kafka's ACL operation codes (AclOperation)."""

    READ = 3
    WRITE = 4
    DESCRIBE = 8


ALLOW = 3  # AclPermissionType.ALLOW
ANY_HOST = "*"


def group_name(prefix: str, role: Role | str) -> str:
    """The consumer group of a tier: ``<topic prefix>.<role>``, so that runs under
    different prefixes on one cluster never share a group."""
    return f"{prefix}.{role}"


def transactional_id(prefix: str, member: str) -> str:
    """A reward member's stable transactional id: ``<topic prefix>.<member>``
    (``rlbus.reward-0``); its successor reuses it, which fences the zombie."""
    return f"{prefix}.{member}"


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW row: ``principal`` may ``operation`` on the resource, from any host."""

    principal: str
    resource_type: ResourceType
    name: str
    pattern: PatternType
    operation: Operation
    why: str = field(default="", compare=False)

    def __str__(self) -> str:
        return (f"{self.principal:<16} {self.operation.name:<8} {self.resource_type.name:<16} "
                f"{self.pattern.name:<8} {self.name}")


@dataclass(frozen=True)
class _Right:
    role: Role
    resource: str  # a catalogue name (Topics attribute), "group" or "transactional_id"
    operation: Operation
    why: str


def _rights() -> list[_Right]:
    """What each role's arrows in the data-flow diagram need; nothing else."""
    R, W, D = Operation.READ, Operation.WRITE, Operation.DESCRIBE
    roll, inf, rew, lrn = Role.ROLLOUT, Role.INFERENCE, Role.REWARD, Role.LEARNER
    dlq = "dead letters of what it refuses (undecodable, over a limit, handling failed)"
    return [
        _Right(roll, "prompts", R, "takes the prompts it rolls out"),
        _Right(roll, "steps", W, "every model call is a StepRequest"),
        _Right(roll, "results", R, "reads the answers on its own partition (assigned)"),
        _Right(roll, "trajectories", W, "publishes one Trajectory per episode"),
        _Right(roll, "dlq", W, dlq),
        _Right(roll, "group", R, "joins the rollout group; commits prompt offsets"),
        _Right(inf, "steps", R, "takes the step requests it answers"),
        _Right(inf, "results", W, "answers on the requester's partition"),
        _Right(inf, "weights", R, "catches up on and follows published weight versions"),
        _Right(inf, "served", W, "reports the version it serves (what wait_served reads)"),
        _Right(inf, "dlq", W, dlq),
        _Right(inf, "group", R, "joins the inference group; commits step offsets"),
        _Right(rew, "trajectories", R, "takes the trajectories it scores"),
        _Right(rew, "scored", W, "publishes ScoredTrajectory, in transactions"),
        _Right(rew, "dlq", W, dlq),
        _Right(rew, "group", R, "joins the reward group; its offsets commit inside its "
               "transactions (TxnOffsetCommit)"),
        _Right(rew, "transactional_id", W, "its transactional producer (one id per member, "
               "reused by its successor to fence a zombie)"),
        _Right(lrn, "prompts", W, "the feeder submits prompt groups (credit window)"),
        _Right(lrn, "scored", R, "assembles complete groups to train on"),
        _Right(lrn, "weights", W, "announces each new weight version"),
        _Right(lrn, "weights", R, "catches up on the newest version at start (restart)"),
        _Right(lrn, "served", R, "waits until inference serves a version"),
        _Right(lrn, "trajectories", D, "end offsets only: the rollout throughput metric"),
        _Right(lrn, "results", D, "end offsets only: the inference throughput metric"),
        _Right(lrn, "dlq", W, dlq + "; bad dataset rows"),
        _Right(lrn, "group", R, "joins the learner group; commits scored offsets"),
    ]


def acls(
    topics: TopicSettings,
    principals: Mapping[Role, str] | None = None,
    roles: Iterable[Role] = TIER_ROLES,
) -> list[Acl]:
    """Every ALLOW row the tiers need for the topics of ``topics``, sorted by principal.
    ``principals``: user name per role (default: the role's name)."""
    names = Topics(topics)
    wanted = set(roles)
    rows = []
    for right in _rights():
        if right.role not in wanted:
            continue
        user = (principals or {}).get(right.role, str(right.role))
        kind, name, pattern = _resource(names, right)
        rows.append(Acl(f"User:{user}", kind, name, pattern, right.operation, right.why))
    return sorted(rows)


def _resource(names: Topics, right: _Right) -> tuple[ResourceType, str, PatternType]:
    prefix = names.settings.prefix
    if right.resource == "group":
        return ResourceType.GROUP, group_name(prefix, right.role), PatternType.LITERAL
    if right.resource == "transactional_id":
        return (ResourceType.TRANSACTIONAL_ID, transactional_id(prefix, f"{right.role}-"),
                PatternType.PREFIXED)
    return ResourceType.TOPIC, getattr(names, right.resource), PatternType.LITERAL


# ------------------------------------------------------------------------ applying them


async def apply_acls(kafka: KafkaSettings, rows: Sequence[Acl]) -> list[Acl]:
    """Create the rows the broker does not hold yet (idempotent); returns those created.
    ``kafka`` must be a principal allowed to alter ACLs (the admin super user)."""
    async with admin_client(kafka) as admin:
        held = await _held(admin, kafka)
        missing = [row for row in rows if row not in held]
        if missing:
            await _create(admin, kafka, missing)
    return missing


async def _held(admin: Any, kafka: KafkaSettings) -> set[Acl]:
    from aiokafka.protocol.admin import DescribeAclsRequest

    # any resource type (1), any name, any pattern (1), any principal, host, operation (1)
    request = DescribeAclsRequest(1, None, 1, None, None, 1, ALLOW)
    response = await with_timeout(admin._send_request(request), kafka.request_timeout_s,
                                  "describe ACLs")
    _raise_for(response.error_code, response.error_message, "DESCRIBE on the cluster's ACLs")
    held = set()
    for kind, name, pattern, entries in response.resources:
        for principal, _host, operation, _permission in entries:
            if kind in ResourceType._value2member_map_ and operation in (
                    Operation._value2member_map_) and pattern in PatternType._value2member_map_:
                held.add(Acl(principal, ResourceType(kind), name, PatternType(pattern),
                             Operation(operation)))
    return held


async def _create(admin: Any, kafka: KafkaSettings, rows: Sequence[Acl]) -> None:
    from aiokafka.protocol.admin import CreateAclsRequest

    async def create(row: Acl) -> None:
        request = CreateAclsRequest(row.resource_type, row.name, row.pattern, row.principal,
                                    ANY_HOST, row.operation, ALLOW)
        response = await with_timeout(admin._send_request(request), kafka.request_timeout_s,
                                      "create ACL")
        for code, message in response.creation_responses:
            _raise_for(code, message, f"creating the ACL {row}")

    # aiokafka's CreateAclsRequest carries one creation: the requests go out together
    await asyncio.gather(*(create(row) for row in rows))


def _raise_for(code: int, message: str | None, what: str) -> None:
    if code == 0:
        return
    from aiokafka.errors import for_code

    error = for_code(code)
    if code in AUTHORIZATION_CODES:
        raise AccessDeniedError(f"the broker refuses {what}: {error.__name__} (connect as the "
                                "admin principal, its only super user)")
    raise RuntimeError(f"{what} failed: {error.__name__} {message or ''}".strip())


# ------------------------------------------------------------------ the start-up check


async def check_access(
    kafka: KafkaSettings,
    topics: TopicSettings,
    role: Role,
    *,
    group: str | None = None,
    transactional_ids: Sequence[str] = (),
) -> None:
    """Raise :class:`AccessDeniedError` unless the connected principal holds every right
    ``role`` needs: each topic operation (KIP-430 authorized operations in a metadata
    answer), READ on its consumer group ``group`` (default :func:`group_name`) and, for
    each of ``transactional_ids``, what finding its coordinator needs (DESCRIBE; WRITE is
    checked when the transactional producer starts). A missing topic is an error too."""
    rows = acls(topics, roles=[role])
    user = kafka.sasl_username or "the client"
    async with admin_client(kafka) as admin:
        await _check_topics(admin, kafka, [r for r in rows
                                           if r.resource_type == ResourceType.TOPIC],
                            user, topics.prefix)
        if any(r.resource_type == ResourceType.GROUP for r in rows):
            await _check_group(admin, kafka, group or group_name(topics.prefix, role), user,
                               topics.prefix)
        for txn in transactional_ids:
            await _check_transactional_id(admin, kafka, txn, user, topics.prefix)


def _denied(user: str, operation: str, kind: str, name: str, prefix: str
            ) -> AccessDeniedError:
    return AccessDeniedError(
        f"the broker does not allow user {user!r} {operation} on {kind} {name!r}; is it the "
        f"role's user, and were the ACLs of topic prefix {prefix!r} applied (`rlbus acl "
        "apply` as the admin principal, docs/security.md)?")


async def _check_topics(admin: Any, kafka: KafkaSettings, rows: list[Acl], user: str,
                        prefix: str) -> None:
    names = sorted({r.name for r in rows})
    found = await with_timeout(topic_operations(admin, names), kafka.request_timeout_s,
                               "metadata")
    for row in rows:
        access = found.get(row.name)
        if access is None or not access.authorized:
            raise _denied(user, row.operation.name, "topic", row.name, prefix)
        if not access.exists:
            raise MissingTopicError(f"topic {row.name} does not exist; create the catalogue "
                                    "with `rlbus topics create` (RLBUS_TOPICS__PREFIX?)")
        if row.operation not in access.operations:
            raise _denied(user, row.operation.name, "topic", row.name, prefix)


async def _check_group(admin: Any, kafka: KafkaSettings, group: str, user: str,
                       prefix: str) -> None:
    try:
        allowed = await with_timeout(group_operations(admin, group, kafka.request_timeout_s),
                                     kafka.request_timeout_s, "describe group")
    except NotAuthorized:
        raise _denied(user, "READ", "group", group, prefix) from None
    if Operation.READ not in allowed:
        raise _denied(user, "READ", "group", group, prefix)


async def _check_transactional_id(admin: Any, kafka: KafkaSettings, txn: str,
                                  user: str, prefix: str) -> None:
    try:
        await with_timeout(coordinator(admin, txn, 1, kafka.request_timeout_s),
                           kafka.request_timeout_s, "find transaction coordinator")
    except NotAuthorized:
        raise _denied(user, "WRITE", "transactional id", txn, prefix) from None
