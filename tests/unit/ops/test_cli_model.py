"""``rlbus model init PATH``: a tiny local model folder, built atomically, never clobbered."""

from __future__ import annotations

import pytest

from rlbus.ops.cli import _parser, main


def test_model_init_builds_a_folder_the_services_can_load(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = tmp_path / "models" / "tiny"
    assert main(["model", "init", str(path), "--words", "zebra"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert AutoConfig.from_pretrained(path).vocab_size == len(tokenizer)
    assert tokenizer("guess a number zebra", add_special_tokens=False)["input_ids"][-1] != (
        tokenizer.unk_token_id
    )
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == ["tiny"]  # no .tmp


def test_model_init_refuses_a_non_empty_folder_unless_forced(tmp_path, capsys):
    path = tmp_path / "mine"
    path.mkdir()
    (path / "weights.bin").write_text("someone's model")
    with pytest.raises(SystemExit, match=r"exists and is not empty.*--force"):
        main(["model", "init", str(path)])
    assert (path / "weights.bin").read_text() == "someone's model"
    assert main(["model", "init", str(path), "--force"]) == 0
    assert not (path / "weights.bin").exists() and (path / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no .tmp, no .old
    assert str(path) in capsys.readouterr().out


def test_model_init_fills_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert main(["model", "init", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "tokenizer.json").is_file()


def test_an_interrupted_build_leaves_no_folder_behind(tmp_path, monkeypatch):
    from rlbus.learner import tiny_model

    def interrupted(folder, **kwargs):
        folder.mkdir()
        (folder / "config.json").write_text("{}")  # half a model
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_model, "build_tiny_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["model", "init", str(tmp_path / "tiny")])
    assert list(tmp_path.iterdir()) == []


def test_a_word_with_a_space_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="without spaces"):
        main(["model", "init", str(tmp_path / "m"), "--words", "two words"])
    assert list(tmp_path.iterdir()) == []


def test_the_size_choices_are_the_builders_sizes():
    from rlbus.learner.tiny_model import SIZES

    for size in SIZES:
        assert _parser().parse_args(["model", "init", "m", "--size", size]).size == size
    with pytest.raises(SystemExit):
        _parser().parse_args(["model", "init", "m", "--size", "huge"])
