"""What the gateway's tests share: the chat tokenizer (built once), a served gateway, and a
scripted policy."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from rlbus.api import Generation
from rlbus.learner.chat_model import build_chat_model
from rlbus.messages import Sampling
from rlbus.rollout.gateway import Gateway


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_chat_model(tmp_path_factory.mktemp("chat")))


@pytest.fixture
async def gateway():
    g = Gateway("policy")
    await g.start()
    yield g
    await g.stop()


class Scripted:
    """A policy that answers each call with the next scripted text (and its eos). A test
    clears ``gate`` to hold a call in flight, or sets ``delay_s``."""

    def __init__(self, tokenizer, replies: list[str], delay_s: float = 0.0) -> None:
        self.tok, self.replies, self.delay_s = tokenizer, list(replies), delay_s
        self.contexts: list[list[int]] = []
        self.cancelled = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        self.contexts.append(list(input_ids))
        try:
            await self.gate.wait()
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        return Generation(ids, [-0.5] * len(ids), policy_version=7)
