"""LoRA in the learner: only the adapter trains, settings that do not fit the model are a
clear error at start, the checkpoint resumes the adapter and its optimizer, and a publish
writes the adapter's folder alone (PEFT's format, much smaller than the model)."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlbus.client import ClientSettings, RolloutClient
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.trainer import Trainer
from rlbus.learner.work import Work
from rlbus.messages import LoraAdapter
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from rlbus.weights import ADAPTER_CONFIG, ADAPTER_FILE, WEIGHTS_FILE, verified_weights
from tests.support.lora import tiny_qwen2

WORK = [Work([3, 4, 5, 6, 7], [False, False, True, True, True], [0.0, 0.0, -1.0, -2.0, -1.5],
             1.0)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def trainer(base: Path, **lora: object) -> Trainer:
    return Trainer(LearnerSettings(model_path=base, torch_threads=None,
                                   lora={"rank": 4, **lora}))


def test_a_lora_step_changes_only_the_adapter(base: Path) -> None:
    t = trainer(base)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.update(WORK)
    t.update(WORK)  # B starts at zero: A's gradient appears from the second step
    changed = {k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert {k for k in before if ".lora_A." in k} <= changed
    assert t.adapter == LoraAdapter(rank=4, alpha=8.0, target_modules=[
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(t.cfg.lr)  # the default
    assert trainer(base, lr=5e-4).optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


@pytest.mark.parametrize(("lora", "says"), [
    ({"rank": 33}, r"RLBUS_LORA__RANK=33 is wider than .*k_proj \(16 features\)"),
    ({"target_modules": ["q_proj", "qkv_proj"]},
     "RLBUS_LORA__TARGET_MODULES: qkv_proj is no linear layer of the model; it has "
     "down_proj, gate_proj, k_proj"),
])
def test_settings_that_do_not_fit_the_model_are_a_clear_error_at_start(
        base: Path, lora: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        trainer(base, **lora)


def test_lora_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBUS_LORA__RANK", "8")
    monkeypatch.setenv("RLBUS_LORA__TARGET_MODULES", "q_proj,v_proj")
    s = LearnerSettings().lora
    assert (s.rank, s.target_modules, s.enabled) == (8, ["q_proj", "v_proj"], True)
    assert not LearnerSettings(lora={"rank": 0}).lora.enabled


def test_a_checkpoint_resumes_the_adapter_and_its_optimizer(base: Path) -> None:
    t = trainer(base, target_modules=["q_proj", "v_proj"])
    t.update(WORK)
    state = copy.deepcopy(t.state())  # as saved: not the live tensors
    assert state.model and all(".lora_" in k for k in state.model)
    again = trainer(base, target_modules=["q_proj", "v_proj"])
    again.restore(state)
    t.update(WORK)
    again.update(WORK)  # the same step from the same adapter and moments
    for k, v in t.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[k], v)
    with pytest.raises(ValueError, match="not this LoRA adapter"):
        trainer(base).restore(state)  # other target modules: other tensors


async def test_a_publish_writes_only_the_adapter_folder(base: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    t = trainer(base)
    t.update(WORK)
    topics = TopicSettings(prefix="lora", partitions=1, result_partitions=1)
    bus = MemoryBus(memory_broker(topics))
    client = await RolloutClient.connect(ClientSettings(
        topics=topics, weights_dir=tmp_path / "store", model_path=base), bus)
    with caplog.at_level(logging.INFO):
        event = await client.publish_weights(t.weights())
        second = await client.publish_weights(t.weights())
    await bus.close()
    assert event.adapter == t.adapter and second.version == 2
    only_the_adapter(t, base, event.uri, event.checksum, caplog.text)


def only_the_adapter(t: Trainer, base: Path, uri: str, checksum: str, log: str) -> None:
    folder = Path(uri)
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE]
    size = verified_weights(uri, checksum).stat().st_size
    assert f"published LoRA adapter v1: {size} bytes (rank 4)" in log
    assert size * 4 < (base / WEIGHTS_FILE).stat().st_size  # r=4 of a hidden size of 32
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    # PEFT reads it as it is, to the adapter the learner trained
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    trained = dict(t.model.named_parameters())
    for name, p in peft.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(p, trained[name])
    assert set(load_file(folder / ADAPTER_FILE)) == set(t.weights().tensors)
