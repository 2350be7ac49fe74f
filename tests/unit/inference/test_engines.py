"""In-flight weight updates. The hf engine's: a generation that spans a weight update
finishes without restarting, its tokens carry both versions, and each version's part has
the logprobs a fresh engine gives (the new part exactly with ``inflight_kv`` recompute;
with keep, the new part's cache came from the old weights, and its logprobs differ). The
synthetic engine's latency model: each token dated by the version held when its modelled
decode step began."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbus.inference import engines
from rlbus.inference.engines import HFEngine, SyntheticEngine
from rlbus.inference.settings import InferenceSettings, SyntheticEngineSettings
from rlbus.learner.store import save_weights
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import Sampling
from tests.polling import wait_until

PROMPT = [3, 8, 9, 14, 5]
SWITCH_AT = 5
"""Tokens decoded by v0 before v1 lands."""
LONG = 60


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("inflight")
    v0, v1 = build_tiny_model(root / "v0", seed=0), build_tiny_model(root / "v1", seed=1)
    model = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32)
    path, sha = save_weights(model, root / "store", 1, keep=2)
    return {"v0": v0, "v1": v1, "uri": str(path), "checksum": sha}


def engine(folder: Path, eos: bool = False, **kw: Any) -> HFEngine:
    e = HFEngine(InferenceSettings(model_path=folder, torch_threads=None, **kw))
    if not eos:
        e.eos_ids = set()  # a random model may stop anywhere: every completion runs LONG
    return e


def teacher_forced(folder: Path, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Each completion token's logprob under a fresh model, given everything before it."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, prompt_len - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, x[0, prompt_len:, None]).squeeze(-1)


def hold_at_step(e: HFEngine, step: int) -> threading.Event:
    """Make the decode loop wait inside step ``step`` until a load is waiting at the step
    boundary, so the switch lands after exactly ``step`` tokens. Set: step reached."""
    reached = threading.Event()
    pick, calls = e._pick, [0]

    def held(logits: Any, sampling: Sampling) -> Any:
        calls[0] += 1
        if calls[0] == step:
            reached.set()
            deadline = time.monotonic() + 30
            while not e._turnstile.locked() and time.monotonic() < deadline:
                time.sleep(0.001)
        return pick(logits, sampling)

    e._pick = held  # type: ignore[method-assign]
    return reached


async def spanning_generation(models: dict[str, Any], kv: str) -> tuple[HFEngine, Any]:
    import asyncio

    e = engine(models["v0"], inflight_updates=True, inflight_kv=kv)
    reached = hold_at_step(e, SWITCH_AT)
    steps_before = e.decode_steps
    task = asyncio.create_task(e.generate([PROMPT], Sampling(temperature=0.0,
                                                             max_new_tokens=LONG)))
    await wait_until(reached.is_set, "the decode loop reaching the switch step")
    async with e.step_boundary():
        await e.load(models["uri"], models["checksum"], 1)
    (c,) = await task
    # one forward per token: nothing was generated twice (no restart)
    assert e.decode_steps - steps_before == LONG
    return e, c


def test_the_own_decode_loop_gives_what_generate_gives(models: dict[str, Any]) -> None:
    import asyncio

    prompts = [PROMPT, [7, 7, 2], [4, 9, 10, 11, 12, 13, 3, 2]]  # left padding differs
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    ref = asyncio.run(engine(models["v0"], eos=True).generate(prompts, greedy))
    got = asyncio.run(engine(models["v0"], eos=True, inflight_updates=True
                             ).generate(prompts, greedy))
    for r, g in zip(ref, got, strict=True):
        assert (g.completion_ids, g.finish_reason) == (r.completion_ids, r.finish_reason)
        assert g.version_spans == [(0, len(r.completion_ids))]
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_the_own_loop_reports_the_distribution_it_sampled_from(models: dict[str, Any],
                                                               top_p: float) -> None:
    import asyncio

    e = engine(models["v0"], inflight_updates=True)
    (c,) = asyncio.run(e.generate([PROMPT], Sampling(temperature=0.8, top_p=top_p,
                                                      max_new_tokens=10)))
    plain = teacher_forced(models["v0"], PROMPT + c.completion_ids, len(PROMPT))
    model = AutoModelForCausalLM.from_pretrained(models["v0"], dtype=torch.float32).eval()
    x = torch.tensor([PROMPT + c.completion_ids])
    with torch.no_grad():
        scaled = model(x).logits[0, len(PROMPT) - 1 : -1] / 0.8
    at_t = scaled.log_softmax(-1).gather(-1, x[0, len(PROMPT):, None]).squeeze(-1)
    got = torch.tensor(c.logprobs)
    if top_p == 1.0:
        torch.testing.assert_close(got, at_t, atol=1e-5, rtol=1e-5)
    else:  # renormalised over the nucleus: at least the untruncated logprob
        assert bool((got >= at_t - 1e-5).all())
    assert not torch.equal(got, plain)


async def test_a_generation_spanning_an_update_recomputed_matches_each_version(
        models: dict[str, Any]) -> None:
    e, c = await spanning_generation(models, "recompute")
    assert c.version_spans == [(0, SWITCH_AT), (1, LONG - SWITCH_AT)]
    assert len(c.completion_ids) == LONG and e.version == 1
    ids = PROMPT + c.completion_ids
    got = torch.tensor(c.logprobs)
    old = teacher_forced(models["v0"], ids, len(PROMPT))
    new = teacher_forced(models["v1"], ids, len(PROMPT))
    torch.testing.assert_close(got[:SWITCH_AT], old[:SWITCH_AT], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[SWITCH_AT:], new[SWITCH_AT:], atol=1e-4, rtol=1e-4)
    # the v0 part is exactly what a fresh v0 engine generates: it did not restart
    fresh = engine(models["v0"])
    (ref,) = await fresh.generate([PROMPT], Sampling(temperature=0.0, max_new_tokens=SWITCH_AT))
    assert c.completion_ids[:SWITCH_AT] == ref.completion_ids


async def test_a_generation_spanning_an_update_with_the_cache_kept(
        models: dict[str, Any]) -> None:
    """keep (PipelineRL's choice, the default): the v0 part matches a fresh v0 engine; the
    v1 part is v1's weights over keys and values v0 computed for the first tokens, so it
    is NOT what a fresh v1 engine gives for that prefix. Its logprobs are still those of
    the distribution each token was drawn from (what the learner's ratio needs)."""
    _, c = await spanning_generation(models, "keep")
    assert c.version_spans == [(0, SWITCH_AT), (1, LONG - SWITCH_AT)]
    ids = PROMPT + c.completion_ids
    got = torch.tensor(c.logprobs)
    old = teacher_forced(models["v0"], ids, len(PROMPT))
    new = teacher_forced(models["v1"], ids, len(PROMPT))
    torch.testing.assert_close(got[:SWITCH_AT], old[:SWITCH_AT], atol=1e-4, rtol=1e-4)
    gap = (got[SWITCH_AT:] - new[SWITCH_AT:]).abs().max().item()
    assert gap > 1e-3, "the kept cache should make the new part differ from a fresh v1"


def synthetic(**kw: Any) -> SyntheticEngine:
    return SyntheticEngine(InferenceSettings(engine="synthetic", inflight_updates=True,
                                             synthetic=SyntheticEngineSettings(**kw)))


def test_the_synthetic_engine_dates_each_token_by_its_modelled_decode_step() -> None:
    e = synthetic(base_ms=10, per_token_ms=20, completion_tokens=8)
    e._loads.extend([(100.0, 1), (100.055, 2), (100.500, 3)])
    # steps begin at +10, +30, +50, +70 ... ms: v1 until the load at +55 ms, then v2
    assert e._spans(100.0, 1, 8) == [(1, 3), (2, 5)]
    assert e._spans(100.0, 1, 2) == [(1, 2)]


async def test_a_synthetic_generation_spanning_a_load_reports_both_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine's clock, 10 ms a reading: the load lands 10 ms into the first 50 ms decode
    # step however long this machine takes between the two (a busy one can take 50 ms)
    readings = itertools.count()
    monkeypatch.setattr(engines, "time",
                        types.SimpleNamespace(monotonic=lambda: 100 + next(readings) / 100))
    e = synthetic(base_ms=0, per_token_ms=50, completion_tokens=8)
    generating = asyncio.create_task(e.generate([PROMPT, PROMPT], Sampling(max_new_tokens=8)))
    await asyncio.sleep(0)  # the batch has begun its first decode step, at v0
    await e.load("unused", "unused", 1)
    for c in await generating:
        assert c.version_spans == [(0, 1), (1, 7)]
        assert len(c.completion_ids) == 8


async def test_the_synthetic_engine_without_inflight_updates_reports_no_spans() -> None:
    e = SyntheticEngine(InferenceSettings(engine="synthetic"))
    generating = asyncio.create_task(e.generate([PROMPT], Sampling(max_new_tokens=8)))
    await asyncio.sleep(0)
    await e.load("unused", "unused", 1)
    assert [c.version_spans for c in await generating] == [None]
