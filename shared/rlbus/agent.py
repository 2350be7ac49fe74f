"""The default agent: the multi-turn loop the rollout tier and the load-test baseline play.

Each turn: the policy generates from the exact token context so far (prompt, completions and
observations concatenated as recorded), the completion is decoded into the action, and the
action goes to the environment, unless it is a tool call. The episode ends when the
environment says done, after ``task.max_turns`` turns, or when the next generation would
not fit in ``max_context_tokens``.

Tools: when the environment offers any, the first observation ends with their description
(:func:`describe_tools`) and an action of the form
``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` (read by
:mod:`rlbus.tool_calls`, as the gateway reads it) runs that tool under the episode's timeout
instead of stepping the environment. Its result is the next observation; a malformed call,
an unknown tool, bad arguments, an exception or a timeout give an ``error: ...``
observation, and the episode goes on. Every
call is recorded in its turn (:class:`rlbus.messages.ToolCall`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Sequence
from typing import Any

from rlbus.api import Agent, Episode, Tool
from rlbus.messages import ToolCall, Turn
from rlbus.tool_calls import find_tool_calls

MAX_TOOL_RESULT_CHARS = 4000
"""A tool's answer is cut to this many characters before it enters the context."""


def describe_tools(tools: Sequence[Tool]) -> str:
    """The block appended to the first observation when the environment offers tools."""
    specs = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in tools]
    lines = "\n".join(json.dumps(s, sort_keys=True) for s in specs)
    return ("\n\n# tools\ncall one with <tool_call>{\"name\": ..., \"arguments\": {...}}"
            f"</tool_call>\n{lines}\n")


def parse_tool_call(action: str) -> tuple[str, dict[str, Any]] | str | None:
    """``(name, arguments)`` for the action's first tool call, an error text for a malformed
    one (:mod:`rlbus.tool_calls`), None if the action calls no tool."""
    blocks = find_tool_calls(action)
    if not blocks:
        return None
    first = blocks[0]
    return first.error if first.error is not None else (first.name, first.arguments)


async def run_tool(tools: Sequence[Tool], name: str, arguments: dict[str, Any],
                   timeout_s: float) -> ToolCall:
    """Call one tool; never raises: failures are recorded as the call's ``error``."""
    started = time.perf_counter()
    by_name = {t.name: t for t in tools}
    result, error = "", None
    tool = by_name.get(name)
    if tool is None:
        error = f"unknown tool {name!r}; tools: {sorted(by_name)}"
    else:
        try:
            if inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**arguments), timeout_s)
            else:  # a sync tool runs in a thread so a slow one cannot stall the loop
                value = await asyncio.wait_for(
                    asyncio.to_thread(tool.fn, **arguments), timeout_s)
            result = str(value)[:MAX_TOOL_RESULT_CHARS]
        except TimeoutError:
            error = f"tool {name!r} timed out after {timeout_s:g}s"
        except Exception as exc:  # a tool's bug is an observation, not a dead episode
            error = f"tool {name!r} raised {type(exc).__name__}: {exc}"[:500]
    return ToolCall(name=name, arguments=arguments, result=result, error=error,
                    seconds=round(time.perf_counter() - started, 6))


class MultiTurnAgent(Agent):
    """Policy, environment (or tool), policy, ... until done; see the module docstring."""

    async def run(self, episode: Episode) -> None:
        ep = episode
        tools = list(ep.env.tools)
        obs = await asyncio.wait_for(ep.env.reset(ep.spec), ep.timeout_s)
        if tools:
            obs += describe_tools(tools)
        new_ids = ep.tokenizer.encode(obs)
        context: list[int] = []
        for _turn in range(ep.task.max_turns):
            context += new_ids
            if len(context) + ep.sampling.max_new_tokens > ep.max_context_tokens:
                return
            gen = await ep.policy.generate(context, ep.sampling)
            action = ep.tokenizer.decode(gen.completion_ids)
            call = parse_tool_call(action) if tools else None
            record: ToolCall | None = None
            if call is None:
                outcome = await asyncio.wait_for(ep.env.step(action), ep.timeout_s)
                observation, reward, done = outcome.observation, outcome.reward, outcome.done
            else:
                if isinstance(call, str):
                    record = ToolCall(name="", arguments={}, error=call)
                else:
                    record = await run_tool(tools, *call, ep.timeout_s)
                observation = record.result if record.error is None else f"error: {record.error}"
                reward, done = 0.0, False
            ep.turns.append(Turn(
                input_ids=new_ids,
                completion_ids=gen.completion_ids,
                logprobs=gen.logprobs,
                policy_version=gen.policy_version,
                version_spans=gen.version_spans,
                finish_reason=gen.finish_reason,
                action=action,
                observation=observation,
                env_reward=reward,
                tool_call=record,
            ))
            context += gen.completion_ids
            if done:
                return
            new_ids = ep.tokenizer.encode(observation)
