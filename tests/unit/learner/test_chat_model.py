"""The chat model loads like a real Qwen2 chat model; its template is ChatML with tool calls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlbus.learner.chat_model import (
    IM_END,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    build_chat_model,
)

Messages = list[dict[str, Any]]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    start = time.perf_counter()
    folder = build_chat_model(tmp_path_factory.mktemp("chat"), seed=0)
    return folder, time.perf_counter() - start


@pytest.fixture(scope="module")
def folder(built: tuple[Path, float]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def ids_of(tokenizer: PreTrainedTokenizerBase, messages: Messages, **kwargs: Any) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(enc["input_ids"])


def test_builds_in_well_under_ten_seconds(built: tuple[Path, float]) -> None:
    print(f"build_chat_model: {built[1]:.2f} s")
    assert built[1] < 10


def test_loads_with_auto_classes(folder: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (folder / "model.safetensors").exists()
    assert model.config.vocab_size == len(tokenizer) == 1024
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, "<|endoftext|>"])
    assert tokenizer.eos_token_id == model.config.eos_token_id == eos
    assert tokenizer.pad_token_id == model.config.pad_token_id == pad
    assert model.generation_config.eos_token_id == eos
    assert model.generation_config.pad_token_id == pad
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_head_dim_is_64(folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.model.layers[0].self_attn.head_dim == 64
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    with pytest.raises(ValueError, match="heads"):
        build_chat_model(folder / "bad", hidden=256, heads=2)


def test_special_tokens_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS + TOOL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(ids)
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode(
        "hi", add_special_tokens=False)  # no BOS/EOS added
    # The tool markers are added tokens but not special: a parser still sees them.
    text = f"ok {CALL}{IM_END}"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == f"ok {CALL}"


@pytest.mark.parametrize("text", [
    "Hello world, this is a test of the tokenizer.",
    "12 + 7 = 19; 3.1415 and -42",
    'def f(x):\n    return {"a": x}  # comment\n\n\n',
    "  leading spaces, trailing tab\t, unicode: héllo 日本 🙂",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    CALL,
])
def test_round_trip(folder: Path, tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # transformers 5.x loads a qwen2 folder with its own pipeline; it must be the saved one
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids == ids


def test_template_plain_chat(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False) == (
        "<|im_start|>user\nHi!<|im_end|>\n")


def test_template_tools(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": '
        '"Current weather", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n" + CALL +
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode(text)) == text


def assert_prefix_stable(tokenizer: PreTrainedTokenizerBase, replies: list[dict[str, Any]],
                         reply_texts: list[str], tools: Messages | None = None) -> None:
    """Rendering up to each reply + its canonical ids + <|im_end|>\\n prefixes what follows."""
    messages: Messages = [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": "Hi, can you help?"}]
    end = tokenizer.encode(f"{IM_END}\n", add_special_tokens=False)
    for turn, (reply, text) in enumerate(zip(replies, reply_texts, strict=True)):
        seen = ids_of(tokenizer, messages, tools=tools, add_generation_prompt=True)
        seen += tokenizer.encode(text, add_special_tokens=False) + end
        messages += [reply, {"role": "user", "content": f"Thanks. Question {turn}?"}]
        after = ids_of(tokenizer, messages, tools=tools, add_generation_prompt=True)
        assert after[: len(seen)] == seen, f"turn {turn}"


def test_prefix_stable_three_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    texts = ["Sure! What do you need?", "  Indented: def f(x):\n    return x\n",
             '{"answer": 42}\n\nDone.']
    assert_prefix_stable(tokenizer, [{"role": "assistant", "content": t} for t in texts], texts)


def test_prefix_stable_with_a_canonical_tool_call(tokenizer: PreTrainedTokenizerBase) -> None:
    call = {"role": "assistant", "content": "Checking.", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    answer = {"role": "assistant", "content": "Sunny."}
    assert_prefix_stable(tokenizer, [call, answer], [f"Checking.\n{CALL}", "Sunny."], TOOLS)


def test_a_reply_starting_with_a_newline_is_only_a_text_prefix(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """The one exception: Qwen2's split joins the reply's first "\\n" to "assistant\\n"."""
    messages: Messages = [{"role": "user", "content": "Hi"}]
    first = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    then = [*messages, {"role": "assistant", "content": "\nHello"}]
    text = tokenizer.apply_chat_template(then, tokenize=False)
    assert text == first + f"\nHello{IM_END}\n"
    seen = tokenizer.encode(first) + tokenizer.encode("\nHello")
    assert tokenizer.encode(text)[: len(seen)] != seen


def test_generate_from_the_template(folder: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 8
    assert isinstance(tokenizer.decode(new), str)


def test_same_seed_same_model(folder: Path, tmp_path: Path) -> None:
    again = build_chat_model(tmp_path / "again", seed=0)
    other = build_chat_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    a = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
