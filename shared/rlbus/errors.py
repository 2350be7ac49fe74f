"""rlbus's errors, typed by what the caller can do about them.

Every rlbus error is an :class:`RlbusError`, with a ``retriable`` flag on its class, and is
one of three kinds:

* :class:`RetriableError` (``retriable = True``): the same call may succeed later (a broker
  that did not answer in time, a sandbox that failed to start). Nothing is wrong with the
  input.
* :class:`RefusedError`: this piece of work is refused or failed for good (a message that
  does not decode, is over a limit, names no plugin); retrying it gives the same answer.
  The caller records why (a dead letter, a failed episode, a masked sample) and goes on
  with the next. It carries a :class:`RefusalReason`.
* :class:`FatalError`: the process cannot go on as configured (an unknown setting, topics of
  another shape); it stops and says why.

Each error also keeps the builtin base it had (``ValueError``, ``TimeoutError``, ...) so an
``except`` written against those still catches it. Errors that belong to one tier (the
gateway's, the reward pool's) live in that tier and subclass these bases.

A refusal that is not raised, such as a limit check's verdict, is a :class:`Refusal`: a
typed reason and the human detail. A dead letter carries both (:class:`rlbus.messages.
DeadLetter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RefusalReason(StrEnum):
    """Why a message was refused: the code a dead letter carries next to its text."""

    UNDECODABLE = "undecodable"
    """Not msgpack, or not a map: nothing of it could be read."""
    INVALID = "invalid"
    """Readable, but not a valid message of its type (schema, or an invariant such as an
    episode index below its group size, or token ids inside the model's vocabulary)."""
    OVER_LIMIT = "over_limit"
    """Over an operator limit (``RLBUS_LIMITS__*``), on decode or before the work starts."""
    TOO_LARGE = "too_large"
    """What handling it produced is larger than the topics accept
    (``RLBUS_TOPICS__MAX_MESSAGE_BYTES``)."""
    UNKNOWN_PLUGIN = "unknown_plugin"
    """It names a task, agent or verifier that is not installed or does not load."""
    GROUP_GIVEN_UP = "group_given_up"
    """Its group crashed on every attempt (``RLBUS_GROUP_ATTEMPTS``)."""
    HANDLING_FAILED = "handling_failed"
    """Its handling raised: a bug, or code of a plugin that failed on it."""


@dataclass(frozen=True)
class Refusal:
    """A refused message's reason code and the text that explains it to a person."""

    reason: RefusalReason
    detail: str

    def __str__(self) -> str:
        return self.detail


class RlbusError(Exception):
    """Base of every rlbus error."""

    retriable: bool = False
    """True where the same call may succeed if tried again later."""


class RetriableError(RlbusError):
    """A transient failure: try again later; the input is not at fault."""

    retriable = True


class RefusedError(RlbusError):
    """This piece of work is refused or failed for good: record why, go on with the next.
    ``reason`` is the class's unless one is given for this instance."""

    reason: RefusalReason = RefusalReason.HANDLING_FAILED

    def __init__(self, message: str, *, reason: RefusalReason | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def refusal(self) -> Refusal:
        """The refusal this error stands for, its message as the detail."""
        return Refusal(self.reason, str(self))


class FatalError(RlbusError):
    """The process cannot go on as configured: stop and say why."""


def reason_of(exc: BaseException) -> RefusalReason:
    """The reason a dead letter gives for an exception its handling raised."""
    return exc.reason if isinstance(exc, RefusedError) else RefusalReason.HANDLING_FAILED


# -- the core's, the transport's and the extension API's own errors


class DecodeError(RefusedError, ValueError):
    """The bytes are not a valid message of the expected type."""

    reason = RefusalReason.UNDECODABLE


class InvalidMessageError(RefusedError, ValueError):
    """Valid on the wire, but its content cannot be worked on (a token id past the model's
    vocabulary): refused as ``invalid``."""

    reason = RefusalReason.INVALID


class MessageTooLargeError(RefusedError, ValueError):
    """An encoded message is larger than the topics accept (``max_message_bytes``)."""

    reason = RefusalReason.TOO_LARGE


class PluginError(RefusedError, LookupError):
    """A task, agent or verifier cannot be found or loaded; the message says why."""

    reason = RefusalReason.UNKNOWN_PLUGIN


class ChecksumMismatchError(RefusedError, RuntimeError):
    """The weights on disk are not the ones the WeightVersion announced."""

    reason = RefusalReason.INVALID


class WeightsOutsideStoreError(RefusedError, ValueError):
    """A WeightVersion's uri names a file outside the configured weight store (or no local
    file at all): never loaded, dead-lettered."""

    reason = RefusalReason.INVALID


class BrokerTimeout(RetriableError, TimeoutError):
    """A broker call did not finish within ``KafkaSettings.request_timeout_s``."""


class BrokerConnectError(RetriableError, ConnectionError):
    """The first connection to the cluster failed; the message says why, if it can tell."""


class SandboxError(RetriableError, RuntimeError):
    """The sandbox itself failed, not the program: the sample must not be scored."""


class NoCreditError(RetriableError, RuntimeError):
    """The trainer client's credit window is full: no more training groups until the
    trainer publishes its next weight version (:mod:`rlbus.client`)."""


class WeightsMismatchError(RefusedError, ValueError):
    """Weights a trainer published do not have the names, shapes or dtypes the served
    model has: nothing was written or announced."""

    reason = RefusalReason.INVALID


class NotServedError(RetriableError, TimeoutError):
    """The inference members did not report serving a weight version in time; the
    message names each live member and the version it serves."""


class WeightsRefusedError(RefusedError, RuntimeError):
    """An inference member refused to load a published weight version (its files did not
    verify); the message names the member and why."""

    reason = RefusalReason.INVALID


class PositionError(FatalError, ValueError):
    """A trainer's checkpointed position that this client cannot resume from (of another
    format, or of another topic)."""


class SegmentedEpisodeError(FatalError, ValueError):
    """A trainer asked an episode of several segments for its one token sequence
    (``Episode.token_ids``): there is none the model saw. Train each of its ``segments``, or
    run the rollout tier's gateway with ``RLBUS_GATEWAY_HISTORY=strict``."""


class UnknownSettingError(FatalError, ValueError):
    """An RLBUS_* environment variable names no setting of any rlbus service."""


class AccessDeniedError(FatalError, PermissionError):
    """The broker refuses this principal an operation its role needs (an ACL is missing,
    or the role is used for what is not its own); the message names the operation, the
    resource and what to fix."""


class MissingTopicError(FatalError, LookupError):
    """A topic of the catalogue does not exist (``rlbus topics create`` makes them)."""


class TopicMismatchError(FatalError, RuntimeError):
    """An existing topic does not have the shape the catalogue asks for."""


class TopicCreationError(FatalError, RuntimeError):
    """The broker refused to create a topic (e.g. replication above the broker count)."""


MAX_ERROR_CHARS = 2000
"""Longest reason a dead letter carries (a reason may quote hostile input)."""


def failure_reason(exc: BaseException) -> str:
    """The reason a dead letter gives for an exception: its type and message."""
    return bounded(f"{type(exc).__name__}: {exc}")


def refusal_for(exc: BaseException) -> Refusal:
    """The refusal of a delivery whose handling raised ``exc``: the reason a
    :class:`rlbus.errors.RefusedError` carries (else ``handling_failed``), and
    :func:`failure_reason`'s text."""
    return Refusal(reason_of(exc), failure_reason(exc))


def bounded(error: str) -> str:
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return f"{error[:MAX_ERROR_CHARS]}... ({len(error) - MAX_ERROR_CHARS} more characters)"
