"""GroupAssembler: each group assembled and trained once, however many copies arrive; an
Episode as the token sequences (segments) a trainer trains on."""

from __future__ import annotations

import msgpack
import pytest

from rlbus.client import Episode, Segment, SegmentedEpisodeError
from rlbus.client.groups import GroupAssembler
from rlbus.codec import decode, encode
from rlbus.messages import ScoredTrajectory, Trajectory, Turn
from rlbus.transport import Delivery
from tests import factories

GROUP_SIZE = 2  # factories.trajectory's


def delivery(group_id: str, index: int, offset: int) -> Delivery[object]:
    return Delivery("scored", 0, offset, None, factories.scored(group_id, index), {}, 0)


def test_a_second_copy_of_a_complete_group_waiting_for_its_step_is_dropped():
    """Found by the compose end-to-end test: across a rebalance at start-up, two rollout
    members both ran one prompt; both copies of its group completed before the learner's
    step took the first, and step 3 trained the group twice (the ledger held it 16 times)."""
    assembler = GroupAssembler()
    offsets = iter(range(100))
    for index in range(GROUP_SIZE):
        assert assembler.add(delivery("run/2", index, next(offsets))) == []
    assert [g.group_id for g in assembler.ready] == ["run/2"]  # waiting for a second group
    copies = [delivery("run/2", index, next(offsets)) for index in range(GROUP_SIZE)]
    for copy in copies:
        assert assembler.add(copy) == [copy]  # dropped, and acked at once
    assert [g.group_id for g in assembler.ready] == ["run/2"] and not assembler.open
    assert assembler.duplicates == GROUP_SIZE
    (taken,) = assembler.take(2)
    assert assembler.add(delivery("run/2", 0, next(offsets)))  # trained: still dropped
    assert taken.group_id == "run/2" and assembler.trained_ids() == ["run/2"]


def _segmented() -> ScoredTrajectory:
    """Turn 1 extends turn 0; turn 2's context was trimmed (a new segment): ids 1 2 | 5 2 |
    3 | 6 then 1 4 | 7."""
    t = factories.trajectory("run/3")
    first, = t.turns
    turns = [first, Turn(input_ids=[3], completion_ids=[6], logprobs=[-0.5], policy_version=1),
             Turn(input_ids=[1, 4], completion_ids=[7], logprobs=[-0.25], policy_version=2,
                  fresh_context=True)]
    return ScoredTrajectory(trajectory=t.model_copy(update={"turns": turns}), reward=1.0)


def test_an_episode_whose_history_was_not_linear_is_one_segment_per_context() -> None:
    e = Episode.of(_segmented(), {})
    assert e.segments == (
        Segment([1, 2, 5, 2, 3, 6], [False, False, True, True, False, True],
                [0.0, 0.0, -1.5, -0.125, 0.0, -0.5]),
        Segment([1, 4, 7], [False, False, True], [0.0, 0.0, -0.25]),
    )
    assert e.policy_version == 0 and e.valid  # its oldest turn's version, as ever
    for name in ("token_ids", "loss_mask", "logprobs"):
        with pytest.raises(SegmentedEpisodeError, match=r"episode run/3/0 has 2 segments.*"
                                                        r"train each of episode\.segments"):
            getattr(e, name)


def test_a_linear_episode_is_one_segment_and_its_one_sequence() -> None:
    e = Episode.of(factories.scored("run/4"), {})
    (only,) = e.segments
    assert (e.token_ids, e.loss_mask, e.logprobs) == (only.token_ids, only.loss_mask,
                                                      only.logprobs)
    assert e.token_ids == [1, 2, 5, 2]
    failed = factories.scored("run/4").trajectory.failed_stand_in("gone")
    none = Episode.of(ScoredTrajectory.failed_stand_in(failed, "gone"), {})
    assert none.segments == () and none.token_ids == [] and not none.valid


def test_a_record_written_before_segments_existed_reads_as_linear_and_new_ones_keep_them() -> None:
    old = encode(factories.trajectory("run/5"), packed=False)
    raw = msgpack.unpackb(old)
    for turn in raw["turns"]:
        turn.pop("fresh_context")
    t = decode(msgpack.packb(raw), Trajectory)
    assert len(t.segments()) == 1 and not t.turns[0].fresh_context
    segmented = _segmented().trajectory
    assert decode(encode(segmented), Trajectory).segments() == segmented.segments()


def test_an_episode_from_several_versions_exposes_each_tokens_version() -> None:
    t = factories.trajectory(version=1)
    later = Turn(input_ids=[7, 8], completion_ids=[4, 5, 6], logprobs=[-1.0] * 3,
                 policy_version=2, version_spans=[(2, 1), (3, 2)])
    t = t.model_copy(update={"turns": [*t.turns, later]})
    ep = Episode.of(ScoredTrajectory(trajectory=t, reward=1.0), {})
    assert (ep.policy_version, ep.newest_version) == (1, 3)
    assert ep.version_of_age() == 1
    assert ep.version_of_age("newest") == 3
    seg = ep.segments[0]
    assert len(seg.versions) == len(seg.token_ids)
    # turn 0: [1, 2] context, [5, 2] sampled at v1; turn 1: [7, 8] context, 4 at v2, 5 6 at v3
    assert seg.versions == [-1, -1, 1, 1, -1, -1, 2, 3, 3]
    sampled = [v for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m]
    assert -1 not in sampled


def _spanning(group_id: str, index: int, oldest: int, newest: int) -> Delivery[object]:
    """An episode whose turns came from versions ``oldest`` to ``newest``."""
    t = factories.trajectory(group_id, index, version=oldest)
    later = Turn(input_ids=[7], completion_ids=[4], logprobs=[-1.0], policy_version=newest)
    scored = ScoredTrajectory(trajectory=t.model_copy(update={"turns": [*t.turns, later]}),
                              reward=1.0)
    return Delivery("scored", 0, index, None, scored, {}, 0)


@pytest.mark.parametrize(("staleness_from", "due_at"), [("oldest", 5), ("newest", 7)])
def test_a_straggling_group_is_due_when_the_token_the_learner_counts_reaches_the_bound(
        staleness_from, due_at):
    """Its member back ran from v1 to v3: the learner's stale mask counts from v1 (oldest)
    or v3 (newest), so the client waits for its straggler at that version's last chance
    (bound 4) and not before."""
    assembler = GroupAssembler(staleness_from=staleness_from)
    assembler.add(_spanning("run/0", 0, oldest=1, newest=3))
    for version in range(2, 9):
        due = assembler.due(version, max_staleness=4, n=4)
        assert due == (["run/0"] if version == due_at else [])
    assembler.add(_spanning("run/0", 1, oldest=1, newest=4))
    (taken,) = assembler.take(1, last_chance=due_at - 4)
    assert taken.started == 1 and taken.counted == due_at - 4
