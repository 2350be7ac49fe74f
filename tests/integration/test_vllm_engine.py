"""RLBUS_ENGINE=vllm on vLLM's CPU backend, checked against the hf engine.

vLLM pins its own torch, so it lives in .venv-vllm (``make vllm-env``); these tests run from
the main venv's pytest and drive that interpreter in subprocesses. This file is also the
driver: ``.venv-vllm/bin/python tests/integration/test_vllm_engine.py engine SPEC OUT`` runs
the engine scenario, so only one module carries both halves. vLLM spawns its engine core,
hence the ``__main__`` guard and the light top-level imports.

One engine start serves the engine tests (a module fixture): fresh weights v1, then an
in-place reload to v2, then back to v1, which must give v1's tokens exactly; then in-flight
updates (a long generation that v2 lands in the middle of, with the KV cache kept and
recomputed) and LoRA (two adapter versions, each against the same engine loaded with the
merged weights, and misfits refused). The engine runs with ``inflight_updates`` and a LoRA
slot from the start, so the plain scenario covers that configuration too. The service test
starts a second engine, inside a real inference process on the real broker.

The venv (VLLM_VENV, default .venv-vllm) is missing: it is built (minutes, what ``make
vllm-env`` runs); with RLBUS_SKIP_VLLM=1 these tests are skipped instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
MAX_NEW = 12
LONG = 100
"""Tokens of the generation that spans an update."""
SWITCH_AFTER = 5
"""Tokens generated before the driver starts loading v2 into that generation."""
LORA_RANK, LORA_ALPHA, MAX_LORA_RANK = 4, 8.0, 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE_ENV = {  # small and quick: no torch.compile, a fixed 0.25 GiB KV cache
    "RLBUS_VLLM_ENFORCE_EAGER": "true",
    "RLBUS_VLLM_KV_CACHE_GIB": "0.25",
    "RLBUS_VLLM_MAX_MODEL_LEN": "256",
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        if os.environ.get("RLBUS_SKIP_VLLM") == "1":
            pytest.skip(f"{VLLM_PYTHON.parents[1]} is missing and RLBUS_SKIP_VLLM=1 "
                        "(make vllm-env builds it)")
        subprocess.run(["bash", str(REPO / "scripts" / "vllm_env.sh")], check=True, cwd=REPO)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two random-init Qwen2 folders (v1, v2) and both in the learner's weight store.

    v1's generation config gets a second eos id (:func:`_stop_token`), so that a greedy
    completion ends with "stop" for certain."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from rlbus.learner.chat_model import build_chat_model
    from rlbus.learner.store import save_weights

    root = tmp_path_factory.mktemp("vllm")
    v1, v2 = build_chat_model(root / "v1", seed=0), build_chat_model(root / "v2", seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 9, 17, 3, 30, 12)]
    hf1 = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32).eval()
    stop = _stop_token([_hf_greedy(hf1, p) for p in prompts])
    config = json.loads((v1 / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop["token"]]
    (v1 / "generation_config.json").write_text(json.dumps(config))
    store = root / "store"
    entries = {}
    for version, folder in ((1, v1), (2, v2)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        path, sha = save_weights(model, store, version, keep=2)
        entries[version] = {"uri": str(path), "checksum": sha}
    return {"v1": v1, "v2": v2, "prompts": prompts, "store": entries,
            "stop": stop}


@pytest.fixture(scope="module")
def lora(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two PEFT-format adapters over v1 (versions 3 and 4), the merged weights of each in a
    store of their own (5 and 6: W + alpha/r * B @ A, computed here), and a misfit: an
    adapter whose q_proj lora_A is one column short (vLLM would pad it without a word)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlbus.learner.store import save_weights
    from rlbus.weights import sha256_file

    root = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(models["v1"], dtype=torch.float32).eval()
    weights = {k: v for k, v in base.state_dict().items()
               if k.endswith(".weight") and k.rsplit(".", 2)[-2] in LORA_TARGETS}
    out: dict[str, Any] = {"adapters": {}, "merged": {}}
    for version, seed in ((3, 10), (4, 11)):
        tensors = _adapter(weights, seed)
        folder = _write_adapter(root / f"a{version}", tensors)
        out["adapters"][version] = {"uri": str(folder),
                                    "checksum": sha256_file(folder / "adapter_model.safetensors")}
        merged = AutoModelForCausalLM.from_pretrained(models["v1"], dtype=torch.float32)
        state = merged.state_dict()
        with torch.no_grad():
            for key in weights:
                stem = "base_model.model." + key.removesuffix(".weight")
                a, b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
                state[key].add_(LORA_ALPHA / LORA_RANK * (b @ a))
        path, sha = save_weights(merged, root / "merged", version + 2, keep=2)
        out["merged"][version + 2] = {"uri": str(path), "checksum": sha}
    bad = _adapter(weights, 12)
    key = next(k for k in bad if "q_proj.lora_A" in k)
    bad[key] = bad[key][:, :-1].contiguous()
    folder = _write_adapter(root / "misfit", bad)
    out["misfit"] = {"uri": str(folder),
                     "checksum": sha256_file(folder / "adapter_model.safetensors")}
    return out


def _adapter(weights: dict[str, Any], seed: int) -> dict[str, Any]:
    """PEFT's tensors of a rank LORA_RANK adapter on every targeted linear layer; B is not
    zero (PEFT starts it at zero), so the adapter changes the outputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, w in weights.items():  # w: (out, in)
        stem = "base_model.model." + key.removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = torch.randn(LORA_RANK, w.shape[1], generator=g) * 0.1
        tensors[f"{stem}.lora_B.weight"] = torch.randn(w.shape[0], LORA_RANK, generator=g) * 0.1
    return tensors


