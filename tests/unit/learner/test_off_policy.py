"""Decoupled off-policy correction against hand-computed values (the arithmetic is in the
comments), its reduction to the one-ratio loss where the engine agrees with the learner,
and the trainer's use of it: pi_old from the step's first forward pass, its figures."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from rlbus.client import Episode, ScoredGroup
from rlbus.learner.grpo import policy_loss
from rlbus.learner.off_policy import (
    Correction,
    importance_weights,
    mismatch_stats,
    peak,
    sums,
)
from rlbus.learner.settings import LearnerSettings, OffPolicyMode, OffPolicySettings
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.learner.trainer import Trainer, Work
from tests import factories

MODES: tuple[OffPolicyMode, ...] = get_args(OffPolicyMode)
W = [0.25, 1.0, 3.0, 8.0]  # importance weights pi_old / mu of four tokens


def close(actual: Tensor, expected: Tensor | list[Any] | float) -> None:
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected).float(),
                               atol=1e-5, rtol=1e-5)


def weights(mode: OffPolicyMode, w: list[list[float]], mask: list[list[float]] | None = None,
            **knobs: Any) -> tuple[Any, Tensor]:
    """importance_weights of tokens whose pi_old / mu is ``w`` (mu: arbitrary logprobs)."""
    mu = torch.tensor([[-0.5 - 0.25 * j for j in range(len(w[0]))]] * len(w))  # (B, T)
    old = mu + torch.tensor(w).log()  # (B, T)
    m = torch.tensor(mask) if mask is not None else torch.ones_like(mu)
    return importance_weights(old, mu, m, Correction(mode, **knobs)), m


# ------------------------------------------------------------------ the weights, by mode


def test_decoupled_weights_are_the_ratio_itself() -> None:
    w, _ = weights("decoupled", [W])
    close(w.weight, [W])
    assert not w.corrected.any() and not w.sequence_masked.any()


def test_tis_truncates_the_weight_at_its_cap() -> None:
    # min(w, 2): 0.25, 1, 2, 2; the two above the cap are counted as corrected
    w, _ = weights("tis", [W], tis_cap=2.0)
    close(w.weight, [[0.25, 1.0, 2.0, 2.0]])
    assert w.corrected.tolist() == [[False, False, True, True]]
    close(w.raw, [W])  # the metrics see the weight before truncation


def test_token_mask_zeroes_tokens_outside_the_band_and_keeps_the_rest_weighted() -> None:
    # [0.5, 5]: 0.25 and 8 fall outside (weight 0), 1 and 3 keep their weight (IcePop)
    w, _ = weights("token_mask", [W], token_band=(0.5, 5.0))
    close(w.weight, [[0.0, 1.0, 3.0, 0.0]])
    assert w.corrected.tolist() == [[True, False, False, True]]
    edge, _ = weights("token_mask", [[0.5, 5.0]], token_band=(0.5, 5.0))
    close(edge.weight, [[0.5, 5.0]])  # the band is closed


def test_seq_mask_drops_a_sequence_by_the_geometric_mean_of_its_weights() -> None:
    # row 0: (0.25 * 1 * 3 * 8) ** (1/4) = 6 ** 0.25 = 1.565 > 1.001: masked whole.
    # row 1: loss tokens 2 and 0.5 (the other two off the mask): sqrt(2 * 0.5) = 1: kept,
    # with each token's own weight (as NeMo-RL's seq-mask-tis keeps them).
    w, _ = weights("seq_mask", [W, [2.0, 0.5, 7.0, 9.0]],
                   mask=[[1, 1, 1, 1], [1, 1, 0, 0]], seq_band=(0.999, 1.001))
    assert w.sequence_masked.tolist() == [True, False]
    close(w.weight, [[0.0] * 4, [2.0, 0.5, 0.0, 0.0]])
    assert w.corrected.tolist() == [[True] * 4, [False] * 4]


def test_seq_mask_band_edges_and_an_empty_row() -> None:
    # geometric means 0.998 and 1.002 with a band of [0.999, 1.001]: both out; a row with no
    # loss token is never counted as masked
    w, _ = weights("seq_mask", [[0.998, 0.998], [1.002, 1.002], [5.0, 5.0]],
                   mask=[[1, 1], [1, 1], [0, 0]])
    assert w.sequence_masked.tolist() == [True, True, False]


def test_log_ratios_are_clamped_before_exp() -> None:
    # log w = 100 or -100 would overflow to inf or round to 0: clamped to +-20 first
    mu = torch.tensor([[-100.0, -0.5]])
    old = torch.tensor([[0.0, -100.5]])
    w = importance_weights(old, mu, torch.ones(1, 2), Correction("decoupled"))
    close(w.log_raw, [[20.0, -20.0]])
    assert torch.isfinite(w.weight).all() and (w.weight > 0).all()
    # the loss's own ratio pi_theta / pi_old is clamped the same way
    logprobs = torch.tensor([[0.0, -0.5]], requires_grad=True)
    loss, stats = policy_loss(logprobs, mu, torch.tensor([-1.0]), torch.ones(1, 2),
                              proximal_logprobs=torch.tensor([[-200.0, -0.5]]))
    assert math.isfinite(float(loss.detach())) and math.isfinite(stats["mean_ratio"])


def test_tokens_off_the_loss_mask_weigh_nothing_and_count_nowhere() -> None:
    w, _ = weights("tis", [W], mask=[[1, 0, 0, 1]], tis_cap=2.0)
    close(w.weight, [[0.25, 0.0, 0.0, 2.0]])
    assert w.corrected.tolist() == [[False, False, False, True]]
    assert peak(w) == pytest.approx(8.0)


# ------------------------------------------------------------------------- the loss


def one_token(ratio: float, w: float, advantage: float, mode: OffPolicyMode = "decoupled",
              **knobs: Any) -> tuple[Tensor, Tensor]:
    """Decoupled loss and d loss / d logprob for one token with pi_theta / pi_old = ratio
    and pi_old / mu = w (clip 0.2 both ways)."""
    mu = torch.tensor([[-1.0]])
    old = mu + math.log(w)
    logprobs = (old + math.log(ratio)).clone().requires_grad_(True)
    iw = importance_weights(old, mu, torch.ones(1, 1), Correction(mode, **knobs))
    loss, _ = policy_loss(logprobs, mu, torch.tensor([advantage]), torch.ones(1, 1),
                          proximal_logprobs=old, weight=iw.weight)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad[0, 0]


@pytest.mark.parametrize(
    ("ratio", "w", "advantage", "mode", "loss", "grad"),
    [
        # r inside the clip: -w * r * A, gradient -w * r * A (d r / d logprob = r)
        (1.1, 1.5, 1.0, "decoupled", -1.5 * 1.1, -1.5 * 1.1),
        # r = 1.5 above 1 + 0.2 with A > 0: the clip sets it to 1.2, no gradient
        (1.5, 2.0, 1.0, "decoupled", -2.0 * 1.2, 0.0),
        # A < 0, r = 0.5 below 1 - 0.2: min(-0.5, -0.8) = -0.8 -> the clip, no gradient
        (0.5, 0.5, -1.0, "decoupled", 0.5 * 0.8, 0.0),
        # A < 0, r = 1.5: the unclipped term is the smaller, -(-1.5) * w = 1.5 w
        (1.5, 0.5, -1.0, "decoupled", 0.5 * 1.5, 0.5 * 1.5),
        # tis: w = 3 counts as 2
        (1.1, 3.0, 1.0, "tis", -2.0 * 1.1, -2.0 * 1.1),
        # token_mask: w = 8 outside [0.5, 5], nothing at all
        (1.1, 8.0, 1.0, "token_mask", 0.0, 0.0),
        # seq_mask: one token of w = 1.0005, inside [0.999, 1.001]: weighted by it
        (1.1, 1.0005, 1.0, "seq_mask", -1.0005 * 1.1, -1.0005 * 1.1),
    ],
)
def test_decoupled_loss_matches_hand_computation(ratio: float, w: float, advantage: float,
                                                 mode: OffPolicyMode, loss: float,
                                                 grad: float) -> None:
    got_loss, got_grad = one_token(ratio, w, advantage, mode)
    assert float(got_loss) == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert float(got_grad) == pytest.approx(grad, rel=1e-5, abs=1e-6)


def test_decoupled_stats_are_of_the_ratio_against_pi_old() -> None:
    # mu far off (w = e^1) but pi_theta = pi_old: ratio 1, nothing clipped, no KL to pi_old
    mu = torch.tensor([[-2.0, -3.0]])
    old = mu + 1.0
    _, stats = policy_loss(old.clone(), mu, torch.tensor([1.0]), torch.ones(1, 2),
                           proximal_logprobs=old)
    assert stats == {"clip_frac": 0.0, "mean_ratio": 1.0, "approx_kl": 0.0}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", ["token", "sequence", "dr_grpo"])
def test_every_mode_is_the_one_ratio_loss_where_the_engine_agrees(mode: OffPolicyMode,
                                                                  norm: str) -> None:
    """mu == pi_old: w = 1 on every token, so (b)-(e) give (a)'s loss and gradient, bit for
    bit (a multiplication by exactly 1, a clamp that clamps nothing)."""
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(3, 6, generator=g) * 4  # (B, T)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    adv = torch.tensor([1.5, -0.5, 0.7])
    current = mu + torch.randn(3, 6, generator=g) * 0.3  # pi_theta a little off
    kw: dict[str, Any] = {"clip_low": 0.2, "clip_high": 0.28, "norm": norm}

    def run(**extra: Any) -> tuple[Tensor, Tensor, dict[str, float]]:
        logprobs = current.clone().requires_grad_(True)
        loss, stats = policy_loss(logprobs, mu, adv, mask, **kw, **extra)
        loss.backward()  # type: ignore[no-untyped-call]
        assert logprobs.grad is not None
        return loss.detach(), logprobs.grad, stats

    plain = run()
    iw = importance_weights(mu, mu, mask, Correction(mode))
    corrected = run(proximal_logprobs=mu, weight=iw.weight) if mode != "none" else run()
    assert torch.equal(plain[0], corrected[0]) and torch.equal(plain[1], corrected[1])
    assert plain[2] == corrected[2]
    assert not iw.corrected.any() and not iw.sequence_masked.any()


# ---------------------------------------------------------------------------- figures


def test_figures_are_token_means_and_the_k3_estimate_of_kl_mu_to_pi_old() -> None:
    # k3 = (w - 1) - ln w: 0.25 -> -0.75 + 1.386294 = 0.636294; 1 -> 0;
    # 3 -> 2 - 1.098612 = 0.901388; 8 -> 7 - 2.079442 = 4.920558; mean 6.458240 / 4
    w, _ = weights("tis", [W], tis_cap=2.0)
    stats = mismatch_stats(sums(w), peak(w), tokens=4, sequences=1)
    assert stats.weight_mean == pytest.approx(sum(W) / 4)
    assert stats.weight_max == pytest.approx(8.0)
    assert stats.corrected_frac == pytest.approx(0.5)
    assert stats.kl == pytest.approx(6.458240 / 4, rel=1e-5)
    assert stats.seq_masked_frac == 0.0
    masked, _ = weights("seq_mask", [W, [1.0, 1.0, 1.0, 1.0]])
    assert mismatch_stats(sums(masked), peak(masked), 8, 2).seq_masked_frac == 0.5
    agree, _ = weights("none", [[1.0, 1.0]])
    assert mismatch_stats(sums(agree), peak(agree), 2, 1).row() == {
        "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_corrected_frac": 0.0,
        "mismatch_kl": 0.0, "is_seq_masked_frac": 0.0}


# --------------------------------------------------------------------------- settings


def test_the_setting_is_read_from_nested_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBUS_OFF_POLICY__MODE", "token_mask")
    monkeypatch.setenv("RLBUS_OFF_POLICY__TOKEN_HIGH", "4")
    s = LearnerSettings()
    assert Correction.of(s.off_policy) == Correction("token_mask", 2.0, (0.5, 4.0),
                                                     (0.999, 1.001))
    assert LearnerSettings(_env_file=None).off_policy.mode == "token_mask"


def test_the_default_is_the_one_ratio_loss_and_bands_must_be_bands() -> None:
    assert OffPolicySettings().mode == "none" and not Correction().decoupled
    with pytest.raises(ValidationError, match="token_low must be below"):
        OffPolicySettings(token_low=5.0, token_high=0.5)
    with pytest.raises(ValidationError, match="seq_low must be below"):
        OffPolicySettings(seq_low=1.0, seq_high=1.0)
    with pytest.raises(ValidationError):
        OffPolicySettings(mode="icepop")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        OffPolicySettings(tis_cap=0.0)


# ---------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


def trainer(folder: Path, mode: OffPolicyMode = "none", **settings: Any) -> Trainer:
    return Trainer(LearnerSettings(model_path=folder, torch_threads=None, lr=1e-2,
                                   off_policy=OffPolicySettings(mode=mode), **settings))


def work(n: int = 6, seed: int = 0, vocab: int = 40) -> list[Work]:
    rng = random.Random(seed)
    out: list[Work] = []
    for _ in range(n):
        length = rng.randint(6, 24)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        sampled = [i >= 3 and rng.random() < 0.6 for i in range(length)]
        logprobs = [-rng.uniform(2.5, 5.0) if s else 0.0 for s in sampled]
        out.append(Work(ids, sampled, logprobs, rng.choice([-1.5, -0.5, 0.7, 1.2])))
    return out


def on_policy(t: Trainer, batch: list[Work]) -> list[Work]:
    """``batch`` with the behaviour logprobs the trainer's own weights give (mu == pi_old)."""
    out = []
    for w in batch:
        ids = torch.tensor([w.ids])
        with torch.no_grad():
            lp, _ = t.scorer(ids, torch.ones_like(ids), torch.ones(1, len(w.ids) - 1))
        own = [0.0] + [x if s else 0.0 for x, s in zip(lp[0].tolist(), w.sampled[1:],
                                                       strict=True)]
        out.append(Work(w.ids, w.sampled, own, w.advantage))
    return out


