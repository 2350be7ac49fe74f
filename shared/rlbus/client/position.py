"""Where a trainer stands in rlbus's streams: what it checkpoints next to its model."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlbus.errors import PositionError

POSITION_FORMAT: Final = 1


class Position(BaseModel):
    """A trainer's place in rlbus, as :meth:`rlbus.client.RolloutClient.position` hands it
    out. Saved with a model that has trained on every group taken before it was made, and
    given back to a restarted client, nothing is delivered twice and nothing is lost.

    It round-trips through JSON (:meth:`to_json`, :meth:`from_json`), so a trainer saves it
    beside its own checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = POSITION_FORMAT
    topic: str | None = None
    """The trajectories.scored topic the offsets are of (None: no offsets yet)."""
    offsets: dict[int, int] = {}
    """Per partition of ``topic``: every record below the offset was taken or dropped."""
    taken: list[str] = []
    """Ids of the groups taken, oldest first (the newest ``remember_groups``): a later copy
    of one, or one above ``offsets`` that was taken already, is dropped."""
    submitted: int = Field(default=0, ge=0)
    """Training groups submitted (the credit window's count)."""
    steps: int = Field(default=0, ge=0)
    """Weight versions this trainer published (the credit window's clock)."""
    version: int = Field(default=0, ge=0)
    """The newest weight version this trainer published."""

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Position:
        """A position saved by :meth:`to_json`; a :class:`PositionError` if it is not one."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise PositionError(f"not a rlbus client position (format {POSITION_FORMAT}): "
                                f"{exc}") from exc
