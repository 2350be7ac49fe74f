"""The topic catalogue and its idempotent creation.

``ensure_topics`` is safe to run any number of times, from any number of services at once:
it creates what is missing and fails clearly if an existing topic has a partition count other
than the catalogue's (silently using it would break the static reply-partition assignment).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import BaseModel

from rlbus.errors import TopicCreationError as TopicCreationError  # still importable from here
from rlbus.errors import TopicMismatchError as TopicMismatchError
from rlbus.messages import (
    DeadLetter,
    Prompt,
    ScoredTrajectory,
    StepRequest,
    StepResult,
    Trajectory,
    WeightsServed,
    WeightVersion,
)
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.transport import FRAMING_BYTES, MemoryBroker, admin_client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicSpec:
    """One topic of the catalogue."""

    name: str
    message: type[BaseModel]
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


class Topics:
    """Full topic names for one prefix; ``Topics(settings).steps`` → ``"rlbus.steps"``."""

    def __init__(self, settings: TopicSettings) -> None:
        self.settings = settings
        p = settings.prefix
        self.prompts = f"{p}.prompts"
        self.steps = f"{p}.steps"
        self.results = f"{p}.steps.results"
        self.trajectories = f"{p}.trajectories"
        self.scored = f"{p}.trajectories.scored"
        self.weights = f"{p}.weights"
        self.served = f"{p}.weights.served"
        self.dlq = f"{p}.dlq"

    def catalogue(self) -> list[TopicSpec]:
        s = self.settings
        work = {
            "retention.ms": str(s.retention_ms),
            "max.message.bytes": str(s.max_message_bytes + FRAMING_BYTES),
            "min.insync.replicas": str(s.min_insync_replicas),
        }
        compacted = {**work, "cleanup.policy": "compact"}
        compacted.pop("retention.ms")
        return [
            TopicSpec(self.prompts, Prompt, s.partitions, work),
            TopicSpec(self.steps, StepRequest, s.partitions, work),
            TopicSpec(self.results, StepResult, s.result_partitions, work),
            TopicSpec(self.trajectories, Trajectory, s.partitions, work),
            TopicSpec(self.scored, ScoredTrajectory, s.partitions, work),
            TopicSpec(self.weights, WeightVersion, 1, compacted),
            # compacted by member, and deleted after the retention too: members come and go
            TopicSpec(self.served, WeightsServed, 1, {**work, "cleanup.policy": "compact,delete"}),
            TopicSpec(self.dlq, DeadLetter, 1, work),
        ]


_TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error code


async def ensure_topics(kafka: KafkaSettings, topics: TopicSettings) -> list[str]:
    """Create missing topics; return the names created (empty when all existed)."""
    from aiokafka.admin import NewTopic

    specs = Topics(topics).catalogue()
    async with admin_client(kafka) as admin:
        existing = await _partition_counts(admin, [s.name for s in specs])
        _check_shapes(specs, existing)
        missing = [s for s in specs if s.name not in existing]
        created = []
        for spec in missing:
            new = NewTopic(
                spec.name, spec.partitions, topics.replication, topic_configs=spec.config
            )
            # aiokafka reports failures in the response, it does not raise them
            response = await admin.create_topics([new])
            for name, code, *rest in response.topic_errors:
                if code == _TOPIC_ALREADY_EXISTS:
                    continue  # another service created it between our look and our create
                if code != 0:
                    message = rest[0] if rest else ""
                    raise TopicCreationError(f"creating {name} failed: error {code} {message}")
                created.append(name)
        if created:
            log.info("created topics: %s", ", ".join(created))
        return created


def _check_shapes(specs: list[TopicSpec], existing: dict[str, int]) -> None:
    for spec in specs:
        have = existing.get(spec.name)
        if have is not None and have != spec.partitions:
            raise TopicMismatchError(
                f"topic {spec.name} has {have} partitions but the settings ask for "
                f"{spec.partitions}; delete it or change RLBUS_TOPICS__* to match"
            )


async def _partition_counts(admin: object, names: list[str]) -> dict[str, int]:
    listed = set(await admin.list_topics())  # type: ignore[attr-defined]
    wanted = [n for n in names if n in listed]
    if not wanted:
        return {}
    described = await admin.describe_topics(wanted)  # type: ignore[attr-defined]
    return {d["topic"]: len(d["partitions"]) for d in described}


def memory_broker(topics: TopicSettings) -> MemoryBroker:
    """An in-memory broker with the catalogue's topics and partition counts (unit tests)."""
    return MemoryBroker({spec.name: spec.partitions for spec in Topics(topics).catalogue()})
