"""Whether a published LoRA adapter fits the served base model, before anything is loaded.

A LoRA version is a PEFT folder (``adapter_model.safetensors`` and ``adapter_config.json``)
and its WeightVersion's :class:`~rlbus.messages.LoraAdapter`. The three must agree, and the
adapter's tensors must fit the base model's linear layers: for a layer ``P`` of ``in``
inputs and ``out`` outputs, ``base_model.model.P.lora_A.weight`` is ``[rank, in]`` and
``...lora_B.weight`` is ``[out, rank]``, for every layer whose last name is a target, and
nothing else. :func:`adapter_problems` says every way they do not, from the config and the
safetensors header alone (no torch), so any engine can use it: the hf engine with the
shapes of its model's ``nn.Linear`` layers, the vllm engine with shapes it reads from the
model's config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbus.client.tensors import TensorSpec, read_header
from rlbus.messages import LoraAdapter
from rlbus.weights import ADAPTER_CONFIG, ADAPTER_FILE

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a base module's path in an adapter file's tensor names."""
UNSERVED = {"use_dora": False, "use_rslora": False, "modules_to_save": None,
            "bias": "none", "fan_in_fan_out": False}
"""PEFT options that change what the adapter computes beyond B A x alpha / r, with the
value an adapter served here must have (the learner's; vLLM refuses most of them too)."""


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, TensorSpec]]:
    """The adapter folder's config and its tensors' specs (from the file's header)."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: not a JSON object")
    return config, read_header(folder / ADAPTER_FILE)


def adapter_problems(config: Mapping[str, Any], specs: Mapping[str, TensorSpec],
                     announced: LoraAdapter,
                     linear: Mapping[str, tuple[int, int]]) -> list[str]:
    """Every way an adapter (its ``adapter_config.json`` as ``config``, its tensors'
    ``specs``) disagrees with the ``announced`` shape or does not fit a base model whose
    linear layers are ``linear`` (module path -> (in_features, out_features)). Empty when
    it fits."""
    out = _config_problems(config, announced)
    targets = set(announced.target_modules)
    wrapped = {path: shape for path, shape in linear.items()
               if path.rsplit(".", 1)[-1] in targets}
    names = {p.rsplit(".", 1)[-1] for p in linear}
    out += [f"target module {t}: the model has no such linear layer ({', '.join(sorted(names))})"
            for t in sorted(targets - names)]
    expected: dict[str, tuple[int, ...]] = {}
    for path, (fan_in, fan_out) in wrapped.items():
        expected[f"{PEFT_PREFIX}{path}.lora_A.weight"] = (announced.rank, fan_in)
        expected[f"{PEFT_PREFIX}{path}.lora_B.weight"] = (fan_out, announced.rank)
    for name, spec in sorted(specs.items()):
        if name not in expected:
            out.append(f"{name}: no such LoRA tensor for this model and target modules")
        elif spec.shape != expected[name]:
            out.append(f"{name}: shape {list(spec.shape)}, the model needs "
                       f"{list(expected[name])}")
    out += [f"{name}: missing" for name in sorted(expected.keys() - specs.keys())]
    return out


def _config_problems(config: Mapping[str, Any], announced: LoraAdapter) -> list[str]:
    out = []
    if config.get("peft_type", "LORA") != "LORA":
        out.append(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}, not LORA")
    if config.get("r") != announced.rank:
        out.append(f"{ADAPTER_CONFIG}: r {config.get('r')!r}, announced rank {announced.rank}")
    if config.get("lora_alpha") != announced.alpha:
        out.append(f"{ADAPTER_CONFIG}: lora_alpha {config.get('lora_alpha')!r}, announced "
                   f"alpha {announced.alpha}")
    modules = config.get("target_modules")
    if not isinstance(modules, list) or set(modules) != set(announced.target_modules):
        out.append(f"{ADAPTER_CONFIG}: target_modules {modules!r}, announced "
                   f"{announced.target_modules}")
    for key, value in UNSERVED.items():
        if config.get(key, value) not in (value, [] if value is None else value):
            out.append(f"{ADAPTER_CONFIG}: {key} {config[key]!r} is not served (only {value!r})")
    return out
