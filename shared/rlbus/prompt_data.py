"""Prompts from a dataset: parquet, JSON lines, or a Hugging Face ``datasets`` folder.

A dataset row becomes a task spec through :class:`DatasetSettings`: ``columns`` maps the
row's columns onto spec keys (empty: every column under its own name), ``template`` renders
``spec["prompt"]`` from the row (``str.format`` over its columns) and ``system_prompt`` goes
to ``spec["system_prompt"]``; the task's environment decides how to show them (the built-in
``gsm8k`` task puts the system prompt first). The spec is then checked by the task's
:meth:`~rlbus.api.Task.validate`.

A row that lacks a mapped column or fails validation is a :class:`BadRow` (its 0-based
number and what is wrong): the caller dead-letters it (:func:`dead_letter`) and goes on. A
column that no row has is a :class:`DatasetError` at load, before anything is sent.

:class:`PromptSource` walks the rows for ``epochs`` passes, each in its own permutation
(seeded by ``shuffle_seed`` and the epoch, so a restart recomputes it); its
:class:`DatasetPosition` (epoch, index into that epoch's permutation) is what a checkpoint
keeps so that a resumed run continues where it stopped.

Parquet and ``save_to_disk`` folders are read with ``datasets`` (imported here, lazily:
shared code stays light). JSON lines are read line by line with the stdlib, so that one
malformed line is one bad row rather than a failed load, as it would be with the
``datasets`` JSON builder, which also infers one schema over all rows.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlbus.api import Task, TaskSpec
from rlbus.errors import FatalError, Refusal, RefusalReason
from rlbus.transport import Bus, RawRecord
from rlbus.transport.deadletter import sink_of

Format = Literal["auto", "parquet", "jsonl", "arrow"]


class DatasetSettings(BaseModel):
    """A dataset of prompts (``RLBUS_DATASET__*``, ``RLBUS_EVAL_DATASET__*``)."""

    model_config = ConfigDict(extra="forbid")

    path: Path
    """A ``.parquet`` file, a ``.jsonl`` file, or a folder written by ``save_to_disk``."""
    format: Format = "auto"
    """auto: by the path (a folder is arrow, ``.parquet``, ``.jsonl``/``.json``)."""
    split: str = "train"
    """The split of a ``DatasetDict`` folder (a plain ``Dataset`` folder has none)."""
    columns: dict[str, str] = {}
    """Column -> spec key (JSON in the environment); empty: every column as it is named."""
    template: str | None = None
    """``str.format`` template over the row's columns, rendered into ``spec["prompt"]``."""
    system_prompt: str | None = None
    """Text put in ``spec["system_prompt"]`` of every row."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the dataset; after the last one the feeder sends no more prompts."""
    shuffle_seed: int | None = 0
    """Seed of each epoch's permutation (with the epoch number); None: file order."""


class DatasetError(FatalError, ValueError):
    """A dataset that cannot feed at all: unreadable, or a mapped column no row has."""


@dataclass(frozen=True)
class BadRow:
    """A row that makes no valid spec: its 0-based number in the file and why."""

    number: int
    error: str
    row: dict[str, Any]


@dataclass(frozen=True)
class DatasetPosition:
    """Where a pass over the dataset stands: ``index`` rows of epoch ``epoch``'s
    permutation are done."""

    epoch: int = 0
    index: int = 0


Rows = Sequence[dict[str, Any] | BadRow]
"""A dataset's rows, in file order; an unparsable JSON line is a :class:`BadRow`."""


def load_rows(s: DatasetSettings) -> Rows:
    """The rows of ``s.path``; a :class:`DatasetError` if it cannot be read or lacks a
    mapped column altogether. Blocking: call it off the event loop."""
    fmt = _format(s)
    if not s.path.exists():
        raise DatasetError(f"dataset {s.path}: no such file or folder")
    rows = _jsonl(s.path) if fmt == "jsonl" else _hf(s, fmt)
    _check_columns(s, rows)
    return rows


def _format(s: DatasetSettings) -> Format:
    if s.format != "auto":
        return s.format
    if s.path.is_dir():
        return "arrow"
    suffix = s.path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DatasetError(f"dataset {s.path}: format not known from the name; set format "
                       "(parquet, jsonl or arrow)")


