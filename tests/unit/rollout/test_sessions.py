"""Session.context on its own (no HTTP): which ids a call adds to the recorded history."""

from __future__ import annotations

import pytest

from rlbus.messages import Sampling
from rlbus.rollout.sessions import ChatRequest, GatewayCode, GatewayError, Session

pytestmark = pytest.mark.slow


def _session(tokenizer) -> Session:  # strict: a call that does not extend the history fails
    return Session(id="s", policy=None, tokenizer=tokenizer, sampling=Sampling(),
                   max_context_tokens=4096, history="strict")


def _request(messages) -> ChatRequest:
    return ChatRequest(model="policy", messages=messages)


def _first_reply(tokenizer, reply: str, ended: bool):
    """A session after one call answered ``reply`` (with its end-of-turn if ``ended``)."""
    s = _session(tokenizer)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    context, _ = s.context(_request(messages))
    completion = tokenizer.encode(reply, add_special_tokens=False)
    s.ids = context + completion + ([tokenizer.eos_token_id] if ended else [])
    return s, [*messages, {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cut-short"])
def test_a_call_adds_the_template_text_after_the_recorded_ids(tokenizer, ended):
    s, messages = _first_reply(tokenizer, "hello there", ended)
    recorded = list(s.ids)
    messages.append({"role": "user", "content": "2 + 2 ?"})
    context, new = s.context(_request(messages))
    assert not s.fresh and context == recorded + new  # the ids as sampled, then the rest
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    assert tokenizer.decode(context, skip_special_tokens=False) == rendered
    # the new ids begin at the reply's end-of-turn (cut short: the template's own)
    assert tokenizer.decode(new, skip_special_tokens=False).startswith(
        "\n" if ended else tokenizer.eos_token)


def test_messages_that_go_on_with_a_reply_cut_short_are_refused(tokenizer):
    s, messages = _first_reply(tokenizer, "hello", ended=False)
    messages[-1] = {"role": "assistant", "content": "hello there, friend"}
    with pytest.raises(GatewayError) as err:
        s.context(_request([*messages, {"role": "user", "content": "and?"}]))
    assert err.value.code is GatewayCode.CONTEXT_DIVERGED
    assert "without an end-of-turn token" in err.value.message and s.failed


def test_an_edited_reply_is_refused_saying_where_the_texts_part(tokenizer):
    s, messages = _first_reply(tokenizer, "hello there", ended=True)
    messages[-1] = {"role": "assistant", "content": "hello here"}
    with pytest.raises(GatewayError) as err:
        s.context(_request([*messages, {"role": "user", "content": "and?"}]))
    assert err.value.code is GatewayCode.CONTEXT_DIVERGED
    assert "saw 'there<|im_end|>" in err.value.message
