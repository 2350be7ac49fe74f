"""The tiny model loads like a real one and its tokenizer round-trips every task text."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlbus import plugins
from rlbus.api import Task
from rlbus.learner.grpo import sequence_logprobs
from rlbus.learner.tiny_model import EOS, build_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def task_texts(task: Task, episodes: int = 20) -> list[str]:
    """Every prompt and observation a few random episodes produce."""
    rng, texts = random.Random(0), []

    async def play() -> None:
        for _ in range(episodes):
            env = task.make_env()
            texts.append(await env.reset(task.sample(rng)))
            for _turn in range(task.max_turns):
                outcome = await env.step(str(rng.randint(-1, 17)))
                texts.append(outcome.observation)
                if outcome.done:
                    break

    asyncio.run(play())
    return texts


DEMO_TASKS = ["guess_number", "addition", "synthetic"]  # what the tiny tokenizer is for


@pytest.mark.parametrize("name", DEMO_TASKS)
def test_round_trip_is_exact_for_task_texts(name: str, tokenizer: PreTrainedTokenizerBase) -> None:
    for text in task_texts(plugins.task(name)):
        ids = tokenizer.encode(text)
        assert tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids) == text


def test_numbers_are_single_tokens_and_nothing_is_added(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    for n in range(100):
        assert len(tokenizer.encode(str(n))) == 1
    # no BOS/EOS added: prompt, completion and observation ids concatenate as they are
    assert tokenizer.encode("higher") == tokenizer.encode("higher", add_special_tokens=True)
    assert len(tokenizer.encode("higher")) == 1


def test_a_completion_decodes_to_its_action(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [*tokenizer.encode("7"), tokenizer.convert_tokens_to_ids(EOS)]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "7"


def test_model_reloads_and_runs_forward(folder: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tokenizer.encode("guess a number from 0 to 15 :")])  # (1, T)
    logits = model(input_ids=ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_same_seed_same_weights(tmp_path: Path, folder: Path) -> None:
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, "tiny", seed=0))
    first = AutoModelForCausalLM.from_pretrained(folder)
    for a, b in zip(first.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_wider_embedding_for_lora_widens_the_logits(tmp_path: Path, folder: Path) -> None:
    """The demo's --lora model: its frozen head can put logits far apart (at 0.02 they stay
    within a few units of each other whatever the hidden state)."""
    wide = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, embedding_std=0.2))
    plain = AutoModelForCausalLM.from_pretrained(folder)

    def spread(model: torch.nn.Module) -> float:
        head = model.get_output_embeddings().weight  # (V, H), tied to the embedding
        return float(head.norm(dim=1).max() * head.shape[1] ** 0.5)  # |row| x |normed h|

    assert float(wide.get_input_embeddings().weight.std()) == pytest.approx(0.2, rel=0.1)
    assert spread(plain) < 2 < 10 < spread(wide)


def test_logprobs_do_not_depend_on_padding_side(
    folder: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Learner (right-padded) and sampler (often left-padded) must agree token for token."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer.encode("3 + 4 =")
    pad = tokenizer.pad_token_id
    right = torch.tensor([[*ids, pad, pad]])  # (1, T + 2)
    left = torch.tensor([[pad, pad, *ids]])
    mask_right = (torch.arange(len(ids) + 2) < len(ids)).long()[None]
    with torch.no_grad():
        lp_right = sequence_logprobs(model, right, mask_right)[:, : len(ids) - 1]
        lp_left = sequence_logprobs(model, left, mask_right.flip(1))[:, 2:]
        lp_bare = sequence_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids)).long())
    torch.testing.assert_close(lp_right, lp_bare)
    torch.testing.assert_close(lp_left, lp_bare)


def test_extra_words_are_tokens_and_keep_the_other_ids(tmp_path: Path,
                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    extended = AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path, "tiny", seed=0, words=["calculator", "answer", "higher"]))
    assert extended.decode(extended.encode("answer 7 calculator")) == "answer 7 calculator"
    assert extended.unk_token_id not in extended.encode("answer calculator")
    for word in ("higher", "7", "guess"):
        assert extended.encode(word) == tokenizer.encode(word)