def _jsonl(path: Path) -> list[dict[str, Any] | BadRow]:
    rows: list[dict[str, Any] | BadRow] = []
    for n, line in enumerate(path.read_text().splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            rows.append(BadRow(n, f"row {n}: not JSON: {exc}", {"line": line[:1000]}))
            continue
        rows.append(row if isinstance(row, dict) else
                    BadRow(n, f"row {n}: not a JSON object", {"line": line[:1000]}))
    return rows


def _hf(s: DatasetSettings, fmt: Format) -> Rows:
    import datasets  # heavy: only where a dataset is read

    if fmt == "parquet":
        return datasets.Dataset.from_parquet(str(s.path))  # type: ignore[no-any-return]
    loaded = datasets.load_from_disk(str(s.path))
    if isinstance(loaded, datasets.DatasetDict):
        if s.split not in loaded:
            raise DatasetError(f"dataset {s.path}: no split {s.split!r} "
                               f"(it has {', '.join(loaded)})")
        return loaded[s.split]  # type: ignore[no-any-return]
    return loaded  # type: ignore[no-any-return]


def _check_columns(s: DatasetSettings, rows: Rows) -> None:
    present: set[str] = set()
    names = getattr(rows, "column_names", None)  # a datasets.Dataset knows its columns
    if names is not None:
        present = set(names)
    else:
        for row in rows:
            if isinstance(row, dict):
                present |= row.keys()
    missing = sorted(set(s.columns) - present)
    if missing and any(isinstance(r, dict) for r in rows):
        raise DatasetError(f"dataset {s.path}: no row has column(s) {', '.join(missing)} "
                           f"(columns: {', '.join(sorted(present)) or 'none'})")


def to_spec(row: dict[str, Any], number: int, s: DatasetSettings, task: Task) -> TaskSpec:
    """The spec of row ``number``; raises :class:`BadRowError` naming what is wrong."""
    missing = [c for c in s.columns if row.get(c) is None]
    if missing:
        raise BadRowError(f"row {number}: missing column(s) {', '.join(missing)}")
    spec = {key: row[col] for col, key in s.columns.items()} if s.columns else dict(row)
    if s.template is not None:
        try:
            spec["prompt"] = s.template.format(**row)
        except KeyError as exc:
            raise BadRowError(f"row {number}: template needs missing column {exc}") from exc
    if s.system_prompt is not None:
        spec["system_prompt"] = s.system_prompt
    try:
        task.validate(spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise BadRowError(f"row {number}: not a valid {task.name} spec: {exc}") from exc
    return spec


class BadRowError(ValueError):
    """One row makes no valid spec (the message names the row and the column)."""


def spec_or_bad(rows: Rows, number: int, s: DatasetSettings, task: Task) -> TaskSpec | BadRow:
    """Row ``number`` as a spec, or as the :class:`BadRow` it is."""
    row = rows[number]
    if isinstance(row, BadRow):
        return row
    try:
        return to_spec(row, number, s, task)
    except BadRowError as exc:
        return BadRow(number, str(exc), dict(row))


def specs(rows: Rows, s: DatasetSettings, task: Task) -> tuple[list[TaskSpec], list[BadRow]]:
    """Every row in file order: the valid specs and the bad rows (an evaluation set)."""
    out = [spec_or_bad(rows, n, s, task) for n in range(len(rows))]
    return ([x for x in out if not isinstance(x, BadRow)],
            [x for x in out if isinstance(x, BadRow)])


class PromptSource:
    """``epochs`` passes over a dataset's rows, each in its seeded permutation."""

    def __init__(self, rows: Rows, settings: DatasetSettings, task: Task,
                 position: DatasetPosition | None = None) -> None:
        self.rows, self.settings, self.task = rows, settings, task
        self.position = position or DatasetPosition()
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation)

    @property
    def exhausted(self) -> bool:
        """True once every epoch is done (or the dataset is empty)."""
        return not self.rows or self.position.epoch >= self.settings.epochs

    def permutation(self, epoch: int) -> list[int]:
        """Row numbers in epoch ``epoch``'s order (recomputed the same after a restart)."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.rows)))
            if self.settings.shuffle_seed is not None:
                random.Random(f"{self.settings.shuffle_seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next(self) -> TaskSpec | BadRow | None:
        """The next row (as a spec or a bad row), None when exhausted; advances."""
        if self.exhausted:
            return None
        epoch, index = self.position.epoch, self.position.index
        number = self.permutation(epoch)[index]
        index += 1
        self.position = (DatasetPosition(epoch + 1, 0) if index >= len(self.rows)
                         else DatasetPosition(epoch, index))
        return spec_or_bad(self.rows, number, self.settings, self.task)


async def dead_letter(bus: Bus, s: DatasetSettings, bad: BadRow) -> None:
    """Send ``bad`` to ``bus``'s dead-letter topic, if it has one: the source is named
    ``dataset:<path>``, the offset is the row number, the payload the row as JSON."""
    sink = await sink_of(bus)
    if sink is None:
        return
    payload = json.dumps(bad.row, default=str).encode()
    raw = RawRecord(topic=f"dataset:{s.path}", partition=0, offset=bad.number, key=None,
                    value=payload, headers={}, timestamp_ms=int(time.time() * 1000))
    await sink.put(raw, Refusal(RefusalReason.INVALID, bad.error))