def _write_adapter(folder: Path, tensors: dict[str, Any]) -> Path:
    """An adapter folder as peft's ``save_pretrained`` writes it (safetensors + config)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA, "target_modules": LORA_TARGETS, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True}))
    return folder


@pytest.fixture(scope="module")
def engine_run(vllm_python: Path, models: dict[str, Any], lora: dict[str, Any],
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The engine scenario (:func:`drive_engine`) in .venv-vllm; its outputs as JSON."""
    folder = tmp_path_factory.mktemp("engine_run")
    spec = {"model_path": str(models["v1"]), "prompts": models["prompts"],
            "store": models["store"], "lora": lora}
    (folder / "spec.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(vllm_python), __file__, "engine", str(folder / "spec.json"), str(folder / "out.json")],
        env=_child_env(ENGINE_ENV), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    out: dict[str, Any] = json.loads((folder / "out.json").read_text())
    out["subprocess_s"] = time.perf_counter() - t0
    print(f"\nvllm engine run: {_figures(out)}")
    return out


def _stop_token(greedy: list[list[int]]) -> dict[str, int]:
    """A token that only one prompt's greedy completion emits, as late as can be (a random
    model repeats itself, so most completions hold one token); that one stops there."""
    for k in range(len(greedy[0]) - 1, -1, -1):
        for i, ids in enumerate(greedy):
            others = {t for j, o in enumerate(greedy) if j != i for t in o}
            if ids[k] not in ids[:k] and ids[k] not in others:
                return {"prompt": i, "token": ids[k], "length": k + 1}
    raise AssertionError(f"every token is shared: {greedy}")


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    from rlbus.processes import child_env

    return child_env(extra)


def _figures(out: dict[str, Any]) -> str:
    keys = ("start_s", "first_batch_s", "second_batch_s", "reload_s", "inflight_s", "lora_s",
            "subprocess_s")
    return ", ".join(f"{k}={out[k]:.2f}" if isinstance(out[k], float) else f"{k}={out[k]}"
                     for k in keys)


# --------------------------------------------------------------------------- hf reference


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                             top_k=None)
    ids: list[int] = out[0, len(prompt):].tolist()
    return ids


