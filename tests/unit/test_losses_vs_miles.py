"""Differential test of the PPO and KL terms against a transcription of Miles' formulas
(miles/utils/ppo_utils.py: compute_policy_loss, compute_approx_kl, with the log-ratio bound
and the non-finite KL guard of its loss), on random float32 inputs with extremes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_losses import _one_rollout_batch
from trainer.losses import LossSettings, kl_penalty, micro_batch_loss, ppo_clip_loss
from trainer.reducers import StepReduction


def miles_policy_loss(log_probs, old_log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c):
    ppo_kl = old_log_probs.float() - log_probs.float()
    ratio = torch.clamp(-ppo_kl, min=-20.0, max=20.0).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is not None:
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1
    ppo_kl = torch.nan_to_num(ppo_kl, nan=0.0, posinf=0.0, neginf=0.0)
    return pg_losses, clipfrac, ppo_kl


def miles_approx_kl(log_probs, log_probs_base, kl_loss_type):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    else:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0)


def _random_log_probs(gen: torch.Generator, n: int) -> torch.Tensor:
    """Mostly ordinary log-probs, with a share of extremes: far-off values, -inf, and
    log-ratios just past the bound."""
    lp = -torch.rand(n, generator=gen) * 5
    pick = torch.rand(n, generator=gen)
    lp = torch.where(pick < 0.1, -torch.rand(n, generator=gen) * 200, lp)
    lp = torch.where((pick >= 0.1) & (pick < 0.15), torch.full_like(lp, -math.inf), lp)
    return lp


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("eps_clip_c", [None, 3.0])
def test_policy_terms_match_miles_on_random_inputs(seed, eps_clip_c):
    gen = torch.Generator().manual_seed(seed)
    n = 4096
    log_probs = -torch.rand(n, generator=gen) * 5
    old = _random_log_probs(gen, n)
    # Log-ratios on both sides of the bound, exactly.
    old[:4] = log_probs[:4] - torch.tensor([20.2, -20.2, 19.9, -19.9])
    advantages = torch.randn(n, generator=gen) * 2
    ours = ppo_clip_loss(
        log_probs, old, advantages, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=eps_clip_c
    )
    pg, clipfrac, ppo_kl = miles_policy_loss(log_probs, old, advantages, 0.2, 0.28, eps_clip_c)
    assert ours.pg_loss.isfinite().all()
    torch.testing.assert_close(ours.pg_loss, pg, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.clipped, clipfrac, rtol=0, atol=0)
    torch.testing.assert_close(ours.ppo_kl, ppo_kl, rtol=0, atol=0)
    beyond = (log_probs - old).abs() > 20
    assert ours.log_ratio_clamped.bool().tolist() == beyond.tolist()
    assert ours.log_ratio_clamped[:4].tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimates_match_miles_on_random_inputs(kind):
    gen = torch.Generator().manual_seed(7)
    n = 4096
    log_probs = _random_log_probs(gen, n)
    log_probs[log_probs.isinf()] = -1.0  # the policy's own log-probs are finite
    ref = _random_log_probs(gen, n)
    ours = kl_penalty(log_probs, ref, kind)
    assert ours.isfinite().all()
    torch.testing.assert_close(ours, miles_approx_kl(log_probs, ref, kind), rtol=1e-6, atol=0)


def test_a_ratio_past_the_bound_gives_miles_loss():
    terms = ppo_clip_loss(
        torch.tensor([20.2]), torch.zeros(1), torch.tensor([-1.0]), eps_clip=0.2, eps_clip_high=0.28
    )
    # exp(20) = 4.85e8 (Miles), not exp(20.2) = 5.9e8.
    assert terms.pg_loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_minus_inf_log_probs_give_a_finite_loss_and_gradient(kind):
    batch = _one_rollout_batch([-math.inf, -1.0])
    log_probs = torch.tensor([[-2.0, -1.0]], requires_grad=True)
    reduction = StepReduction.for_step(batch.loss_mask, 1, calculate_per_token_loss=False)
    settings = LossSettings(kl_loss_coef=0.5, kl_loss_type=kind)
    loss, metrics = micro_batch_loss(
        settings,
        batch,
        log_probs,
        torch.zeros(1, 2),
        reduction,
        ref_log_probs=torch.tensor([[-math.inf, -1.0]]),
    )
    loss.backward()
    assert loss.isfinite()
    assert log_probs.grad.isfinite().all()
    assert metrics["log_ratio_clamped_tokens"].item() == 1
    assert metrics["ppo_kl"].item() == 0  # token a's -inf KL counts 0, token b's is 0
    # Token a: ratio exp(20), A = +1, clipped at 1.28; token b: ratio 1.
    assert metrics["pg_loss"].item() == pytest.approx((-1.28 - 1.0) / 2)
    # Token a's infinite KL counts 0, except low_var_kl, which clamps it to 10 first.
    assert metrics["kl_loss"].item() == (5.0 if kind == "low_var_kl" else 0.0)
