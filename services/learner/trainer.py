"""One GRPO optimizer step over complete groups (see grpo.py for the loss itself)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlbus import plugins
from rlbus.messages import ScoredTrajectory, Trajectory
from rlbus.services.learner.groups import Group
from rlbus.services.learner.grpo import collate, group_advantages, policy_loss, sequence_logprobs
from rlbus.services.learner.settings import LearnerSettings


def packed(t: Trajectory) -> tuple[list[int], list[bool], list[float]]:
    """The episode as one sequence: token ids exactly as sampled, which of them the policy
    sampled, and the engine's logprobs for those (0 elsewhere)."""
    ids: list[int] = []
    sampled: list[bool] = []
    logprobs: list[float] = []
    for turn in t.turns:
        ids += turn.input_ids + turn.completion_ids
        sampled += [False] * len(turn.input_ids) + [True] * len(turn.completion_ids)
        logprobs += [0.0] * len(turn.input_ids) + turn.logprobs
    return ids, sampled, logprobs


@dataclass
class Sample:
    scored: ScoredTrajectory
    advantage: float
    staleness: int
    used: bool


class Trainer:
    """Holds the policy and its optimizer."""

    def __init__(self, cfg: LearnerSettings) -> None:
        from transformers import AutoModelForCausalLM

        if cfg.model_path is None:
            raise ValueError("the learner needs RLBUS_MODEL_PATH (the initial policy folder)")
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        model: Any = AutoModelForCausalLM.from_pretrained(cfg.model_path)
        self.model = model.to(self.device)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )

    def samples(self, groups: list[Group], version: int) -> list[Sample]:
        """Advantages per group; stale or invalid episodes are masked (advantage 0)."""
        out: list[Sample] = []
        for g in groups:
            members = g.ordered()
            stale = [version - m.trajectory.min_version for m in members]
            usable = [
                m.valid and bool(m.trajectory.turns) and s <= self.cfg.max_staleness
                for m, s in zip(members, stale, strict=True)
            ]
            adv = group_advantages(
                torch.tensor([m.reward for m in members]),
                torch.tensor(usable),
                scale_by_std=self.cfg.scale_by_std,
            )
            out += [
                Sample(m, float(a), s, u)
                for m, a, s, u in zip(members, adv.tolist(), stale, usable, strict=True)
            ]
        return out

    def step(self, groups: list[Group], version: int) -> dict[str, float]:
        samples = self.samples(groups, version)
        used = [s for s in samples if s.used and s.advantage != 0.0]
        stats: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
        if used:
            stats = self._optimize(used)
        return {**stats, **self._describe(samples)}

    def _optimize(self, used: list[Sample]) -> dict[str, float]:
        seqs = [packed(s.scored.trajectory) for s in used]
        batch = collate(
            [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], self.pad_id
        )
        ids = batch.input_ids.to(self.device)  # (B, T)
        logprobs = sequence_logprobs(self.model, ids, batch.attention_mask.to(self.device))
        loss, stats = policy_loss(
            logprobs,  # (B, T-1)
            batch.behaviour_logprobs.to(self.device),
            torch.tensor([s.advantage for s in used], device=self.device),  # (B,)
            batch.loss_mask.to(self.device),
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            norm=self.cfg.loss_norm,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), **stats}

    def _describe(self, samples: list[Sample]) -> dict[str, float]:
        valid = [s for s in samples if s.used]
        success = [
            _success(t.task, t.spec, [turn.action for turn in t.turns if turn.tool_call is None])
            for t in (s.scored.trajectory for s in valid)
        ]
        return {
            "episodes": len(samples),
            "masked": len(samples) - len(valid),
            "reward_mean": _mean([s.scored.reward for s in valid]),
            "success_rate": _mean([float(x) for x in success]),
            "staleness_mean": _mean([float(s.staleness) for s in valid]),
            "staleness_max": float(max((s.staleness for s in valid), default=0)),
            "turns_mean": _mean([float(len(s.scored.trajectory.turns)) for s in valid]),
            "tokens": float(sum(s.scored.trajectory.num_tokens for s in samples)),
        }

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


class SyntheticTrainer:
    """No model: a step takes ``synthetic_step_s`` of wall time (load tests)."""

    def __init__(self, cfg: LearnerSettings) -> None:
        self.cfg = cfg

    def step(self, groups: list[Group], version: int) -> dict[str, float]:
        import time

        time.sleep(self.cfg.synthetic_step_s)  # stands in for GPU work, off the event loop
        samples = [m for g in groups for m in g.ordered()]
        stale_by_id = {id(m): version - m.trajectory.min_version for m in samples}
        # the same mask as the GRPO trainer: failed or too stale samples are not trained
        valid = [m for m in samples if m.valid and stale_by_id[id(m)] <= self.cfg.max_staleness]
        stale = [float(stale_by_id[id(m)]) for m in valid]
        return {
            "loss": 0.0,
            "episodes": float(len(samples)),
            "masked": float(len(samples) - len(valid)),
            "reward_mean": _mean([m.reward for m in valid]),
            "success_rate": math.nan,
            "staleness_mean": _mean(stale),
            "staleness_max": max(stale, default=0.0),
            "turns_mean": _mean([float(len(m.trajectory.turns)) for m in samples]),
            "tokens": float(sum(m.trajectory.num_tokens for m in samples)),
        }

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        return None


def _success(task: str, spec: dict[str, Any], actions: list[str]) -> bool:
    """The task's success metric; False for a task this process cannot load."""
    try:
        return plugins.task(task).success(spec, actions)
    except plugins.PluginError:
        return False
