"""What replay, trace and status print, without a broker: hostile bytes, human times, and
topic names that stay distinguishable at 80 columns."""

from __future__ import annotations

import base64
import io
import json
from datetime import UTC, datetime

import msgpack
from rich.console import Console

from rlbus.codec import encode
from rlbus.messages import DeadLetter, Prompt, StepRequest, Trajectory, WeightVersion
from rlbus.ops import inspection
from rlbus.ops.status import Sample, render, table
from rlbus.settings import TopicSettings
from rlbus.topics import Topics
from rlbus.transport import RawRecord
from tests import factories

T0 = int(datetime(2026, 12, 3, 10, 11, 12, 345000, tzinfo=UTC).timestamp() * 1000)
GARBAGE = b"\xc1\xff\x00not msgpack"


def record(value: bytes, topic: str = "r.steps", key: bytes | None = None, at: int = T0,
           offset: int = 0) -> RawRecord:  # fmt: skip
    return RawRecord(topic, 0, offset, key, value, {}, at)


def one(value: bytes, message_type: type) -> inspection.Decoded:
    (d,) = inspection.decoded([record(value)], message_type)
    return d


def test_garbage_is_base64_and_the_decode_error():
    d = one(GARBAGE, StepRequest)
    row = json.loads(json.dumps(inspection.as_json(*d)))
    assert row["error"].startswith("not msgpack")
    assert base64.b64decode(row["value_base64"]) == GARBAGE
    assert "message" not in row


def test_msgpack_that_fails_the_schema_is_base64_and_the_validation_error():
    value = msgpack.packb({"episode_id": 7, "turn": "x"})
    row = inspection.as_json(*one(value, StepRequest))
    assert row["error"].startswith("invalid StepRequest")
    assert base64.b64decode(row["value_base64"]) == value


def test_a_dead_letter_with_a_non_utf8_payload_and_key_prints_as_json():
    letter = DeadLetter(source_topic="r.steps", partition=1, offset=9, error="not msgpack",
                        service="inference-0", key=b"\xfe\xff", payload=GARBAGE)  # fmt: skip
    row = json.loads(json.dumps(inspection.as_json(*one(encode(letter), DeadLetter))))
    assert base64.b64decode(row["message"]["payload"]["base64"]) == GARBAGE
    assert base64.b64decode(row["message"]["key"]["base64"]) == b"\xfe\xff"


TOPICS = Topics(TopicSettings(prefix="r"))


def dead_letter_row(payload: bytes, key: bytes | None = b"long/1", source: str = "r.prompts",
                    raw_bytes: bool = False) -> dict:  # fmt: skip
    letter = DeadLetter(source_topic=source, partition=0, offset=3, error="too long",
                        service="rollout-0", key=key, payload=payload)  # fmt: skip
    d = one(encode(letter), DeadLetter)
    row = inspection.as_json(*d, topics=TOPICS, raw_bytes=raw_bytes)
    return json.loads(json.dumps(row))["message"]


def test_a_dead_letter_shows_its_reason_code_next_to_its_text():
    letter = DeadLetter(source_topic="r.prompts", partition=0, offset=3, error="too long",
                        service="rollout-0", reason="over_limit")  # fmt: skip
    d = one(encode(letter), DeadLetter)
    row = json.loads(json.dumps(inspection.as_json(*d, topics=TOPICS)))["message"]
    assert (row["reason"], row["error"]) == ("over_limit", "too long")
    text: list[str] = []
    inspection.render_episode(inspection.EpisodeRecords("long/1", [d]), text.append)
    assert "by rollout-0 [over_limit]: too long" in "".join(text)


def test_a_dead_lettered_prompt_shows_its_text_key_and_the_prompt():
    prompt = factories.prompt("long/1")
    row = dead_letter_row(encode(prompt))
    assert row["key"] == "long/1"
    assert row["payload_type"] == "Prompt"
    assert row["payload"]["group_id"] == "long/1" and row["payload"]["task"] == prompt.task
    assert row["source_topic"] == "r.prompts" and row["error"] == "too long"


