"""A straggling group is waited for, not masked: the staleness bound holds and nothing is
wasted (shared/rlbus/client/groups.py, RolloutClient._holding).

The learner runs on the in-memory bus with the synthetic trainer; the test plays the reward
tier itself, publishing scored episodes with chosen policy versions at chosen moments.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbus.client.groups import GroupAssembler
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.messages import ScoredTrajectory
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import Delivery, MemoryBus
from tests.factories import trajectory
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="st", partitions=1, result_partitions=1)


def _episode(group: str, index: int, version: int) -> ScoredTrajectory:
    t = trajectory(group, index, version=version)
    return ScoredTrajectory(trajectory=t, reward=float(index), verifier="x")


def _delivery(group: str, index: int, version: int) -> Delivery[Any]:
    return Delivery("t", 0, 0, None, _episode(group, index, version), [], 0)


def _assembler(*episodes: tuple[str, int, int]) -> GroupAssembler:
    a = GroupAssembler()
    for e in episodes:
        a.add(_delivery(*e))
    return a


def test_groups_are_taken_oldest_weights_first():
    a = _assembler(("g/new", 0, 3), ("g/new", 1, 3), ("g/old", 0, 1), ("g/old", 1, 2))
    assert [g.group_id for g in a.take(1)] == ["g/old"]
    assert [g.group_id for g in a.ready] == ["g/new"]


def test_due_names_groups_whose_last_chance_is_this_step():
    a = _assembler(("g/late", 0, 1), ("g/young", 0, 2), ("g/done", 0, 2), ("g/done", 1, 2))
    assert a.due(version=3, max_staleness=2, n=1) == ["g/late"]
    assert a.due(version=4, max_staleness=2, n=2) == ["g/young"]  # g/done has the other
    # g/late is already past saving at version 4: waiting for it cannot help
    assert a.due(version=4, max_staleness=2, n=1) == []  # g/done has the only place
    t = trajectory("g/unseen", 0).model_copy(update={"turns": [], "status": "failed"})
    failed = ScoredTrajectory(trajectory=t, reward=0.0, verifier="x")  # back, no turn;
    a.add(Delivery("t", 0, 1, None, failed, [], 0))  # the other member is still out
    assert a.open["g/unseen"].started == -1  # nothing known of its weights
    assert "g/unseen" not in a.due(version=1, max_staleness=2, n=4)
    assert "g/unseen" not in a.due(version=2, max_staleness=3, n=4)


def test_due_leaves_out_groups_the_step_has_no_place_for():
    a = _assembler(("g/late", 0, 1), ("g/full", 0, 1), ("g/full", 1, 1))
    assert a.due(version=3, max_staleness=2, n=1) == []  # g/full takes the one place
    assert a.due(version=3, max_staleness=2, n=2) == ["g/late"]


def test_a_group_past_saving_does_not_take_a_last_chance_groups_place():
    """g/lost (v0) is masked whatever step trains it; g/last (v1) can still train now.
    Oldest-first would train g/lost and let g/last go stale as well."""
    a = _assembler(("g/lost", 0, 0), ("g/lost", 1, 0), ("g/last", 0, 1), ("g/last", 1, 1),
                   ("g/young", 0, 2), ("g/young", 1, 2))
    assert a.due(version=3, max_staleness=2, n=1) == []  # g/last is complete: no wait
    assert [g.group_id for g in a.take(1, last_chance=1)] == ["g/last"]
    a.add(_delivery("g/last2", 0, 2))  # complete later: it has to wait for its place
    a.add(_delivery("g/last2", 1, 2))
    a.add(_delivery("g/newer", 0, 3))
    a.add(_delivery("g/newer", 1, 3))
    # the lost one goes right after the last-chance ones, ahead of younger groups, so its
    # offsets are not held back for long
    assert [g.group_id for g in a.take(3, last_chance=2)] == ["g/young", "g/last2", "g/lost"]
    assert [g.group_id for g in a.ready] == ["g/newer"]


def test_past_saving_groups_do_not_count_against_the_places_of_due_ones():
    a = _assembler(("g/lost", 0, 0), ("g/lost", 1, 0), ("g/late", 0, 1))
    assert a.due(version=3, max_staleness=2, n=1) == ["g/late"]


async def _run(tmp_path: Path, wait_s: float) -> tuple[list[dict[str, Any]], Learner]:
    """run/0 trains at v0; run/1 straggles (one member back at v0); run/2 is complete at
    v1. At v1 the learner has a full batch (run/2), and it is run/1's last chance within
    max_staleness=1; run/3 (v2) comes last.

    The straggler comes back only once the learner has decided about step 2 (held it, or
    trained it without run/1), however slow the machine: the metrics then show which."""
    broker = memory_broker(TOPICS)
    settings = LearnerSettings(
        topics=TOPICS, trainer="synthetic", synthetic_step_s=0.0, feed=False, group_size=2,
        groups_per_step=1, max_steps=3, max_staleness=1, straggler_wait_s=wait_s,
        checkpoint_dir=tmp_path / "ckpt", metrics_file=tmp_path / "metrics.jsonl",
    )
    learner = Learner(settings, MemoryBus(broker))
    producer = await MemoryBus(broker).producer()
    scored = Topics(TOPICS).scored

    async def send(group: str, index: int, version: int) -> None:
        await producer.send(scored, _episode(group, index, version), key=group)

    run = asyncio.create_task(learner.run())

    async def until(condition: Callable[[], bool], what: str) -> None:
        await wait_until(lambda: condition() or run.done(), what)
        if run.done():
            raise AssertionError(f"the learner stopped before {what}: {run.result()}")

    for e in [("run/0", 0, 0), ("run/0", 1, 0), ("run/1", 0, 0)]:
        await send(*e)
    await until(lambda: learner.step >= 1, "the first step")
    await send("run/2", 0, 1)
    await send("run/2", 1, 1)
    if wait_s:
        await until(lambda: learner.counters.get("straggler_waits", 0) >= 1,
                    "step 2 is held for run/1")
        assert learner.step == 1  # held, not trained on run/2 alone
    else:
        await until(lambda: learner.step >= 2, "step 2 trains run/2")
    await send("run/1", 1, 0)
    await send("run/3", 0, 2)
    await send("run/3", 1, 2)
    await asyncio.wait_for(run, 30)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, learner


async def test_the_learner_waits_for_a_straggler_instead_of_masking_it(tmp_path):
    rows, learner = await _run(tmp_path, wait_s=30)
    assert [r["masked"] for r in rows] == [0, 0, 0]  # run/1 trained at step 2, in time
    assert [r["trained"] for r in rows] == [2, 2, 2]
    assert max(r["staleness_max"] for r in rows) == 1  # the bound holds
    # step 2 was held once, until run/1 was complete, never given up on
    assert learner.counters.get("straggler_waits") == 1
    assert "straggler_timeouts" not in learner.counters
    assert rows[0]["waited_s"] == rows[2]["waited_s"] == 0


async def test_without_waiting_the_straggler_is_masked_as_stale(tmp_path):
    rows, learner = await _run(tmp_path, wait_s=0)
    assert [r["masked_stale"] for r in rows] == [0, 0, 2]  # both members of run/1
    assert all(r["waited_s"] == 0 for r in rows)
    assert "straggler_waits" not in learner.counters
