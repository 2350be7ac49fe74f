"""The hf engine serves base + LoRA adapter: tokens and logprobs equal a fresh engine's on
the merged weights, a new version replaces the adapter's tensors in place, and an adapter
that does not fit (its config against the message, a module the model lacks, a shape) is
refused before anything changes, the old version still served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.client.tensors import AdapterWeights, TensorSpec
from rlbus.errors import WeightsMismatchError
from rlbus.inference.adapters import adapter_problems
from rlbus.inference.engines import HFEngine
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import LoraAdapter, Sampling
from rlbus.weights import ADAPTER_CONFIG
from tests.support.lora import merged, publish, random_adapter, tiny_qwen2

PROMPTS = [[3, 8, 9, 14, 5], [7, 2]]
GREEDY = Sampling(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    base = tiny_qwen2(root / "base")
    out: dict[str, Any] = {"base": base, "store": root / "store"}
    for v in (1, 2):
        wrapped, weights = random_adapter(base, seed=v)
        out[v] = (weights, *publish(weights, out["store"], v), merged(wrapped, root / f"m{v}"))
    return out


def engine(folder: Path, **kw: Any) -> HFEngine:
    e = HFEngine(InferenceSettings(model_path=folder, torch_threads=None, **kw))
    e.eos_ids = set()  # a random model may stop anywhere: every completion runs its length
    return e


async def same_as_merged(e: HFEngine, merged_folder: Path) -> None:
    want = await engine(merged_folder).generate(PROMPTS, GREEDY)
    got = await e.generate(PROMPTS, GREEDY)
    for g, w in zip(got, want, strict=True):
        assert g.completion_ids == w.completion_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                   atol=1e-5, rtol=0)


async def load(e: HFEngine, entry: tuple[AdapterWeights, str, str, Path], version: int) -> None:
    weights, uri, checksum, _ = entry
    await e.load_adapter(uri, checksum, version, weights.adapter)


@pytest.mark.parametrize("inflight", [False, True])
async def test_base_plus_adapter_serves_what_the_merged_weights_do(world: dict[str, Any],
                                                                   inflight: bool) -> None:
    e = engine(world["base"], inflight_updates=inflight)
    await load(e, world[1], 1)
    assert e.version == 1
    await same_as_merged(e, world[1][3])


async def test_a_new_version_replaces_the_adapter_in_place(world: dict[str, Any]) -> None:
    e = engine(world["base"])
    await load(e, world[1], 1)
    tensors = {k: t.data_ptr() for k, t in e.model.state_dict().items()}
    await load(e, world[2], 2)
    assert {k: t.data_ptr() for k, t in e.model.state_dict().items()} == tensors
    assert e.version == 2
    await same_as_merged(e, world[2][3])


def misfit_config(folder: Path, **change: Any) -> None:
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))


@pytest.mark.parametrize(("spoil", "says"), [
    (lambda a, f: (misfit_config(f, r=8), a)[1], "adapter_config.json: r 8, announced rank 4"),
    (lambda a, f: a.model_copy(update={"target_modules": [*a.target_modules, "qkv_proj"]}),
     "target module qkv_proj: the model has no such linear layer"),
    (lambda a, f: (misfit_config(f, target_modules=["q_proj"]), a)[1],
     "target_modules \\['q_proj'\\], announced"),
])
async def test_an_adapter_that_does_not_fit_is_refused_and_the_old_one_serves(
        world: dict[str, Any], tmp_path: Path, spoil: Any, says: str) -> None:
    e = engine(world["base"])
    await load(e, world[1], 1)
    weights, uri, checksum, _ = world[2]
    folder = tmp_path / "v000002"
    shutil.copytree(uri, folder)
    adapter = spoil(weights.adapter, folder)
    with pytest.raises(WeightsMismatchError, match=says):
        await e.load_adapter(str(folder), checksum, 2, adapter)
    assert e.version == 1
    await same_as_merged(e, world[1][3])


async def test_an_adapter_of_another_shape_is_refused(world: dict[str, Any],
                                                      tmp_path: Path) -> None:
    e = engine(world["base"])
    await load(e, world[1], 1)
    _, wider = random_adapter(world["base"], rank=8)
    uri, checksum = publish(wider, tmp_path, 3)
    with pytest.raises(WeightsMismatchError, match="not the served adapter's"):
        await e.load_adapter(uri, checksum, 3, wider.adapter)
    assert e.version == 1


async def test_a_first_adapter_that_does_not_fit_leaves_the_plain_model(
        world: dict[str, Any]) -> None:
    e = engine(world["base"])
    weights, uri, checksum, _ = world[1]
    with pytest.raises(WeightsMismatchError, match="announced"):
        await e.load_adapter(uri, checksum, 1, weights.adapter.model_copy(update={"rank": 2}))
    assert e.adapter is None and not any(".lora_" in k for k in e.model.state_dict())


def test_problems_name_each_tensor_of_the_wrong_shape_or_missing() -> None:
    adapter = LoraAdapter(rank=2, alpha=4, target_modules=["q_proj"])
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}
    linear = {"model.layers.0.self_attn.q_proj": (8, 16), "model.layers.0.mlp.up_proj": (8, 4)}
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert adapter_problems(config, {a: TensorSpec("F32", (2, 8)), b: TensorSpec("F32", (16, 2))},
                            adapter, linear) == []
    assert adapter_problems(config, {a: TensorSpec("F32", (2, 9))}, adapter, linear) == [
        f"{a}: shape [2, 9], the model needs [2, 8]", f"{b}: missing"]
    assert adapter_problems({**config, "use_dora": True}, {}, adapter, {})[0] == \
        "adapter_config.json: use_dora True is not served (only False)"
