"""Operator limits on every field that sizes work, checked before anything is allocated.

A message is valid msgpack and valid schema, and still hostile: a Prompt with a group size of
10^9 made a rollout process allocate 7 GB in a minute and, never acked, came back to every
restarted instance (a poison pill). Each tier checks what it is about to multiply against
these limits (``RLBUS_LIMITS__*``, the same for every tier) and dead-letters a message over
one with the reason; nothing of it is started, and the offset moves on. A check's verdict is
a :class:`rlbus.errors.Refusal`: over a limit, or invalid (an invariant the schema cannot
state), with the text that names the setting.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, model_validator

from rlbus.errors import Refusal, RefusalReason

if TYPE_CHECKING:  # settings import this module; it stays free of the wire types
    from rlbus.messages import Prompt, ScoredTrajectory, StepRequest, Trajectory


class Limits(BaseModel):
    """Largest values a message may ask for; over one, it is dead-lettered."""

    max_group_size: int = Field(default=256, ge=1)
    """Episodes one prompt may ask for (rollout starts that many at once)."""
    max_new_tokens: int = Field(default=8192, ge=1)
    """Tokens one generation may ask for."""
    max_input_tokens: int = Field(default=131_072, ge=1)
    """Context tokens one step request may carry."""
    max_turns: int = Field(default=256, ge=1)
    """Turns one trajectory may hold."""
    max_spec_bytes: int = Field(default=256 * 1024, ge=64)
    """Size of a task spec as JSON (it is copied into every trajectory of its group)."""
    max_depth: int = Field(default=32, ge=8, le=256)
    """Nesting of maps and arrays in one message, its own top-level map being 1; checked on
    decode. Free-form fields (a task spec, a verifier's info) are where depth comes from;
    far below the depth at which json, pydantic or copy.deepcopy recurse out of stack."""
    max_elements: int = Field(default=1 << 18, ge=1024)
    """Array items plus map entries in one message, all collections together; also the
    largest one collection may declare, refused by the unpacker before it allocates. Our
    messages carry token ids as packed binaries (one element); a producer that sends them
    as msgpack arrays counts one element a token."""
    max_string_bytes: int | None = Field(default=None, ge=1024)
    """Bytes of one string or binary value; unset, as many as its message holds (the topic's
    ``max_message_bytes`` bounds that already, and a string costs no more memory than its
    bytes). Set, at least ``4 * max_input_tokens``: a packed token array is one binary, 4
    bytes a token."""

    @model_validator(mode="after")
    def _tokens_fit_a_binary(self) -> Limits:
        if self.max_string_bytes is not None and \
                self.max_string_bytes < 4 * self.max_input_tokens:
            raise ValueError(
                f"max_string_bytes {self.max_string_bytes} cannot hold a packed context of "
                f"max_input_tokens {self.max_input_tokens} (4 bytes a token)")
        return self


def _spec_bytes(spec: object) -> int:
    try:
        return len(json.dumps(spec, separators=(",", ":"), default=str))
    except (TypeError, ValueError, RecursionError):  # circular or odd: as good as too large
        return 1 << 62


def _over(what: str, value: int, limit: int, setting: str, unit: str = "") -> Refusal:
    return Refusal(RefusalReason.OVER_LIMIT, f"{what} {value} is over the limit {limit} "
                   f"(RLBUS_LIMITS__{setting.upper()}){unit}")


def check_prompt(p: Prompt, limits: Limits) -> Refusal | None:
    """Why ``p`` must not be rolled out, or None."""
    if p.group_size > limits.max_group_size:
        return _over("group_size", p.group_size, limits.max_group_size, "max_group_size")
    if p.sampling.max_new_tokens > limits.max_new_tokens:
        return _over("max_new_tokens", p.sampling.max_new_tokens, limits.max_new_tokens,
                     "max_new_tokens")
    size = _spec_bytes(p.spec)
    if size > limits.max_spec_bytes:
        return _over("spec of", size, limits.max_spec_bytes, "max_spec_bytes", " bytes")
    return None


def check_step(r: StepRequest, limits: Limits) -> Refusal | None:
    """Why ``r`` must not be generated, or None."""
    if len(r.input_ids) > limits.max_input_tokens:
        return _over("input of", len(r.input_ids), limits.max_input_tokens,
                     "max_input_tokens", " tokens")
    if r.sampling.max_new_tokens > limits.max_new_tokens:
        return _over("max_new_tokens", r.sampling.max_new_tokens, limits.max_new_tokens,
                     "max_new_tokens")
    return None


def check_identity(t: Trajectory, limits: Limits) -> Refusal | None:
    """Why ``t`` cannot be a member of a group the learner would assemble, or None."""
    if t.group_size > limits.max_group_size:
        return _over("group_size", t.group_size, limits.max_group_size, "max_group_size")
    if t.index >= t.group_size:
        return Refusal(RefusalReason.INVALID,
                       f"episode index {t.index} is not below its group_size {t.group_size}")
    return None


def check_trajectory(t: Trajectory, limits: Limits) -> Refusal | None:
    """Why ``t`` must not be scored or trained on, or None."""
    why = check_identity(t, limits)
    if why is not None:
        return why
    if len(t.turns) > limits.max_turns:
        return _over("turns", len(t.turns), limits.max_turns, "max_turns")
    size = _spec_bytes(t.spec)
    if size > limits.max_spec_bytes:
        return _over("spec of", size, limits.max_spec_bytes, "max_spec_bytes", " bytes")
    return None


def check_scored(s: ScoredTrajectory, limits: Limits) -> Refusal | None:
    return check_trajectory(s.trajectory, limits)


def check_token_ids(t: Trajectory, vocab_size: int) -> Refusal | None:
    """Why ``t`` holds a token id its model has no embedding for, or None: valid on the wire,
    such an id fails every batch it lands in (an embedding lookup out of range)."""
    for k, turn in enumerate(t.turns):
        for field, ids in (("input_ids", turn.input_ids), ("completion_ids", turn.completion_ids)):
            if len(ids) and not 0 <= min(ids) <= max(ids) < vocab_size:
                bad = next(i for i in ids if not 0 <= i < vocab_size)
                return Refusal(RefusalReason.INVALID,
                               f"turn {k} {field} holds token id {bad}, outside the model's "
                               f"vocabulary of {vocab_size}")
    return None
