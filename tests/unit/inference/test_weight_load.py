"""The hf engine loads a published version in place from the verified mapping; a file
that is corrupt, truncated or does not fit the model leaves the served weights as they
were."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlbus.client.tensors import prepare, write_version
from rlbus.errors import WeightsMismatchError
from rlbus.inference.engines import HFEngine
from rlbus.inference.settings import InferenceSettings
from rlbus.inference.weight_load import load_in_place
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.weights import ChecksumMismatchError, verified_mapping, weights_file


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _engine(model_dir: Path) -> HFEngine:
    return HFEngine(InferenceSettings(model_path=model_dir))


def _trained(model_dir: Path) -> torch.nn.Module:
    model = _engine(model_dir).model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model: torch.nn.Module, other: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, other[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_a_published_version_loads_in_place_into_the_same_parameters(
        tmp_path: Path, model_dir: Path, algorithm: str) -> None:
    trained = _trained(model_dir)
    folder, checksum = write_version(prepare(trained), tmp_path, 2, 1, set(), algorithm)  # type: ignore[arg-type]
    engine = _engine(model_dir)
    params = {k: p.data_ptr() for k, p in engine.model.named_parameters()}

    asyncio.run(engine.load(str(folder), checksum, 2))

    assert engine.version == 2
    assert _same(engine.model, _snapshot(trained))
    assert {k: p.data_ptr() for k, p in engine.model.named_parameters()} == params
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied


def test_a_bf16_file_loads_into_an_fp32_model(tmp_path: Path, model_dir: Path) -> None:
    trained = _trained(model_dir).to(torch.bfloat16)
    folder, checksum = write_version(prepare(trained), tmp_path, 1, 1, set())
    engine = _engine(model_dir)
    asyncio.run(engine.load(str(folder), checksum, 1))
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, trained.state_dict()[k].float())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_truncated_file_is_refused_and_the_old_weights_stay(
        tmp_path: Path, model_dir: Path, damage: str) -> None:
    folder, checksum = write_version(prepare(_trained(model_dir)), tmp_path, 5, 1, set(),
                                     "xxh3_128")
    path = weights_file(str(folder))
    with path.open("r+b") as f:
        if damage == "truncate":
            f.truncate(path.stat().st_size // 2)
        else:
            f.seek(path.stat().st_size // 2)
            f.write(b"\xff\xfe\xfd\xfc")
    engine = _engine(model_dir)
    before = _snapshot(engine.model)

    with pytest.raises(ChecksumMismatchError, match="xxh3_128"):
        asyncio.run(engine.load(str(folder), checksum, 5))

    assert engine.version == 0
    assert _same(engine.model, before)


def test_a_file_that_does_not_fit_the_model_changes_nothing(tmp_path: Path,
                                                            model_dir: Path) -> None:
    state = _snapshot(_trained(model_dir))
    name = next(k for k in state if k.endswith("mlp.up_proj.weight"))
    state[name] = state[name][:-1]  # one row short
    del state["model.norm.weight"]
    state["extra.weight"] = torch.zeros(2)
    folder, checksum = write_version(prepare(state), tmp_path, 1, 1, set())
    engine = _engine(model_dir)
    before = _snapshot(engine.model)

    mapping = verified_mapping(str(folder), checksum)
    with pytest.raises(WeightsMismatchError) as caught:
        load_in_place(engine.model, mapping)
    mapping.close()

    message = str(caught.value)
    assert f"{name}: shape" in message and "model.norm.weight: missing" in message
    assert "extra.weight: not in the model" in message
    assert _same(engine.model, before)