def _hf_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float,
                 top_p: float) -> list[float]:
    """Teacher-forced log p(completion token | prefix) under the distribution sampled from:
    logits / T, renormalised over the top-p nucleus (the smallest set of most likely tokens
    holding at least top_p of the mass)."""
    import torch

    ids = torch.tensor([prompt + completion])  # (1, T)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (N, V)
    probs, order = logits.softmax(-1).sort(-1, descending=True)  # (N, V)
    outside = probs.cumsum(-1) - probs >= top_p  # mass before it already reaches top_p
    logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(outside, -1e30))
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion).unsqueeze(-1))  # (N, 1)
    return lp.squeeze(-1).tolist()  # type: ignore[no-any-return]


def _deltas(model: Any, prompts: list[list[int]], gens: list[dict[str, Any]],
            temperature: float, top_p: float) -> list[float]:
    out = []
    for prompt, gen in zip(prompts, gens, strict=True):
        ref = _hf_logprobs(model, prompt, gen["ids"], temperature, top_p)
        out += [abs(a - b) for a, b in zip(gen["logprobs"], ref, strict=True)]
    return out


@pytest.fixture(scope="module")
def hf(models: dict[str, Any]) -> dict[int, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    return {v: AutoModelForCausalLM.from_pretrained(models[f"v{v}"], dtype=torch.float32).eval()
            for v in (1, 2)}


# --------------------------------------------------------------------------- tests


def test_generates_from_token_ids(engine_run: dict[str, Any], models: dict[str, Any]) -> None:
    stop = models["stop"]
    for run in ("fresh_v1", "sampled_v1"):
        for gen in engine_run[run]:
            assert 1 <= len(gen["ids"]) <= MAX_NEW
            assert len(gen["logprobs"]) == len(gen["ids"])
            assert all(lp <= 0.0 for lp in gen["logprobs"])
            ended = gen["ids"][-1] == stop["token"]
            assert gen["finish"] == ("stop" if ended else "length"), gen
            assert ended or len(gen["ids"]) == MAX_NEW
    stopped = engine_run["fresh_v1"][stop["prompt"]]
    assert (stopped["finish"], len(stopped["ids"])) == ("stop", stop["length"])
    # cancelled requests are aborted in vLLM, and the engine serves on
    assert engine_run["abort"] == {"cancelled": True, "unfinished_after": 0, "serves_after": True}


def test_logprobs_match_the_hf_engine(engine_run: dict[str, Any], models: dict[str, Any],
                                      hf: dict[int, Any]) -> None:
    """Greedy: the hf engine's own tokens and logprobs, on v1 and after loading v2 from the
    store; sampled at temperature 0.7, top-p 0.9 and at 1.3: the teacher-forced logprobs of
    vLLM's tokens under the distribution sampled from (what the hf engine reports too)."""
    hf_v1, hf_v2 = asyncio.run(_hf_engine_greedy(models))
    deltas = []
    for ref, got in ((hf_v1, engine_run["fresh_v1"]), (hf_v2, engine_run["reloaded_v2"])):
        for r, g in zip(ref, got, strict=True):
            assert (g["ids"], g["finish"]) == (r.completion_ids, r.finish_reason)
            deltas += [abs(a - b) for a, b in zip(g["logprobs"], r.logprobs, strict=True)]
    deltas += _deltas(hf[1], models["prompts"], engine_run["sampled_v1"], 0.7, 0.9)
    deltas += _deltas(hf[1], models["prompts"], engine_run["sampled_hot"], 1.3, 1.0)
    print(f"\n|Δ logprob| vllm vs hf over {len(deltas)} tokens: max {max(deltas):.2e}, "
          f"mean {sum(deltas) / len(deltas):.2e}")
    assert max(deltas) < 1e-3


async def _hf_engine_greedy(models: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    from rlbus.inference.engines import HFEngine
    from rlbus.inference.settings import InferenceSettings
    from rlbus.messages import Sampling

    engine = HFEngine(InferenceSettings(engine="hf", model_path=models["v1"], torch_threads=None))
    greedy = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    v1 = await engine.generate(models["prompts"], greedy)
    await engine.load(models["store"][2]["uri"], models["store"][2]["checksum"], 2)
    return v1, await engine.generate(models["prompts"], greedy)


def test_reload_changes_outputs_and_matches_a_fresh_engine(engine_run: dict[str, Any],
                                                           models: dict[str, Any],
                                                           hf: dict[int, Any]) -> None:
    fresh, v2, back = (engine_run[k] for k in ("fresh_v1", "reloaded_v2", "reloaded_v1"))
    assert [g["ids"] for g in v2] != [g["ids"] for g in fresh]
    # v2 from the store gives what a fresh v2 model gives (hf: the store's file and the
    # folder differ in which name of the tied embedding they keep)
    assert [g["ids"] for g in v2] == [_hf_greedy(hf[2], p)[: len(g["ids"])]
                                     for p, g in zip(models["prompts"], v2, strict=True)]
    # back to v1 from the store: token for token what the engine gave when fresh on v1
    assert [g["ids"] for g in back] == [g["ids"] for g in fresh]
    assert [g["finish"] for g in back] == [g["finish"] for g in fresh]
    worst = max(abs(a - b) for g, h in zip(back, fresh, strict=True)
                for a, b in zip(g["logprobs"], h["logprobs"], strict=True))
    assert worst < 1e-5
    assert engine_run["versions"] == [0, 2, 1]
    assert engine_run["bad_checksum"] == {"refused": True, "version": 1}


def _spanning_checks(run: dict[str, Any], long_v1: dict[str, Any]) -> int:
    """What a generation that v2 landed in must show, whatever the cache: it ran to the end
    without restarting (its v1 part is the v1 generation's own start), and its tokens say
    which version made them. Returns the switch point."""
    k = run["spans"][0][1]
    assert run["spans"] == [[1, k], [2, LONG - k]], run["spans"]
    assert SWITCH_AFTER <= k < LONG
    assert (len(run["ids"]), run["finish"]) == (LONG, "length")
    assert run["ids"][:k] == long_v1["ids"][:k]
    worst = max(abs(a - b) for a, b in zip(run["logprobs"][:k], long_v1["logprobs"][:k],
                                           strict=True))
    assert worst < 1e-5
    return k


def test_inflight_update_with_the_cache_recomputed(engine_run: dict[str, Any],
                                                  models: dict[str, Any],
                                                  hf: dict[int, Any]) -> None:
    """recompute: the pause preempts the request and vLLM prefills it again with v2, so the
    v2 part is exactly v2's greedy continuation of the prompt and the v1 part, and each
    part's logprobs are a fresh model's of that version."""
    run, long_v1 = engine_run["recompute"], engine_run["long_v1"]
    k = _spanning_checks(run, long_v1)
    cont = engine_run["continued_v2"]
    assert run["ids"][k:] == cont["ids"]
    worst = max(abs(a - b) for a, b in zip(run["logprobs"][k:], cont["logprobs"], strict=True))
    assert worst < 1e-4
    prompt = engine_run["long_prompt"]
    old = _hf_logprobs(hf[1], prompt, run["ids"], 1.0, 1.0)
    new = _hf_logprobs(hf[2], prompt, run["ids"], 1.0, 1.0)
    gaps = [abs(a - b) for a, b in zip(run["logprobs"], old[:k] + new[k:], strict=True)]
    print(f"\nrecompute: switch after {k} of {LONG} tokens, max |Δ logprob| vs fresh "
          f"v1/v2 {max(gaps):.2e}")
    assert max(gaps) < 1e-3


def test_inflight_update_with_the_cache_kept(engine_run: dict[str, Any],
                                             models: dict[str, Any],
                                             hf: dict[int, Any]) -> None:
    """keep (the default): the v1 part matches a fresh v1 engine; the v2 part is v2's
    weights over keys and values v1 computed, so it is not what a fresh v2 engine gives
    for that prefix (its logprobs are still those of the distribution each token was drawn
    from, what the learner's ratio needs)."""
    run = engine_run["keep"]
    k = _spanning_checks(run, engine_run["long_v1"])
    prompt = engine_run["long_prompt"]
    old = _hf_logprobs(hf[1], prompt, run["ids"], 1.0, 1.0)
    new = _hf_logprobs(hf[2], prompt, run["ids"], 1.0, 1.0)
    assert max(abs(a - b) for a, b in zip(run["logprobs"][:k], old[:k], strict=True)) < 1e-3
    gap = max(abs(a - b) for a, b in zip(run["logprobs"][k:], new[k:], strict=True))
    print(f"\nkeep: switch after {k} of {LONG} tokens, v2 part vs a fresh v2: {gap:.2e}")
    assert gap > 1e-3, "the kept cache should make the v2 part differ from a fresh v2"


def test_lora_adapters_match_the_merged_weights(engine_run: dict[str, Any]) -> None:
    """Base + adapter through a LoRA request gives the tokens and logprobs of the same
    engine loaded with the merged weights; the second version replaces the first in place
    (one adapter loaded), also inside a running generation, and a misfit is refused while
    the engine serves on."""
    got = engine_run["lora"]
    deltas = []
    for adapter, merged in (("v3", "merged_5"), ("v4", "merged_6")):
        for a, m in zip(got[adapter], got[merged], strict=True):
            assert (a["ids"], a["finish"]) == (m["ids"], m["finish"])
            deltas += [abs(x - y) for x, y in zip(a["logprobs"], m["logprobs"], strict=True)]
    print(f"\n|Δ logprob| adapter vs merged over {len(deltas)} tokens: max {max(deltas):.2e}")
    assert max(deltas) < 1e-4
    assert [g["ids"] for g in got["v3"]] != [g["ids"] for g in got["v4"]]
    assert [g["ids"] for g in got["v3"]] != [g["ids"] for g in engine_run["fresh_v1"]]
    assert got["loaded"] == [1]
    # v4 landed inside a generation on v3 and it ran on: v3's start, then v4's continuation
    run, k = got["spanning"], got["spanning"]["spans"][0][1]
    assert run["spans"] == [[3, k], [4, LONG - k]] and SWITCH_AFTER <= k < LONG
    assert run["ids"][:k] == got["long_v3"]["ids"][:k]
    assert run["ids"][k:] == got["continued_v4"]["ids"]
    worst = max(abs(a - b) for a, b in zip(run["logprobs"], got["long_v3"]["logprobs"][:k]
                                           + got["continued_v4"]["logprobs"], strict=True))
    assert worst < 1e-4
    refused = got["refused"]
    assert refused["shape"].startswith("WeightsMismatchError") and "q_proj.lora_A" in \
        refused["shape"]
    assert refused["config"].startswith("WeightsMismatchError")
    assert "r 4, announced rank 2" in refused["config"]
    assert refused["checksum"].startswith("ChecksumMismatchError")
    assert got["version_after"] == 4
    for after, v4 in zip(got["after_refusals"], got["v4"], strict=True):  # still adapter v4
        assert after["ids"] == v4["ids"]
        assert max(abs(x - y) for x, y in zip(after["logprobs"], v4["logprobs"],
                                              strict=True)) < 1e-5


@pytest.mark.kafka
def test_inference_service_end_to_end(vllm_python: Path, models: dict[str, Any],
                                      engine_run: dict[str, Any], kafka_bootstrap: str,
                                      unique_name: Any, tmp_path: Path) -> None:
    """A real inference process with RLBUS_ENGINE=vllm: it loads v2 announced on the weights
    topic, answers step requests with v2's tokens, and drains on SIGTERM."""
    from rlbus.processes import spawn_process

    env = _child_env({**ENGINE_ENV, "RLBUS_ENGINE": "vllm", "RLBUS_MODEL_PATH": str(models["v1"]),
                      "RLBUS_KAFKA__BOOTSTRAP": kafka_bootstrap,
                      "RLBUS_TOPICS__PREFIX": unique_name("vllm")})
    subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "topics", "create"],
                   env=env, check=True, capture_output=True)
    asyncio.run(_announce(env, models["store"][2]))
    log = tmp_path / "inference-0.log"
    t0 = time.perf_counter()
    proc = spawn_process([str(vllm_python), "-m", "rlbus.inference"], env, log)
    try:
        _wait_for(log, "inference-0 ready", proc, timeout=300)
        ready_s = time.perf_counter() - t0
        results = asyncio.run(_ask(env, models["prompts"]))
        print(f"\nvllm service: ready in {ready_s:.1f}s, answered in "
              f"{time.perf_counter() - t0 - ready_s:.1f}s")
        for result, want in zip(results, engine_run["reloaded_v2"], strict=True):
            assert (result.policy_version, result.finish_reason) == (2, want["finish"])
            assert result.completion_ids == want["ids"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)


