"""``python -m loadtest.weight_publish_bench``: from the end of an optimizer step until an
inference member serves the new weights, today's path and the new one side by side.

One learner-side :class:`~rlbus.client.RolloutClient` publishes (``publish_weights(model,
wait_served=True)``: write the version into the weight store, announce it on the weights
topic of a real local broker, wait for the member's ``WeightsServed`` report of it) to one
:class:`~rlbus.inference.service.Inference` member with the ``hf`` engine, both in this
process, over Kafka. The clock starts when the trainer's step has changed its parameters
and stops when ``publish_weights`` returns: what a trainer waiting on the new version sees.

Arms, interleaved round by round (each round in a rotated order), so a machine shared with
other work loads them alike:

- **today**: the writer and reader of ``main`` before this bench: ``safetensors`` ``save_file``
  then a sha256 pass over the file; the member re-hashes the file (``verified_weights``)
  then ``safetensors.torch.load_model`` (a new state dict, then ``load_state_dict``).
  Kept verbatim here (:func:`today_write_version`, :meth:`BenchEngine.load_today`).
- **new sha256**: the code's path: one pass that writes each tensor and hashes its bytes on
  a second thread; the member maps the file, hashes the mapping and copies each tensor from
  it into the model's own parameter (:mod:`rlbus.inference.weight_load`).
- **new xxh3_128**: the same with ``RLBUS_WEIGHTS_CHECKSUM=xxh3_128``.

- **LoRA r=N** (``--lora N``, default 16; 0: none): the learner publishes only a PEFT
  adapter over every linear layer (``publish_weights(AdapterWeights)``: the same writer,
  ``adapter_model.safetensors`` and ``adapter_config.json``); the member checks it against
  its base model, verifies it and copies it into LoRA layers injected on the first version
  (:meth:`HFEngine.load_adapter`; its "load" includes the verify). Measured after the other
  arms, on a member of its own (a member serving an adapter serves no full weights).

Models: a Qwen2 of ~1 GB in fp32 (``--mb``, built from a config: no download), then the
demo's tiny Llama (``rlbus demo``) and the chat model (``build_chat_model``). Parts of each
round are timed where they run: the write (learner), the member's verify and load; the rest
("announce → served") is the event, the member noticing it (its batch loop polls steps for
up to 0.5 s between reloads) and the ``WeightsServed`` report coming back. Median of
``--repeats`` rounds per arm. Prints a table; writes ``weight_publish.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest import report
from rlbus.client import RolloutClient
from rlbus.client import rollout_client as client_module
from rlbus.client.settings import ClientSettings
from rlbus.client.tensors import Prepared, _prune
from rlbus.inference.engines import HFEngine
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.inference.weight_load import load_in_place
from rlbus.messages import LoraAdapter
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from rlbus.weights import (
    ADAPTER_FILE,
    WEIGHTS_FILE,
    sha256_file,
    verified_mapping,
    verified_weights,
)

ARMS = ("today", "new sha256", "new xxh3_128")


def say(text: str) -> None:
    print(f"[weights] {text}", flush=True)


# --------------------------------------------------------------------------- today's path


def today_write_version(weights: Prepared, weights_dir: Path, version: int, keep: int,
                        prefer: set[str], checksum: str = "sha256") -> tuple[Path, str]:
    """``rlbus.client.tensors.write_version`` as it was: safetensors' ``save_file``, then
    sha256 over the file it wrote."""
    from safetensors.torch import save_file

    folder = weights_dir / f"v{version:06d}"
    tmp = weights_dir / f".v{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    assert weights.tensors is not None
    kept = {}
    for names in weights.aliases:
        name = min(names & prefer) if names & prefer else min(names)
        kept[name] = weights.tensors[name].contiguous()
    with timed(TIMES, "save_file"):
        save_file(kept, str(tmp / WEIGHTS_FILE))
    with timed(TIMES, "sha256 on write"):
        digest = sha256_file(tmp / WEIGHTS_FILE)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    _prune(weights_dir, keep)
    return folder, digest


TIMES: dict[str, float] = {}
"""Seconds of each timed part of the current round (reset per round)."""


@contextlib.contextmanager
def timed(into: dict[str, float], part: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[part] = into.get(part, 0.0) + time.perf_counter() - t0


class BenchEngine(HFEngine):
    """The hf engine, loading by today's path or by the new one as the bench says."""

    path = "new"

    async def load_adapter(self, uri: str, checksum: str, version: int,
                           adapter: LoraAdapter) -> None:
        with timed(TIMES, "load"):
            await super().load_adapter(uri, checksum, version, adapter)

    async def load(self, uri: str, checksum: str, version: int) -> None:
        load = self.load_today if self.path == "today" else self.load_new
        await asyncio.to_thread(load, uri, checksum)
        self.version = version

    def load_today(self, uri: str, checksum: str) -> None:
        from safetensors.torch import load_model

        with timed(TIMES, "verify"):
            path = verified_weights(uri, checksum)
        with timed(TIMES, "load"):
            load_model(self.model, str(path), device=str(self.device))

    def load_new(self, uri: str, checksum: str) -> None:
        """What :meth:`HFEngine._load_verified` does, its two calls timed apart."""
        with timed(TIMES, "verify"):
            mapping = verified_mapping(uri, checksum)
        try:
            with timed(TIMES, "load"):
                load_in_place(self.model, mapping, uri)
        finally:
            mapping.close()


