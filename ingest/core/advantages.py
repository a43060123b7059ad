"""Per-group advantages over unique rollouts (CONTRACT section 3, MILES_SEMANTICS section 9).

Owns the advantage formula, the check that all rows of a rollout share one reward, and
broadcasting a rollout's advantage to its rows. Arithmetic is float64 throughout, and the
group is centred on its first reward before averaging; the `training_batches.advantage`
column is float64, so the written values are reproducible across numpy builds and replays.

Miles normalizes float32 tensors instead, so the two differ where float32 rounding
dominates: for groups whose rewards differ by much more than float32's resolution they
agree to about 1e-5 relative, but a constant group gets exactly 0 here while Miles' mean
is off by an ulp, its std is ~6e-8 rather than 0, and eight rewards of 0.7 get +0.056
each there (docs/DESIGN.md, Miles quirks).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, NamedTuple

import numpy as np

from ingest.core.rewards import numeric_reward, rewards_equal

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageRow",
    "check_rollout_rewards",
    "numeric_reward",
    "rollout_advantages",
    "row_advantages",
]

Estimator = Literal["grpo", "gspo", "reinforce_plus_plus_baseline", "none"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "gspo", "reinforce_plus_plus_baseline", "none")
# Added to the std before dividing, as in Miles, so a tiny non-zero std stays finite.
STD_EPS = 1e-6


def rollout_advantages(
    rewards: Sequence[float], estimator: str, std_normalization: bool
) -> list[float]:
    """Advantages of one group's unique rollouts, one per reward, in the same order.

    grpo/gspo: `(r - mean) / (std_unbiased + 1e-6)` when `std_normalization`, more than one
    rollout and std > 0, else `r - mean`; reinforce_plus_plus_baseline: `r - mean` (never
    divided); none: `r`.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage_estimator {estimator!r}; expected one of "
            f"{', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return []
    if estimator == "none":
        return r.tolist()
    # Centre on the first reward before averaging: exact zeros for a constant group (a plain
    # float mean of 9 equal values can be off by an ulp) and less cancellation otherwise.
    shifted = r - r[0]
    a = shifted - shifted.mean()
    if estimator in ("grpo", "gspo") and std_normalization and r.size > 1:
        std = float(shifted.std(ddof=1))
        if std > 0:
            a = a / (std + STD_EPS)
    return a.tolist()


def check_rollout_rewards(
    rollout_id: Hashable, rewards: Sequence[float], rows: Sequence[int] | None = None
) -> float:
    """The one reward all rows of a rollout share; ValueError (Miles' message) if they differ.

    `rows` are the row positions named in the message (default 0..len-1).
    """
    if not rewards:
        raise ValueError(f"rollout {rollout_id} has no rows")
    positions = list(range(len(rewards))) if rows is None else list(rows)
    first = rewards[0]
    if any(not rewards_equal(float(x), float(first)) for x in rewards[1:]):
        raise ValueError(
            f"all samples in rollout {rollout_id} must share one reward; "
            f"rows {positions} have rewards {list(rewards)}"
        )
    return first


class AdvantageRow(NamedTuple):
    """One training row as advantage computation needs it (reward already read as float)."""

    group_index: int | None
    rollout_id: Hashable | None  # None: the row is its own rollout
    reward: float


def row_advantages(
    rows: Sequence[AdvantageRow], estimator: str, std_normalization: bool
) -> list[float]:
    """Per-row advantages for a batch: Miles train-data conversion over unique rollouts.

    Rows are grouped by `group_index` in first-seen order (rows of a group need not be
    contiguous; a row without a group_index forms a group of its own), bucketed by
    `rollout_id` within the group, each rollout's reward checked to be shared
    (`check_rollout_rewards`), and each rollout's advantage broadcast to its rows.
    """
    groups: dict[Hashable, list[int]] = {}
    for pos, row in enumerate(rows):
        gkey: Hashable = ("row", pos) if row.group_index is None else row.group_index
        groups.setdefault(gkey, []).append(pos)

    out = [0.0] * len(rows)
    for positions in groups.values():
        buckets: dict[tuple[str, Hashable], list[int]] = {}
        for pos in positions:
            rid = rows[pos].rollout_id
            buckets.setdefault(("row", pos) if rid is None else ("id", rid), []).append(pos)
        rollout_rewards = [
            check_rollout_rewards(
                key[1] if key[0] == "id" else f"row {key[1]}",
                [rows[p].reward for p in members],
                members,
            )
            for key, members in buckets.items()
        ]
        advantages = rollout_advantages(rollout_rewards, estimator, std_normalization)
        for members, adv in zip(buckets.values(), advantages, strict=True):
            for pos in members:
                out[pos] = adv
    return out
