"""A small random-init Qwen2 chat model with a real byte-level BPE tokenizer, built locally.

The OpenAI-compatible gateway renders requests with ``tokenizer.apply_chat_template`` and
generates from token ids, so its tests need what a real chat model ships: a byte-level BPE
tokenizer (any text round-trips), ChatML special tokens, and a chat template with tool calls.
:func:`build_chat_model` saves one that loads with ``AutoModelForCausalLM`` /
``AutoTokenizer`` and that vLLM's CPU backend accepts (Qwen2, head_dim 64); transformers 4.x
and 5.x load it to the same tokenizer, template and logits.

Tokens. ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos) are special tokens;
``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` are added
tokens that are *not* special, as in Qwen2.5: each is one id, never split, and
``decode(..., skip_special_tokens=True)`` keeps them, so a tool-call parser sees its markers.
The tokenizer adds no BOS/EOS when encoding. The tokenizer depends only on the built-in
corpus, never on ``seed``: every seed's model shares its ids.

Prefix stability. Every message is rendered verbatim (nothing trimmed, no history dropped),
so rendering ``messages[:k]`` with the generation prompt, then the reply, then
``<|im_end|>\n``, is a text prefix of rendering ``messages[:k+1]`` and more. It is a *token*
prefix too when the reply's ids are the canonical encoding of its text, with one exception:
a reply that starts with a newline (Qwen2's split joins it to the ``\n`` after
``assistant``). Sampled ids need not be canonical (``"h" "ello"`` decodes like ``"hello"``),
so a gateway keeps the ids it sampled and encodes only the text that follows them. Tool
calls are re-rendered from the parsed call, as ``\n<tool_call>\n{"name": N, "arguments":
A}\n</tool_call>`` after the content (A verbatim when a JSON string, else ``tojson``), so
such a reply is stable only if the model wrote exactly that. Consecutive tool results share
one user turn. The NFC normalizer (Qwen2's) means a non-NFC text does not round-trip.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlbus.learner.tiny_model import save_random_init

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HEAD_DIM = 64  # vLLM's CPU attention kernels accept only a few head sizes; 64 is one

CHAT_TEMPLATE = r"""
{%- macro text(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content %}{%- for part in content %}{{- part.text }}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + text(message.content) }}{%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}
            {%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()
"""ChatML with Hermes-style tool calls, after Qwen2.5's template (written anew, not copied)."""

_TEXT = (
    "the a an and or but if then of to in on for with from by as at is are was were be been "
    "can could will would should may might must do does did have has had not no yes all any "
    "some many more most other such only also just very well now here there up down out over "
    "you your we our they their it its this that these those what which how why when where "
    "who please thanks hello sorry sure okay user assistant system tool tools function call "
    "result answer question number value weather city time date day week year name list file "
    "code test error message model data search text word line page book world people person "
    "place thing way work part point problem case fact group hand home room water food money "
    "helpful correct wrong true false none check find get set add compute return write read "
    "make take give tell ask need want know think see look come go use try run start stop "
    "open close send show help keep move live play turn change begin end learn build plan "
    "good new first last long great little own old right big high small large next early "
    "young important different same able bad best better sunny rain cold warm today tomorrow"
)
_CODE = "class import while try except raise async await lambda yield self dict str int"
_WORDS, _CODE_WORDS = _TEXT.split(), _CODE.split()
_FUNCS = ["get_weather", "search_web", "add", "read_file", "run_tests", "lookup", "send_email"]
_KEYS = ["city", "query", "a", "b", "path", "id", "unit", "limit", "to", "text", "name"]
_FIXED = [
    "You are a helpful assistant.", "What is the weather in Paris today?",
    "# Tools", "You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments",
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather",'
    ' "parameters": {"type": "object", "properties": {"city": {"type": "string"}},'
    ' "required": ["city"]}}}',
]


def corpus(lines: int = 400) -> Iterator[str]:
    """Deterministic training text: English-ish sentences, arithmetic, JSON, Python, tool calls."""
    rng = random.Random(0)
    yield from _FIXED
    for i in range(lines):
        kind = i % 5
        if kind == 0:
            sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(4, 12))).capitalize()
                         + rng.choice([".", "?", "!", "."]) for _ in range(rng.randint(1, 4))]
            yield rng.choice([" ", "\n\n", "\n- "]).join(sentences)
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            yield f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; {rng.random():.4f}"
        elif kind == 2:
            obj = {k: rng.choice([rng.randint(-50, 5000), rng.choice(_WORDS), True, None])
                   for k in rng.sample(_KEYS, rng.randint(1, 4))}
            yield json.dumps(obj) + "\n" + json.dumps([obj, [1, 2.5]], indent=2)
        elif kind == 3:
            f, x, y = rng.choice(_FUNCS), rng.choice(_KEYS), rng.choice(_KEYS)
            yield (f"def {f}({x}, {y}=None):\n    if {y} is None:\n        return [{x}]\n\n"
                   f"    for i in range(len({x})):\n        print(f\"{{i}}: {{{y}}}\")\n"
                   f"    return {{'{x}': {x}, \"{y}\": {y}}}  # {rng.choice(_WORDS)}\n\n\n"
                   f"{' '.join(rng.sample(_CODE_WORDS, 5))}\n")
        else:
            args = {k: rng.choice([rng.choice(_WORDS), rng.randint(0, 100)])
                    for k in rng.sample(_KEYS, rng.randint(1, 3))}
            yield json.dumps({"name": rng.choice(_FUNCS), "arguments": args})


def build_tokenizer(folder: str | Path, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on :func:`corpus`, save it to `folder`, return it."""
    backend = Tokenizer(models.BPE())
    # Qwen2's normalizer and split regex exactly: transformers 5.x loads a qwen2 folder with
    # its own Qwen2Tokenizer, which rebuilds this pipeline from vocab and merges alone.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS), special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(), trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, pad_token=PAD, eos_token=IM_END,
        clean_up_tokenization_spaces=False, model_max_length=4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    _portable_config(Path(folder))
    return tokenizer


def _portable_config(folder: Path) -> None:
    """Load the same under transformers 4.x (vLLM may pin it) as under 5.x: 4.x reads the
    template from the config, not chat_template.jinja, and its PreTrainedTokenizerFast would
    return token_type_ids, which Qwen2 rejects; its Qwen2TokenizerFast uses tokenizer.json."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_chat_model(folder: str | Path, *, seed: int = 0, vocab_size: int = 1024,
                     hidden: int = 128, layers: int = 2, heads: int = 2) -> Path:
    """Save a random-init Qwen2 chat model and its tokenizer to `folder`; return `folder`."""
    if hidden != heads * HEAD_DIM:
        raise ValueError(f"hidden must be heads * {HEAD_DIM} (vLLM's CPU kernels), "
                         f"got hidden={hidden}, heads={heads}")
    folder = Path(folder)
    tokenizer = build_tokenizer(folder, vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        # rope_theta stays the default 1e4: transformers 4.x ignores 5.x's rope_parameters
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=True,  # halves the parameters of a model this small
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_random_init(Qwen2ForCausalLM, config, tokenizer, folder, seed)
