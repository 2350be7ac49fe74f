"""The ``rlbus`` command. Imports nothing heavy until a subcommand needs it.

rlbus demo                      train on the built-in multi-turn task, end to end
rlbus run SERVICE               run one service (rollout, inference, reward, learner)
rlbus topics create             create the topic catalogue (idempotent)
rlbus acl apply [--dry-run]     grant each role the ACLs it needs (idempotent)
rlbus model init PATH           build a tiny random-init model and tokenizer in PATH
rlbus feed FILE.jsonl           publish prompts from a dataset file
rlbus replay TOPIC              print (or re-publish) messages of a topic
rlbus trace EPISODE_ID          one episode's messages across topics, turn by turn
rlbus status                    lag and throughput per topic and consumer group
rlbus broker start|stop|status  a local Kafka broker (no Docker needed; --secure: ACLs)
rlbus k8s names                 topic and consumer-group names the Helm chart renders
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

MODEL_SIZES = ("tiny", "small", "h64")
"""The tiny model builder's sizes (tiny_model.SIZES; a test holds them equal): listed here
because this module must not import torch."""

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlbus",
        description="Rollout-as-a-service for RL of multi-turn LLM agents, over Kafka.",
        epilog="Settings come from RLBUS_* environment variables (nested with __), "
        "e.g. RLBUS_KAFKA__BOOTSTRAP=127.0.0.1:9092.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a tiny model on guess-the-number, end to end")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default 4800)")
    demo.add_argument("--minutes", type=float, default=10.0, help="wall-time budget")
    demo.add_argument("--run-dir", default=None, help="output folder (default runs/<time>)")
    demo.add_argument("--rollouts", type=int, default=1, help="rollout processes")
    demo.add_argument("--inference", type=int, default=1, help="inference processes")
    demo.add_argument("--no-progress", action="store_true", help="plain log lines, no live table")
    demo.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                      help="inference engine (vllm: from --vllm-python's venv)")
    demo.add_argument("--size", choices=MODEL_SIZES, default=None,
                      help="model shape (default tiny; h64 with --engine vllm)")
    demo.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                      help="interpreter of vLLM's venv (make vllm-env)")
    demo.add_argument("--lora", type=int, default=0, metavar="RANK",
                      help="train a LoRA adapter of this rank, publish only it (docs/lora.md)")
    demo.add_argument("--secure", action="store_true",
                      help="a local broker with TLS, a SCRAM user per role and ACLs "
                      "(docs/security.md); each service logs in as its own role")

    run = sub.add_parser("run", help="run one service until SIGTERM")
    from rlbus.settings import tiers  # the installed tiers' registry (settings modules only)

    run.add_argument("service", choices=tuple(tiers()))

    topics = sub.add_parser("topics", help="the topic catalogue")
    topics.add_argument("action", choices=("create", "list"))

    acl = sub.add_parser(
        "acl", help="the ACLs each role needs on a secured broker (docs/security.md)",
        description="Rows derived from the topic catalogue (RLBUS_TOPICS__PREFIX) and the "
        "group and transactional-id names the services use. `apply` connects as the admin "
        "principal (RLBUS_KAFKA__*) and creates those the broker lacks.")
    acl.add_argument("action", choices=("apply",))
    acl.add_argument("--dry-run", action="store_true",
                     help="print the rows, connect to nothing")
    acl.add_argument("--principal", action="append", default=[], metavar="ROLE=USER",
                     help="the SCRAM user of a role (default: the role's name), repeatable")

    model = sub.add_parser("model", help="a local model folder for the services")
    model_sub = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = model_sub.add_parser(
        "init", help="build a tiny random-init Llama and its tokenizer (no download)"
    )
    init.add_argument("path", help="folder to create, e.g. models/tiny (RLBUS_MODEL_PATH)")
    init.add_argument(
        "--size", choices=MODEL_SIZES, default="tiny",
        help="tiny: 90k parameters; h64: head_dim 64, for the vllm engine"
    )  # the keys of rlbus.learner.tiny_model.SIZES, which imports torch
    init.add_argument("--seed", type=int, default=0, help="seed of the random init")
    init.add_argument(
        "--words", nargs="+", action="extend", default=[], metavar="WORD",
        help="extra vocabulary words, one token each (the words of a task of your own)",
    )  # fmt: skip
    init.add_argument("--force", action="store_true", help="replace a non-empty folder")

    feed = sub.add_parser(
        "feed", help="publish prompts from a file: prompts, or a dataset with --task",
        description="Without --task, FILE holds one prompt per line: {\"task\": ..., "
        "\"spec\": {...}}, checked whole before anything is sent. With --task, FILE is a "
        "dataset (.parquet, .jsonl, or a save_to_disk folder) whose rows become that task's "
        "specs; a row that makes no spec is dead-lettered and the feed goes on.")
    feed.add_argument("file", help="a prompts .jsonl file, or a dataset with --task")
    feed.add_argument("--group-size", type=int, default=8)
    feed.add_argument("--run-name", default="feed")
    feed.add_argument("--max-new-tokens", type=int, default=16)
    feed.add_argument("--temperature", type=float, default=1.0)
    data = feed.add_argument_group("dataset (with --task)")
    data.add_argument("--task", help="the installed task every row is a spec of")
    data.add_argument("--format", choices=("auto", "parquet", "jsonl", "arrow"), default="auto")
    data.add_argument("--split", default="train", help="split of a DatasetDict folder")
    data.add_argument("--columns", default="{}",
                      help='JSON: column -> spec key, e.g. \'{"question": "question"}\'')
    data.add_argument("--template", help="str.format template over a row: spec['prompt']")
    data.add_argument("--system-prompt", help="spec['system_prompt'] of every row")
    data.add_argument("--epochs", type=int, default=1)
    data.add_argument("--shuffle-seed", type=int, default=None,
                      help="shuffle each epoch with this seed (default: file order)")

    replay = sub.add_parser("replay", help="print a topic's messages as JSON lines, or re-publish")
    replay.add_argument("topic", help="full name or catalogue name, e.g. trajectories")
    start = replay.add_mutually_exclusive_group()
    start.add_argument("--from-offset", type=int, help="start at this offset in every partition")
    start.add_argument("--from-time", help="start at a time: epoch s/ms or ISO 8601")
    start.add_argument("--from-beginning", action="store_true", help="the default")
    replay.add_argument("--key", help="only records with this key")
    replay.add_argument("--episode", help="only messages of this episode id")
    replay.add_argument("--group", help="only messages of this group id")
    replay.add_argument("--limit", type=int, help="at most this many messages")
    replay.add_argument("--to", help="re-publish the matching records (bytes, key, headers)")
    replay.add_argument(
        "--raw", action="store_true",
        help="dead letters: key and payload as base64, as stored (default: decoded)",
    )  # fmt: skip

    st = sub.add_parser("status", help="live lag and throughput per topic and consumer group")
    st.add_argument(
        "--once", action="store_true", help="print one table and exit (the default off a terminal)"
    )
    st.add_argument("--interval", type=float, default=2.0, help="seconds between samples")

    tr = sub.add_parser("trace", help="one episode across topics, turn by turn")
    tr.add_argument("episode_id")
    tr.add_argument("--json", action="store_true", help="JSON lines instead of the transcript")

    broker = sub.add_parser("broker", help="local Kafka broker: start|stop|status")
    broker.add_argument("args", nargs=argparse.REMAINDER)

    k8s = sub.add_parser("k8s", help="Kubernetes: the names deploy/helm/rlbus must render")
    k8s.add_argument("action", choices=("names",))
    k8s.add_argument("--prefix", help="topic prefix (default RLBUS_TOPICS__PREFIX or rlbus)")
    k8s.add_argument("--partitions", type=int, help="partitions of the work topics")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pydantic import ValidationError

    from rlbus.errors import AccessDeniedError
    from rlbus.settings import UnknownSettingError
    from rlbus.transport import BrokerConnectError

    try:
        return _dispatch(args)
    except (UnknownSettingError, ValidationError) as exc:
        raise SystemExit(f"rlbus {args.command}: invalid settings: {exc}") from None
    except BrokerConnectError as exc:
        raise SystemExit(f"rlbus {args.command}: cannot reach Kafka: {exc}") from None
    except AccessDeniedError as exc:
        raise SystemExit(f"rlbus {args.command}: {exc}") from None


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from rlbus.runner import run_service

        run_service(args.service)
        return 0
    if args.command == "broker":
        from rlbus.ops.broker import main as broker_main

        return broker_main(args.args)
    if args.command == "topics":
        from rlbus.ops.admin import topics_command

        return asyncio.run(topics_command(args.action))
    if args.command == "acl":
        from rlbus.ops.admin import acl_command

        return asyncio.run(acl_command(args.dry_run, args.principal))
    if args.command == "model":
        from pathlib import Path

        from rlbus.ops.admin import model_init_command

        return model_init_command(
            Path(args.path), size=args.size, seed=args.seed, words=args.words, force=args.force
        )
    if args.command == "feed":
        from rlbus.ops.admin import feed_command

        return asyncio.run(feed_command(args))
    if args.command in ("replay", "trace"):
        from rlbus.ops.admin import inspect_command

        return asyncio.run(inspect_command(args))
    if args.command == "status":
        from rlbus.ops.admin import AdminSettings
        from rlbus.ops.status import status_command
        from rlbus.topics import Topics

        s = AdminSettings()
        try:
            return asyncio.run(status_command(s.kafka, Topics(s.topics), args.once, args.interval))
        except KeyboardInterrupt:  # how a live status ends
            return 0
    if args.command == "k8s":
        from rlbus.ops.k8s import k8s_command

        return k8s_command(args.action, args.prefix, args.partitions)
    if args.command == "demo":
        from rlbus.ops.demo import demo_command

        return demo_command(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
