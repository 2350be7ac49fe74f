"""Operator commands: topics, feeding prompts, inspecting topics, and a local model folder."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rlbus import plugins
from rlbus.acl import TIER_ROLES, Role, acls, apply_acls
from rlbus.errors import PluginError
from rlbus.messages import Prompt, Sampling
from rlbus.prompt_data import (
    BadRow,
    DatasetError,
    DatasetSettings,
    PromptSource,
    dead_letter,
    load_rows,
)
from rlbus.settings import ServiceSettings, tiers
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus, admin_client

log = logging.getLogger(__name__)


class AdminSettings(ServiceSettings):
    """Connection and topic settings of operator commands (same RLBUS_* variables)."""

    @classmethod
    def also_accepted(cls) -> list[type[BaseModel]]:
        return list(tiers().values())


def principals(pairs: Sequence[str]) -> dict[Role, str]:
    """``ROLE=USER`` pairs as a mapping; a clear exit on an unknown role."""
    found = {}
    for pair in pairs:
        role, sep, user = pair.partition("=")
        if not sep or not user or role not in TIER_ROLES:
            raise SystemExit(f"rlbus acl: --principal {pair!r}: expected ROLE=USER with ROLE "
                             f"one of {', '.join(TIER_ROLES)}")
        found[Role(role)] = user
    return found


async def acl_command(dry_run: bool, pairs: Sequence[str] = ()) -> int:
    """Print (``dry_run``) or apply the ACL rows of every role for the configured topics."""
    s = AdminSettings()
    rows = acls(s.topics, principals(pairs))
    if dry_run:
        for row in rows:
            print(row)
        return 0
    created = await apply_acls(s.kafka, rows)
    for row in created:
        print(f"created  {row}")
    print(f"rlbus acl: {len(created)} created, {len(rows) - len(created)} already held "
          f"({len(rows)} rows for the topics of prefix {s.topics.prefix!r})")
    return 0


async def topics_command(action: str) -> int:
    s = AdminSettings()
    if action == "create":
        created = await ensure_topics(s.kafka, s.topics)
        print(f"created {len(created)} topic(s): {', '.join(created) or '(all existed)'}")
        return 0
    async with admin_client(s.kafka) as admin:
        existing = set(await admin.list_topics())
    for spec in Topics(s.topics).catalogue():
        mark = "ok" if spec.name in existing else "missing"
        print(f"{spec.name:<40} {spec.partitions:>3} partitions  {mark}")
    return 0


def read_prompts(path: Path, args: argparse.Namespace) -> list[Prompt]:
    """Validate the whole file before publishing anything: a bad line N fails with N."""
    if not path.is_file():
        raise SystemExit(f"no such file: {path}")
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            prompts.append(
                Prompt(
                    group_id=row.get("group_id", f"{args.run_name}/{n}"),
                    task=row["task"],
                    spec=row.get("spec", {}),
                    group_size=row.get("group_size", args.group_size),
                    sampling=sampling,
                )
            )
        except (json.JSONDecodeError, KeyError, ValidationError, TypeError) as exc:
            raise SystemExit(f"{path}:{n}: not a prompt ({type(exc).__name__}: {exc})") from None
    return prompts


def dataset_settings(args: argparse.Namespace) -> DatasetSettings:
    """The dataset the flags describe; a clear exit on a bad flag."""
    try:
        return DatasetSettings(
            path=Path(args.file), format=args.format, split=args.split,
            columns=json.loads(args.columns), template=args.template,
            system_prompt=args.system_prompt, epochs=args.epochs,
            shuffle_seed=args.shuffle_seed)
    except (json.JSONDecodeError, ValidationError) as exc:
        raise SystemExit(f"rlbus feed: bad dataset options: {exc}") from None


def read_dataset(args: argparse.Namespace) -> tuple[list[Prompt], list[BadRow]]:
    """Every epoch's rows as prompts of ``args.task`` (group ids ``<run>/<n>``), and the
    rows that make no spec. A file that cannot feed at all, or an unknown task, exits."""
    s = dataset_settings(args)
    try:
        task = plugins.task(args.task)
        source = PromptSource(load_rows(s), s, task)
    except (PluginError, DatasetError) as exc:
        raise SystemExit(f"rlbus feed: {exc}") from None
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    prompts: list[Prompt] = []
    bad: list[BadRow] = []
    while (item := source.next()) is not None:
        if isinstance(item, BadRow):
            bad.append(item)
            continue
        prompts.append(Prompt(group_id=f"{args.run_name}/{len(prompts)}", task=args.task,
                              spec=item, group_size=args.group_size, sampling=sampling))
    return prompts, bad


async def feed_command(args: argparse.Namespace) -> int:
    if args.task is not None:
        return await feed_dataset(args)
    path = Path(args.file)
    prompts = read_prompts(path, args)  # before connecting: a bad file costs no broker call
    s = AdminSettings()
    topics = Topics(s.topics)
    bus = KafkaBus(s.kafka, dlq_topic=topics.dlq, service="feed")
    try:
        producer = await bus.producer()
        for p in prompts:
            await producer.send(topics.prompts, p, key=p.group_id)
    finally:
        await bus.close()
    print(f"published {len(prompts)} prompt(s) to {topics.prompts}")
    return 0


async def feed_dataset(args: argparse.Namespace) -> int:
    prompts, bad = read_dataset(args)  # read and mapped before connecting
    s = AdminSettings()
    topics = Topics(s.topics)
    bus = KafkaBus(s.kafka, dlq_topic=topics.dlq, service="feed")
    data = dataset_settings(args)
    try:
        producer = await bus.producer()
        for row in bad:
            await dead_letter(bus, data, row)
        for p in prompts:
            await producer.send(topics.prompts, p, key=p.group_id)
    finally:
        await bus.close()
    print(f"published {len(prompts)} prompt(s) to {topics.prompts}"
          + (f"; {len(bad)} bad row(s) dead-lettered to {topics.dlq}" if bad else ""))
    for row in bad[:5]:
        print(f"  {row.error}", file=sys.stderr)
    return 0


async def inspect_command(args: argparse.Namespace) -> int:
    from rlbus.ops import inspection

    s = AdminSettings()
    topics = Topics(s.topics)
    bus = KafkaBus(s.kafka, dlq_topic=None, service="inspect")
    try:
        if args.command == "trace":
            found = await inspection.gather_episode(bus, topics, args.episode_id)
            if args.json:
                for d in found.rows:
                    print(json.dumps(inspection.as_json(*d, topics=topics)))
            else:
                inspection.render_episode(found, sys.stdout.write)
            return 0 if found.rows else 1
        start = inspection.Start(
            offset=args.from_offset,
            timestamp_ms=inspection.parse_time(args.from_time) if args.from_time else None,
        )
        match = inspection.Filter(key=args.key, episode=args.episode, group=args.group)
        n = await inspection.replay(
            bus, topics, args.topic, start, match, to=args.to, limit=args.limit,
            raw_bytes=args.raw,
        )
        if args.to:
            print(f"re-published {n} record(s) to {args.to}", file=sys.stderr)
        return 0
    except LookupError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        await bus.close()


def model_init_command(
    path: Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    words: Sequence[str] = (),
    force: bool = False,
) -> int:
    """Build the tiny random-init Llama and its word-level tokenizer (the built-in tasks'
    words, plus ``words`` for a task of your own) into ``path``.

    Built in ``<path>.tmp`` and renamed when complete, so an interrupted build is never taken
    for a model; an existing non-empty folder is replaced only with ``force``.
    """
    path = Path(os.path.abspath(path))  # "models/tiny/", "." and ".." have a name to rename
    if path.exists() and not path.is_dir():
        raise SystemExit(f"rlbus model init: {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise SystemExit(f"rlbus model init: {path} exists and is not empty (--force replaces it)")
    from transformers.utils import logging as transformers_logging

    from rlbus.learner.tiny_model import build_tiny_model  # imports torch

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # noise
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # the leftover of an interrupted build
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_tiny_model(tmp, size=size, seed=seed, words=words)
        _replace_folder(tmp, path)
    except ValueError as exc:  # a word the tokenizer cannot hold
        raise SystemExit(f"rlbus model init: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"rlbus model init: built a random-init {size} model and its tokenizer in {path}")
    return 0


def _replace_folder(new: Path, path: Path) -> None:
    """Rename ``new`` to ``path``; a non-empty ``path`` is moved aside first (a rename
    replaces only an empty folder) and deleted once ``new`` is in place."""
    old = path.with_name(path.name + ".old")
    if path.is_dir() and any(path.iterdir()):
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    new.replace(path)
    shutil.rmtree(old, ignore_errors=True)