def _settings(env: dict[str, str]) -> tuple[Any, Any]:
    from rlbus.settings import KafkaSettings, TopicSettings
    from rlbus.topics import Topics

    topics = TopicSettings(prefix=env["RLBUS_TOPICS__PREFIX"])
    return KafkaSettings(bootstrap=env["RLBUS_KAFKA__BOOTSTRAP"]), Topics(topics)


async def _announce(env: dict[str, str], entry: dict[str, str]) -> None:
    from rlbus.messages import WeightVersion
    from rlbus.transport import KafkaBus

    kafka, topics = _settings(env)
    bus = KafkaBus(kafka, dlq_topic=None, service="test")
    producer = await bus.producer()
    await producer.send(topics.weights, WeightVersion(model="policy", version=2, step=2,
                                                      **entry), key="policy", partition=0)
    await bus.close()


async def _ask(env: dict[str, str], prompts: list[list[int]]) -> list[Any]:
    from rlbus.messages import Sampling, StepRequest, StepResult
    from rlbus.transport import KafkaBus

    kafka, topics = _settings(env)
    bus = KafkaBus(kafka, dlq_topic=None, service="test")
    results = await bus.consumer([topics.results], StepResult, assign=[(topics.results, 0)])
    producer = await bus.producer()
    greedy = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    for i, ids in enumerate(prompts):
        await producer.send(topics.steps, StepRequest(
            request_id=f"e{i}/t0", episode_id=f"e{i}", turn=0, input_ids=ids, sampling=greedy,
            reply_partition=0, min_version=2), key=f"e{i}")
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 180
    while len(got) < len(prompts) and time.monotonic() < deadline:
        for d in await results.poll(1.0):
            got[d.message.episode_id] = d.message
    await bus.close()
    assert len(got) == len(prompts), sorted(got)
    return [got[f"e{i}"] for i in range(len(prompts))]


