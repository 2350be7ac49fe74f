"""Settings of the rollout tier (env prefix ``RLBUS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from rlbus.settings import ServiceSettings

GatewayHistory = Literal["segments", "strict"]
"""What the gateway does with a call whose messages do not extend the session's history:
start a new training segment, or fail the episode (:mod:`rlbus.rollout.sessions`)."""


class RolloutSettings(ServiceSettings):
    """One rollout instance: runs episodes of the prompts its consumer group hands it."""

    service: ClassVar[str] = "rlbus.rollout.service:Rollout"

    model_path: Path | None = None
    """Folder with the policy's tokenizer (the same folder inference loads)."""
    tokenizer: Literal["hf", "synthetic"] = "hf"
    """hf: the policy's tokenizer from model_path; synthetic: word hashes, for load tests
    with the synthetic engine (no model anywhere)."""
    max_concurrent_episodes: int = Field(default=64, ge=1)
    """Episodes in flight at once in this instance (each holds one pending step request)."""
    max_groups_in_flight: int = Field(default=16, ge=1)
    """Prompts taken but not finished; at this bound the instance stops fetching prompts
    (backpressure: a stalled inference tier leaves work in Kafka, not in memory)."""
    reply_partition: int | None = None
    """Partition of steps.results this instance reads its answers from. Default: derived
    from ``instance`` (its number, else a hash). Two instances sharing one is safe (each
    drops answers it did not ask for), only wasteful."""
    step_timeout_s: float = Field(default=30.0, gt=0)
    """Re-send a step request not answered within this time (same request_id)."""
    group_attempts: int = Field(default=3, ge=1)
    """Times a group that crashed (not an episode that failed: those are published) is
    rolled out before its prompt is dead-lettered."""
    step_retries: int = Field(default=3, ge=0)
    """Re-sends before the episode is published as failed (and masked by the learner)."""
    env_timeout_s: float = Field(default=30.0, gt=0)
    """Longest an environment's reset or step may take before the episode fails; a tool
    call past it gives an error observation instead."""
    max_context_tokens: int = Field(default=4096, ge=16)
    """An episode whose next generation would not fit in this context ends after its last
    complete turn (it is scored as it stands)."""
    agent: str = "multi_turn"
    """The agent that plays each episode: an ``rlbus.agents`` entry point or an import
    string ``package.module:attr`` (docs/extending.md). A ChatAgent gets an OpenAI endpoint
    per episode from this instance's gateway."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Longest a ChatAgent's episode may run (its calls included) before it fails."""
    gateway_host: str = "127.0.0.1"
    """Where the OpenAI gateway listens (ChatAgents only); the agents run in this process."""
    gateway_port: int = Field(default=0, ge=0, le=65535)
    """Its port; 0 picks a free one."""
    served_model_name: str = "policy"
    """The model name the gateway answers to (``/v1/models``)."""
    gateway_max_sessions: int = Field(default=1024, ge=1)
    """Gateway sessions (ChatAgent episodes) open at once in this instance; an episode past
    it fails, saying so."""
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request body the gateway reads (413 past it)."""
    gateway_max_session_tokens: int = Field(default=1 << 20, ge=16)
    """Most tokens one session records, every call's prompt and completion counted (a call
    past it gets a 400 ``session_too_long``)."""
    gateway_idle_timeout_s: float = Field(default=300.0, gt=0)
    """A ChatAgent that makes no call for this long is stopped and its episode fails (what
    it recorded is published with the failure)."""
    gateway_history: GatewayHistory = "segments"
    """A gateway call whose messages do not extend what the session recorded (history
    trimmed, summarised or edited, a retried call, a template that re-renders old turns,
    other tools): segments, the call's context is the template's rendering of its messages
    and starts a new segment, trained with the episode's reward like the others; strict,
    the call gets a 400 ``context_diverged`` and the episode fails (masked)."""
    gateway_history_by_task: dict[str, GatewayHistory] = {}
    """``gateway_history`` for the named tasks (JSON in the environment:
    ``{"swe": "strict"}``); the others get ``gateway_history``."""

    def history_of(self, task: str) -> GatewayHistory:
        """The gateway history mode of an episode of ``task``."""
        return self.gateway_history_by_task.get(task, self.gateway_history)
