"""One error hierarchy: every rlbus error says whether it is worth retrying, a refusal says
why with a code, and the builtin bases callers catch are kept."""

import msgpack
import pytest

from rlbus import codec, plugins, settings, topics, transport, weights
from rlbus.errors import (
    BrokerConnectError,
    BrokerTimeout,
    ChecksumMismatchError,
    DecodeError,
    FatalError,
    MessageTooLargeError,
    PluginError,
    Refusal,
    RefusalReason,
    RefusedError,
    RetriableError,
    RlbusError,
    SandboxError,
    TopicCreationError,
    TopicMismatchError,
    UnknownSettingError,
    reason_of,
)
from rlbus.messages import Prompt
from rlbus.transport import refusal_for

KINDS = {  # error: (its kind, the builtin base callers catch it by)
    BrokerTimeout: (RetriableError, TimeoutError),
    BrokerConnectError: (RetriableError, ConnectionError),
    SandboxError: (RetriableError, RuntimeError),
    DecodeError: (RefusedError, ValueError),
    MessageTooLargeError: (RefusedError, ValueError),
    PluginError: (RefusedError, LookupError),
    ChecksumMismatchError: (RefusedError, RuntimeError),
    UnknownSettingError: (FatalError, ValueError),
    TopicMismatchError: (FatalError, RuntimeError),
    TopicCreationError: (FatalError, RuntimeError),
}


@pytest.mark.parametrize("error", list(KINDS), ids=lambda e: e.__name__)
def test_each_error_has_one_kind_its_retriable_flag_and_its_builtin_base(error):
    kind, builtin = KINDS[error]
    assert issubclass(error, kind) and issubclass(error, RlbusError)
    assert issubclass(error, builtin)
    assert error.retriable is (kind is RetriableError)
    with pytest.raises(builtin, match="why"):
        raise error("why")


def test_the_moved_errors_keep_their_old_homes():
    assert codec.DecodeError is DecodeError
    assert plugins.PluginError is PluginError
    assert settings.UnknownSettingError is UnknownSettingError
    assert weights.ChecksumMismatchError is ChecksumMismatchError
    assert (topics.TopicMismatchError, topics.TopicCreationError) == (
        TopicMismatchError, TopicCreationError)
    assert (transport.BrokerTimeout, transport.BrokerConnectError,
            transport.MessageTooLargeError) == (
        BrokerTimeout, BrokerConnectError, MessageTooLargeError)


def test_a_refused_error_carries_its_class_reason_unless_given_one():
    assert PluginError("no task named 'x'").refusal == Refusal(
        RefusalReason.UNKNOWN_PLUGIN, "no task named 'x'")
    assert DecodeError("big", reason=RefusalReason.OVER_LIMIT).reason is RefusalReason.OVER_LIMIT
    assert DecodeError("x").reason is RefusalReason.UNDECODABLE  # the instance's is its own
    assert str(Refusal(RefusalReason.INVALID, "the text")) == "the text"


def test_a_raised_exception_is_refused_with_its_type_and_its_reason():
    assert reason_of(KeyError("k")) is RefusalReason.HANDLING_FAILED
    assert reason_of(MessageTooLargeError("m")) is RefusalReason.TOO_LARGE
    assert refusal_for(KeyError("k")) == Refusal(RefusalReason.HANDLING_FAILED, "KeyError: 'k'")
    assert refusal_for(MessageTooLargeError("too big")) == Refusal(
        RefusalReason.TOO_LARGE, "MessageTooLargeError: too big")


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xc1", RefusalReason.UNDECODABLE),  # not msgpack
    (msgpack.packb([1, 2]), RefusalReason.UNDECODABLE),  # not a map
    (msgpack.packb({"group_id": 7}), RefusalReason.INVALID),
    (b"\x91" * 100 + b"\x01", RefusalReason.OVER_LIMIT),  # nested over max_depth
], ids=["garbage", "array", "schema", "deep"])
def test_each_decode_refusal_says_which_kind_it_is(data, reason):
    with pytest.raises(DecodeError) as caught:
        codec.decode(data, Prompt)
    assert caught.value.reason is reason, caught.value
