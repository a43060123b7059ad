"""Reducers on hand-computed tensors (MILES_SEMANTICS 10.1, 10.3)."""

from __future__ import annotations

import pytest
import torch

from schemas.errors import FilterLoadError
from tests.support.trainer_fixtures import batch_rows
from trainer.batches import tensorize
from trainer.losses import LossSettings, micro_batch_loss
from trainer.reducers import (
    StepReduction,
    get_dr_grpo_reducer,
    load_pg_loss_reducer,
    sum_of_sample_mean,
    sum_of_token,
)

# The MILES 10.1 example: rollout A = two siblings with mask sums 3 and 1 (D = 4 each),
# rollout B = one row with mask sum 2.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
MASK_SUMS = torch.tensor([4.0, 4.0, 2.0])
N_ROLLOUTS = 2


def test_sum_of_sample_mean_shares_the_denominator_of_siblings():
    ones = torch.ones(3, 4)
    assert sum_of_sample_mean(ones, MASK, MASK_SUMS).item() == pytest.approx(2.0)
    reduce = StepReduction.for_step(MASK, N_ROLLOUTS, calculate_per_token_loss=False)
    assert reduce(ones, MASK, MASK_SUMS).item() == pytest.approx(1.0)

    x = torch.tensor([[1.0, 2, 3, 9], [4, 9, 9, 9], [5, 6, 9, 9]])  # 9s are masked out
    # (1+2+3)/4 + 4/4 + (5+6)/2 = 8 over 2 rollouts; per-row denominators (3, 1, 2)
    # would give (2 + 4 + 5.5) / 2 instead.
    assert reduce(x, MASK, MASK_SUMS).item() == pytest.approx(4.0)


def test_token_mean_divides_by_the_token_count():
    x = torch.tensor([[1.0, 2, 3, 9], [4, 9, 9, 9], [5, 6, 9, 9]])
    reduce = StepReduction.for_step(MASK, N_ROLLOUTS, calculate_per_token_loss=True)
    assert reduce.denominator == 6
    assert sum_of_token(x, MASK).item() == pytest.approx(21.0)
    assert reduce(x, MASK, MASK_SUMS).item() == pytest.approx(21 / 6)
    # A fully masked row still counts one token (Megatron's max(Σm_i, 1)).
    padded = torch.cat([MASK, torch.zeros(1, 4)])
    assert StepReduction.for_step(padded, 3, calculate_per_token_loss=True).denominator == 7


def test_micro_batch_shares_add_up_to_the_step_value():
    x = torch.tensor([[1.0, 2, 3, 9], [4, 9, 9, 9], [5, 6, 9, 9]])
    reduce = StepReduction.for_step(MASK, N_ROLLOUTS, calculate_per_token_loss=False)
    whole = reduce(x, MASK, MASK_SUMS)
    # The siblings land in different micro-batches and still form one token mean.
    parts = reduce(x[:1], MASK[:1], MASK_SUMS[:1]) + reduce(x[1:], MASK[1:], MASK_SUMS[1:])
    assert parts.item() == pytest.approx(whole.item())


def test_dr_grpo_reducer_uses_a_constant_divisor():
    loss_masks = [torch.tensor([1.0, 1, 1]), torch.tensor([1.0])]
    flat = torch.ones(4)
    reducer = get_dr_grpo_reducer([5, 3], [3, 1], loss_masks, False)
    assert reducer(flat).item() == pytest.approx(0.004)  # MILES 10.3 example
    per_token = get_dr_grpo_reducer([5, 3], [3, 1], loss_masks, True)
    assert per_token(torch.tensor([1.0, 2, 3, 4])).item() == pytest.approx(10.0)


@pytest.mark.parametrize(
    "path", ["trainer.reducers.get_dr_grpo_reducer", "trainer.reducers:get_dr_grpo_reducer"]
)
def test_reducer_paths_accept_dot_and_colon(path):
    assert load_pg_loss_reducer(path) is get_dr_grpo_reducer


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("no_such_module_xyz.fn", "reducer path 'no_such_module_xyz.fn': cannot import module "
                                  "'no_such_module_xyz': No module named 'no_such_module_xyz'"),
        ("trainer.reducers.nope", "reducer path 'trainer.reducers.nope': module "
                                  "'trainer.reducers' has no attribute 'nope'"),
        ("trainer.reducers:DR_GRPO_DIVISOR", "reducer path 'trainer.reducers:DR_GRPO_DIVISOR': "
                                             "'DR_GRPO_DIVISOR' is not callable (got float)"),
        ("justaname", "reducer path 'justaname' is not of the form 'module.function' or "
                      "'module:function'"),
        ("broken_reducers_at_import.factory", "reducer path 'broken_reducers_at_import.factory': "
         "importing module 'broken_reducers_at_import' raised ZeroDivisionError: division by zero"),
    ],
)
def test_bad_reducer_paths_raise_one_line_filter_load_error(path, expected, tmp_path,
                                                             monkeypatch):
    (tmp_path / "broken_reducers_at_import.py").write_text("RATIO = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FilterLoadError) as info:
        load_pg_loss_reducer(path)
    assert str(info.value) == expected


def _batch():
    rows = batch_rows(
        "r",
        1,
        [
            # Rollout (0, 0) compacted into two siblings, mask sums 3 and 1.
            dict(
                group_index=0,
                rollout_id=0,
                prompt_tokens=[1],
                response_tokens=[2, 3, 4],
                loss_mask=[1, 1, 1],
                rollout_log_probs=[-1.0, -1.0, -1.0],
                advantage=1.0,
            ),
            dict(
                group_index=0,
                rollout_id=0,
                fragment_index=1,
                prompt_tokens=[5],
                response_tokens=[6],
                loss_mask=[1],
                rollout_log_probs=[-1.0],
                advantage=1.0,
            ),
            dict(
                group_index=0,
                rollout_id=1,
                prompt_tokens=[1],
                response_tokens=[7, 8],
                loss_mask=[1, 1],
                rollout_log_probs=[-1.0, -1.0],
                advantage=-1.0,
            ),
        ],
    )
    return tensorize(rows, 1)


def test_custom_reducer_replaces_only_the_pg_loss():
    batch = _batch()
    log_probs = torch.full(batch.loss_mask.shape, -1.1)  # ratio e^-0.1 everywhere
    entropy = torch.full(batch.loss_mask.shape, 2.0)
    reduction = StepReduction.for_step(
        batch.loss_mask, batch.n_rollouts, calculate_per_token_loss=False
    )
    settings = LossSettings(eps_clip=0.05, eps_clip_high=0.05)
    _, default = micro_batch_loss(settings, batch, log_probs, entropy, reduction)
    _, custom = micro_batch_loss(
        settings, batch, log_probs, entropy, reduction, pg_reducer_factory=get_dr_grpo_reducer
    )
    r = torch.tensor(-0.1).exp().item()
    # pg per token: -A·r when unclipped. A=+1 tokens (4 of rollout A): -r; r < 0.95 and
    # A > 0 leaves them unclipped. A=-1 tokens (2 of rollout B): clipped at 0.95 -> +0.95.
    assert default["pg_loss"].item() == pytest.approx((-r + 0.95) / 2, rel=1e-5)
    assert custom["pg_loss"].item() == pytest.approx((4 * -r + 2 * 0.95) / 1000 / 2, rel=1e-5)
    for key in ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ppo_kl", "entropy_loss"):
        assert custom[key].item() == pytest.approx(default[key].item())
    assert default["pg_clipfrac"].item() == pytest.approx(0.5)  # rollout B fully clipped