# --------------------------------------------------------------------------- driver (.venv-vllm)


async def drive_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Fresh on v1 (greedy, sampled, abort), reload v2, bad checksum, reload v1."""
    from rlbus.inference.engines import make_engine
    from rlbus.inference.settings import InferenceSettings
    from rlbus.messages import Sampling
    from rlbus.weights import ChecksumMismatchError

    prompts, store = spec["prompts"], spec["store"]
    greedy = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    out: dict[str, Any] = {"versions": []}
    t0 = time.perf_counter()
    engine = make_engine(InferenceSettings(engine="vllm", model_path=spec["model_path"],
                                           inflight_updates=True,
                                           vllm_max_lora_rank=MAX_LORA_RANK))
    out["start_s"] = time.perf_counter() - t0

    async def timed(key: str, sampling: Sampling) -> list[dict[str, Any]]:
        t = time.perf_counter()
        gens = await engine.generate(prompts, sampling)
        out[key] = time.perf_counter() - t
        out["versions"].append(engine.version)
        return [{"ids": g.completion_ids, "logprobs": g.logprobs, "finish": g.finish_reason}
                for g in gens]

    out["fresh_v1"] = await timed("first_batch_s", greedy)
    out["sampled_v1"] = await timed("second_batch_s", Sampling(temperature=0.7, top_p=0.9,
                                                               max_new_tokens=MAX_NEW))
    out["sampled_hot"] = await timed("hot_batch_s", Sampling(temperature=1.3,
                                                             max_new_tokens=MAX_NEW))
    del out["versions"][-2:]
    out["abort"] = await _abort(engine, prompts)
    t = time.perf_counter()
    await engine.load(store["2"]["uri"], store["2"]["checksum"], 2)
    out["reload_s"] = time.perf_counter() - t
    out["reloaded_v2"] = await timed("v2_batch_s", greedy)
    try:
        await engine.load(store["1"]["uri"], store["2"]["checksum"], 1)
        refused = False
    except ChecksumMismatchError:
        refused = True
    await engine.load(store["1"]["uri"], store["1"]["checksum"], 1)
    out["reloaded_v1"] = await timed("v1_batch_s", greedy)
    out["bad_checksum"] = {"refused": refused, "version": engine.version}
    t = time.perf_counter()
    out.update(await _inflight(engine, spec))
    out["inflight_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out["lora"] = await _lora(engine, spec)
    out["lora_s"] = time.perf_counter() - t
    await engine.close()
    return out


def _as_json(gens: list[Any]) -> list[dict[str, Any]]:
    return [{"ids": g.completion_ids, "logprobs": g.logprobs, "finish": g.finish_reason,
             "spans": g.version_spans} for g in gens]


async def _inflight(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """From v1: a long greedy generation; the same with v2 loaded once it has
    SWITCH_AFTER tokens, with the cache kept, then (from v1 again) recomputed; and v2's
    greedy continuation of the recomputed run's v1 part. eos is ignored (a random model
    may stop anywhere), as the hf engine's test does."""
    import functools

    from vllm.sampling_params import SamplingParams

    from rlbus.messages import Sampling

    v1, v2 = spec["store"]["1"], spec["store"]["2"]
    prompt = spec["prompts"][4]
    long = Sampling(temperature=0.0, max_new_tokens=LONG)
    params = engine._params
    engine._params = functools.partial(SamplingParams, ignore_eos=True)
    out: dict[str, Any] = {"long_prompt": prompt}
    (out["long_v1"],) = _as_json(await engine.generate([prompt], long))
    for kv in ("keep", "recompute"):
        engine.inflight_kv = kv
        out[kv] = await _spanning(engine, prompt, lambda: engine.load(v2["uri"],
                                                                      v2["checksum"], 2))
        if kv == "keep":
            await engine.load(v1["uri"], v1["checksum"], 1)
    out["continued_v2"] = await _continued(engine, prompt, out["recompute"])
    engine._params = params
    return out


