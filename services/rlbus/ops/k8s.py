"""``rlbus k8s names``: the names the Helm chart must render, as the code makes them.

Each scalable tier is autoscaled on the lag of its own consumer group on its own input
topic (deploy/helm/rlbus/templates/scaledobjects.yaml). The chart derives those names from
``topics.prefix`` by the code's rules; this prints what the code makes of a prefix (the
catalogue of :mod:`rlbus.topics`, the groups of :func:`rlbus.acl.group_name`), and
tests/k8s/test_chart.py holds every rendered ScaledObject and ``RLBUS_GROUP`` to it.
"""

from __future__ import annotations

import json
from typing import Any

from rlbus.acl import group_name
from rlbus.settings import TopicSettings
from rlbus.topics import Topics

TIER_INPUTS = {
    "rollout": "prompts",
    "inference": "steps",
    "reward": "trajectories",
    "learner": "scored",
}
"""The :class:`~rlbus.topics.Topics` attribute each tier's consumer group reads
(tests/unit/ops/test_k8s.py checks it against the services' own subscriptions)."""

SCALABLE = ("rollout", "inference", "reward")
"""Tiers that scale with their group's lag; the learner is one optimizer and does not."""


def names(settings: TopicSettings) -> dict[str, Any]:
    """Topics (name → partitions) and, per tier, its group, input topic and partitions."""
    topics = Topics(settings)
    partitions = {spec.name: spec.partitions for spec in topics.catalogue()}
    by_tier: dict[str, dict[str, Any]] = {}
    for tier in TIER_INPUTS:
        topic = getattr(topics, TIER_INPUTS[tier])
        by_tier[tier] = {
            "group": group_name(settings.prefix, tier),
            "topic": topic,
            "partitions": partitions[topic],
            "autoscaled": tier in SCALABLE,
        }
    return {"prefix": settings.prefix, "topics": partitions, "tiers": by_tier}


def k8s_command(action: str, prefix: str | None, partitions: int | None) -> int:
    from rlbus.ops.admin import AdminSettings

    topics = AdminSettings().topics  # RLBUS_TOPICS__* as every service reads them
    overrides = {k: v for k, v in (("prefix", prefix), ("partitions", partitions)) if v}
    if action == "names":
        settings = TopicSettings(**{**topics.model_dump(), **overrides})
        print(json.dumps(names(settings), indent=2))
    return 0
