"""Message factories shared by the unit and integration tiers."""

from __future__ import annotations

from rlbus.messages import (
    DeadLetter,
    Prompt,
    ScoredTrajectory,
    StepRequest,
    StepResult,
    Trajectory,
    Turn,
    WeightVersion,
)


def prompt(group_id: str = "run/0", group_size: int = 2) -> Prompt:
    return Prompt(group_id=group_id, task="guess_number", spec={"target": 3}, group_size=group_size)


def step_request(episode_id: str = "run/0/0", turn: int = 0) -> StepRequest:
    return StepRequest(
        request_id=f"{episode_id}/t{turn}",
        episode_id=episode_id,
        turn=turn,
        input_ids=[1, 2, 3],
        reply_partition=0,
    )


def step_result(episode_id: str = "run/0/0") -> StepResult:
    return StepResult(
        request_id=f"{episode_id}/t0",
        episode_id=episode_id,
        completion_ids=[7, 2],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        policy_version=1,
    )


def trajectory(group_id: str = "run/0", index: int = 0, version: int = 0) -> Trajectory:
    return Trajectory(
        episode_id=f"{group_id}/{index}",
        group_id=group_id,
        index=index,
        group_size=2,
        task="guess_number",
        spec={"target": 3},
        turns=[
            Turn(
                input_ids=[1, 2],
                completion_ids=[5, 2],
                logprobs=[-1.5, -0.125],
                policy_version=version,
                action="3",
                observation="correct",
            )
        ],
    )


def scored(group_id: str = "run/0", index: int = 0, reward: float = 1.0) -> ScoredTrajectory:
    return ScoredTrajectory(trajectory=trajectory(group_id, index), reward=reward, verifier="x")


def weight_version(version: int = 1) -> WeightVersion:
    return WeightVersion(
        model="tiny", version=version, uri="/tmp/w", checksum="ab" * 32, step=version
    )


def dead_letter() -> DeadLetter:
    return DeadLetter(
        source_topic="t", partition=0, offset=4, error="boom", service="s", payload=b"\x00"
    )


ALL = [prompt, step_request, step_result, trajectory, scored, weight_version, dead_letter]