async def _spanning(engine: Any, prompt: list[int], load: Any) -> dict[str, Any]:
    """A greedy LONG-token generation with ``load()`` run once it has SWITCH_AFTER tokens."""
    from rlbus.messages import Sampling

    task = asyncio.ensure_future(engine.generate([prompt], Sampling(temperature=0.0,
                                                                   max_new_tokens=LONG)))
    await _until_generated(engine, SWITCH_AFTER)
    await load()
    (run,) = _as_json(await task)
    return run


async def _continued(engine: Any, prompt: list[int], run: dict[str, Any]) -> dict[str, Any]:
    """The engine's greedy continuation of ``prompt`` plus the first span of ``run``."""
    from rlbus.messages import Sampling

    k = run["spans"][0][1]
    (cont,) = _as_json(await engine.generate(
        [prompt + run["ids"][:k]], Sampling(temperature=0.0, max_new_tokens=LONG - k)))
    return cont


async def _until_generated(engine: Any, n: int) -> None:
    """Wait until a running request has ``n`` tokens (vLLM's output processor counts them
    as they come, whatever the output kind)."""
    deadline = time.monotonic() + 60
    while max((s.detokenizer.num_output_tokens()
               for s in engine.llm.output_processor.request_states.values()), default=0) < n:
        assert time.monotonic() < deadline, "the long generation never reached the switch"
        await asyncio.sleep(0.001)


