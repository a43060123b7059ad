"""Loss reducers: how per-token values of a step become one scalar (MILES_SEMANTICS 10.1, 10.3).

A step may be split into micro-batches (and data-parallel ranks); every reducer here
returns a micro-batch's *share* of the step value, so the shares add up to the value the
whole step would give. The outer normalisation therefore uses step-wide denominators:
the number of rollouts (sample-mean mode) or the loss-token count (per-token mode).

`get_dr_grpo_reducer` is the shipped example of a custom pg-loss reducer, with the Miles
factory signature; `load_pg_loss_reducer` loads any such factory by path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from schemas.dotted import load_callable

Reducer = Callable[[Tensor], Tensor]
ReducerFactory = Callable[[list[int], list[int], list[Tensor], bool], Reducer]

DR_GRPO_DIVISOR = 1000.0
"""Dr.GRPO's constant in place of |o_i| (Miles example value: the generation budget)."""


def sum_of_sample_mean(x: Tensor, loss_mask: Tensor, rollout_mask_sums: Tensor) -> Tensor:
    """Σ_i Σ_t x·m / max(D_i, 1): one token-mean per rollout, siblings sharing D_i."""
    return ((x * loss_mask).sum(-1) / rollout_mask_sums.clamp(min=1)).sum()


def sum_of_token(x: Tensor, loss_mask: Tensor) -> Tensor:
    """Σ_i Σ_t x·m, the per-token (DAPO) numerator."""
    return (x * loss_mask).sum()


@dataclass(frozen=True)
class StepReduction:
    """The default reducer of one step, outer normalisation included.

    Sample-mean mode (Miles default, GRPO): sum_of_sample_mean / number of rollouts.
    Per-token mode (`calculate_per_token_loss`, DAPO token_mean): sum_of_token /
    Σ_i max(Σ_t m_i, 1), Megatron's token count.
    """

    calculate_per_token_loss: bool
    denominator: float

    @classmethod
    def for_step(
        cls, loss_mask: Tensor, n_rollouts: int, *, calculate_per_token_loss: bool
    ) -> StepReduction:
        """Denominator from the whole step's `loss_mask` [B, T] and rollout count."""
        if calculate_per_token_loss:
            return cls(True, float(loss_mask.sum(-1).clamp(min=1).sum()))
        return cls(False, float(n_rollouts))

    def __call__(self, x: Tensor, loss_mask: Tensor, rollout_mask_sums: Tensor) -> Tensor:
        """A micro-batch's share of the step value of per-token `x` [b, T]."""
        if self.calculate_per_token_loss:
            total = sum_of_token(x, loss_mask)
        else:
            total = sum_of_sample_mean(x, loss_mask, rollout_mask_sums)
        return total / self.denominator


def get_dr_grpo_reducer(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[Tensor],
    calculate_per_token_loss: bool = False,
) -> Reducer:
    """Dr.GRPO pg-loss reducer: masked token sum over a constant instead of |o_i|.

    Use with `--custom-pg-loss-reducer-function-path trainer.reducers.get_dr_grpo_reducer`
    and run advantages without std normalisation. The result is divided by the step's
    rollout count like any sample-mean loss. In per-token mode it is the plain masked sum,
    which the outer normalisation turns into a token mean. Like the Miles example it sees
    no per-rollout denominators, so it is not compaction-aware (which Dr.GRPO does not need:
    its divisor is the same for every rollout).
    """
    del total_lengths, response_lengths  # part of the Miles signature, unused here
    mask = torch.cat(loss_masks) if loss_masks else torch.zeros(0)

    def reduce(x: Tensor) -> Tensor:
        total = (x * mask.to(x.dtype)).sum()
        return total if calculate_per_token_loss else total / DR_GRPO_DIVISOR

    return reduce


def load_pg_loss_reducer(path: str) -> ReducerFactory:
    """Import a reducer factory from `module.fn` or `module:fn`.

    Miles splits dotted paths at the last dot and rejects `module:fn`, although its own
    example README uses that form; both are accepted here.
    """
    return load_callable(path, "reducer")
