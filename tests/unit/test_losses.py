"""PPO-clip, KL and log-prob terms against hand-computed values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.trainer_fixtures import batch_rows
from trainer.batches import tensorize
from trainer.losses import (
    LossSettings,
    kl_penalty,
    micro_batch_loss,
    ppo_clip_loss,
    token_log_probs,
)
from trainer.reducers import StepReduction


def _terms(ratio: float, advantage: float, **eps):
    return ppo_clip_loss(
        torch.tensor([math.log(ratio)]), torch.zeros(1), torch.tensor([advantage]), **eps
    )


def test_clip_higher_lets_positive_advantages_move_further():
    dapo = {"eps_clip": 0.2, "eps_clip_high": 0.28}
    # r = 1.25 with A > 0: inside DAPO's 1.28 bound, outside symmetric PPO's 1.2.
    inside = _terms(1.25, 1.0, **dapo)
    assert inside.pg_loss.item() == pytest.approx(-1.25)
    assert inside.clipped.item() == 0
    symmetric = _terms(1.25, 1.0, eps_clip=0.2, eps_clip_high=0.2)
    assert symmetric.pg_loss.item() == pytest.approx(-1.2)
    assert symmetric.clipped_high.item() == 1
    # Above 1.28 the upper bound binds.
    above = _terms(1.4, 1.0, **dapo)
    assert above.pg_loss.item() == pytest.approx(-1.28)
    assert (above.clipped_high.item(), above.clipped_low.item()) == (1, 0)
    # Negative advantages keep the 0.8 lower bound: 0.85 passes, 0.75 is clipped.
    assert _terms(0.85, -1.0, **dapo).pg_loss.item() == pytest.approx(0.85)
    below = _terms(0.75, -1.0, **dapo)
    assert below.pg_loss.item() == pytest.approx(0.8)
    assert (below.clipped_low.item(), below.clipped_high.item()) == (1, 0)
    # The bounds never bind on the side that would raise the objective.
    assert _terms(1.4, -1.0, **dapo).clipped.item() == 0
    assert _terms(0.5, 1.0, **dapo).clipped.item() == 0


def test_dual_clip_caps_negative_advantage_loss():
    capped = _terms(5.0, -1.0, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    assert capped.pg_loss.item() == pytest.approx(3.0)
    positive = _terms(5.0, 1.0, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    assert positive.pg_loss.item() == pytest.approx(-1.28)


def test_gradients_of_a_two_token_example():
    # One rollout, two loss tokens, sample-mean over D = 2 and 1 rollout:
    # loss = (pg_a + pg_b) / 2. Token a: r = 1.1, A = +1, unclipped: pg = -r,
    # d pg / d logp = -r = -1.1. Token b: r = 0.7, A = -1, clipped at 0.8: constant.
    log_probs = torch.tensor([[math.log(1.1), math.log(0.7)]], requires_grad=True)
    terms = ppo_clip_loss(
        log_probs, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), eps_clip=0.2, eps_clip_high=0.28
    )
    reduce = StepReduction.for_step(torch.ones(1, 2), 1, calculate_per_token_loss=False)
    loss = reduce(terms.pg_loss, torch.ones(1, 2), torch.tensor([2.0]))
    loss.backward()
    assert loss.item() == pytest.approx((-1.1 + 0.8) / 2)
    assert log_probs.grad[0].tolist() == pytest.approx([-0.55, 0.0])


def test_kl_estimators():
    lp, ref = torch.tensor([0.5]), torch.tensor([0.0])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    far = torch.tensor([-20.0])
    assert kl_penalty(far, ref, "low_var_kl").item() == pytest.approx(10.0)
    assert kl_penalty(far, ref, "k3").item() > 1e8


def test_token_log_probs_and_entropy():
    # Position 0 predicts token 1 with p = 0.75.
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    log_probs, entropy = token_log_probs(logits, torch.tensor([[0, 1]]), with_entropy_grad=False)
    assert log_probs[0].tolist() == pytest.approx([math.log(0.75)])
    assert entropy[0].tolist() == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])


def _one_rollout_batch(rollout_log_probs):
    rows = batch_rows(
        "r",
        1,
        [
            dict(
                group_index=0,
                rollout_id=0,
                prompt_tokens=[1],
                response_tokens=[2, 3],
                loss_mask=[1, 1],
                rollout_log_probs=rollout_log_probs,
                advantage=1.0,
            )
        ],
    )
    return tensorize(rows, 1)


def test_rows_without_rollout_log_probs_use_the_trainer_policy():
    batch = _one_rollout_batch(None)
    log_probs = torch.tensor([[-2.0, -3.0]], requires_grad=True)
    reduction = StepReduction.for_step(batch.loss_mask, 1, calculate_per_token_loss=False)
    loss, metrics = micro_batch_loss(LossSettings(), batch, log_probs, torch.zeros(1, 2), reduction)
    loss.backward()
    # Ratio 1 everywhere: pg = -A = -1 per token, gradient -A / D = -0.5 per token.
    assert metrics["pg_loss"].item() == pytest.approx(-1.0)
    assert metrics["pg_clipfrac"].item() == 0
    assert log_probs.grad[0].tolist() == pytest.approx([-0.5, -0.5])


def test_kl_and_entropy_terms_enter_the_loss():
    batch = _one_rollout_batch([-2.0, -3.0])
    log_probs = torch.tensor([[-2.0, -3.0]])
    reduction = StepReduction.for_step(batch.loss_mask, 1, calculate_per_token_loss=False)
    settings = LossSettings(kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    loss, metrics = micro_batch_loss(
        settings,
        batch,
        log_probs,
        torch.tensor([[1.0, 3.0]]),
        reduction,
        ref_log_probs=torch.tensor([[-2.5, -3.5]]),
    )
    assert metrics["kl_loss"].item() == pytest.approx(0.5)
    assert metrics["entropy_loss"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 2.0 + 0.5 * 0.5)
