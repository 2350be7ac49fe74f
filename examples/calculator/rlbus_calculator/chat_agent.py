"""The same task, played by agent code written against the official OpenAI client: the
rollout tier serves it an endpoint per episode (the gateway) and trains on its exact tokens.
Register it as an agent (pyproject) and set RLBUS_AGENT=calculator_chat on the rollout tier.
"""

from __future__ import annotations

import json

import openai

from rlbus.api import ChatAgent, ChatSession
from rlbus_calculator.task import evaluate

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates an integer expression with + - *",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


class CalculatorChatAgent(ChatAgent):
    async def run(self, session: ChatSession) -> None:
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        question = await session.env.reset(session.spec)
        messages: list = [{"role": "user", "content": question}]
        for _ in range(session.task.max_turns):
            reply = await client.chat.completions.create(
                model=session.model, messages=messages, tools=TOOLS, max_tokens=32)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:  # an answer: the environment judges it
                outcome = await session.env.step(message.content or "")
                if outcome.done:
                    return
                messages.append({"role": "user", "content": outcome.observation})
                continue
            for call in message.tool_calls:
                try:
                    result = str(evaluate(json.loads(call.function.arguments)["expression"]))
                except Exception as exc:  # a bad call is the model's mistake, shown to it
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
