"""Policy loss of one micro-batch: PPO-clip with clip-higher, optional reference KL, entropy.

Formulas follow MILES_SEMANTICS 10.2. Every per-token term is reduced with the step's
default reducer (`StepReduction`); only the pg loss may use a custom reducer, as in Miles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.batches import StepBatch
from trainer.reducers import ReducerFactory, StepReduction

KlType = Literal["k1", "k2", "k3", "low_var_kl"]

# Bound on |logp - old_logp| before exp, as in Miles: exp(20) ~ 4.9e8 keeps one stale or
# -inf old log-prob from overflowing the step's loss.
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class LossSettings:
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: float | None = None
    kl_loss_coef: float = 0.0  # 0 disables the reference KL term
    kl_loss_type: KlType = "k1"
    entropy_coef: float = 0.0
    use_rollout_log_probs: bool = True


@dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token PPO terms; the clip indicators are 0/1 floats."""

    pg_loss: Tensor
    clipped: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    ppo_kl: Tensor
    log_ratio_clamped: Tensor


def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """pg = max(-r·A, -clip(r, 1-eps_clip, 1+eps_clip_high)·A), r = exp(logp - old_logp).

    The lower bound binds only for A < 0 (r below 1-eps_clip), the upper one only for A > 0
    (r above 1+eps_clip_high), so `clipped` = `clipped_low` + `clipped_high`. Dual clip
    caps the loss of negative advantages at -eps_clip_c·A. The log-ratio is clamped to
    ±LOG_RATIO_BOUND before exp (`log_ratio_clamped` marks those tokens) and `ppo_kl`
    is 0 where it is not finite.
    """
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg_loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        pg_loss = torch.where(
            advantages < 0, torch.minimum(pg_loss, -advantages * eps_clip_c), pg_loss
        )
    return PolicyLossTerms(
        pg_loss=pg_loss,
        clipped=(clipped > unclipped).float(),
        clipped_low=((ratio < 1 - eps_clip) & (advantages < 0)).float(),
        clipped_high=((ratio > 1 + eps_clip_high) & (advantages > 0)).float(),
        ppo_kl=torch.where(log_ratio.isfinite(), -log_ratio, 0.0).detach(),
        log_ratio_clamped=(log_ratio.detach().abs() > LOG_RATIO_BOUND).float(),
    )


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: KlType) -> Tensor:
    """Per-token KL estimate of the policy to the reference, lr = logp - ref_logp; 0 where
    the estimate is not finite (an -inf reference log-prob, k3 overflowing), as in Miles."""

    def estimate(lr: Tensor) -> Tensor:
        if kind == "k1":
            return lr
        if kind == "k2":
            return lr.square() / 2
        kl = (-lr).exp() - 1 + lr
        # low_var_kl is k3 clamped, which keeps one outlier token from dominating the step.
        return kl.clamp(-10, 10) if kind == "low_var_kl" else kl

    lr = log_probs - ref_log_probs
    bad = ~estimate(lr.detach()).isfinite()
    # Zeroing lr first keeps the gradient at those tokens 0, not inf·0 = NaN.
    kl = estimate(torch.where(bad, torch.zeros_like(lr), lr))
    return torch.where(bad, torch.zeros_like(kl), kl)


def token_log_probs(
    logits: Tensor, tokens: Tensor, *, with_entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    """Log-prob of `tokens[:, 1:]` under `logits[:, :-1]`, and the entropy there.

    Computed in float32 whatever the model dtype: bf16 log-softmax over a large vocabulary
    loses the small ratio differences PPO clips on.
    """
    logits = logits[:, :-1].float()
    log_z = logits.logsumexp(-1)
    log_probs = logits.gather(-1, tokens[:, 1:, None]).squeeze(-1) - log_z
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        entropy = log_z - (logits.softmax(-1) * logits).sum(-1)
    return log_probs, entropy


def micro_batch_loss(
    settings: LossSettings,
    batch: StepBatch,
    log_probs: Tensor,
    entropy: Tensor,
    reduction: StepReduction,
    *,
    ref_log_probs: Tensor | None = None,
    pg_reducer_factory: ReducerFactory | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's share of the step loss, and of each logged metric (detached)."""
    device = log_probs.device
    loss_mask = batch.loss_mask.to(device)
    mask_sums = batch.rollout_mask_sums.to(device)
    advantages = batch.advantages.to(device)
    own = log_probs.detach()
    if settings.use_rollout_log_probs:
        old = torch.where(
            batch.has_old_log_probs.to(device)[:, None], batch.old_log_probs.to(device), own
        )
    else:
        old = own
    terms = ppo_clip_loss(
        log_probs,
        old,
        advantages,
        eps_clip=settings.eps_clip,
        eps_clip_high=settings.eps_clip_high,
        eps_clip_c=settings.eps_clip_c,
    )

    def reduce(x: Tensor) -> Tensor:
        return reduction(x, loss_mask, mask_sums)

    if pg_reducer_factory is None:
        pg_loss = reduce(terms.pg_loss)
    else:
        pg_loss = _custom_reduce(pg_reducer_factory, batch, terms.pg_loss, reduction)
    entropy_loss = reduce(entropy)
    loss = pg_loss - settings.entropy_coef * entropy_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": reduce(terms.clipped),
        "pg_clipfrac_low": reduce(terms.clipped_low),
        "pg_clipfrac_high": reduce(terms.clipped_high),
        "ppo_kl": reduce(terms.ppo_kl),
        # A count, not a share: how many loss tokens hit the log-ratio bound this step.
        "log_ratio_clamped_tokens": (terms.log_ratio_clamped * loss_mask).sum(),
        "entropy_loss": entropy_loss.detach(),
    }
    if ref_log_probs is not None:
        kl_loss = reduce(kl_penalty(log_probs, ref_log_probs, settings.kl_loss_type))
        loss = loss + settings.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def _custom_reduce(
    factory: ReducerFactory, batch: StepBatch, pg_loss: Tensor, reduction: StepReduction
) -> Tensor:
    """Call a Miles reducer factory on the flat response tokens, then normalise like Miles."""
    response_mask = batch.response_mask.to(pg_loss.device)
    response_lengths = batch.response_lengths.tolist()
    loss_masks = list(batch.loss_mask.to(pg_loss.device)[response_mask].split(response_lengths))
    reducer = factory(
        batch.total_lengths.tolist(),
        response_lengths,
        loss_masks,
        reduction.calculate_per_token_loss,
    )
    return reducer(pg_loss[response_mask]) / reduction.denominator
