"""What travels inside the learner: the sequences a step trains on and the orders rank 0
broadcasts to the follower ranks under ``torchrun`` (see :mod:`.distributed`).

Both are pickled by ``torch.distributed.broadcast_object_list``, so every rank must import
this module under the same name: plain frozen dataclasses, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """One sequence to train on: an episode's segment (the whole of a linear episode)
    packed as one token sequence."""

    ids: list[int]
    """Token ids exactly as sampled: the context, completions and observations in order."""
    sampled: list[bool]
    """Which of ``ids`` the policy sampled (the tokens the loss is over)."""
    logprobs: list[float]
    """The engine's logprob of each sampled token (0 elsewhere): the behaviour policy."""
    advantage: float
    """The episode's group-relative advantage, shared by all of its sampled tokens."""
    episode: str | None = None
    """The episode it is a segment of: the loss normalisation counts episodes, and the
    sequences of one are one (None: a sequence that is an episode of its own)."""


@dataclass(frozen=True)
class TrainOrder:
    """Rank 0 to every rank: take one step on ``work`` (each rank trains its share)."""

    work: list[Work]


@dataclass(frozen=True)
class Release:
    """Rank 0 to the followers: no more steps; leave the process group and exit."""


RankMessage = TrainOrder | Release
"""Everything rank 0 broadcasts to the followers, once the optimizer state is replicated."""
