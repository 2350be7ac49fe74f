"""Run the four services together on one bus (in memory or Kafka) for a few steps."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rlbus.inference.engine import Engine
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.transport import Bus


def settings(model: Path, run: Path, common: dict[str, Any], **learner: Any) -> dict[str, Any]:
    return {
        "inference": InferenceSettings(**common, model_path=model, batch_wait_ms=1,
                                       weights_dir=run / "weights"),
        "rollout": RolloutSettings(**common, model_path=model, step_timeout_s=10),
        "reward": RewardSettings(**common),
        "learner": LearnerSettings(
            **common,
            model_path=model,
            weights_dir=run / "weights",
            checkpoint_dir=run / "checkpoint",
            metrics_file=run / "metrics.jsonl",
            checkpoint_every=1,
            **{"max_steps": 2, "groups_per_step": 2, "group_size": 4, **learner},
        ),
    }


async def run_pipeline(s: dict[str, Any], make_bus: Any,
                       engine: Engine | None = None) -> dict[str, Any]:
    """Start inference (on ``engine``, else the one its settings name), reward and rollout;
    run the learner to max_steps; stop the rest."""
    others = [
        Inference(s["inference"], make_bus("inference"), engine=engine),
        Reward(s["reward"], make_bus("reward")),
        Rollout(s["rollout"], make_bus("rollout")),
    ]
    tasks = [asyncio.create_task(o.run()) for o in others]
    learner = Learner(s["learner"], make_bus("learner"))
    try:
        summary = await asyncio.wait_for(learner.run(), 240)
    finally:
        for o in others:
            o.request_stop("test over")
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {"learner": learner, "others": others, "summary": summary}


def bus_factory(bus_cls: type[Bus], **kwargs: Any) -> Any:
    return lambda service: bus_cls(service=service, **kwargs)