@contextlib.contextmanager
def writer(arm: str) -> Iterator[None]:
    """The client's writer for ``arm``, timed as a whole."""
    original = client_module.write_version
    inner = today_write_version if arm == "today" else original

    def write(*args: Any, **kwargs: Any) -> tuple[Path, str]:
        with timed(TIMES, "write"):
            return inner(*args, **kwargs)  # type: ignore[arg-type]

    client_module.write_version = write  # type: ignore[assignment]
    try:
        yield
    finally:
        client_module.write_version = original


# --------------------------------------------------------------------------- models


def qwen2_config(mb: float) -> Any:
    """A Qwen2 (hidden 1024, MLP 2816, 16 heads, vocab 32k, tied embeddings) with as many
    layers as make ~``mb`` MB of fp32 parameters (12.85M a layer, 32.8M the embedding)."""
    from transformers import Qwen2Config

    layers = max(1, round((mb * 1e6 / 4 - 32.8e6) / 12.85e6))
    return Qwen2Config(vocab_size=32_000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=16, tie_word_embeddings=True,
                       max_position_embeddings=512, pad_token_id=0, eos_token_id=1)


def build_qwen2(folder: Path, mb: float) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    Qwen2ForCausalLM(qwen2_config(mb)).save_pretrained(folder)
    return folder


def learner_model(folder: Path) -> Any:
    """The trainer's copy of the served model, with other weights (another seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
    return model


def optimizer_step(model: Any) -> None:
    """Stands for the step's update: every parameter changes, in place."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # a LoRA-wrapped model: the adapter alone
                p.add_(1e-3)


# --------------------------------------------------------------------------- the run


Member = tuple[dict[str, Any], "BenchEngine", Inference, "asyncio.Task[dict[str, Any]]"]


async def serving_member(bootstrap: str, folder: Path, store: Path) -> Member:
    """Topics of their own and an inference member serving the model in ``folder`` from
    ``store``: the client's common settings, the member's engine, the member, its task."""
    kafka = KafkaSettings(bootstrap=bootstrap)
    topics = TopicSettings(prefix=f"wpbench-{uuid.uuid4().hex[:8]}", partitions=1,
                           result_partitions=1)
    await ensure_topics(kafka, topics)
    common: dict[str, Any] = {"kafka": kafka, "topics": topics}
    engine = BenchEngine(InferenceSettings(model_path=folder, engine="hf", weights_dir=store))
    inference = Inference(InferenceSettings(**common, model_path=folder, weights_dir=store,
                                            served_report_s=1.0),
                          KafkaBus(kafka, dlq_topic=Topics(topics).dlq, service="inference"),
                          engine)
    return common, engine, inference, asyncio.create_task(inference.run())


async def measure(bootstrap: str, folder: Path, name: str, repeats: int,
                  store: Path) -> dict[str, Any]:
    """``repeats`` interleaved rounds of every arm for the model in ``folder``."""
    common, engine, inference, served = await serving_member(bootstrap, folder, store)
    model = learner_model(folder)
    client = await RolloutClient.connect(ClientSettings(
        **common, model_path=folder, weights_dir=store, keep_weights=2))
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    try:
        for r in range(repeats + 1):  # round 0 warms up every arm; not counted
            order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
            for arm in order:
                row = await one_round(client, engine, model, arm)
                if r:
                    rows[arm].append(row)
            say(f"{name} round {r}: " + ", ".join(
                f"{a} {rows[a][-1]['total'] if r else 0:.2f}s" for a in ARMS))
        equal = _equal(model, engine.model)
    finally:
        await client.close()
        inference.request_stop("bench over")
        await served
    return {"model": name, "params": sum(p.numel() for p in model.parameters()),
            "file_mb": (store / f"v{client.version:06d}" / WEIGHTS_FILE).stat().st_size / 1e6,
            "served_equals_trained": equal, "rounds": rows,
            "median": {arm: _medians(rows[arm]) for arm in ARMS}}


