"""Every message that crosses Kafka, in one module.

Each model names its direction (producer → consumer) and states its invariants. Evolution is
additive: a new field is optional with a default, and older readers ignore fields they do not
know. A breaking change is a new message type on a new topic, never a reused name.
``schema_version`` is checked on decode: a version this code does not speak is a dead letter.

Token ids and logprobs are ``list[int]`` / ``list[float]`` in Python and travel as packed
little-endian int32 / float32 bytes (see :mod:`rlbus.codec` for the measurement behind that).
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializationInfo,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
_LITTLE = sys.byteorder == "little"


def _unpack(typecode: str) -> Any:
    def unpack(value: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            arr = array(typecode)
            arr.frombytes(value)
            if not _LITTLE:
                arr.byteswap()
            return arr.tolist()
        if typecode == "i" and isinstance(value, list):
            _check_int32(value)
        return value

    return unpack


def _check_int32(ids: list[Any]) -> None:
    """Token ids sent as a msgpack array (a foreign producer's choice) must be ints that
    int32 holds, or the message would not encode again (a dead letter's payload, reward's
    output). Packed ones hold nothing else; checked here, not per item, so they cost
    nothing (a per-item constraint made validating a long trajectory twice as slow)."""
    try:
        outside = bool(ids) and (min(ids) < -(2**31) or max(ids) > 2**31 - 1)
    except TypeError:  # strings, nil, maps: min() cannot order them against an int
        raise ValueError("token ids must be integers") from None
    if outside:
        raise ValueError("token ids must be in the range of int32")


def _pack(typecode: str) -> Any:
    def pack(value: list[Any], info: SerializationInfo) -> Any:
        if not (info.context and info.context.get("packed")):
            return value
        arr = array(typecode, value)
        if not _LITTLE:
            arr.byteswap()
        return arr.tobytes()

    return pack


TokenIds = Annotated[list[int], BeforeValidator(_unpack("i")), PlainSerializer(_pack("i"))]
"""Token ids; int32 bytes on the wire."""
Logprobs = Annotated[list[float], BeforeValidator(_unpack("f")), PlainSerializer(_pack("f"))]

VersionSpans = list[tuple[int, int]]
"""The weight version of every completion token, run-length encoded: ``(version, count)``
pairs in token order, counts summing to the number of completion tokens. A generation
that spans an in-flight weight update (docs/internals.md, "Partial rollouts") has several;
versions never decrease along it."""


def _spans_shape(value: Any) -> Any:
    """One error for a malformed spans list, at its first bad pair: pydantic's own
    validation reports every bad element, and a hostile list of 100k makes 100k errors."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError("version_spans must be a list of [version, count] pairs")
    for i, pair in enumerate(value):
        if not (isinstance(pair, list | tuple) and len(pair) == 2
                and all(type(x) is int for x in pair)):
            raise ValueError(f"version_spans[{i}] is not a [version, count] pair of ints")
    return [(v, c) for v, c in value]


_SpansField = Annotated[VersionSpans | None, BeforeValidator(_spans_shape)]


def spans_of(versions: list[int]) -> VersionSpans:
    """Run-length spans of a per-token version list."""
    out: VersionSpans = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def cut_spans(spans: VersionSpans | None, n: int) -> VersionSpans | None:
    """``spans`` of the first ``n`` tokens only (a completion cut short, e.g. at a stop
    string); None stays None."""
    if spans is None:
        return None
    out: VersionSpans = []
    for v, count in spans:
        take = min(count, n - sum(c for _, c in out))
        if take <= 0:
            break
        out.append((v, take))
    return out


def _check_spans(spans: VersionSpans | None, tokens: int, policy_version: int) -> None:
    if spans is None:
        return
    if any(c <= 0 or v < 0 for v, c in spans):
        raise ValueError("version_spans need versions >= 0 and counts > 0")
    if sum(c for _, c in spans) != tokens:
        raise ValueError(f"version_spans cover {sum(c for _, c in spans)} tokens of {tokens}")
    if spans and min(v for v, _ in spans) != policy_version:
        raise ValueError("policy_version must be the oldest version of version_spans")
"""Per-token log-probabilities; float32 bytes on the wire."""


class Message(BaseModel):
    """Base of every wire type."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(f"unsupported schema_version {v}; this build speaks {SCHEMA_VERSION}")
        return v


class Sampling(BaseModel):
    """How a completion is sampled; travels inside Prompt and StepRequest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_new_tokens: int = Field(default=16, ge=1)


class Prompt(Message):
    """learner feeder or ``rlbus feed`` → rollout. One GRPO group to roll out.

    ``group_id`` is deterministic (run name + index) so a re-sent prompt is recognisable.
    """

    group_id: str
    task: str
    spec: dict[str, Any]
    group_size: int = Field(ge=1)
    sampling: Sampling = Sampling()
    min_version: int = Field(default=0, ge=0)
    """Oldest policy version allowed to sample this group (the learner's version when it
    admitted the group); inference waits for these weights rather than serve staler ones."""
    purpose: Literal["train", "eval"] = "train"
    """eval: measured by the learner, never trained on."""
    eval_round: int | None = Field(default=None, ge=0)
    """eval: the learner step this evaluation round measures (one round, one set)."""
    created_at: float = Field(default_factory=time.time)


class StepRequest(Message):
    """rollout → inference. One model call of one episode turn.

    ``request_id`` is ``<episode_id>/t<turn>``: a re-send after a timeout reuses it, so the
    requester drops whichever duplicate answer arrives second. The answer goes to partition
    ``reply_partition`` of steps.results, which only the requesting rollout instance reads.
    """

    request_id: str
    episode_id: str
    turn: int = Field(ge=0)
    input_ids: TokenIds
    sampling: Sampling = Sampling()
    reply_partition: int = Field(ge=0)
    min_version: int = Field(default=0, ge=0)
    """Copied from the Prompt: the engine must hold at least this version."""
    sent_at: float = Field(default_factory=time.time)

    @field_validator("input_ids")
    @classmethod
    def _non_empty(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("input_ids is empty")
        return v


FinishReason = Literal["stop", "length", "error"]


class StepResult(Message):
    """inference → the rollout instance that asked. One completion.

    Invariant: ``len(logprobs) == len(completion_ids)``; ``policy_version`` is the weight
    version that produced every token, or, where ``version_spans`` is set (an in-flight
    weight update landed during the generation), the oldest of them, and the spans say
    which version produced which token. ``finish_reason == "error"`` carries ``error`` and
    no tokens: the requester decides whether to retry or fail the episode.
    """

    request_id: str
    episode_id: str
    completion_ids: TokenIds = []
    logprobs: Logprobs = []
    finish_reason: FinishReason
    policy_version: int = Field(ge=0)
    error: str | None = None
    replica: str = ""
    version_spans: _SpansField = None
    """The version of every completion token (:data:`VersionSpans`); None: all of them
    ``policy_version`` (records from before in-flight updates stay valid)."""

    @model_validator(mode="after")
    def _aligned(self) -> StepResult:
        _check_aligned(self.completion_ids, self.logprobs)
        _check_spans(self.version_spans, len(self.completion_ids), self.policy_version)
        return self


def _check_aligned(ids: list[int], logprobs: list[float]) -> None:
    if len(ids) != len(logprobs):
        raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} completion tokens")
    if any(math.isnan(x) or x > 0.0 for x in logprobs):
        raise ValueError("logprobs must be finite and <= 0")


class ToolCall(BaseModel):
    """A tool the agent ran in place of an environment step (see :mod:`rlbus.agent`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    arguments: dict[str, Any] = {}
    result: str = ""
    error: str | None = None
    """Why the call failed (unknown tool, bad arguments, exception, timeout); None if not."""
    seconds: float = 0.0


class Turn(BaseModel):
    """One turn of an episode, inside Trajectory.

    ``input_ids`` are the tokens appended to the context before this turn's completion (the
    prompt for turn 0, the environment's observation afterwards); the model saw
    ``concat(input_ids, completion_ids of every earlier turn …)`` exactly as sent, back to
    the latest turn with ``fresh_context`` (see :meth:`Trajectory.segments`).
    Invariant: ``len(logprobs) == len(completion_ids)``.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    input_ids: TokenIds
    completion_ids: TokenIds
    logprobs: Logprobs
    policy_version: int = Field(ge=0)
    finish_reason: FinishReason = "stop"
    action: str = ""
    observation: str = ""
    env_reward: float = 0.0
    tool_call: ToolCall | None = None
    """Set when this turn's action was a tool call: its observation is the tool's answer."""
    fresh_context: bool = False
    """This turn's ``input_ids`` are the call's whole context; the turns before it are not
    part of what the model saw: a new segment starts here (an agent whose history did not
    extend what it was given: trimmed, summarised, edited, retried). False in records
    written before segments existed, which are linear."""
    version_spans: _SpansField = None
    """Copied from the StepResult: the version of every completion token; None: all of
    them ``policy_version``, which is otherwise their oldest."""

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        _check_aligned(self.completion_ids, self.logprobs)
        _check_spans(self.version_spans, len(self.completion_ids), self.policy_version)
        return self

    @property
    def token_versions(self) -> list[int]:
        """The weight version that sampled each completion token."""
        if self.version_spans is None:
            return [self.policy_version] * len(self.completion_ids)
        return [v for v, count in self.version_spans for _ in range(count)]

    @property
    def newest_version(self) -> int:
        """The newest version that sampled any of its tokens (``policy_version`` is the
        oldest)."""
        if not self.version_spans:
            return self.policy_version
        return max(v for v, _ in self.version_spans)


class Trajectory(Message):
    """rollout → reward. One finished (or failed) episode.

    ``episode_id`` is ``<group_id>/<index>``. A failed episode (``status == "failed"``, with
    ``error``) is still published so the group completes; the learner masks it instead of
    scoring it 0.
    """

    episode_id: str
    group_id: str
    index: int = Field(ge=0)
    group_size: int = Field(ge=1)
    task: str
    spec: dict[str, Any]
    turns: list[Turn]
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    purpose: Literal["train", "eval"] = "train"
    eval_round: int | None = Field(default=None, ge=0)
    """Copied from the prompt: which evaluation round this episode belongs to."""
    started_at: float = 0.0
    finished_at: float = Field(default_factory=time.time)

    @property
    def min_version(self) -> int:
        """The oldest weight version that sampled any of its tokens (0: no turn)."""
        return min((t.policy_version for t in self.turns), default=0)

    @property
    def max_version(self) -> int:
        """The newest weight version that sampled any of its tokens (0: no turn)."""
        return max((t.newest_version for t in self.turns), default=0)

    def version_of_age(self, staleness_from: Literal["oldest", "newest"]) -> int:
        """The version its staleness counts from: its oldest token's (``min_version``, the
        default everywhere) or its newest's (``max_version``)."""
        return self.min_version if staleness_from == "oldest" else self.max_version

    def failed_stand_in(self, error: str) -> Trajectory:
        """This episode as a failed one with none of its content (no turns, no spec): what a
        tier passes on for an episode it dead-lettered, so that its group still completes,
        with this member masked, instead of waiting for it for ever."""
        return self.model_copy(update={"turns": [], "spec": {}, "status": "failed",
                                       "error": error})

    def segments(self) -> list[list[Turn]]:
        """The turns as the token sequences the model saw: a new one at each turn with
        ``fresh_context`` (the first turn always starts one). A linear episode is one
        segment; one with no turns has none. Each turn is in exactly one segment, so every
        sampled token is in exactly one."""
        out: list[list[Turn]] = []
        for turn in self.turns:
            if turn.fresh_context or not out:
                out.append([])
            out[-1].append(turn)
        return out

    @property
    def num_tokens(self) -> int:
        """Tokens of all its segments together: a context shared by two segments counts in
        each (it is a trainer's work twice)."""
        return sum(len(t.input_ids) + len(t.completion_ids) for t in self.turns)


MASK_CAUSES = ("stale", "failed", "invalid", "bad_logprobs")
"""Why a scored episode that reached the learner is not trained: weights older than its
``max_staleness`` allows, a rollout that failed, no usable reward (a verifier that raised
or timed out, an episode with no turns), or a behaviour logprob that is not finite (an
engine's NaN or infinity, which would make the loss NaN). Metrics count each as
``masked_<cause>``."""


class ScoredTrajectory(Message):
    """reward → learner. A trajectory with its verified reward.

    ``valid`` is False for failed episodes and for verifiers that raised or timed out; the
    learner masks those. Invariant: ``reward`` is finite.
    """

    trajectory: Trajectory
    reward: float
    valid: bool = True
    verifier: str = ""
    error: str | None = None
    info: dict[str, Any] = {}
    """What the verifier reported besides the reward (its Verdict's info)."""

    @classmethod
    def failed_stand_in(cls, t: Trajectory, error: str) -> ScoredTrajectory:
        """A masked stand-in for episode ``t``, dead-lettered by a tier: see
        :meth:`Trajectory.failed_stand_in`."""
        return cls(trajectory=t.failed_stand_in(error), reward=0.0, valid=False, error=error)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward must be finite, got {v}")
        return v


class LoraAdapter(BaseModel):
    """The shape of a LoRA adapter (:attr:`WeightVersion.adapter`): what the served base
    model must fit. The adapter folder's ``adapter_config.json`` (PEFT's format, which peft
    and vLLM read) must say the same; an engine checks both before loading."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)
    """The module names the adapter wraps (PEFT's resolved list, e.g. ``q_proj``)."""


class WeightVersion(Message):
    """learner → every inference replica, and the learner itself on restart (compacted, keyed
    by model). Rollout does not read it: the staleness gate is at inference.

    The weights live at ``uri`` (a safetensors folder); ``checksum`` is the sha256 of the
    safetensors file (a bare hex digest), or ``xxh3_128:<hex>`` (the learner's
    ``RLBUS_WEIGHTS_CHECKSUM``), checked before loading.
    """

    model: str
    version: int = Field(ge=0)
    uri: str
    checksum: str
    step: int = Field(ge=0)
    created_at: float = Field(default_factory=time.time)
    samples_trained: int = Field(default=0, ge=0)
    """Episodes that have entered the loss up to this step, over the whole run (what
    ``rlbus status`` reports as trained)."""
    samples_masked: dict[str, int] = {}
    """Episodes that reached the learner and were masked up to this step, by cause
    (:data:`MASK_CAUSES`)."""
    adapter: LoraAdapter | None = None
    """None: ``uri`` holds the full weights (``model.safetensors``). Set: ``uri`` is a PEFT
    adapter folder (``adapter_model.safetensors`` and ``adapter_config.json``) to serve over
    the base model the member started from (``RLBUS_MODEL_PATH``); ``checksum`` is that of
    ``adapter_model.safetensors``. Each version's adapter is whole, not a delta: it replaces
    the one served before. One that does not fit the base model is a dead letter, and the
    member goes on serving what it served."""


class WeightsServed(Message):
    """inference → trainers (:meth:`rlbus.client.RolloutClient.wait_served`). Which weights
    one inference member serves now (compacted, keyed by member).

    Each member sends one when it starts serving, after every load or refusal, every
    ``every_s`` seconds in between (so a reader can tell a live member from one that
    vanished) and, with ``leaving``, when it stops. ``version`` produced every token the
    member generated since ``at``.
    """

    model: str
    member: str
    version: int = Field(ge=0)
    """The weight version the member serves (0: the model folder it started from)."""
    refused_version: int | None = Field(default=None, ge=0)
    """The newest version it refused to load (its files did not verify), if any."""
    refused_error: str | None = None
    """Why it refused ``refused_version``."""
    every_s: float = Field(gt=0, allow_inf_nan=False)
    """How often the member reports while it runs."""
    leaving: bool = False
    """The member is stopping: it serves nothing from now on."""
    at: float = Field(default_factory=time.time)
    """When the member sent this (its clock)."""


class DeadLetter(Message):
    """any service → operators. A message that could not be decoded or handled."""

    source_topic: str
    partition: int
    offset: int
    error: str
    """Why, for a person (an exception's "<Type>: <message>", or a check's verdict)."""
    service: str
    key: bytes | None = None
    payload: bytes = b""
    failed_at: float = Field(default_factory=time.time)
    reason: str = ""
    """Why, as a code: a :class:`rlbus.errors.RefusalReason` value. A plain string, so that a
    reader older than a reason still reads the letter; empty from a writer older than the
    field."""