def test_raw_keeps_a_dead_letters_key_and_payload_as_stored_base64():
    payload = encode(factories.prompt("long/1"))
    row = dead_letter_row(payload, raw_bytes=True)
    assert row["key"] == {"base64": base64.b64encode(b"long/1").decode()}
    assert base64.b64decode(row["payload"]["base64"]) == payload
    assert "payload_type" not in row


def test_a_dead_letter_payload_that_fails_its_type_shows_as_plain_msgpack():
    payload = msgpack.packb({"group_id": 7, "blob": b"\xff", "text": "hi"}, use_bin_type=True)
    row = dead_letter_row(payload)
    assert row["payload_type"] == "msgpack"
    assert row["payload"] == {"group_id": 7, "blob": {"base64": "/w=="}, "text": "hi"}


def test_a_dead_letter_payload_that_is_not_msgpack_and_a_binary_key_stay_base64():
    for payload in (GARBAGE, b"7", msgpack.packb("a lone string")):  # scalars say less as such
        row = dead_letter_row(payload, key=b"\xfe\xff")
        assert row["payload_type"] == "base64", payload
        assert base64.b64decode(row["payload"]["base64"]) == payload
        assert base64.b64decode(row["key"]["base64"]) == b"\xfe\xff"
    assert dead_letter_row(GARBAGE, key=None)["key"] is None


def test_a_dead_letter_payload_over_the_decode_limits_stays_base64():
    deep = b"\x91" * 1000 + b"\x00"  # [[[...0...]]], 1000 levels: msgpack parses it
    row = dead_letter_row(deep)
    assert row["payload_type"] == "base64"
    assert base64.b64decode(row["payload"]["base64"]) == deep


def test_a_dead_letters_source_topic_names_its_type_under_any_prefix():
    scored = encode(factories.scored("run/1", 2))
    for source in ("r.trajectories.scored", "rescore.trajectories.scored"):
        row = dead_letter_row(scored, source=source)
        assert row["payload_type"] == "ScoredTrajectory", source
    assert dead_letter_row(encode(factories.step_result()), source="x.y.steps.results")[
        "payload_type"] == "StepResult"
    outside = dead_letter_row(encode(factories.prompt()), source="elsewhere")
    assert outside["payload_type"] == "msgpack"  # no type known: the plain map
    assert outside["payload"]["group_id"] == "run/0"


def test_binary_and_exotic_values_in_a_free_form_spec_print_as_json():
    data = factories.prompt("g").model_dump(mode="python", context={"packed": True})
    data["spec"] = {"bin": b"\xff", "ts": msgpack.Timestamp(1, 2), "nested": {b"\xff": 1, 2: b"x"}}
    d = one(msgpack.packb(data, use_bin_type=True), Prompt)
    assert d.message is not None
    row = json.loads(json.dumps(inspection.as_json(*d)))
    assert row["message"]["spec"]["bin"] == {"base64": base64.b64encode(b"\xff").decode()}
    assert row["message"]["spec"]["ts"].startswith("Timestamp(")


def test_a_binary_key_and_an_impossible_timestamp_do_not_break_a_row():
    row = inspection.as_json(record(GARBAGE, key=b"\xff", at=2**62), None, None)
    assert row["key"] == {"base64": base64.b64encode(b"\xff").decode()}
    assert row["time"] == str(2**62)
    assert "error" not in row  # a topic outside the catalogue: no type, so no decode error


