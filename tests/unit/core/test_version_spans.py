"""Per-token weight versions (partial rollouts): run-length spans on StepResult and Turn."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlbus import codec
from rlbus.messages import StepResult, Trajectory, Turn, cut_spans, spans_of
from tests import factories


def result(spans: list[tuple[int, int]] | None, version: int = 3) -> StepResult:
    return StepResult(request_id="r", episode_id="run/0/0", completion_ids=[1, 2, 3],
                      logprobs=[-1.0, -2.0, -3.0], finish_reason="stop",
                      policy_version=version, version_spans=spans)


def test_spans_survive_the_wire_and_absent_means_all_at_policy_version() -> None:
    r = result([(3, 1), (4, 2)])
    back = codec.decode(codec.encode(r), StepResult)
    assert back.version_spans == [(3, 1), (4, 2)]
    old = result(None)
    assert codec.decode(codec.encode(old), StepResult).version_spans is None
    turn = Turn(input_ids=[9], completion_ids=[1, 2, 3], logprobs=[-1.0] * 3,
                policy_version=3)
    assert turn.token_versions == [3, 3, 3]
    assert turn.newest_version == 3


@pytest.mark.parametrize("spans", [
    [(3, 1), (4, 1)],  # covers 2 of 3 tokens
    [(3, 1), (4, 3)],  # covers 4
    [(3, 3), (4, 0)],  # an empty run
    [(4, 1), (5, 2)],  # policy_version 3 is not the oldest
])
def test_spans_that_do_not_describe_the_tokens_are_refused(spans: list[tuple[int, int]]
                                                           ) -> None:
    with pytest.raises(ValidationError):
        result(spans)


def test_run_length_helpers() -> None:
    assert spans_of([2, 2, 3, 3, 3]) == [(2, 2), (3, 3)]
    assert spans_of([]) == []
    assert cut_spans([(2, 2), (3, 3)], 3) == [(2, 2), (3, 1)]
    assert cut_spans([(2, 2), (3, 3)], 0) == []
    assert cut_spans(None, 3) is None


def test_a_trajectory_knows_its_oldest_and_newest_token() -> None:
    t = factories.trajectory(version=2)
    spanning = Turn(input_ids=[7], completion_ids=[1, 2, 3], logprobs=[-1.0] * 3,
                    policy_version=3, version_spans=[(3, 1), (5, 2)])
    t2 = t.model_copy(update={"turns": [*t.turns, spanning]})
    assert (t2.min_version, t2.max_version) == (2, 5)
    assert t2.version_of_age("oldest") == 2
    assert t2.version_of_age("newest") == 5
    assert spanning.token_versions == [3, 5, 5]
    empty = t.model_copy(update={"turns": []})
    assert isinstance(empty, Trajectory)
    assert (empty.min_version, empty.max_version) == (0, 0)


def test_a_malformed_spans_list_is_one_error_however_long() -> None:
    with pytest.raises(ValidationError) as info:
        result([None] * 100_000)  # type: ignore[list-item]
    assert info.value.error_count() == 1
    with pytest.raises(ValidationError):
        result([(3, True), (4, 2)])  # a bool is no count
