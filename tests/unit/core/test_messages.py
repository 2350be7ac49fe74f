import math

import msgpack
import pytest

from rlbus.codec import DecodeError, decode, encode, to_jsonable
from rlbus.messages import DeadLetter, StepResult, Trajectory, Turn
from tests import factories


@pytest.mark.parametrize("make", factories.ALL, ids=lambda f: f.__name__)
def test_every_message_round_trips(make):
    msg = make()
    assert decode(encode(msg), type(msg)) == msg


def test_encoded_as_map_by_field_name_with_schema_version():
    raw = msgpack.unpackb(encode(factories.step_result()))
    assert raw["schema_version"] == 1
    assert raw["request_id"] == "run/0/0/t0"
    # token ids travel packed: int32 little-endian bytes
    assert raw["completion_ids"] == b"\x07\x00\x00\x00\x02\x00\x00\x00"


def test_unknown_fields_are_ignored_for_additive_evolution():
    raw = msgpack.unpackb(encode(factories.weight_version()))
    raw["added_in_a_later_version"] = {"x": 1}
    assert decode(msgpack.packb(raw), type(factories.weight_version())).version == 1


def test_a_dead_letter_carries_its_reason_code_as_a_plain_string():
    letter = factories.dead_letter().model_copy(update={"reason": "over_limit"})
    assert msgpack.unpackb(encode(letter))["reason"] == "over_limit"
    older = msgpack.unpackb(encode(letter))
    del older["reason"]  # a writer older than the field
    assert decode(msgpack.packb(older), DeadLetter).reason == ""
    newer = msgpack.unpackb(encode(letter)) | {"reason": "a_reason_added_later"}
    assert decode(msgpack.packb(newer), DeadLetter).reason == "a_reason_added_later"


def test_unknown_schema_version_is_refused():
    raw = msgpack.unpackb(encode(factories.prompt()))
    raw["schema_version"] = 99
    with pytest.raises(DecodeError, match="schema_version"):
        decode(msgpack.packb(raw), type(factories.prompt()))


@pytest.mark.parametrize(
    "data",
    [b"\xc1garbage", msgpack.packb([1, 2, 3]), msgpack.packb({"request_id": 5})],
    ids=["not-msgpack", "not-a-map", "wrong-shape"],
)
def test_bad_bytes_raise_decode_error(data):
    with pytest.raises(DecodeError):
        decode(data, StepResult)


def test_logprobs_must_match_tokens():
    with pytest.raises(ValueError, match="2 logprobs for 1 completion tokens"):
        Turn(input_ids=[1], completion_ids=[1], logprobs=[-1.0, -2.0], policy_version=0)


def test_nan_reward_refused():
    with pytest.raises(ValueError, match="finite"):
        factories.scored(reward=math.nan)


def test_json_view_has_plain_lists():
    view = to_jsonable(factories.trajectory())
    assert view["turns"][0]["completion_ids"] == [5, 2]


def test_float32_logprobs_survive_exactly_when_representable():
    traj = decode(encode(factories.trajectory()), Trajectory)
    assert traj.turns[0].logprobs == [-1.5, -0.125]