async def _lora(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """On v1: adapter v3, adapter v4 (in place of v3, loaded inside a long generation),
    three misfits refused, then the merged weights of each adapter as full versions 5
    and 6."""
    import functools

    from vllm.sampling_params import SamplingParams

    from rlbus.errors import WeightsMismatchError
    from rlbus.messages import LoraAdapter, Sampling
    from rlbus.weights import ChecksumMismatchError

    prompts, lora = spec["prompts"], spec["lora"]
    greedy = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    shape = LoraAdapter(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=LORA_TARGETS)
    v1 = spec["store"]["1"]
    await engine.load(v1["uri"], v1["checksum"], 1)
    out: dict[str, Any] = {}
    a3, a4 = lora["adapters"]["3"], lora["adapters"]["4"]
    await engine.load_adapter(a3["uri"], a3["checksum"], 3, shape)
    out["v3"] = _as_json(await engine.generate(prompts, greedy))
    # adapter v4 lands inside a running generation on v3 (recompute), as new weights do
    params, engine.inflight_kv = engine._params, "recompute"
    engine._params = functools.partial(SamplingParams, ignore_eos=True)
    prompt = spec["prompts"][4]
    (out["long_v3"],) = _as_json(await engine.generate(
        [prompt], Sampling(temperature=0.0, max_new_tokens=LONG)))
    out["spanning"] = await _spanning(
        engine, prompt, lambda: engine.load_adapter(a4["uri"], a4["checksum"], 4, shape))
    out["continued_v4"] = await _continued(engine, prompt, out["spanning"])
    engine._params = params
    out["v4"] = _as_json(await engine.generate(prompts, greedy))
    out["loaded"] = sorted(await engine.llm.list_loras())
    refused = {}
    misfit = lora["misfit"]
    for why, (uri, checksum, adapter) in {
        "shape": (misfit["uri"], misfit["checksum"], shape),
        "config": (a4["uri"], a4["checksum"], shape.model_copy(update={"rank": 2})),
        "checksum": (a4["uri"], misfit["checksum"], shape),
    }.items():
        try:
            await engine.load_adapter(uri, checksum, 7, adapter)
            refused[why] = "loaded"
        except (WeightsMismatchError, ChecksumMismatchError) as exc:
            refused[why] = f"{type(exc).__name__}: {exc}"
    out["refused"] = refused
    out["after_refusals"] = _as_json(await engine.generate(prompts, greedy))
    out["version_after"] = engine.version
    for version in ("5", "6"):
        m = lora["merged"][version]
        await engine.load(m["uri"], m["checksum"], int(version))
        out[f"merged_{version}"] = _as_json(await engine.generate(prompts, greedy))
    return out


async def _abort(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    from rlbus.messages import Sampling

    long = Sampling(temperature=1.0, max_new_tokens=200)
    task = asyncio.ensure_future(engine.generate(prompts, long))
    await asyncio.sleep(0.1)
    task.cancel()
    cancelled = False
    try:
        await task
    except asyncio.CancelledError:
        cancelled = True
    for _ in range(50):  # aborts reach the engine core asynchronously
        if engine.llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.1)
    unfinished = engine.llm.get_num_unfinished_requests()
    after = await engine.generate(prompts[:1], Sampling(temperature=0.0, max_new_tokens=2))
    return {"cancelled": cancelled, "unfinished_after": unfinished,
            "serves_after": len(after[0].completion_ids) == 2}


if __name__ == "__main__":
    command, spec_path, out_path = sys.argv[1:4]
    assert command == "engine", command
    result = asyncio.run(drive_engine(json.loads(Path(spec_path).read_text())))
    Path(out_path).write_text(json.dumps(result))