def parameters(t: Trainer) -> list[Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_trainer_step_where_the_engine_agrees_is_the_one_ratio_step(folder: Path,
                                                                      mode: OffPolicyMode
                                                                      ) -> None:
    plain, corrected = trainer(folder), trainer(folder, mode)
    batch = on_policy(plain, work())
    a, b = plain.optimize(batch), corrected.optimize(batch)
    assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=1e-7)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for pa, pb in zip(parameters(plain), parameters(corrected), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    assert b.mismatch is not None
    assert b.mismatch.weight_mean == pytest.approx(1.0, abs=1e-5)
    assert b.mismatch.kl == pytest.approx(0.0, abs=1e-6)
    assert b.mismatch.corrected_frac == 0.0 and b.mismatch.seq_masked_frac == 0.0


def test_pi_old_is_the_first_forward_pass_and_later_updates_reuse_it(folder: Path) -> None:
    """One forward pass per update, none extra: the first update's ratio against pi_old is
    exactly 1; the second, after an optimizer step, is not, because it still compares with
    the pi_old of the first; the weights pi_old / mu stay those of the first pass."""
    t = trainer(folder, "tis")
    batch = work(seed=1)
    proximal: list[Tensor] = []
    first = t.update(batch, proximal)
    assert len(proximal) == 1 and first.mean_ratio == pytest.approx(1.0, abs=1e-7)
    assert first.clip_frac == 0.0 and first.approx_kl == pytest.approx(0.0, abs=1e-7)
    kept = [p.clone() for p in proximal]
    second = t.update(batch, proximal)
    assert len(proximal) == 1 and torch.equal(kept[0], proximal[0])
    assert second.mean_ratio != pytest.approx(1.0, abs=1e-4)
    assert first.mismatch == second.mismatch  # w is pi_old / mu, fixed within the step


def shifted(batch: list[Work], shift: float) -> tuple[list[Work], int, int]:
    """``batch`` with every other sampled token's behaviour logprob lowered by ``shift``
    (w = e^shift there, 1 elsewhere); the counts of loss tokens and of shifted ones."""
    out, tokens, moved = [], 0, 0
    for w in batch:
        lps = list(w.logprobs)
        for i, s in enumerate(w.sampled):
            if s and i > 0:
                tokens += 1
                if tokens % 2 == 0:
                    lps[i] -= shift
                    moved += 1
        out.append(Work(w.ids, w.sampled, lps, w.advantage))
    return out, tokens, moved


def test_tis_reports_the_gap_and_corrects_it(folder: Path) -> None:
    # every other token has w = 3 (above the cap of 2), the rest w = 1:
    # mean (3 k + (n - k)) / n, corrected k / n, KL k / n * (2 - ln 3)
    batch, n, k = shifted(on_policy(trainer(folder), work(seed=2)), math.log(3.0))
    stats = trainer(folder, "tis").optimize(batch)
    m = stats.mismatch
    assert m is not None
    assert m.weight_mean == pytest.approx((3 * k + n - k) / n, rel=1e-4)
    assert m.weight_max == pytest.approx(3.0, rel=1e-4)
    assert m.corrected_frac == pytest.approx(k / n)
    assert m.kl == pytest.approx(k / n * (2 - math.log(3.0)), rel=1e-3)
    row = stats.row()
    assert {"is_weight_mean", "is_weight_max", "is_corrected_frac", "mismatch_kl",
            "is_seq_masked_frac"} <= set(row)
    none = trainer(folder).optimize(batch)  # measured in mode none too, corrected not
    assert none.mismatch is not None and none.mismatch.corrected_frac == 0.0
    assert none.mismatch.weight_mean == pytest.approx(m.weight_mean, rel=1e-6)
    assert none.loss != pytest.approx(stats.loss, rel=1e-3)
    masked = trainer(folder, "token_mask").optimize(shifted(batch, math.log(3.0))[0])
    assert masked.mismatch is not None  # w = 9 on a quarter of the tokens: outside [0.5, 5]
    assert masked.mismatch.weight_max == pytest.approx(9.0, rel=1e-4)
    assert 0.0 < masked.mismatch.corrected_frac < 0.5


@pytest.mark.parametrize("mode", ["tis", "seq_mask"])
def test_micro_batches_give_the_one_batch_corrected_update(folder: Path,
                                                           mode: OffPolicyMode) -> None:
    whole, micro = trainer(folder, mode), trainer(folder, mode, micro_batch_tokens=40)
    batch = work(n=7, seed=3)
    for _ in range(2):
        a, b = whole.optimize(batch), micro.optimize(batch)
        assert (b.micro_batches or 0) > 1
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
        assert a.mismatch is not None and b.mismatch is not None
        assert a.mismatch.weight_mean == pytest.approx(b.mismatch.weight_mean, rel=1e-6)
        assert a.mismatch.weight_max == pytest.approx(b.mismatch.weight_max, rel=1e-6)
        assert a.mismatch.corrected_frac == pytest.approx(b.mismatch.corrected_frac)
        assert a.mismatch.seq_masked_frac == pytest.approx(b.mismatch.seq_masked_frac)
    for pa, pb in zip(parameters(whole), parameters(micro), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["none", "tis"])
def test_an_engines_infinite_logprob_masks_its_episode_and_never_reaches_the_loss(
        folder: Path, mode: OffPolicyMode) -> None:
    """-inf passes the wire's check (``logprobs <= 0``); the learner masks the episode
    with its own cause, and the step trains on the others with a finite loss."""
    members = []
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        scored = factories.scored(index=i, reward=reward)
        t = scored.trajectory
        spec = {"target": 3, "low": 1, "high": 9, "max_turns": 5}  # guess_number's
        turns = [t.turns[0].model_copy(update={"logprobs": [-1.5, -math.inf]})] if i == 1 \
            else t.turns
        scored = scored.model_copy(update={"trajectory": t.model_copy(
            update={"turns": turns, "spec": spec})})
        members.append(Episode.of(scored, {}))
    group = ScoredGroup("run/0", "guess_number", "train", tuple(members), started=0)
    stats = trainer(folder, mode).step([group], version=0)
    assert stats.masks.by_cause["bad_logprobs"] == 1 and stats.masks.trained == 3
    assert stats.update is not None and math.isfinite(stats.update.loss)
    assert stats.update.loss != 0.0 and stats.update.mismatch is not None
    assert math.isfinite(stats.update.mismatch.weight_max)
    row = stats.row()
    assert row["masked_bad_logprobs"] == 1 and row["masked"] == 1
    assert all(v is None or math.isfinite(v) for v in row.values())


def test_seq_mask_judges_each_segment_of_an_episode_on_its_own(folder: Path) -> None:
    """An episode of two segments is two rows: one whose every weight is 3 (geometric mean
    3, masked), one that agrees with the learner (1, kept): half the rows masked, and all
    of the masked one's tokens counted as corrected."""
    t = trainer(folder, "seq_mask")
    agree, own = on_policy(t, work(n=2, seed=5))
    lowered = [lp - math.log(3.0) if s else 0.0 for lp, s in zip(own.logprobs, own.sampled,
                                                                  strict=True)]
    segments = [Work(agree.ids, agree.sampled, agree.logprobs, 1.0, episode="run/0/0"),
                Work(own.ids, own.sampled, lowered, 1.0, episode="run/0/0")]
    m = t.optimize(segments).mismatch
    assert m is not None and m.seq_masked_frac == 0.5
    off, on = sum(own.sampled[1:]), sum(agree.sampled[1:])
    assert m.corrected_frac == pytest.approx(off / (off + on))
    assert m.weight_max == pytest.approx(3.0, rel=1e-4)
