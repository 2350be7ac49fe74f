"""Weights are loaded only if they are the ones announced."""

import pytest
import torch

from rlbus.inference.engines import HFEngine
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.store import save_weights
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.weights import ChecksumMismatchError, verified_weights, weights_file


def test_round_trip_and_tamper_detection(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    engine = HFEngine(InferenceSettings(model_path=model_dir))
    trained = engine.model
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    folder, digest = save_weights(trained, tmp_path / "weights", version=3, keep=2)
    assert verified_weights(str(folder), digest) == weights_file(str(folder))

    fresh = HFEngine(InferenceSettings(model_path=model_dir))
    import asyncio

    asyncio.run(fresh.load(str(folder), digest, 3))
    assert fresh.version == 3
    for a, b in zip(fresh.model.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)

    with weights_file(str(folder)).open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(ChecksumMismatchError, match="sha256"):
        asyncio.run(fresh.load(str(folder), digest, 4))
    assert fresh.version == 3


def test_weight_store_keeps_the_newest_versions(tmp_path):
    model = torch.nn.Linear(2, 2)
    for v in range(1, 6):
        save_weights(model, tmp_path, version=v, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000004", "v000005"]


def test_only_uris_inside_the_weight_store_are_accepted(tmp_path):
    from rlbus.weights import WeightsOutsideStoreError, inside_store

    store = tmp_path / "weights"
    (store / "v000001").mkdir(parents=True)
    (store / "v000001" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "model.safetensors").write_bytes(b"x")
    (store / "v000002").symlink_to(tmp_path / "elsewhere")
    inside = store / "v000001"
    assert inside_store(str(inside), store) == inside / "model.safetensors"
    assert inside_store(f"file://{inside}", store) == inside / "model.safetensors"
    for uri in (str(tmp_path / "elsewhere"), f"{store}/../elsewhere", str(store / "v000002"),
                "/etc/passwd", "http://attacker.example/model.safetensors", "s3://b/w"):
        with pytest.raises(WeightsOutsideStoreError, match="weight store") as caught:
            inside_store(uri, store)
        assert caught.value.refusal.reason == "invalid"
