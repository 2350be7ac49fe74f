"""Which operations the connected principal may perform on topics and groups (KIP-430).

A metadata request from version 8 on can ask the broker for each topic's
``topic_authorized_operations``, and a DescribeGroups request from version 3 on for a
group's ``authorized_operations``: bit fields of the ACL operation codes the requesting
principal holds. aiokafka 0.14 speaks metadata up to version 5 only, and parses a
version-3 DescribeGroups answer with the version-2 schema (dropping that field), so this
module adds both (neither is flexible; Kafka 4 still serves them). It is how a service
checks, before it takes any work, that it may do all its role does
(:func:`rlbus.acl.check_access`), without writing anything.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Bytes, Int16, Int32, Schema, String

_UNKNOWN_TOPIC = 3
_TOPIC_AUTHORIZATION_FAILED = 29
_COORDINATOR_NOT_READY = {14, 15, 16}  # loading, not available, not coordinator
AUTHORIZATION_CODES = frozenset({29, 30, 31, 53})
"""Kafka's *_AUTHORIZATION_FAILED codes: topic, group, cluster, transactional id."""


class MetadataResponse_v8(Response):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32),
                          ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        ("topics", Array(
            ("error_code", Int16),
            ("topic", String("utf-8")),
            ("is_internal", Boolean),
            ("partitions", Array(
                ("error_code", Int16), ("partition", Int32), ("leader", Int32),
                ("leader_epoch", Int32), ("replicas", Array(Int32)), ("isr", Array(Int32)),
                ("offline_replicas", Array(Int32)))),
            ("topic_authorized_operations", Int32),
        )),
        ("cluster_authorized_operations", Int32),
    )


class MetadataRequest_v8(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = MetadataResponse_v8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class AuthorizedMetadataRequest(Request[MetadataRequest_v8]):  # type: ignore[misc]
    """Metadata of ``topics`` with the operations the principal may perform on each."""

    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[MetadataRequest_v8]) -> MetadataRequest_v8:
        return request_struct_class(self._topics, False, False, True)


@dataclass(frozen=True)
class TopicAccess:
    """What the broker says about one topic for the connected principal."""

    exists: bool
    """False: the principal may describe it, but there is no such topic."""
    authorized: bool
    """False: the principal may not even describe it (it may or may not exist)."""
    operations: frozenset[int]
    """The ACL operation codes it may perform (READ 3, WRITE 4, DESCRIBE 8, ...)."""


async def topic_operations(admin: Any, topics: list[str]) -> dict[str, TopicAccess]:
    """Per topic of ``topics``, what the principal of ``admin`` (a started aiokafka admin
    client) may do there."""
    response = await admin._send_request(AuthorizedMetadataRequest(topics))
    found = {}
    for code, name, _internal, _partitions, bits in response.topics:
        found[name] = TopicAccess(
            exists=code != _UNKNOWN_TOPIC,
            authorized=code != _TOPIC_AUTHORIZATION_FAILED,
            operations=frozenset(op for op in range(32) if bits > 0 and bits & (1 << op)),
        )
    return found


class DescribeGroupsResponse_v3(Response):  # type: ignore[misc]
    API_KEY = 15
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("groups", Array(
            ("error_code", Int16), ("group", String("utf-8")), ("state", String("utf-8")),
            ("protocol_type", String("utf-8")), ("protocol", String("utf-8")),
            ("members", Array(
                ("member_id", String("utf-8")), ("client_id", String("utf-8")),
                ("client_host", String("utf-8")), ("member_metadata", Bytes),
                ("member_assignment", Bytes))),
            ("authorized_operations", Int32),
        )),
    )


class DescribeGroupsRequest_v3(RequestStruct):  # type: ignore[misc]
    API_KEY = 15
    API_VERSION = 3
    RESPONSE_TYPE = DescribeGroupsResponse_v3
    SCHEMA = Schema(("groups", Array(String("utf-8"))),
                    ("include_authorized_operations", Boolean))


class AuthorizedDescribeGroupsRequest(Request[DescribeGroupsRequest_v3]):  # type: ignore[misc]
    """A group's description with the operations the principal may perform on it."""

    API_KEY = 15

    def __init__(self, group: str) -> None:
        self._group = group

    def build(self, request_struct_class: type[DescribeGroupsRequest_v3]
              ) -> DescribeGroupsRequest_v3:
        return request_struct_class([self._group], True)


class NotAuthorized(Exception):
    """The broker answered with an authorization failure (its Kafka error code)."""

    def __init__(self, code: int) -> None:
        super().__init__(for_code(code).__name__)
        self.code = code


async def coordinator(admin: Any, key: str, kind: int, wait_s: float) -> int:
    """The coordinator of group (``kind`` 0) or transactional id (1) ``key``; waits while
    the broker is still making it (a new cluster's first group or transaction). Raises
    :class:`NotAuthorized` when the principal may not even describe ``key``."""
    from aiokafka.protocol.coordination import FindCoordinatorRequest

    deadline = time.monotonic() + wait_s
    while True:
        response = await admin._send_request(FindCoordinatorRequest(key, kind))
        code = response.error_code
        if code == 0:
            return int(response.coordinator_id)
        if code in AUTHORIZATION_CODES:
            raise NotAuthorized(code)
        if code not in _COORDINATOR_NOT_READY or time.monotonic() > deadline:
            raise for_code(code)(f"finding the coordinator of {key}")
        await asyncio.sleep(0.2)


async def group_operations(admin: Any, group: str, wait_s: float) -> frozenset[int]:
    """The ACL operation codes the principal of ``admin`` holds on consumer group
    ``group``; :class:`NotAuthorized` if it may not describe it."""
    deadline = time.monotonic() + wait_s
    while True:
        node = await coordinator(admin, group, 0, max(0.0, deadline - time.monotonic()))
        response = await admin._send_request(AuthorizedDescribeGroupsRequest(group), node)
        [(code, *_rest, bits)] = response.groups
        if code == 0:
            return frozenset(op for op in range(32) if bits > 0 and bits & (1 << op))
        if code in AUTHORIZATION_CODES:
            raise NotAuthorized(code)
        if code not in _COORDINATOR_NOT_READY or time.monotonic() > deadline:
            raise for_code(code)(f"describing group {group}")
        await asyncio.sleep(0.2)
