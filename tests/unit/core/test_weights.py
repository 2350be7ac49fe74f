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


# --------------------------------------------------------------------------- fast path


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(5, 3), "b.bf16": torch.randn(7).to(torch.bfloat16),
            "c.ids": torch.arange(4), "d.scalar": torch.tensor(2.5), "e.empty": torch.zeros(0, 4),
            "f.half": torch.randn(3, 1).half()}


def _publish(tmp_path, checksum):
    from rlbus.client.tensors import prepare, write_version

    return write_version(prepare(_tensors()), tmp_path / "w", 1, 1, set(), checksum)


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_the_one_pass_writer_writes_safetensors_and_hashes_what_it_wrote(tmp_path, algorithm):
    from safetensors.torch import load_file

    from rlbus.weights import file_checksum

    folder, checksum = _publish(tmp_path, algorithm)
    path = weights_file(str(folder))
    assert checksum == file_checksum(path, algorithm)
    assert checksum.startswith("xxh3_128:") == (algorithm == "xxh3_128")
    loaded = load_file(path)
    assert loaded.keys() == _tensors().keys()
    for name, t in _tensors().items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_a_verified_mapping_holds_exactly_the_announced_bytes(tmp_path, algorithm):
    from rlbus.weights import verified_mapping

    folder, checksum = _publish(tmp_path, algorithm)
    mapping = verified_mapping(str(folder), checksum)
    assert bytes(mapping) == weights_file(str(folder)).read_bytes()
    mapping.close()


def _flip_last_byte(path):
    with path.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def _truncate(path):
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 16)


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, _empty])
@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_a_corrupt_truncated_or_empty_file_is_refused_by_both_readers(tmp_path, algorithm,
                                                                     damage):
    from rlbus.weights import verified_mapping

    folder, checksum = _publish(tmp_path, algorithm)
    damage(weights_file(str(folder)))
    with pytest.raises(ChecksumMismatchError):
        verified_mapping(str(folder), checksum)
    with pytest.raises(ChecksumMismatchError):
        verified_weights(str(folder), checksum)


def test_a_checksum_of_an_unknown_algorithm_is_refused(tmp_path):
    from rlbus.weights import verified_mapping

    folder, checksum = _publish(tmp_path, "sha256")
    with pytest.raises(ChecksumMismatchError, match="md5"):
        verified_mapping(str(folder), f"md5:{checksum}")


def test_the_index_refuses_headers_that_do_not_tile_the_file(tmp_path):
    import json
    import struct

    from rlbus.weights import safetensors_index

    def file(header, data=16):
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + bytes(data)

    good = {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    assert safetensors_index(file(good))["x"].shape == (2, 2)
    bad = [
        file(good, data=20),  # trailing bytes
        file(good, data=12),  # truncated
        file({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]}}, 20),  # gap
        file({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}),  # size
        file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),  # overlap
        file({"x": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}),  # dtype
        file({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}),
        file({"x": "nonsense"}), b"\x00" * 4, struct.pack("<Q", 1 << 40) + b"{}",
    ]
    for data in bad:
        with pytest.raises(ChecksumMismatchError, match="not a safetensors file"):
            safetensors_index(data)


def test_a_version_written_into_a_preallocated_file_is_the_same_file(tmp_path):
    from rlbus.client.tensors import preallocate, prepare, write_version
    from rlbus.weights import file_checksum

    fresh, checksum = write_version(prepare(_tensors()), tmp_path / "a", 1, 1, set())
    preallocate(tmp_path / "b", 1, 1 << 16)  # longer than the file: cut to its length
    folder, again = write_version(prepare(_tensors()), tmp_path / "b", 1, 1, set())
    assert again == checksum == file_checksum(weights_file(str(folder)))
    assert weights_file(str(folder)).read_bytes() == weights_file(str(fresh)).read_bytes()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["v000001"]
