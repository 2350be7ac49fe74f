"""Published weights: what they hold, whether that is what the served model holds, and
writing them into the weight store.

A safetensors file opens with a JSON header naming every tensor with its dtype and shape;
the served model folder's header (or the previous version's) is the reference that new
weights are checked against before anything is written. torch and safetensors are
imported here only inside the functions that need them.

Tied weights (an embedding shared with the output layer) are one tensor under two names:
a file holds one of them (Hugging Face keeps the embedding, ``safetensors.save_model`` the
first name in order), and the engines load either. A source's aliases therefore match the
reference if any one of their names is in it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.errors import WeightsMismatchError
from rlbus.messages import LoraAdapter
from rlbus.weights import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    ChecksumAlgorithm,
    file_checksum,
    format_checksum,
    new_hasher,
)

FLOATS = frozenset({"F32", "BF16", "F16"})
"""The dtypes the engines load a floating-point tensor from (they cast to their own)."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_PROBLEMS_SHOWN = 8


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype (safetensors' name: F32, BF16, I64 ...) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Reference:
    """What published weights must hold, and where that was read."""

    specs: dict[str, TensorSpec]
    source: str
    exact_dtypes: bool
    """True against a previous version (the trainer's own dtype must not change); False
    against the served model folder, whose floating dtype the engines cast from anyway."""


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter to publish (:meth:`rlbus.client.RolloutClient.publish_weights`): its
    tensors under PEFT's names (``get_peft_model_state_dict``), the ``adapter_config.json``
    PEFT writes with them, and its shape for the WeightVersion."""

    tensors: Mapping[str, Any]
    config: Mapping[str, Any]
    adapter: LoraAdapter


@dataclass
class Prepared:
    """Weights ready to write: tensors in memory (from a module or state dict) or a
    safetensors file on disk (from a folder)."""

    specs: dict[str, TensorSpec]
    aliases: list[frozenset[str]]
    """Groups of names that are one tensor (tied weights); each name alone otherwise."""
    tensors: dict[str, Any] | None = None
    file: Path | None = None


def read_header(path: Path) -> dict[str, TensorSpec]:
    """The tensors a safetensors file holds, from its header alone (no torch)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > MAX_HEADER_BYTES:
            raise WeightsMismatchError(f"{path}: not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: TensorSpec(v["dtype"], tuple(v["shape"])) for name, v in header.items()}


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors file(s) of a weights folder (``model.safetensors``, or the shards
    of a Hugging Face ``save_pretrained``), or the file itself."""
    if path.is_file():
        return [path]
    single = path / WEIGHTS_FILE
    if single.exists():
        return [single]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no safetensors file in it")
    return shards


def folder_specs(path: Path) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for file in safetensors_files(path):
        specs.update(read_header(file))
    return specs


def prepare(source: Any) -> Prepared:
    """Weights from a folder or file path, a torch module (a Hugging Face model is one) or
    a state dict, ready to check and write."""
    if isinstance(source, str | os.PathLike):
        return _from_path(Path(source))
    state = source.state_dict() if hasattr(source, "state_dict") else source
    if not isinstance(state, Mapping):
        raise TypeError(f"weights are a state dict, a torch module or a folder, not a "
                        f"{type(source).__name__}")
    return _from_tensors(unwrapped(state))


WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""What DistributedDataParallel (and DataParallel) and ``torch.compile`` put before every
parameter name of the model they wrap; the engines load the plain model's names."""


def unwrapped(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` with a wrapper's prefix taken off, where every name carries it (nested
    wrappers too: a compiled model inside DDP)."""
    for prefix in WRAPPER_PREFIXES:
        if state and all(name.startswith(prefix) for name in state):
            return unwrapped({name.removeprefix(prefix): t for name, t in state.items()})
    return state


def _from_path(path: Path) -> Prepared:
    files = safetensors_files(path)
    if len(files) == 1:
        specs = read_header(files[0])
        return Prepared(specs, [frozenset({n}) for n in specs], file=files[0])
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in files:  # shards: merged into the one file the engines load
        tensors.update(load_file(file))
    return _from_tensors(tensors)


def _from_tensors(state: Mapping[str, Any]) -> Prepared:
    import torch

    tensors: dict[str, Any] = {}
    by_view: dict[tuple[Any, ...], set[str]] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"weights: {name} is a {type(value).__name__}, not a tensor")
        t = value.detach()
        tensors[name] = t
        view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                tuple(t.shape), t.stride(), t.dtype)
        by_view.setdefault(view, set()).add(name)
    specs = {n: TensorSpec(_dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
    return Prepared(specs, [frozenset(names) for names in by_view.values()], tensors=tensors)


_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.get(name, name.upper())


def problems(weights: Prepared, reference: Reference) -> list[str]:
    """Every way ``weights`` differ from ``reference``: a tensor missing or unexpected, a
    shape or dtype that differs. Empty when they match."""
    out: list[str] = []
    covered: set[str] = set()
    for names in weights.aliases:
        spec = weights.specs[min(names)]
        known = sorted(names & reference.specs.keys())
        if not known:
            out.append(f"{' = '.join(sorted(names))}: no such tensor in {reference.source}")
        for name in known:
            covered.add(name)
            want = reference.specs[name]
            if spec.shape != want.shape:
                out.append(f"{name}: shape {list(spec.shape)}, {reference.source} has "
                           f"{list(want.shape)}")
            if not _dtype_ok(spec.dtype, want.dtype, reference.exact_dtypes):
                out.append(f"{name}: dtype {spec.dtype}, {reference.source} has {want.dtype}")
    out += [f"{name}: missing (in {reference.source})"
            for name in sorted(reference.specs.keys() - covered)]
    return out


def _dtype_ok(have: str, want: str, exact: bool) -> bool:
    if have == want:
        return True
    return not exact and have in FLOATS and want in FLOATS


def tie_copies(weights: Prepared, reference: Reference) -> None:
    """Count as aliases the names the reference lacks whose tensor equals another one of
    the same spec: tied weights that were copied apart (a state dict of clones) are still
    one tensor to the engines."""
    if weights.tensors is None:
        return
    import torch

    tensors = weights.tensors
    for names in list(weights.aliases):
        if names & reference.specs.keys():
            continue
        spec = weights.specs[min(names)]
        twin = next((other for other in weights.aliases
                     if other is not names and other & reference.specs.keys()
                     and weights.specs[min(other)] == spec
                     and torch.equal(tensors[min(other)], tensors[min(names)])), None)
        if twin is not None:
            weights.aliases.remove(names)
            weights.aliases[weights.aliases.index(twin)] = twin | names


def check(weights: Prepared, reference: Reference | None, version: int) -> None:
    """Raise :class:`WeightsMismatchError` unless ``weights`` match ``reference``."""
    if reference is None:
        return
    tie_copies(weights, reference)
    found = problems(weights, reference)
    if found:
        shown = "; ".join(found[:MAX_PROBLEMS_SHOWN])
        extra = len(found) - MAX_PROBLEMS_SHOWN
        more = f" (and {extra} more)" if extra > 0 else ""
        raise WeightsMismatchError(f"weights for v{version} refused, nothing published: "
                                   f"{shown}{more}")


def write_version(weights: Prepared, weights_dir: Path, version: int, keep: int,
                  prefer: set[str], checksum: ChecksumAlgorithm = "sha256", *,
                  adapter_config: Mapping[str, Any] | None = None) -> tuple[Path, str]:
    """Write ``weights`` as ``<weights_dir>/v<version:06d>/model.safetensors`` (to a temporary
    folder first, renamed once complete); returns (folder, checksum string). Of tied names,
    the one in ``prefer`` (the reference's) is kept. Keeps the newest ``keep`` versions.
    ``adapter_config``: ``weights`` are a LoRA adapter, written as PEFT's folder
    (``adapter_model.safetensors`` and this as ``adapter_config.json``)."""
    folder = weights_dir / f"v{version:06d}"
    tmp = _tmp_folder(weights_dir, version)
    name = WEIGHTS_FILE if adapter_config is None else ADAPTER_FILE
    if not (tmp / name).is_file():  # else a file preallocated for this version
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    if adapter_config is not None:
        text = json.dumps(dict(adapter_config), indent=2, sort_keys=True)
        (tmp / ADAPTER_CONFIG).write_text(text + "\n")
    if weights.file is not None:
        shutil.copyfile(weights.file, tmp / name)
        digest = file_checksum(tmp / name, checksum)
    else:
        digest = _save(weights, tmp / name, prefer, checksum)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    _prune(weights_dir, keep)
    return folder, digest


def _save(weights: Prepared, path: Path, prefer: set[str], checksum: ChecksumAlgorithm) -> str:
    """Write the safetensors file, hashing each tensor's bytes as they are written (one
    pass; the hash runs on a second thread, one tensor behind the write). Returns the
    checksum string of the file."""
    assert weights.tensors is not None
    kept = {}
    for names in weights.aliases:
        name = min(names & prefer) if names & prefer else min(names)
        kept[name] = weights.tensors[name]
    hasher = new_hasher(checksum)
    with path.open("r+b" if path.exists() else "wb") as f, \
            ThreadPoolExecutor(1, "weights-hash") as pool:
        pending: deque[Future[None]] = deque()
        for chunk in _file_chunks(kept):
            f.write(chunk)
            pending.append(pool.submit(hasher.update, chunk))
            while len(pending) > 2:  # bounds the host copies of device tensors held
                pending.popleft().result()
        for done in pending:
            done.result()
        f.truncate()  # a preallocated file may have been longer
    return format_checksum(checksum, hasher.hexdigest())


def _tmp_folder(weights_dir: Path, version: int) -> Path:
    return weights_dir / f".v{version:06d}.tmp"


def preallocate(weights_dir: Path, version: int, size: int) -> None:
    """Reserve ``size`` bytes for version ``version``'s file in its (private) temporary
    folder, ahead of time: the write then does not allocate blocks as it goes (a 1 GB
    write here: 0.4-0.9 s into a preallocated file, 0.3-1.7 s into a new one; section 10 of
    docs/performance.md). A filesystem that cannot preallocate allocates as it writes."""
    tmp = _tmp_folder(weights_dir, version)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fd = os.open(tmp / WEIGHTS_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
    except OSError:
        pass  # the write allocates as it goes
    finally:
        os.close(fd)


def _file_chunks(tensors: dict[str, Any]) -> Iterator[memoryview]:
    """The bytes of a safetensors file of ``tensors``, as the safetensors library lays it
    out: the 8-byte header size, the JSON header padded with spaces to 8 bytes, then each
    tensor's bytes, widest dtype first (so each one is aligned to its element size)."""
    import torch

    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield memoryview(struct.pack("<Q", len(text)) + text)
    for name in order:
        t = tensors[name].detach().to("cpu").contiguous()
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _prune(weights_dir: Path, keep: int) -> None:
    versions = sorted(p for p in weights_dir.iterdir() if p.name.startswith("v"))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
