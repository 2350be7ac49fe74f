"""Nothing lost and nothing trained twice, counted from the learner's checkpoint.

The checkpoint's ledger lists, per optimizer step the final model went through, the episode
ids that step trained on, not deduplicated (services/rlbus/learner/service.py). The feeder names
episodes ``<run_name>/<group index>/<member>`` and publishes exactly ``max_steps *
groups_per_step`` training groups, so a run that lost nothing and trained nothing twice has
each of those ids in the ledger exactly once, and every step a full batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


def load_ledger(checkpoint: Path) -> list[list[str]]:
    """The episode ids of each step, from a learner's ``checkpoint.pt``."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    ledger: list[list[str]] = state["ledger"]
    return ledger


def expected_episodes(run_name: str, groups: int, group_size: int) -> set[str]:
    return {f"{run_name}/{g}/{i}" for g in range(groups) for i in range(group_size)}


@dataclass(frozen=True)
class LedgerCheck:
    """What the ledger says against what the feeder published."""

    expected: int
    trained: int
    duplicated: list[str]
    lost: list[str]
    unexpected: list[str]
    short_steps: list[int]  # 1-based steps that trained fewer episodes than a full batch

    def assert_exactly_once(self) -> None:
        assert not self.duplicated, f"trained more than once: {self.duplicated[:5]}"
        assert not self.lost, f"lost: {self.lost[:5]}"
        assert not self.unexpected, f"trained but never published: {self.unexpected[:5]}"
        assert not self.short_steps, f"steps short of a full batch: {self.short_steps[:5]}"


def check_ledger(ledger: list[list[str]], expected: set[str], batch: int) -> LedgerCheck:
    """``batch``: episodes per step (groups_per_step * group_size)."""
    trained = [episode for step in ledger for episode in step]
    return LedgerCheck(
        expected=len(expected),
        trained=len(trained),
        duplicated=sorted(e for e, n in Counter(trained).items() if n > 1),
        lost=sorted(expected - set(trained)),
        unexpected=sorted(set(trained) - expected),
        short_steps=[i + 1 for i, step in enumerate(ledger) if len(step) != batch],
    )
