"""Dataset rows become task specs: the formats, the column mapping, bad rows, epochs and the
position a resumed feeder starts from."""

import json

import pytest

from rlbus.math_task import gsm8k
from rlbus.prompt_data import (
    BadRow,
    DatasetError,
    DatasetPosition,
    DatasetSettings,
    PromptSource,
    load_rows,
    specs,
)

ROWS = [{"q": f"what is {i} + 1?", "sol": f"#### {i + 1}", "extra": i} for i in range(6)]


def _jsonl(path, rows, extra_lines=()):
    path.write_text("\n".join([*(json.dumps(r) for r in rows), *extra_lines]) + "\n")
    return path


def _settings(path, **kw):
    return DatasetSettings(path=path, columns={"q": "question", "sol": "answer"}, **kw)


def test_jsonl_parquet_and_a_saved_folder_give_the_same_specs(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dict"))
    paths = [_jsonl(tmp_path / "d.jsonl", ROWS), tmp_path / "d.parquet", tmp_path / "folder"]
    got = [specs(load_rows(_settings(p)), _settings(p), gsm8k)[0] for p in paths]
    split = _settings(tmp_path / "dict", split="test")
    got.append(specs(load_rows(split), split, gsm8k)[0])
    assert all(g == got[0] for g in got)
    assert got[0][2] == {"question": "what is 2 + 1?", "answer": "#### 3"}


def test_template_and_system_prompt_go_into_the_spec(tmp_path):
    s = _settings(_jsonl(tmp_path / "d.jsonl", ROWS[:1]), template="Q: {q}\nA:",
                  system_prompt="answer with a number")
    (spec,), _ = specs(load_rows(s), s, gsm8k)
    assert spec["prompt"] == "Q: what is 0 + 1?\nA:"
    assert spec["system_prompt"] == "answer with a number"


def test_bad_rows_name_their_number_and_column_and_the_rest_feed(tmp_path):
    rows = [ROWS[0], {"q": "no answer here"}, {"q": "x", "sol": "no number"}, ROWS[3]]
    s = _settings(_jsonl(tmp_path / "d.jsonl", rows, ["{not json"]))
    good, bad = specs(load_rows(s), s, gsm8k)
    assert len(good) == 2
    assert [b.number for b in bad] == [1, 2, 4]
    assert "row 1: missing column(s) sol" in bad[0].error
    assert "row 2: not a valid gsm8k spec" in bad[1].error and "no number" in bad[1].error
    assert "row 4: not JSON" in bad[2].error


def test_a_column_no_row_has_fails_at_load_naming_it(tmp_path):
    s = DatasetSettings(path=_jsonl(tmp_path / "d.jsonl", ROWS), columns={"question": "q"})
    with pytest.raises(DatasetError, match=r"no row has column.*question"):
        load_rows(s)


def test_an_unknown_extension_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_rows(DatasetSettings(path=tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(DatasetError, match="format"):
        load_rows(DatasetSettings(path=tmp_path / "d.csv"))


def _drain(source):
    out = []
    while (item := source.next()) is not None:
        out.append(item if isinstance(item, BadRow) else item["question"])
    return out


def test_each_epoch_is_a_seeded_permutation_of_every_row(tmp_path):
    s = _settings(_jsonl(tmp_path / "d.jsonl", ROWS), epochs=2, shuffle_seed=7)
    seen = _drain(PromptSource(load_rows(s), s, gsm8k))
    first, second = seen[:6], seen[6:]
    assert sorted(first) == sorted(second) == sorted(r["q"] for r in ROWS)
    assert first != second  # each epoch its own order
    assert _drain(PromptSource(load_rows(s), s, gsm8k)) == seen  # the same after a restart
    unshuffled = _settings(s.path, shuffle_seed=None)
    assert _drain(PromptSource(load_rows(unshuffled), unshuffled, gsm8k)) == [
        r["q"] for r in ROWS]


def test_a_source_resumed_at_its_position_continues_where_it_stopped(tmp_path):
    s = _settings(_jsonl(tmp_path / "d.jsonl", ROWS), epochs=2)
    rows = load_rows(s)
    whole = _drain(PromptSource(rows, s, gsm8k))
    first = PromptSource(rows, s, gsm8k)
    head = [first.next()["question"] for _ in range(8)]
    assert first.position == DatasetPosition(epoch=1, index=2)
    resumed = PromptSource(rows, s, gsm8k, first.position)
    assert head + _drain(resumed) == whole and resumed.exhausted


def test_settings_read_from_the_environment(monkeypatch, tmp_path):
    from rlbus.learner.settings import LearnerSettings

    monkeypatch.setenv("RLBUS_DATASET__PATH", str(tmp_path / "d.jsonl"))
    monkeypatch.setenv("RLBUS_DATASET__COLUMNS", '{"q": "question"}')
    monkeypatch.setenv("RLBUS_DATASET__EPOCHS", "3")
    monkeypatch.setenv("RLBUS_EVAL_DATASET__PATH", str(tmp_path / "e.parquet"))
    monkeypatch.setenv("RLBUS_EVAL_PASS_K", "4")
    s = LearnerSettings()
    assert s.dataset is not None and s.dataset.columns == {"q": "question"}
    assert s.dataset.epochs == 3 and s.eval_pass_k == 4
    assert s.eval_dataset is not None and s.eval_dataset.path.name == "e.parquet"
