"""Hostile messages at each tier's decode-and-check path: valid msgpack, often valid schema,
built to make a tier recurse, allocate or choke. Each is rejected with a reason or accepted
as a message that stays within the limits; nothing else escapes, and decoding allocates in
proportion to the bytes received, never to what a header or a nesting claims.

The generator is seeded (one seed a tier, printed on failure), so a failing case replays.
"""

from __future__ import annotations

import math
import random
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from rlbus.codec import DecodeError, decode, encode, shape_error
from rlbus.errors import Refusal
from rlbus.limits import Limits, check_prompt, check_scored, check_step, check_trajectory
from rlbus.messages import Message, Prompt, Sampling, ScoredTrajectory, StepRequest, Trajectory
from tests import factories

LIMITS = Limits(max_string_bytes=1 << 20)
"""As an operator would set them: strings bounded below the message size (unset by default)."""
HOLE = "\x00hostile\x00"
HOLE_PACKED = msgpack.packb(HOLE)

# ------------------------------------------------------------------ hostile values (bytes)


def _deep_arrays(rng: random.Random) -> bytes:
    depth = rng.choice([LIMITS.max_depth + 1, 999, 1023, 1100, 100_000])
    return b"\x91" * depth + b"\x01"  # [[[...[1]...]]]


def _deep_maps(rng: random.Random) -> bytes:
    depth = rng.choice([LIMITS.max_depth, 500, 2000, 100_000])
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... None}}