async def measure_lora(bootstrap: str, folder: Path, name: str, repeats: int,
                       store: Path, rank: int) -> dict[str, Any]:
    """``repeats`` rounds of publishing a rank-``rank`` LoRA adapter of the model in
    ``folder`` (all linear layers) to a member of its own, after a warm-up round (the
    first version injects the LoRA layers)."""
    from rlbus.learner import lora
    from rlbus.learner.settings import LoraSettings

    common, _engine, inference, served = await serving_member(bootstrap, folder, store)
    model, adapter = lora.wrap(learner_model(folder), LoraSettings(rank=rank))
    client = await RolloutClient.connect(ClientSettings(
        **common, model_path=folder, weights_dir=store, keep_weights=2))
    arm = f"LoRA r={rank}"
    rows: list[dict[str, float]] = []
    try:
        for r in range(repeats + 1):
            optimizer_step(model)  # only the adapter's parameters are trainable
            TIMES.clear()
            with writer("new"):
                t0 = time.perf_counter()
                await client.publish_weights(lora.adapter_weights(model, adapter),
                                             wait_served=True, timeout_s=300)
                total = time.perf_counter() - t0
            row = dict(TIMES, total=total)
            row["announce → served"] = total - row["write"] - row["load"]
            if r:
                rows.append(row)
            say(f"{name} {arm} round {r}: {total:.3f}s")
    finally:
        await client.close()
        inference.request_stop("bench over")
        await served
    file = store / f"v{client.version:06d}" / ADAPTER_FILE
    return {"model": name, "params": sum(p.numel() for p in model.parameters()
                                         if p.requires_grad),
            "file_mb": file.stat().st_size / 1e6, "rounds": {arm: rows},
            "median": {arm: _medians(rows)}}


async def one_round(client: RolloutClient, engine: BenchEngine, model: Any,
                    arm: str) -> dict[str, float]:
    engine.path = "today" if arm == "today" else "new"
    algorithm = "xxh3_128" if arm.endswith("xxh3_128") else "sha256"
    client.settings = client.settings.model_copy(update={"weights_checksum": algorithm})
    optimizer_step(model)
    TIMES.clear()
    with writer(arm):
        t0 = time.perf_counter()
        await client.publish_weights(model, wait_served=True, timeout_s=300)
        total = time.perf_counter() - t0
    row = dict(TIMES, total=total)
    row["announce → served"] = total - row["write"] - row["verify"] - row["load"]
    return row


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _equal(a: Any, b: Any) -> bool:
    import torch

    theirs = b.state_dict()
    return all(torch.equal(v, theirs[k]) for k, v in a.state_dict().items())


# --------------------------------------------------------------------------- output


PARTS = ("write", "save_file", "sha256 on write", "verify", "load", "announce → served",
         "total")


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        for arm, m in res["median"].items():
            rows.append([res["model"], f"{res['file_mb']:.3g}", arm,
                         *(f"{m[p]:.3f}" if p in m else "-" for p in PARTS)])
    return report.table(["model", "MB", "path", *PARTS], rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.weight_publish_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=1000, help="size of the large model (fp32 MB)")
    p.add_argument("--repeats", type=int, default=5, help="counted rounds per arm")
    p.add_argument("--out", type=Path, help="output folder (default runs/weight-publish-<time>)")
    p.add_argument("--smoke", action="store_true", help="a small model, 1 round: the harness")
    p.add_argument("--lora", type=int, default=16, metavar="RANK",
                   help="also publish a LoRA adapter of this rank per model (0: none)")
    p.add_argument("--lora-only", action="store_true",
                   help="only the LoRA arm (the full-weights arms are left out)")
    p.add_argument("--store", type=Path, default=None,
                   help="where the weight store lies (default: the system's temporary "
                        "folder, on disk here; /dev/shm puts it in memory)")
    return p.parse_args(argv)


def models(tmp: Path, args: argparse.Namespace) -> list[tuple[str, Path]]:
    from rlbus.learner.chat_model import build_chat_model
    from rlbus.learner.tiny_model import build_tiny_model

    mb = 60 if args.smoke else args.mb
    return [(f"qwen2 {mb:.0f}MB fp32", build_qwen2(tmp / "qwen2", mb)),
            ("demo tiny (rlbus demo)", build_tiny_model(tmp / "tiny")),
            ("chat model", build_chat_model(tmp / "chat"))]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "weight-publish")
    from rlbus.ops.broker import bootstrap_or_start

    repeats = 1 if args.smoke else args.repeats
    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:], "rows": [],
                               "store": str(args.store or tempfile.gettempdir())}
    say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    try:
        with tempfile.TemporaryDirectory(prefix="weight-publish-") as tmp:
            for name, folder in models(Path(tmp), args):
                say(f"{name}: {repeats} rounds per arm")
                if not args.lora_only:
                    with tempfile.TemporaryDirectory(prefix="weight-store-",
                                                     dir=args.store) as store:
                        results["rows"].append(asyncio.run(measure(bootstrap, folder, name,
                                                                   repeats, Path(store))))
                if args.lora:
                    with tempfile.TemporaryDirectory(prefix="weight-store-",
                                                     dir=args.store) as store:
                        results["rows"].append(asyncio.run(measure_lora(
                            bootstrap, folder, name, repeats, Path(store), args.lora)))
                report.write_json(out, results, "weight_publish.json")
    finally:
        if cluster is not None:
            cluster.stop()
    results["loadavg_after"] = list(os.getloadavg())
    print("seconds, median of the counted rounds per arm")
    print(table(results["rows"]))
    print(f"load average before {results['machine']['loadavg']}, after "
          f"{results['loadavg_after']}")
    say(f"wrote {report.write_json(out, results, 'weight_publish.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
