"""Weight store and checkpoint: files written so that a crash never leaves a torn one.

Weights: ``<weights_dir>/v<version>/model.safetensors`` plus its sha256, which the
WeightVersion carries and the engines verify before loading. Checkpoint:
``<checkpoint_dir>/checkpoint.pt`` (model, optimizer, version, step, consumer offsets,
trained group ids, feeder position), written to a temporary file, fsynced and renamed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn

from rlbus.weights import WEIGHTS_FILE, sha256_file


def save_weights(model: nn.Module, weights_dir: Path, version: int, keep: int) -> tuple[Path, str]:
    """Write version ``version``; returns (folder, sha256). Keeps the newest ``keep``."""
    folder = weights_dir / f"v{version:06d}"
    tmp = weights_dir / f".v{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / WEIGHTS_FILE))  # handles tied embeddings
    digest = sha256_file(tmp / WEIGHTS_FILE)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    _prune(weights_dir, keep)
    return folder, digest


def _prune(weights_dir: Path, keep: int) -> None:
    versions = sorted(p for p in weights_dir.iterdir() if p.name.startswith("v"))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


CHECKPOINT = "checkpoint.pt"


def save_checkpoint(checkpoint_dir: Path, state: dict[str, Any]) -> Path:
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / CHECKPOINT
    tmp = checkpoint_dir / f".{CHECKPOINT}.tmp"
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(checkpoint_dir: Path) -> dict[str, Any] | None:
    path = checkpoint_dir / CHECKPOINT
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state
