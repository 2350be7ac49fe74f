"""Live progress, summary and reward-curve plot of a training run (from metrics.jsonl)."""

from __future__ import annotations

import math
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.messages import MASK_CAUSES

WINDOW_EPISODES = 512
"""Start and end figures average this many episodes: one step's batch is too noisy."""
TARGET = 0.8
"""The greedy success the demo is measured against (the dotted line of its plot)."""


def _window(rows: list[dict[str, Any]], key: str, last: bool = True) -> float | None:
    """Episode-weighted mean of ``key`` over the first or last WINDOW_EPISODES episodes."""
    part: list[tuple[float, float]] = []
    for r in reversed(rows) if last else rows:
        if r.get(key) is not None:
            part.append((r[key], r.get("episodes") or 1))
            if sum(w for _, w in part) >= WINDOW_EPISODES:
                break
    total = sum(w for _, w in part)
    return round(sum(v * w for v, w in part) / total, 4) if total else None


def _masked(rows: list[dict[str, Any]]) -> int:
    return sum(int(r.get("masked") or 0) for r in rows)


def _rate(rows: list[dict[str, Any]]) -> float:
    """Episodes that entered the loss per second (masked ones are not counted)."""
    if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
        return 0.0
    episodes = rows[-1]["episodes_trained"] - rows[0]["episodes_trained"]
    return float(episodes / (rows[-1]["time"] - rows[0]["time"]))


class Progress:
    """A rich live table on a terminal; a plain line per step otherwise (CI logs)."""

    def __init__(self, total_steps: int, live: bool) -> None:
        self.total = total_steps
        self.live_enabled = live
        self._live: Any = None
        self._printed = 0

    def __enter__(self) -> Progress:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self._table([]), refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(et, e, tb)

    def update(self, rows: list[dict[str, Any]]) -> None:
        if self._live is not None:
            self._live.update(self._table(rows))
            return
        for r in rows[self._printed :]:
            print(self._line(r), flush=True)
        self._printed = len(rows)

    def _line(self, r: dict[str, Any]) -> str:
        if "eval_at_step" in r:  # an evaluation row has no training figures of its own
            return (f"eval at step {r['eval_at_step']:>4}/{self.total}  greedy success "
                    f"{r['eval_success']:.3f} on the fixed eval set  t={r['time']:.0f}s")
        return (
            f"step {r['step']:>4}/{self.total}  reward {_fmt(r.get('reward_mean'))}  "
            f"success {_fmt(r.get('success_rate'))}  staleness<={r.get('staleness_max')}  "
            f"masked {int(r.get('masked') or 0)}  "
            f"loss {_fmt(r.get('loss'))}  t={r['time']:.0f}s"
        )

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        from rich.table import Table

        t = Table(title="rlbus demo: guess-the-number (0..15, 5 guesses)")
        for col in (
            "step",
            f"reward (last {WINDOW_EPISODES} ep.)",
            f"success (last {WINDOW_EPISODES} ep.)",
            "staleness max",
            "trained/s",
            "masked",
            "elapsed",
        ):
            t.add_column(col, justify="right")
        if rows:
            r = rows[-1]
            t.add_row(
                f"{r['step']}/{self.total}",
                _fmt(_window(rows, "reward_mean")),
                _fmt(_window(rows, "success_rate")),
                str(max(int(x.get("staleness_max") or 0) for x in rows)),
                f"{_rate(rows):.1f}",
                str(_masked(rows)),
                f"{r['time']:.0f}s",
            )
        else:
            t.add_row(f"0/{self.total}", "-", "-", "-", "-", "-", "waiting for the first step")
        return t


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def summarize(
    rows: list[dict[str, Any]], reason: str, wall: float, recipe: dict[str, Any]
) -> dict[str, Any]:
    return {
        "ended": reason,
        "steps": rows[-1]["step"] if rows else 0,
        "wall_seconds": round(wall, 1),
        "training_seconds": rows[-1]["time"] if rows else 0,
        "episodes_trained": rows[-1]["episodes_trained"] if rows else 0,
        "trained_per_second": round(_rate(rows), 2),
        "success_start": _window(rows, "success_rate", last=False),
        "success_end": _window(rows, "success_rate"),
        "reward_start": _window(rows, "reward_mean", last=False),
        "reward_end": _window(rows, "reward_mean"),
        "staleness_max": max((int(r.get("staleness_max") or 0) for r in rows), default=0),
        "eval_success": evaluations(rows),
        "eval_pass_at_k": evaluations(rows, "eval_pass_at_k"),
        "eval_pass_k": next((r["eval_pass_k"] for r in rows if "eval_pass_k" in r), None),
        "greedy_target": first_at_target(rows),
        "masked_total": _masked(rows),
        "masked_by_cause": {c: sum(int(r.get(f"masked_{c}") or 0) for r in rows)
                            for c in MASK_CAUSES},
        "duplicates_dropped": rows[-1].get("duplicates_dropped", 0) if rows else 0,
        "recipe": recipe,
    }


def evaluations(rows: list[dict[str, Any]], figure: str = "eval_success") -> dict[int, float]:
    """An evaluation figure (greedy success on the fixed evaluation set, or pass@k), by the
    step it was taken at."""
    return {int(r["eval_at_step"]): r[figure] for r in rows if figure in r}


def first_at_target(rows: list[dict[str, Any]], target: float = TARGET) -> dict[str, Any] | None:
    """The first evaluation at or above `target`: its step, and the learner's seconds and
    episodes trained when that step's weights were taken (None: not reached)."""
    trained = {r["step"]: r for r in rows if "eval_at_step" not in r}
    for step, success in sorted(evaluations(rows).items()):
        if success >= target:
            at = trained.get(step, {})
            return {"step": step, "success": success, "training_seconds": at.get("time"),
                    "episodes_trained": at.get("episodes_trained")}
    return None


def smoothed(rows: list[dict[str, Any]], key: str) -> list[float]:
    """Episode-weighted rolling mean over the last WINDOW_EPISODES episodes at each step."""
    out: list[float] = []
    for i in range(len(rows)):
        value = _window(rows[: i + 1], key)
        out.append(math.nan if value is None else value)
    return out


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    times = [r["time"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(
        steps,
        [_nan(r.get("success_rate")) for r in rows],
        color="C0",
        alpha=0.15,
        linewidth=0.6,
        label="sampled, per step",
    )
    ax1.plot(
        steps,
        smoothed(rows, "success_rate"),
        color="C0",
        linewidth=2,
        label=f"sampled, last {WINDOW_EPISODES} episodes",
    )
    evals = evaluations(rows)
    if evals:
        ax1.plot(
            list(evals),
            list(evals.values()),
            "o-",
            color="C2",
            linewidth=1.5,
            markersize=4,
            label="greedy, fixed eval set",
        )
    ax1.axhline(TARGET, color="grey", linestyle=":", label=f"target {TARGET:g}")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("success rate")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(loc="lower right")
    ax1.set_title("success by step")
    ax2.plot(times, smoothed(rows, "reward_mean"), color="C1", linewidth=2)
    ax2.set_xlabel("seconds since the learner started")
    ax2.set_ylabel(f"mean reward (last {WINDOW_EPISODES} episodes)")
    ax2.set_title("reward by wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _nan(x: Any) -> float:
    return math.nan if x is None else float(x)
