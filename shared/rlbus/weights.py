"""The weight store's conventions, shared by its writer (learner) and readers (engines).

A published version is ``<weights_dir>/v<version>/model.safetensors``; its WeightVersion
event carries the folder's URI and the file's checksum, which readers check before loading.

A checksum names its algorithm: ``xxh3_128:<hex>``, or a bare hex digest for sha256 (what
every version published before the prefix existed carries). sha256 is the default: it also
resists a forger who can write into the weight store but not announce versions; xxh3-128
detects any torn, truncated or corrupted file, as the engines need, at several GB/s on one
core where sha256 runs at about 0.5-1 GB/s (docs/performance.md, section 10).

A reader maps the file once (:func:`verified_mapping`), hashes the mapping and loads from
that same mapping: the bytes it loads are the bytes it verified, even if the file is
replaced in between.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from rlbus.errors import (
    ChecksumMismatchError as ChecksumMismatchError,  # still importable from here
)
from rlbus.errors import WeightsOutsideStoreError as WeightsOutsideStoreError

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
"""A LoRA version's tensors (PEFT's name), next to ``adapter_config.json``."""
ADAPTER_CONFIG = "adapter_config.json"

ChecksumAlgorithm = Literal["sha256", "xxh3_128"]
CHUNK = 16 << 20
"""Bytes hashed per call: large enough that hashlib and xxhash release the GIL."""


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher(algorithm: ChecksumAlgorithm) -> Hasher:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def format_checksum(algorithm: ChecksumAlgorithm, hexdigest: str) -> str:
    """The checksum string a WeightVersion carries (sha256 bare, as it always was)."""
    return hexdigest if algorithm == "sha256" else f"{algorithm}:{hexdigest}"


def parse_checksum(checksum: str) -> tuple[ChecksumAlgorithm, str]:
    """(algorithm, hex digest) of a checksum string; :class:`ChecksumMismatchError` for an
    algorithm this reader does not know (it cannot verify, so it must not load)."""
    algorithm, sep, digest = checksum.rpartition(":")
    if not sep:
        return "sha256", checksum
    if algorithm == "xxh3_128":
        return "xxh3_128", digest
    raise ChecksumMismatchError(f"checksum algorithm {algorithm!r} is not one this reader "
                                "verifies (sha256, xxh3_128)")


def hash_buffer(data: Any, algorithm: ChecksumAlgorithm) -> str:
    """The checksum string of the bytes of ``data`` (any buffer), hashed in chunks."""
    h = new_hasher(algorithm)
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHUNK):
        h.update(view[start : start + CHUNK])
    return format_checksum(algorithm, h.hexdigest())


def file_checksum(path: Path, algorithm: ChecksumAlgorithm = "sha256") -> str:
    h = new_hasher(algorithm)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return format_checksum(algorithm, h.hexdigest())


def sha256_file(path: Path) -> str:
    return file_checksum(path, "sha256")


def weights_file(uri: str) -> Path:
    """The safetensors file of a weight-store entry (a folder or the file itself): a
    folder's ``model.safetensors``, or its ``adapter_model.safetensors`` in a LoRA
    adapter's folder (which has no full weights)."""
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        return path
    if not (path / WEIGHTS_FILE).exists() and (path / ADAPTER_FILE).exists():
        return path / ADAPTER_FILE
    return path / WEIGHTS_FILE


def verified_weights(uri: str, checksum: str) -> Path:
    """The weights file of ``uri``, once its bytes hash to ``checksum``."""
    path = weights_file(uri)
    algorithm, _ = parse_checksum(checksum)
    _check(path, file_checksum(path, algorithm), checksum, algorithm)
    return path


def verified_mapping(uri: str, checksum: str) -> mmap.mmap:
    """The weights file of ``uri`` mapped into memory (copy-on-write: the file never
    changes), once the mapping hashes to ``checksum``: load from it, not from the file,
    and what is loaded is what was verified. Close it when done."""
    path = weights_file(uri)
    algorithm, _ = parse_checksum(checksum)
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise ChecksumMismatchError(f"{path}: empty file, announced {checksum[:12]}…")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        _check(path, hash_buffer(mapping, algorithm), checksum, algorithm)
    except BaseException:
        mapping.close()
        raise
    return mapping


def _check(path: Path, actual: str, announced: str, algorithm: str) -> None:
    if actual != announced:
        raise ChecksumMismatchError(f"{path}: {algorithm} {actual[-32:][:12]}… != announced "
                                    f"{announced[-32:][:12]}…")


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors buffer: dtype name, shape, byte range in the buffer."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def safetensors_index(data: Any, name: str = "weights") -> dict[str, Entry]:
    """Every tensor of the safetensors file in buffer ``data``, its header checked as
    the safetensors library checks it: each tensor's bytes match its dtype and shape,
    lie inside the buffer, and the tensors tile the data section with no gap or overlap.
    Else :class:`ChecksumMismatchError` (a file its writer cannot have meant)."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise _not_safetensors(name, "shorter than its header")
    (size,) = struct.unpack("<Q", view[:8])
    if size > min(MAX_HEADER_BYTES, len(view) - 8):
        raise _not_safetensors(name, f"header of {size} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
        header.pop("__metadata__", None)
        entries = {n: _entry(v, 8 + size) for n, v in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _not_safetensors(name, f"header: {exc!r}") from None
    expected = 8 + size
    for n, e in sorted(entries.items(), key=lambda kv: kv[1].start):
        if e.start != expected or e.end - e.start != math.prod(e.shape) * ITEMSIZE[e.dtype]:
            raise _not_safetensors(name, f"{n}: bytes {e.start}..{e.end} do not hold "
                                   f"{e.dtype}{list(e.shape)} from byte {expected}")
        expected = e.end
    if expected != len(view):
        raise _not_safetensors(name, f"{len(view) - expected} bytes after the last tensor")
    return entries


def _not_safetensors(name: str, why: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(f"{name}: not a safetensors file: {why}")


def _entry(value: dict[str, Any], base: int) -> Entry:
    dtype, shape, (begin, end) = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}")
    if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, end]):
        raise ValueError(f"shape {shape!r} or offsets {[begin, end]!r}")
    return Entry(dtype, tuple(shape), base + begin, base + end)


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
