"""loadtest.lora_fit: its data is binary search as the demo's rollouts lay it out, and a
short fit runs both arms (the learning rates' figures are docs/lora.md's, not checked)."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loadtest.lora_fit import batch, fit, sequences
from rlbus.learner.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fit") / "model", embedding_std=0.2)


def test_the_data_is_binary_search_on_the_guesses_only(folder: Path) -> None:
    tok = AutoTokenizer.from_pretrained(folder)
    seqs = sequences(tok)
    assert len(seqs) == 16
    guessed = {}
    for target, (ids, labels) in enumerate(seqs):
        assert len(ids) == len(labels)
        guessed[target] = [tok.decode([i]).strip() for i, lab in zip(ids, labels, strict=True)
                           if lab != -100]
        assert guessed[target][-1] == str(target)  # binary search finds every target
        assert len(guessed[target]) <= 5
    assert guessed[0] == ["7", "3", "1", "0"]
    assert guessed[15] == ["7", "11", "13", "14", "15"]
    words = tok.decode(seqs[0][0])
    assert words.startswith("guess a number from 0 to 15 :") and "lower" in words


def test_a_short_fit_reports_loss_and_accuracy_for_lora_and_the_whole_model(
        folder: Path) -> None:
    data = batch(sequences(AutoTokenizer.from_pretrained(folder)))
    for rank in (4, 0):
        rows = fit(folder, data, rank, 3e-3, steps=4, every=2)
        assert [step for step, _, _ in rows] == [2, 4]
        assert all(loss > 0 and 0 <= right <= 1 for _, loss, right in rows)