def _long_string(rng: random.Random) -> bytes:
    n = rng.choice([LIMITS.max_string_bytes + 1, LIMITS.max_string_bytes // 2])
    return msgpack.packb("x" * n)


def _lying_header(rng: random.Random) -> bytes:
    """A header that claims 4G of something, followed by a few bytes of it."""
    head = rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9"])  # str, bin, array, map, ext
    return head + b"\xff\xff\xff\xff" + bytes(rng.randrange(256) for _ in range(8))


def _many_elements(rng: random.Random) -> bytes:
    n = rng.choice([LIMITS.max_elements + 1, LIMITS.max_elements - 64])
    kind = rng.choice([b"\xc0", b"\x80", b"\x90"])  # nil, {} or [] each
    return b"\xdd" + struct.pack(">I", n) + kind * n


def _many_small_collections(rng: random.Random) -> bytes:
    """Many arrays each under the per-collection limit, over it all together."""
    per = 1000
    outer = LIMITS.max_elements // per + rng.randint(1, 5)
    inner = b"\xdc" + struct.pack(">H", per) + b"\x01" * per
    return b"\xdd" + struct.pack(">I", outer) + inner * outer


def _number(rng: random.Random) -> bytes:
    return msgpack.packb(rng.choice([
        2**64 - 1, -(2**63), 2**31, -1, 0, math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324,
    ]))


def _wrong_type(rng: random.Random) -> bytes:
    return msgpack.packb(rng.choice([
        None, True, b"\xff" * 7, "text", [], {}, [1, "a", None], {"1": [2.5, {"x": None}]},
        {"group_size": 10**9}, msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1, 2),
    ]), use_bin_type=True)


def _odd_map(rng: random.Random) -> bytes:
    """Keys that are not strings: ints, nil, binary; and one key given twice."""
    return rng.choice([
        b"\x82\x01\x02\xc0\x03",  # {1: 2, None: 3}
        b"\x81\xc4\x01k\x01",  # {b"k": 1}
        b"\x82\xa1a\x01\xa1a\x02",  # {"a": 1, "a": 2}
        b"\x81\x91\x01\x01",  # {[1]: 1}: an unhashable key
    ])


def _bad_utf8(rng: random.Random) -> bytes:
    return b"\xa3" + bytes([0xFF, 0xFE, rng.randrange(0x80, 0x100)])


def _token_array(rng: random.Random) -> bytes:
    """Token ids or logprobs in the wrong shape: odd byte counts, out-of-range lists."""
    return rng.choice([
        msgpack.packb(b"\x01\x02\x03", use_bin_type=True),  # not a multiple of 4 bytes
        msgpack.packb([2**40, 1]),
        msgpack.packb([-5]),
        msgpack.packb(struct.pack("<2f", math.nan, 0.5), use_bin_type=True),
        msgpack.packb([math.inf]),
        msgpack.packb(b"", use_bin_type=True),
    ])


VALUES: list[Callable[[random.Random], bytes]] = [
    _deep_arrays, _deep_maps, _long_string, _lying_header, _many_elements,
    _many_small_collections, _number, _wrong_type, _odd_map, _bad_utf8, _token_array,
]

# ------------------------------------------------------------------ placing them in messages


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``obj`` a value can be swapped for another, the root excluded."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*path, k))
        out.extend(_paths(v, (*path, k)))
    return out


def _hostile(base: Message, rng: random.Random) -> bytes:
    """``base`` with one value (an existing field, a new key of a nested map, or the whole
    message) replaced by hostile bytes."""
    raw = msgpack.unpackb(encode(base), raw=False)
    value = rng.choice(VALUES)(rng)
    where = rng.random()
    if where < 0.05:
        return value  # the whole message
    if where < 0.1:
        return encode(base)[: rng.randrange(1, len(encode(base)))]  # cut short
    maps = [p for p in _paths(raw) if isinstance(_at(raw, p), dict)]
    if where < 0.3 and maps:  # a key nobody expects, in a free-form map or at the top
        target = _at(raw, rng.choice(maps)) if rng.random() < 0.7 else raw
        target[f"extra{rng.randrange(9)}"] = HOLE
    else:
        *parent, key = rng.choice(_paths(raw))
        _at(raw, tuple(parent))[key] = HOLE
    packed = msgpack.packb(raw, use_bin_type=True)
    assert packed.count(HOLE_PACKED) == 1
    return packed.replace(HOLE_PACKED, value)


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj

# ------------------------------------------------------------------ the property


def _prompt() -> Prompt:
    spec = {"target": 3, "low": 0, "high": 15, "max_turns": 4, "nested": {"a": [1, {"b": 2}]}}
    return Prompt(group_id="g", task="guess_number", spec=spec, group_size=2,
                  sampling=Sampling(max_new_tokens=8))


def _step() -> StepRequest:
    return StepRequest(request_id="e/t0", episode_id="e", turn=0, input_ids=[1, 2, 3],
                       reply_partition=0)


def _trajectory() -> Trajectory:
    return factories.trajectory("g").model_copy(update={"spec": {"target": 3, "k": [1, {}]}})


def _scored() -> ScoredTrajectory:
    return ScoredTrajectory(trajectory=_trajectory(), reward=1.0, info={"why": {"a": [1]}})


TIERS = {  # tier: (what it consumes, a valid one, its check after decoding)
    "rollout": (Prompt, _prompt, check_prompt),
    "inference": (StepRequest, _step, check_step),
    "reward": (Trajectory, _trajectory, check_trajectory),
    "learner": (ScoredTrajectory, _scored, check_scored),
}
CASES = 60


def _decode_and_check(data: bytes, cls: type[Message], check: Callable[..., Refusal | None]
                      ) -> tuple[str, int]:
    """What the tier's consumer does with ``data``; returns (outcome, peak bytes decoding)."""
    tracemalloc.start()
    try:
        message = decode(data, cls, LIMITS)
    except DecodeError as exc:
        assert str(exc).strip(), "a rejection must say why"
        return "rejected", tracemalloc.get_traced_memory()[1]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    why = check(message, LIMITS)  # the tier's own limits: may refuse, must not raise
    # accepted: within the limits as the tier will see it, and encodable again (a dead
    # letter's payload, reward's output carry it)
    assert shape_error(message.model_dump(), LIMITS) is None
    again = encode(message)
    assert encode(decode(again, cls, LIMITS)) == again  # (NaN != NaN: bytes compared)
    return ("refused" if why else "accepted"), peak


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_hostile_messages_are_rejected_with_a_reason_or_accepted_within_limits(tier):
    cls, valid, check = TIERS[tier]
    seed = sorted(TIERS).index(tier)
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for case in range(CASES):
        data = _hostile(valid(), rng)
        try:
            outcome, peak = _decode_and_check(data, cls, check)
        except Exception as exc:
            raise AssertionError(f"{tier} seed {seed} case {case}: {exc!r} escaped "
                                 f"for {data[:80]!r}...") from exc
        # what decoding allocates follows the bytes received, not what they claim: at
        # worst an empty map, one byte, becomes a dict (~64 bytes), then its validated copy
        assert peak <= 160 * len(data) + (1 << 20), (tier, case, peak, len(data))
        seen[outcome] = seen.get(outcome, 0) + 1
    assert seen.get("rejected", 0) > CASES // 3, seen  # the generator is hostile enough
    assert seen.get("accepted", 0) + seen.get("refused", 0) > 0, seen  # and not only that

# ------------------------------------------------------------------ the reasons, one by one


def _with_spec(spec_bytes: bytes) -> bytes:
    raw = msgpack.unpackb(encode(_prompt()), raw=False)
    raw["spec"] = HOLE
    return msgpack.packb(raw).replace(HOLE_PACKED, b"\x81\xa1k" + spec_bytes)


@pytest.mark.parametrize("depth", [LIMITS.max_depth, 900, 100_000])
def test_a_spec_nested_deep_is_refused_on_decode_naming_the_setting(depth):
    # 900: below msgpack's own stack, above what json.dumps (the spec size check) survives
    with pytest.raises(DecodeError, match="RLBUS_LIMITS__MAX_DEPTH"):
        decode(_with_spec(b"\x91" * depth + b"\x01"), Prompt)


def test_the_deepest_spec_allowed_still_decodes_and_checks():
    # Prompt map (1) > spec (2) > "k" (3) > arrays...: max_depth in all
    data = _with_spec(b"\x91" * (LIMITS.max_depth - 2) + b"\x01")
    assert check_prompt(decode(data, Prompt), LIMITS) is None


@pytest.mark.parametrize(("value", "setting"), [
    (msgpack.packb("x" * (LIMITS.max_string_bytes + 1)), "MAX_STRING_BYTES"),
    (msgpack.packb(b"x" * (LIMITS.max_string_bytes + 1), use_bin_type=True),
     "MAX_STRING_BYTES"),
    (b"\xdd\xff\xff\xff\xff", "MAX_ELEMENTS"),
    (b"\xdf\x00\x10\x00\x00", "MAX_ELEMENTS"),
])
def test_sizes_over_a_limit_are_refused_before_allocation_naming_the_setting(value, setting):
    with pytest.raises(DecodeError, match=f"over the limit .*RLBUS_LIMITS__{setting}"):
        decode(_with_spec(value), Prompt, LIMITS)


def test_elements_are_counted_over_the_whole_message():
    tight = Limits(max_elements=2000)
    many = b"\x93" + (b"\xdc\x03\x84" + b"\x01" * 900) * 3  # 3 arrays of 900
    with pytest.raises(DecodeError, match="RLBUS_LIMITS__MAX_ELEMENTS"):
        decode(_with_spec(many), Prompt, tight)


def test_values_a_wire_type_cannot_hold_are_refused_on_decode():
    raw = msgpack.unpackb(encode(_step(), packed=False))
    for field, value, needle in [
        ("input_ids", [2**40], "input_ids: .*token ids must be in the range of int32"),
        ("input_ids", [1, "2"], "input_ids: .*token ids must be integers"),
        ("sampling", {"temperature": math.inf}, "sampling.temperature"),
        ("sampling", {"top_p": math.nan}, "sampling.top_p"),
    ]:
        with pytest.raises(DecodeError, match=needle):
            decode(msgpack.packb({**raw, field: value}), StepRequest)


def test_a_limit_set_too_low_for_a_packed_context_is_a_settings_error():
    with pytest.raises(ValueError, match="cannot hold a packed context"):
        Limits(max_input_tokens=1_000_000, max_string_bytes=1 << 20)
    assert Limits(max_input_tokens=1_000_000, max_string_bytes=4_000_000)
    assert Limits(max_input_tokens=1_000_000)  # unset: as large as the message
