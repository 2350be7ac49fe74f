"""Settings of the reward tier (env prefix ``RLBUS_``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rlbus.settings import ServiceSettings


class RewardSettings(ServiceSettings):
    """One reward instance: scores trajectories and publishes them exactly once."""

    service: ClassVar[str] = "rlbus.reward.service:Reward"

    verifier_timeout_s: float = Field(default=10.0, gt=0)
    """A verifier still running after this has its process killed and the sample masked."""
    verifier_workers: int = Field(default=2, ge=1)
    """Verifier processes; a slow verifier holds one of them, never the tier."""
    batch_size: int = Field(default=64, ge=1)
    """Trajectories scored and published per Kafka transaction."""
    transactional_id: str | None = None
    """Stable id for zombie fencing; default ``<topic prefix>.reward-<instance>``. aiokafka
    has no KIP-447 group-metadata fencing, so a restarted member must reuse its
    predecessor's id."""
