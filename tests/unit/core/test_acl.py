"""The ACL rows each role gets: derived from the catalogue, and no more than its role needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlbus.acl import (
    TIER_ROLES,
    Acl,
    Operation,
    PatternType,
    ResourceType,
    Role,
    acls,
    group_name,
    transactional_id,
)
from rlbus.client import ClientSettings
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics

TOPICS = TopicSettings(prefix="p")
T = Topics(TOPICS)
DOC = Path(__file__).parents[3] / "docs" / "security.md"


def rights(role: Role, kind: ResourceType = ResourceType.TOPIC) -> set[tuple[str, Operation]]:
    return {(r.name, r.operation) for r in acls(TOPICS)
            if r.principal == f"User:{role}" and r.resource_type == kind}


def writers(topic: str) -> set[str]:
    return {r.principal.removeprefix("User:") for r in acls(TOPICS)
            if r.name == topic and r.operation == Operation.WRITE}


def test_each_topic_is_written_by_the_roles_of_the_data_flow_only() -> None:
    assert writers(T.prompts) == {"learner"}
    assert writers(T.steps) == {"rollout"}
    assert writers(T.results) == {"inference"}
    assert writers(T.trajectories) == {"rollout"}
    assert writers(T.scored) == {"reward"}
    assert writers(T.weights) == {"learner"}
    assert writers(T.served) == {"inference"}
    assert writers(T.dlq) == set(TIER_ROLES)


@pytest.mark.parametrize(("role", "forbidden"), [
    (Role.ROLLOUT, [T.scored, T.weights, T.prompts, T.results]),  # runs agent and tool code
    (Role.REWARD, [T.weights, T.prompts, T.results, T.trajectories]),  # runs verifiers
    (Role.INFERENCE, [T.trajectories, T.scored, T.weights, T.prompts]),
])
def test_a_role_cannot_write_outside_its_arrows(role: Role, forbidden: list[str]) -> None:
    written = {name for name, op in rights(role) if op == Operation.WRITE}
    assert not written & set(forbidden)


def test_nobody_but_admin_reads_dead_letters_and_rollout_does_not_read_weights() -> None:
    assert not any(r.name == T.dlq and r.operation != Operation.WRITE for r in acls(TOPICS))
    assert (T.weights, Operation.READ) not in rights(Role.ROLLOUT)


def test_topics_are_literal_since_a_name_is_a_prefix_of_another() -> None:
    # rlbus.steps is a prefix of rlbus.steps.results: a PREFIXED row would leak
    topic_rows = [r for r in acls(TOPICS) if r.resource_type == ResourceType.TOPIC]
    assert {r.pattern for r in topic_rows} == {PatternType.LITERAL}
    assert {r.name for r in topic_rows} == {spec.name for spec in T.catalogue()}


def test_groups_and_transactional_ids_are_the_ones_the_services_use() -> None:
    for role in TIER_ROLES:
        assert rights(role, ResourceType.GROUP) == {(group_name("p", role), Operation.READ)}
    assert ClientSettings(topics=TOPICS).consumer_group == group_name("p", Role.LEARNER)
    [txn] = [r for r in acls(TOPICS) if r.resource_type == ResourceType.TRANSACTIONAL_ID]
    assert (txn.principal, txn.pattern, txn.operation) == (
        "User:reward", PatternType.PREFIXED, Operation.WRITE)
    for instance in ("0", "7", "pod-abc"):
        [used] = Reward(RewardSettings(topics=TOPICS, instance=instance)).transactional_ids()
        assert used == transactional_id("p", f"reward-{instance}")
        assert used.startswith(txn.name)


def test_every_row_says_why_and_admin_gets_none() -> None:
    rows = acls(TOPICS)
    assert all(r.why for r in rows)
    assert not [r for r in rows if r.principal == "User:admin"]
    assert len(set(rows)) == len(rows)


def test_principals_can_be_renamed() -> None:
    rows = acls(TOPICS, {Role.ROLLOUT: "svc-rollout"})
    assert {r.principal for r in rows} == {"User:svc-rollout", "User:inference",
                                           "User:reward", "User:learner"}


def test_the_documented_table_is_the_derived_one() -> None:
    """docs/security.md lists every row for the default prefix, with its reason."""
    rows = acls(TopicSettings())
    documented = set()
    for line in DOC.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in TIER_ROLES:
            documented.add((cells[0], cells[1], cells[2], cells[3]))
    assert documented == {_doc_row(r) for r in rows}


def _doc_row(r: Acl) -> tuple[str, str, str, str]:
    star = "*" if r.pattern == PatternType.PREFIXED else ""
    kind = r.resource_type.name.lower().replace("_", " ")
    return r.principal.removeprefix("User:"), r.operation.name, f"{kind} {r.name}{star}", r.why


def test_str_is_one_row() -> None:
    row = Acl("User:x", ResourceType.TOPIC, "t", PatternType.LITERAL, Operation.WRITE, "why")
    assert re.fullmatch(r"User:x +WRITE +TOPIC +LITERAL +t", str(row))
