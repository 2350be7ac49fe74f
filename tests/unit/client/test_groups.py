"""GroupAssembler: each group assembled and trained once, however many copies arrive."""

from __future__ import annotations

from rlbus.client.groups import GroupAssembler
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
