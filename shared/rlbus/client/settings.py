"""What a trainer-side client needs to know: the cluster, its topics, its model and its pace."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlbus.acl import group_name
from rlbus.limits import Limits
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.weights import ChecksumAlgorithm


class ClientSettings(BaseModel):
    """One trainer's connection to rlbus (:class:`rlbus.client.RolloutClient`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka: KafkaSettings = KafkaSettings()
    """How to reach the broker."""
    topics: TopicSettings = TopicSettings()
    """The topic prefix and shapes of the rlbus deployment to use."""
    limits: Limits = Limits()
    """What a scored episode may hold; one over a limit is dead-lettered and a failed
    stand-in takes its place in its group."""
    group: str = ""
    """Consumer group on trajectories.scored; default ``<topic prefix>.learner``. One
    trainer (or one rank 0) per group: groups are assembled in one process."""
    member: str = "client-0"
    """This client's name in dead letters, spans and logs."""
    run_name: str = "run"
    """Prefix of the group ids :meth:`~rlbus.client.RolloutClient.submit` makes up."""
    model_name: str = "policy"
    """Key of the WeightVersion events published; inference members load only theirs."""
    model_path: Path | None = None
    """The model folder the inference tier serves: its safetensors header gives the tensor
    names, shapes and dtypes that published weights must have until a version has been
    published (then that version's file does)."""
    weights_dir: Path = Path("runs/weights")
    """Weight store: one ``v<version, 6 digits>/model.safetensors`` folder per published version, on
    storage every inference member can read at the same path."""
    keep_weights: int = Field(default=3, ge=1)
    """Published versions kept in the weight store (older ones are deleted)."""
    weights_checksum: ChecksumAlgorithm = "sha256"
    """How a published file's checksum is computed. sha256 also resists someone who can
    write into the weight store but not announce versions; xxh3_128 detects torn and
    corrupted files as well, several times faster (a 1 GB publish: docs/performance.md,
    section 10). Readers verify either."""
    groups_per_step: int = Field(default=4, ge=1)
    """Training groups the trainer takes between two published weight versions."""
    max_staleness: int = Field(default=2, ge=0)
    """Most versions a sample's oldest token may lag the trainer's weights when it trains.
    The credit window admits training groups at most this far ahead; ``receive`` waits for
    a straggling group whose last chance within the bound is the next step (up to
    ``straggler_wait_s``)."""
    staleness_from: Literal["oldest", "newest"] = "oldest"
    """Which of an episode's tokens the bound counts from for ordering and waiting: the
    oldest, or the newest (the learner's ``staleness_from``: a partial rollout whose latest
    part is recent trains, so its group need not be waited for until that part's last
    chance). The credit window counts groups, whatever this says."""
    straggler_wait_s: float = Field(default=60.0, ge=0)
    """Longest ``receive`` holds back for a group that would otherwise go stale (its
    other members are back, one is still running); 0: never wait."""
    remember_groups: int = Field(default=100_000, ge=1)
    """Group ids taken that the client remembers (and a position holds), so that a later
    copy of one (rollout is at-least-once) is dropped."""
    served_ttl_s: float = Field(default=30.0, gt=0)
    """An inference member counts as live while its newest report is younger than this
    (members report every ``RLBUS_SERVED_REPORT_S``, 5 s by default)."""

    @property
    def consumer_group(self) -> str:
        return self.group or group_name(self.topics.prefix, "learner")
