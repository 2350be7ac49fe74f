"""The one reader of ``<tool_call>`` blocks in a completion, for the default agent and the
OpenAI gateway alike.

A block is ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` (the Hermes/Qwen
convention common chat templates use). ``arguments`` may be left out (no arguments) or be a
string holding a JSON object (OpenAI's own wire form, which some models copy). Anything else
between the tags is a malformed call, read with the reason it is not a call: the agent shows
that reason to the model, the gateway leaves the block in the content as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_SHAPE = 'tool call needs {"name": str, "arguments": {...}}'


@dataclass(frozen=True)
class ToolCallBlock:
    """One ``<tool_call>`` block of a text: where it is, and the call it holds or why it
    holds none (``error`` set, ``name`` empty)."""

    start: int
    end: int
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def find_tool_calls(text: str) -> list[ToolCallBlock]:
    """Every ``<tool_call>`` block of ``text``, in order, well-formed or not."""
    return [_read(m) for m in _BLOCK.finditer(text)]


def _read(m: re.Match[str]) -> ToolCallBlock:
    start, end = m.span()
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as exc:
        return ToolCallBlock(start, end, error=f"tool call is not valid JSON: {exc}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallBlock(start, end, error=CALL_SHAPE)
    arguments = _arguments(call.get("arguments", {}))
    if arguments is None:
        return ToolCallBlock(start, end, error="tool call arguments must be a JSON object")
    return ToolCallBlock(start, end, name=call["name"], arguments=arguments)


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def without_calls(text: str, blocks: list[ToolCallBlock]) -> str:
    """``text`` with the well-formed ``blocks`` cut out (malformed ones stay as text)."""
    kept, at = [], 0
    for b in blocks:
        if b.ok:
            kept.append(text[at:b.start])
            at = b.end
    kept.append(text[at:])
    return "".join(kept)