def test_trace_shows_utc_times_and_offsets_from_the_first_record():
    steps = [
        (T0, encode(factories.step_request("run/7/1", 0))),
        (T0 + 12, encode(factories.step_result("run/7/1"))),
        (T0 + 1500, GARBAGE),
    ]
    rows = [
        inspection.decoded([record(v, at=at, offset=i)], StepRequest if i == 0 else None)
        for i, (at, v) in enumerate(steps)
    ]
    found = inspection.EpisodeRecords("run/7/1", [next(r) for r in rows])
    found.rows[2] = found.rows[2]._replace(error="not msgpack: boom")
    text: list[str] = []
    inspection.render_episode(found, text.append)
    out = "".join(text)
    assert "timeline (from 2026-12-03T10:11:12.345Z)" in out
    lines = [line.split() for line in out.splitlines()[2:]]
    assert lines[0] == ["2026-12-03T10:11:12.345Z", "+0.000s", "r.steps[0]@0", "StepRequest"]
    assert lines[1][:2] == ["2026-12-03T10:11:12.357Z", "+0.012s"]
    assert lines[2][:2] == ["2026-12-03T10:11:13.845Z", "+1.500s"]
    assert f"undecodable (not msgpack: boom); base64 {base64.b64encode(GARBAGE).decode()}" in out
    assert str(T0) not in out  # no raw epoch milliseconds


def test_trace_shows_where_each_segment_of_an_episode_starts():
    t = factories.trajectory("run/8")
    first = t.turns[0]
    fresh = first.model_copy(update={"input_ids": [1, 2, 3], "fresh_context": True,
                                     "action": "5"})
    t = t.model_copy(update={"turns": [first, first, fresh]})
    found = inspection.EpisodeRecords("run/8/0", [one(encode(t), Trajectory)])
    text: list[str] = []
    inspection.render_episode(found, text.append)
    lines = "".join(text).splitlines()
    assert "  segments 2 (its agent's history was not linear" in "\n".join(lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("  -- segment starts"))
    assert lines[at] == ("  -- segment starts: turn 2's context is its 3 input tokens, not "
                         "the turns above")
    assert lines[at - 1].startswith("  turn 1 ") and lines[at + 1].startswith("  turn 2 ")
    linear = inspection.EpisodeRecords("run/8/1", [one(encode(factories.trajectory()),
                                                       Trajectory)])
    text.clear()
    inspection.render_episode(linear, text.append)
    assert "segment" not in "".join(text)


def test_status_at_80_columns_shows_the_prefix_once_and_distinct_topic_names():
    prefix = "demo-20261203-101112"
    names = [s.name for s in Topics(TopicSettings(prefix=prefix)).catalogue()]
    groups = {(f"{prefix}.reward", f"{prefix}.trajectories"): 3, ("[b]x[/b]", names[0]): 1}
    cur = Sample(1.0, dict.fromkeys(names, 10), groups, groups)
    console = Console(width=80, file=io.StringIO())
    console.print(table(None, cur, prefix))
    out = console.file.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    assert out.count(prefix) == 1  # once, in the title
    cells = {line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")}
    short = {n.removeprefix(prefix + ".") for n in names}
    assert short <= cells  # trajectories and trajectories.scored, each in full
    assert "reward" in out and "[b]x[/b]" in out  # a group name is text, not markup


def test_status_counts_samples_trained_apart_from_masked_ones_by_cause():
    def at(t: float, step: int, trained: int, stale: int) -> Sample:
        w = WeightVersion(model="policy", version=step, uri="u", checksum="c", step=step,
                          samples_trained=trained, samples_masked={"stale": stale, "failed": 2})
        return Sample(t, {}, {}, {}, {"policy": w})

    console = Console(width=120, file=io.StringIO())
    console.print(render(at(10.0, 4, 100, 1), at(12.0, 6, 150, 3)))
    row = next(line for line in console.file.getvalue().splitlines() if "policy" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    # 50 trained in 2 s; masked stale, failed, invalid, bad_logprobs
    assert cells == ["policy", "6", "150", "25.0", "3", "2", "0", "0"]


def test_trace_shortens_large_bad_records_and_json_keeps_them_whole():
    big = GARBAGE * 1000
    d = inspection.Decoded(record(big, key=b"run/7/1"), None, "not msgpack: boom")
    text: list[str] = []
    inspection.render_episode(inspection.EpisodeRecords("run/7/1", [d]), text.append)
    out = "".join(text)
    assert f"({len(big)} bytes; --json has them all)" in out and len(out) < 1000
    assert base64.b64decode(inspection.as_json(*d)["value_base64"]) == big
