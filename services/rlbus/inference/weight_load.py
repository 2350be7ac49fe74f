"""Loading a verified weights file into a served model, in place.

The file is mapped once and hashed (:func:`rlbus.weights.verified_mapping`); then every
tensor is copied straight from the mapping into the model's own parameter, one tensor at
a time: no state dict of new tensors is built (``safetensors.torch.load_model`` builds
one, then copies it again), and no more memory than one tensor's host copy is used beyond
the model. Names, shapes and dtypes are all checked before the first copy, so a file that
does not fit leaves the model as it was.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

from rlbus.client.tensors import FLOATS
from rlbus.errors import WeightsMismatchError
from rlbus.weights import Entry, safetensors_index

TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def load_in_place(model: Any, mapping: mmap.mmap, name: str = "weights") -> None:
    """Copy the safetensors file in ``mapping`` into ``model``'s parameters and buffers
    (on whatever device they are; a floating tensor is cast to the parameter's dtype).
    Every parameter must be in the file (tied ones under any one of their names) and
    every tensor of the file must be a parameter of that shape: else
    :class:`~rlbus.errors.WeightsMismatchError`, and nothing is copied."""

    copy_in(copy_plan(model, safetensors_index(mapping, name), name), mapping)


def copy_plan(model: Any, index: dict[str, Entry], name: str) -> list[tuple[Any, Entry]]:
    """(target tensor, file entry) per tensor of ``model``; raises before any copy."""
    groups: dict[int, tuple[Any, list[str]]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), (tensor, []))[1].append(key)
    known = {key for _, keys in groups.values() for key in keys}
    problems = [f"{key}: not in the model" for key in sorted(index.keys() - known)]
    plan = []
    for tensor, keys in groups.values():
        found = [key for key in keys if key in index]
        if not found:
            problems.append(f"{' = '.join(keys)}: missing")
            continue
        entry = index[found[0]]
        if entry.shape != tuple(tensor.shape):
            problems.append(f"{found[0]}: shape {list(entry.shape)}, the model has "
                            f"{list(tensor.shape)}")
        elif not _dtype_fits(entry.dtype, tensor):
            problems.append(f"{found[0]}: dtype {entry.dtype} for a {tensor.dtype} tensor")
        plan.append((tensor, entry))
    if problems:
        raise WeightsMismatchError(f"{name} do not fit the served model: "
                                   + "; ".join(problems[:8]))
    return plan


def _dtype_fits(dtype: str, tensor: Any) -> bool:
    if tensor.dtype.is_floating_point:
        return dtype in FLOATS or dtype == "F64"
    return TORCH_DTYPES[dtype] == str(tensor.dtype).removeprefix("torch.")


def _tensor(mapping: mmap.mmap, entry: Entry) -> Any:
    """A tensor over the mapping's bytes of ``entry``, not a copy (a copy if the bytes
    are not aligned to the dtype's size, which a file of another writer might do)."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[entry.dtype])
    count = entry.end - entry.start
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer: Any = mapping
    offset = entry.start
    if offset % itemsize:
        buffer, offset = bytearray(mapping[entry.start : entry.end]), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a copy-on-write mapping; torch never writes to it
        flat = torch.frombuffer(buffer, dtype=dtype, count=count // itemsize, offset=offset)
    return flat.view(entry.shape)


def adapter_plan(model: Any, index: dict[str, Entry], name: str,
                 adapter_name: str = "default") -> list[tuple[Any, Entry]]:
    """(target tensor, file entry) per tensor of a PEFT adapter file (``base_model.model.P.
    lora_A.weight``) over the LoRA layers injected into ``model`` (``P.lora_A.<adapter_name>
    .weight``); every injected LoRA tensor must be in the file, at its shape, else
    :class:`~rlbus.errors.WeightsMismatchError` before any copy."""
    params = {key: t for key, t in model.state_dict(keep_vars=True).items()
              if f".lora_A.{adapter_name}." in key or f".lora_B.{adapter_name}." in key}
    plan, problems, seen = [], [], set()
    for key, entry in index.items():
        path, _, leaf = key.removeprefix("base_model.model.").rpartition(".")
        module, _, kind = path.rpartition(".")
        target = params.get(f"{module}.{kind}.{adapter_name}.{leaf}")
        if target is None:
            problems.append(f"{key}: no such LoRA tensor in the served model")
        elif entry.shape != tuple(target.shape):
            problems.append(f"{key}: shape {list(entry.shape)}, the model has "
                            f"{list(target.shape)}")
        else:
            plan.append((target, entry))
            seen.add(f"{module}.{kind}.{adapter_name}.{leaf}")
    problems += [f"{key}: missing" for key in sorted(params.keys() - seen)]
    if problems:
        raise WeightsMismatchError(f"{name} does not fit the served adapter: "
                                   + "; ".join(problems[:8]))
    return plan


def copy_in(plan: list[tuple[Any, Entry]], mapping: mmap.mmap) -> None:
    """Copy each entry of ``mapping`` into its target tensor (see :func:`load_in_place`)."""
    import torch

    with torch.no_grad():
        for target, entry in plan:
            source = _tensor(mapping, entry)
            target.copy_(source)
            del source  # the view pins the mapping until it goes
