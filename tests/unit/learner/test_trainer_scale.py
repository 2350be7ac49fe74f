"""The learner's real-model-scale paths give the one-batch fp32 answers: micro-batching with
gradient accumulation, chunked scoring, gradient checkpointing, bf16 autocast, temperature."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbus.inference.engines import HFEngine
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.grpo import score_tokens
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.learner.trainer import Trainer, Work, micro_batches
from rlbus.messages import Sampling


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


def work(n: int = 7, seed: int = 0, vocab: int = 40) -> list[Work]:
    """Sequences of different lengths: a prompt, then sampled and observed spans."""
    rng = random.Random(seed)
    out: list[Work] = []
    for _ in range(n):
        length = rng.randint(6, 30)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        sampled = [i >= 3 and rng.random() < 0.6 for i in range(length)]
        logprobs = [-rng.uniform(0.5, 4.0) if s else 0.0 for s in sampled]
        out.append(Work(ids, sampled, logprobs, rng.choice([-1.5, -0.5, 0.7, 1.2])))
    return out


def trainer(folder: Path, **settings: Any) -> Trainer:
    return Trainer(LearnerSettings(model_path=folder, torch_threads=None, **settings))


def grads(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def assert_same_step(a: Trainer, b: Trainer, batch: list[Work], atol: float = 1e-6) -> None:
    """Same loss, same gradients (clipped: so same norm too) and same parameters after
    (to a tenth of the step size: Adam's first steps divide by |g|, so a gradient of 1e-9
    against 1e-10 on a row the batch barely touches moves it by lr either way)."""
    sa, sb = a.optimize(batch), b.optimize(batch)
    assert sa.loss == pytest.approx(sb.loss, abs=atol, rel=1e-5)
    assert sa.grad_norm == pytest.approx(sb.grad_norm, rel=1e-5)
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=1e-4, msg=name)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("norm", ["token", "sequence", "dr_grpo"])
def test_micro_batches_give_the_one_batch_update(folder: Path, norm: str) -> None:
    common = {"loss_norm": norm, "dr_grpo_max_tokens": 50, "max_grad_norm": 1e9}
    whole = trainer(folder, **common)
    micro = trainer(folder, **common, micro_batch_tokens=40)
    batch = work()
    for _ in range(2):  # the second step from the updated weights and Adam state
        assert_same_step(whole, micro, batch)
    assert (micro.optimize(batch).micro_batches or 0) > 3


def test_the_entropy_bonus_accumulates_like_the_loss(folder: Path) -> None:
    whole = trainer(folder, entropy_coef=0.05)
    micro = trainer(folder, entropy_coef=0.05, micro_batch_tokens=30)
    assert_same_step(whole, micro, work(seed=1))
    fresh = trainer(folder, entropy_coef=0.05)
    stats = fresh.optimize(work(seed=1))
    assert stats.entropy is not None
    assert 0.0 < stats.entropy <= torch.log(torch.tensor(fresh.model.config.vocab_size)).item()
    assert trainer(folder).optimize(work(seed=1)).entropy is None  # not computed when unused


def test_dr_grpo_divides_by_its_constant_not_the_batch_width(folder: Path) -> None:
    short, wide = work(n=2, seed=2)[:1], work(n=2, seed=2)
    wide = [short[0], Work(wide[1].ids + [5] * 40, wide[1].sampled + [False] * 40,
                           wide[1].logprobs + [0.0] * 40, wide[1].advantage)]
    # the same sequences at width ~20 or ~60: the first one's share of the loss is the same
    one = trainer(folder, loss_norm="dr_grpo", dr_grpo_max_tokens=64).optimize(short).loss
    both = trainer(folder, loss_norm="dr_grpo", dr_grpo_max_tokens=64)
    other = trainer(folder, loss_norm="dr_grpo", dr_grpo_max_tokens=64).optimize(wide[1:]).loss
    # sum / (B * 64): with B = 2 each sequence's sum is halved
    assert both.optimize(wide).loss == pytest.approx((one + other) / 2, rel=1e-5)


def test_micro_batches_respect_the_budget() -> None:
    lengths = [3, 5, 5, 8, 9, 20, 50]
    parts = micro_batches(lengths, 20)
    assert [i for p in parts for i in p] == list(range(len(lengths)))
    for p in parts:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 20
    assert parts[-1] == [6]  # longer than the budget: alone
    assert micro_batches(lengths, None) == [list(range(7))]


def test_chunked_scoring_equals_the_models_logits(folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[3, 8, 9, 12, 4, 7, 20], [5, 6, 7, 8, 0, 0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    where = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0]])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    full = logits.log_softmax(-1)
    expected = full.gather(-1, ids[:, 1:, None]).squeeze(-1) * where
    expected_entropy = -(full.exp() * full).sum(-1) * where
    lp, ent = score_tokens(model, ids, mask, entropy=True, where=where, chunk_tokens=3)
    assert ent is not None
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, expected_entropy, atol=1e-5, rtol=1e-5)
    # gradients through the recomputed chunks equal those through the full logits
    (lp.sum() + ent.sum()).backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
    ((logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - (logits.exp() * logits).sum(-1))
     * where).sum().backward()
    for a, p in zip(chunked, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_update(folder: Path) -> None:
    assert_same_step(trainer(folder), trainer(folder, gradient_checkpointing=True), work(seed=3))


def test_bf16_autocast_keeps_fp32_master_weights_and_close_gradients(folder: Path) -> None:
    fp32, bf16 = trainer(folder), trainer(folder, dtype="bfloat16")
    batch = work(seed=4)
    a, b = fp32.optimize(batch), bf16.optimize(batch)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    moments = [t for state in bf16.optimizer.state.values() for t in state.values()
               if t.dim() > 0]  # exp_avg and exp_avg_sq of every parameter
    assert len(moments) == 2 * len(list(bf16.model.parameters()))
    assert all(t.dtype == torch.float32 for t in moments)
    assert b.loss == pytest.approx(a.loss, abs=0.05)
    ga, gb = grads(fp32), grads(bf16)
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in ga.values()]),
        torch.cat([g.flatten() for g in gb.values()]), dim=0)
    assert cos > 0.99  # bf16 keeps 8 bits of mantissa: the same direction, not the same bits


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_learner_scores_the_engines_samples_as_the_engine_did(folder: Path,
                                                              temperature: float) -> None:
    """On-policy at any temperature: the trainer's logprob of each sampled token equals the
    one the hf engine reported, so the importance ratio starts at exactly 1."""
    engine = HFEngine(InferenceSettings(engine="hf", model_path=folder, torch_threads=None))
    prompts = [[3, 8, 9], [5, 6, 7, 11]]
    sampling = Sampling(temperature=temperature, max_new_tokens=6)
    completions = asyncio.run(engine.generate(prompts, sampling))
    t = trainer(folder, temperature=temperature)
    for prompt, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + c.completion_ids])
        with torch.no_grad():
            lp, _ = t.scorer(ids, torch.ones_like(ids), torch.ones(1, ids.shape[1] - 1))
        torch.testing.assert_close(lp[0, len(prompt) - 1 :], torch.tensor(c.logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_temperature_zero_is_refused_for_training(folder: Path) -> None:
    with pytest.raises(ValueError, match="temperature"):
        LearnerSettings(model_path=folder, temperature=0.0)


def test_hf_engine_reports_the_nucleus_it_sampled_from(tmp_path: Path) -> None:
    """top_p < 1: each logprob is under the renormalised nucleus (so at least the untruncated
    one at T, and equal to it when the nucleus is the whole vocabulary); the model folder's
    own sampling defaults, such as a repetition penalty, never change what is sampled."""
    folder = build_tiny_model(tmp_path / "m", size="tiny", seed=1)
    config = folder / "generation_config.json"
    config.write_text('{"repetition_penalty": 3.0, "top_k": 2, "temperature": 0.1}')
    engine = HFEngine(InferenceSettings(engine="hf", model_path=folder, torch_threads=None))
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = [3, 8, 9]
    for top_p, strict in ((1.0, False), (0.5, True)):
        c = asyncio.run(engine.generate([prompt], Sampling(temperature=0.8, top_p=top_p,
                                                           max_new_tokens=6)))[0]
        ids = torch.tensor([prompt + c.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / 0.8
        plain = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        got = torch.tensor(c.logprobs)
        if strict:  # the nucleus of a near-uniform random model is a strict subset
            assert bool((got > plain + 1e-4).all())
        else:
            torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


def test_updates_per_step_reuses_the_batch_and_reports_the_first_pass(folder: Path) -> None:
    """updates_per_step=3 is three optimizer steps on one batch; its figures are the first
    pass's (on-policy data: ratio 1), while a later pass sees the ratio moved and clipped."""
    batch = work(seed=5)
    on_policy: list[Work] = []
    plain = trainer(folder)
    with torch.no_grad():  # the behaviour logprobs: the initial policy's own
        for w in batch:
            t = torch.tensor([w.ids])
            lp, _ = plain.scorer(t, torch.ones_like(t), torch.ones(1, len(w.ids) - 1))
            logprobs = [0.0] + [float(x) if f else 0.0
                                for x, f in zip(lp[0].tolist(), w.sampled[1:], strict=True)]
            on_policy.append(dataclasses.replace(w, logprobs=logprobs))
    many = trainer(folder, updates_per_step=3, lr=1e-2)
    once = trainer(folder, lr=1e-2)
    first = many.optimize(on_policy)
    passes = [once.optimize(on_policy) for _ in range(3)]
    assert first.row() == pytest.approx(passes[0].row(), rel=1e-6)
    assert first.mean_ratio == pytest.approx(1.0, abs=1e-5)
    assert first.clip_frac == 0.0 and passes[2].clip_frac > 0.0
    for (name, pa), pb in zip(many.model.named_parameters(), once.model.parameters(),
                              strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)
