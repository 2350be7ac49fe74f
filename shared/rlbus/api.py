"""The extension API: what a user implements to bring a task, environment, agent or verifier.

Everything here is plain Python with no dependency beyond the message types, and the built-in
tasks, agent and verifiers are written against it too. A plugin is found by name through the
entry-point groups ``rlbus.tasks``, ``rlbus.agents`` and ``rlbus.verifiers`` (an installed
package declares them in its pyproject), or by import string ``package.module:attr``
(:mod:`rlbus.plugins`). See docs/extending.md for a complete example.

- :class:`Task`: samples a spec (a JSON-serialisable dict that travels in every message, so
  it must hold every parameter the score depends on), makes one :class:`Env` per episode and
  scores the actions. ``success`` is the metric the learner reports, free of shaping.
- :class:`Env`: async ``reset``/``step`` over text; may offer :class:`Tool` s.
- :class:`Agent`: plays one episode against a :class:`Policy` and records its turns; the
  default (:class:`rlbus.agent.MultiTurnAgent`) alternates policy and environment, and
  executes tool calls. A :class:`ChatAgent` is agent code written against an OpenAI
  client instead: the rollout tier serves it an endpoint per episode (the gateway).
- :class:`Policy`: token-level generation: ids in, ids + logprobs + policy version out.
- :class:`Verifier`: async, sees the whole trajectory, returns a :class:`Verdict`. The reward
  tier runs it in a worker process, killed at its deadline.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlbus.messages import FinishReason, Sampling, Trajectory, Turn

TaskSpec = dict[str, Any]
"""One episode's parameters: JSON-serialisable, carried by Prompt and Trajectory."""


@dataclass(frozen=True)
class StepOutcome:
    """What an environment answers to one action."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A function the policy may call: ``fn(**arguments)``, sync or async, returns text (or
    anything ``str()`` makes readable). ``parameters`` is a JSON schema of the arguments."""

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: dict[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )


class Env(ABC):
    """An async, gym-like environment over text; one instance per episode."""

    tools: Sequence[Tool] = ()
    """Tools the agent may call during the episode (none by default)."""

    @abstractmethod
    async def reset(self, spec: TaskSpec) -> str:
        """Start an episode; returns the first observation (the prompt text)."""

    @abstractmethod
    async def step(self, action: str) -> StepOutcome:
        """Apply one model turn (its decoded completion text)."""


class Task(ABC):
    """A family of episodes: how to sample them, play them and score them."""

    name: str
    """The name prompts use (the entry point's name for installed tasks)."""
    max_turns: int
    """Most turns any episode of this task may take."""
    verifier: str | None = None
    """The verifier that scores this task (an entry point name or import string); None:
    :meth:`score`, run by the reward tier in a worker process."""

    @abstractmethod
    def sample(self, rng: random.Random) -> TaskSpec:
        """A fresh spec: every parameter that :meth:`score` depends on goes in it."""

    @abstractmethod
    def make_env(self) -> Env:
        """A new environment for one episode."""

    @abstractmethod
    def score(self, spec: TaskSpec, actions: Sequence[str]) -> float:
        """The reward, recomputed from the spec and the actions alone."""

    def success(self, spec: TaskSpec, actions: Sequence[str]) -> bool:
        """Whether the episode solved the task (a metric; default: full reward)."""
        return self.score(spec, actions) >= 1.0

    def validate(self, spec: TaskSpec) -> None:
        """Raise ValueError (or KeyError) naming what a spec from outside, such as a dataset
        row, lacks; such a spec is dead-lettered instead of sent. Default: any spec."""


@dataclass(frozen=True)
class Generation:
    """One completion: its tokens, their logprobs and the policy version that produced all
    of them (the oldest, where ``version_spans`` says an in-flight update split them)."""

    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: FinishReason = "stop"
    version_spans: list[tuple[int, int]] | None = None
    """The version of every token, run-length (``rlbus.messages.VersionSpans``); None: all
    ``policy_version``."""


class Policy(Protocol):
    """Token-level generation; the rollout tier's is a StepRequest over Kafka."""

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation: ...


class Tokenizer(Protocol):
    """Text to ids and back: what the agent needs of the policy's tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Episode:
    """What an agent gets to play one episode with, and where it records the turns.

    ``turns`` is filled as the episode goes: a turn recorded before a failure stays
    recorded. ``max_context_tokens`` bounds the context sent to the policy; ``timeout_s``
    bounds every environment and tool call.
    """

    task: Task
    spec: TaskSpec
    env: Env
    policy: Policy
    tokenizer: Tokenizer
    sampling: Sampling
    max_context_tokens: int
    timeout_s: float
    turns: list[Turn] = field(default_factory=list)


class Agent(ABC):
    """How one episode is played. Raise to fail the episode: its recorded turns are kept,
    it is published as failed, and the learner masks it."""

    @abstractmethod
    async def run(self, episode: Episode) -> None: ...


@dataclass
class ChatSession:
    """What a :class:`ChatAgent` gets: an OpenAI-compatible endpoint for one episode.

    Point any OpenAI client at it (``AsyncOpenAI(base_url=session.base_url,
    api_key=session.api_key)``, model ``session.model``); every chat completion is one turn
    of the episode, generated by the policy with exact tokens recorded. ``env`` is the task's
    environment for this episode (``await env.reset(spec)`` gives the task text), if the agent
    wants it.
    """

    base_url: str
    api_key: str
    model: str
    task: Task
    spec: TaskSpec
    env: Env

    @property
    def anthropic_base_url(self) -> str:
        """The same endpoint for an Anthropic client (``Anthropic(base_url=...,
        api_key=session.api_key)``; the SDK appends ``/v1/messages``)."""
        return self.base_url.removesuffix("/v1")


class ChatAgent(ABC):
    """An agent written against an OpenAI client: ``run`` plays one episode through the
    session's endpoint and returns when it is done (its return value is ignored). Raise to
    fail the episode. Registered in ``rlbus.agents`` like any agent."""

    @abstractmethod
    async def run(self, session: ChatSession) -> None: ...


@dataclass(frozen=True)
class Verdict:
    """A verifier's answer: ``valid=False`` masks the sample (the learner skips it)."""

    reward: float
    valid: bool = True
    info: dict[str, Any] = field(default_factory=dict)


class Verifier(ABC):
    """Scores a whole trajectory (turns, tool calls, spec). Runs in a worker process of the
    reward tier; a verifier past its deadline has its process killed and the sample masked."""

    @abstractmethod
    async def verify(self, trajectory: Trajectory) -> Verdict: ...
