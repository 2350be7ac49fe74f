"""The weight store's conventions, shared by its writer (learner) and readers (engines).

A published version is ``<weights_dir>/v<version>/model.safetensors``; its WeightVersion
event carries the folder's URI and the file's sha256, which readers check before loading.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rlbus.errors import (
    ChecksumMismatchError as ChecksumMismatchError,  # still importable from here
)
from rlbus.errors import WeightsOutsideStoreError as WeightsOutsideStoreError

WEIGHTS_FILE = "model.safetensors"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_file(uri: str) -> Path:
    """The safetensors file of a weight-store entry (a folder or the file itself)."""
    path = Path(uri.removeprefix("file://"))
    return path / WEIGHTS_FILE if path.is_dir() else path


def verified_weights(uri: str, checksum: str) -> Path:
    path = weights_file(uri)
    actual = sha256_file(path)
    if actual != checksum:
        raise ChecksumMismatchError(f"{path}: sha256 {actual[:12]}… != announced {checksum[:12]}…")
    return path


def inside_store(uri: str, store: Path) -> Path:
    """The weights file ``uri`` names, if it lies inside the weight store ``store``:
    a local path (or ``file://`` URI) whose real location, with every ``..`` and symbolic
    link followed, is under the store's. Else :class:`WeightsOutsideStoreError`: a
    WeightVersion must not make a reader load a file of the sender's choosing."""
    if "://" in uri and not uri.startswith("file://"):
        raise WeightsOutsideStoreError(f"weights uri {uri!r} is not a local path inside the "
                                       f"weight store {store} (RLBUS_WEIGHTS_DIR)")
    path = weights_file(uri).resolve()
    root = store.resolve()
    if not path.is_relative_to(root):
        raise WeightsOutsideStoreError(f"weights uri {uri!r} ({path}) lies outside the weight "
                                       f"store {root} (RLBUS_WEIGHTS_DIR)")
    return path
