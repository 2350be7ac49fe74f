"""LoRA in the learner: the policy wrapped with a PEFT adapter, only the adapter trained,
only the adapter published (docs/lora.md).

The settings are checked against the model before peft sees them: peft's own error for a
target module that matches nothing, or a rank past a layer's width, does not say which
setting to change. The published adapter is PEFT's format exactly (the tensors under the
names ``get_peft_model_state_dict`` gives, ``adapter_config.json`` as ``save_pretrained``
writes it), so peft and vLLM load a version folder as it is. Its target modules are the
short names (``q_proj``), which peft and vLLM both match against a module path's last part.
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from rlbus.client.tensors import AdapterWeights
from rlbus.learner.settings import LoraSettings
from rlbus.messages import LoraAdapter

ALL_LINEAR = "all-linear"


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every linear layer of ``model`` by module path, the output head left out (PEFT's
    ``all-linear`` leaves it out too: it is the vocabulary-sized layer)."""
    output = getattr(model, "get_output_embeddings", None)
    head = output() if output is not None else None
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head}


def resolve_targets(model: nn.Module, lora: LoraSettings) -> list[str]:
    """The short module names the adapter wraps, sorted; a :class:`ValueError` naming the
    setting for a target no linear layer has or a rank wider than a target layer."""
    assert lora.rank
    layers = linear_layers(model)
    short = sorted({name.rsplit(".", 1)[-1] for name in layers})
    wanted = short if ALL_LINEAR in lora.target_modules else lora.target_modules
    unknown = [t for t in wanted if t not in short]
    if unknown:
        raise ValueError(f"RLBUS_LORA__TARGET_MODULES: {', '.join(unknown)} is no linear layer "
                         f"of the model; it has {', '.join(short)} (or all-linear)")
    widths = {name: min(m.in_features, m.out_features) for name, m in layers.items()
              if name.rsplit(".", 1)[-1] in wanted}
    narrowest = min(widths, key=widths.__getitem__)
    if lora.rank > widths[narrowest]:
        raise ValueError(f"RLBUS_LORA__RANK={lora.rank} is wider than {narrowest} "
                         f"({widths[narrowest]} features): a rank at most {widths[narrowest]}")
    return sorted(wanted)


def alpha_of(lora: LoraSettings) -> float:
    assert lora.rank
    return lora.alpha if lora.alpha is not None else 2.0 * lora.rank


def wrap(model: nn.Module, lora: LoraSettings) -> tuple[nn.Module, LoraAdapter]:
    """``model`` wrapped with a fresh adapter (base weights frozen, the adapter's B zero:
    the wrapped policy starts as the base one), and the adapter's shape."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_targets(model, lora)
    adapter = LoraAdapter(rank=lora.rank, alpha=alpha_of(lora), target_modules=targets)
    # peft types alpha as int; it only ever divides it by the rank
    config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha,  # type: ignore[arg-type]
                        target_modules=targets, lora_dropout=0.0, bias="none")
    return get_peft_model(model, config), adapter


def adapter_weights(model: Any, adapter: LoraAdapter) -> AdapterWeights:
    """What a publish writes: the adapter's tensors under PEFT's file names and the
    ``adapter_config.json`` that ``save_pretrained`` would write next to them."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["target_modules"] = list(adapter.target_modules)
    json.dumps(config)  # what is not JSON fails here, not halfway through a publish
    return AdapterWeights(tensors=get_peft_model_state_dict(model), config=config,
                          adapter=adapter)


def adapter_state(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint keeps of a LoRA policy: the adapter's parameters (the base is the
    model folder, unchanged), under the wrapped model's own names."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in model.state_dict().items() if name in trained}


def restore_adapter(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a checkpoint's :func:`adapter_state`; a checkpoint of another adapter shape, or
    of the full model, is a clear error."""
    expected = adapter_state(model)
    if state.keys() != expected.keys():
        raise ValueError("the checkpoint's model is not this LoRA adapter (written with other "
                         "RLBUS_LORA__* settings, or without LoRA); point RLBUS_CHECKPOINT_DIR "
                         "elsewhere or use the settings it was written with")
    bad = [k for k, t in state.items() if tuple(t.shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(f"the checkpoint's adapter has other shapes ({bad[0]}: "
                         f"{list(state[bad[0]].shape)}); RLBUS_LORA__RANK differs from its run")
    model.load_state_dict(state, strict=False)
