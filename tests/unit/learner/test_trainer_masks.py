"""Masked episodes are counted by cause; only the rest count as trained."""

from rlbus.learner.stats import MaskCounts
from rlbus.learner.trainer import mask_cause


class _T:
    def __init__(self, status: str = "ok", turns: int = 1) -> None:
        self.status, self.turns = status, [object()] * turns


class _S:
    def __init__(self, valid: bool = True, **kw: object) -> None:
        self.valid, self.trajectory = valid, _T(**kw)  # type: ignore[arg-type]


def test_each_cause_is_told_apart_and_counted() -> None:
    causes = [
        mask_cause(_S(), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(), 3, 2),  # type: ignore[arg-type]
        mask_cause(_S(valid=False, status="failed"), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(valid=False), 0, 2),  # type: ignore[arg-type]
        mask_cause(_S(turns=0), 5, 2),  # type: ignore[arg-type]
    ]
    assert causes == [None, "stale", "failed", "invalid", "invalid"]
    counts = MaskCounts.of(causes)
    assert counts.trained == 1 and counts.masked == 4
    assert counts.row() == {"trained": 1, "masked": 4, "masked_stale": 1, "masked_failed": 1,
                            "masked_invalid": 2}
