"""Each tracker's files read back with its own library, as a person's tools would read them."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768  # the LevelDB log format's block size
_FULL, _LAST = 1, 4


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the event files in ``folder``."""
    acc = _accumulator(folder)
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_histogram(folder: Path, tag: str) -> dict[int, Any]:
    """{step: HistogramValue} of ``tag``."""
    return {e.step: e.histogram_value for e in _accumulator(folder).Histograms(tag)}


def tensorboard_hparams(folder: Path) -> dict[str, Any]:
    """The HParams plugin's session-start values: {name: value}."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = _accumulator(folder).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    out: dict[str, Any] = {}
    for name, value in data.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        out[name] = getattr(value, kind)
    return out


def _accumulator(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def wandb_records(folder: Path) -> Iterator[Any]:
    """The records of the one offline run under ``folder`` (its ``run-<id>.wandb`` file).

    wandb has no public reader for this file any more (its old ``DataStore`` went with the
    Python backend): it is the LevelDB log format behind a 7-byte ``:W&B`` header, each
    record a ``wandb_internal_pb2.Record``, split over 32 KiB blocks in chunks with a 7-byte
    header (crc32c, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def wandb_history(folder: Path) -> dict[int, dict[str, Any]]:
    """{step: {key: value}} of the run's history records (nested keys joined with /)."""
    out: dict[int, dict[str, Any]] = {}
    for record in wandb_records(folder):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            out.setdefault(items["_step"], {}).update(items)
    return out


def wandb_config(folder: Path) -> dict[str, Any]:
    """The run's config, from its run and config records."""
    config: dict[str, Any] = {}
    for record in wandb_records(folder):
        kind = record.WhichOneof("record_type")
        updates = (record.run.config.update if kind == "run"
                   else record.config.update if kind == "config" else [])
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def mlflow_run(uri: str, experiment: str) -> tuple[Any, Any]:
    """(client, the one run) of ``experiment`` in the store at ``uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def mlflow_history(uri: str, experiment: str, key: str) -> dict[int, float]:
    client, run = mlflow_run(uri, experiment)
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
