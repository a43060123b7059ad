"""Step metrics with Miles' keys (CONTRACT section 5, MILES_SEMANTICS section 8).

Owns the filter-stage keys (`rollout/dynamic_filter/drop_<reason>`,
`rollout/raw_reward_unfiltered`) and the batch keys computed over a sealed batch's rows
(`rollout/raw_reward`, episode, length, truncation and zero-std keys). Counting keys that
need the processor's bookkeeping (`groups_offered`, `perf/rollout_time`, ...) live with it.

Quirk choices (MILES_SEMANTICS section 12), stated once here:
- 12: the `metadata["raw_reward"]` source is chosen from the first row; a later row
  without it is skipped instead of raising KeyError.
- 11: zero-std groups use exact equality and `str(round(first, 1))` buckets, so int
  rewards give buckets `0`/`1` and both percentages read 0 (Miles behaviour, kept).
- 14: `rollout/raw_reward` stays per row; `rollout/episode_raw_reward` is per rollout.
- Non-numeric rewards (null, objects without the key) are skipped by every mean; a mean
  with nothing numeric to average is absent, except `episode_raw_reward`, which is 0.0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingest.core.model import FilterVerdict, Group
from ingest.core.rewards import is_numeric, numeric_reward

Metrics = dict[str, float]


@dataclass(slots=True)
class MetricRow:
    """One training row (fragment) of a batch, as the batch metrics read it."""

    group_index: int
    rollout_id: int | None
    sample_index: int | None
    reward: Any  # raw: int / float / bool / dict / None
    response_length: int
    effective_response_length: int
    status: str  # completed / truncated / aborted
    metadata: dict[str, Any] = field(default_factory=dict)


def metric_rows(group: Group) -> list[MetricRow]:
    """A group's rows in Miles order: its rollouts' fragments, each with the rollout reward.

    Metadata is the group's, then the rollout's, then the fragment's (later wins), so a
    `raw_reward` sent with `sample_finished` reaches every fragment of the rollout.
    """
    rows: list[MetricRow] = []
    for rollout in group.ordered_rollouts():
        for fragment in rollout.ordered_fragments():
            rows.append(
                MetricRow(
                    group_index=group.group_index,
                    rollout_id=rollout.rollout_id,
                    sample_index=rollout.sample_index,
                    reward=rollout.reward,
                    response_length=fragment.response_length,
                    effective_response_length=fragment.effective_response_length,
                    status=rollout.status or "",
                    metadata={**group.metadata, **rollout.metadata, **fragment.metadata},
                )
            )
    return rows


def offered_rewards(group: Group) -> list[Any]:
    """Raw rewards of every flattened sample of a group offered to the chain (for 8.1).

    A rollout with no fragments (aborted before any output) is still one sample.
    """
    out: list[Any] = []
    for rollout in group.ordered_rollouts():
        out.extend([rollout.reward] * max(1, len(rollout.fragments)))
    return out


# ---------------------------------------------------------------- filter stage (8.1)


def drop_reason_metrics(verdicts: Iterable[FilterVerdict]) -> Metrics:
    """`rollout/dynamic_filter/drop_<reason>` per counted drop; no key for a reason unseen."""
    counts = Counter(
        v.reason for v in verdicts if not v.keep and v.counted and v.reason
    )
    return {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in counts.items()}


def _flat(rewards: Iterable[Any]) -> Iterable[Any]:
    # A reward is never a list (CONTRACT 2), so nested lists are Miles trajectory nesting.
    for r in rewards:
        if isinstance(r, list):
            yield from _flat(r)
        else:
            yield r


def raw_reward_unfiltered(offered: Iterable[Sequence[Any]], reward_key: str | None) -> Metrics:
    """`rollout/raw_reward_unfiltered`: per-fragment mean over every offered group.

    Each element is one group's raw rewards (nested lists are flattened). Rewards with no
    numeric value are skipped; with none counted the key is absent.
    """
    values = [
        v
        for group in offered
        for r in _flat(group)
        if (v := numeric_reward(r, reward_key)) is not None
    ]
    if not values:
        return {}
    return {"rollout/raw_reward_unfiltered": float(np.mean(values))}


# ---------------------------------------------------------------- batch keys (8.2-8.4)


def _stats(prefix: str, values: Sequence[float]) -> Metrics:
    arr = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}/mean": float(arr.mean()),
        f"{prefix}/median": float(np.median(arr)),
        f"{prefix}/max": float(arr.max()),
        f"{prefix}/min": float(arr.min()),
    }


def _rollout_key(row: MetricRow, position: int) -> Hashable:
    # PR 2710: the same rollout_id in two groups is two episodes.
    if row.rollout_id is not None:
        return ("rollout", row.group_index, row.rollout_id)
    if row.sample_index is not None:
        return ("sample", row.group_index, row.sample_index)
    return ("position", row.group_index, position)


def _row_rewards(rows: Sequence[MetricRow], reward_key: str | None) -> list[float | None]:
    """Each row's numeric reward, from the source the first row selects (quirk 12)."""
    if "raw_reward" in rows[0].metadata:
        return [
            numeric_reward(row.metadata["raw_reward"], reward_key)
            if "raw_reward" in row.metadata
            else None  # Miles raises KeyError here; a skipped row is kinder to a dashboard
            for row in rows
        ]
    return [numeric_reward(row.reward, reward_key) for row in rows]


def _reward_metrics(rows: Sequence[MetricRow], reward_key: str | None) -> Metrics:
    out: Metrics = {"rollout/num_training_samples": float(len(rows))}
    if not rows:
        out["rollout/episode_raw_reward"] = 0.0
        return out
    rewards = _row_rewards(rows, reward_key)
    numeric = [r for r in rewards if r is not None]
    if numeric:
        out["rollout/raw_reward"] = float(np.mean(numeric))
    per_rollout: dict[Hashable, list[float]] = {}
    for pos, (row, r) in enumerate(zip(rows, rewards, strict=True)):
        if r is not None:
            per_rollout.setdefault(_rollout_key(row, pos), []).append(r)
    episode = [float(np.mean(v)) for v in per_rollout.values()]
    out["rollout/episode_raw_reward"] = float(np.mean(episode)) if episode else 0.0
    return out


def _length_metrics(rows: Sequence[MetricRow]) -> Metrics:
    if not rows:
        return {}
    effective: dict[Hashable, int] = {}
    total: dict[Hashable, int] = {}
    for pos, row in enumerate(rows):
        key = _rollout_key(row, pos)
        effective[key] = effective.get(key, 0) + row.effective_response_length
        total[key] = total.get(key, 0) + row.response_length
    out = _stats("rollout/episode_response_length", list(effective.values()))
    out["rollout/episode_total_response_length/mean"] = float(np.mean(list(total.values())))
    out.update(_stats("rollout/response_len", [r.effective_response_length for r in rows]))
    truncated = sum(1 for r in rows if r.status == "truncated")
    out["rollout/truncated_ratio"] = truncated / len(rows)
    return out


def zero_std_metrics(
    rows: Sequence[MetricRow], *, reward_key: str | None, advantage_estimator: str
) -> Metrics:
    """`rollout/zero_std/*` (MILES_SEMANTICS 8.4), over rows grouped by `group_index`.

    A group is zero-std when every reward exactly equals its first (the filter uses 1e-8);
    bucket `str(round(first, 1))`. Absent for `ppo`, for no rows, and when any reward is
    not numeric. Rewards are read through `reward_key`, not `metadata["raw_reward"]`.
    """
    if advantage_estimator == "ppo" or not rows:
        return {}
    groups: dict[int, list[Any]] = {}
    for row in rows:
        reward = row.reward
        # A dict without the key is non-numeric here (it suppresses the keys), not KeyError.
        value = reward.get(reward_key) if isinstance(reward, dict) and reward_key else reward
        if not is_numeric(value):
            return {}
        groups.setdefault(row.group_index, []).append(value)
    buckets: Counter[str] = Counter()
    for values in groups.values():
        first = values[0]
        if all(v == first for v in values):
            buckets[str(round(first, 1))] += 1
    out: Metrics = {f"rollout/zero_std/count_{b}": float(n) for b, n in buckets.items()}
    out["rollout/zero_std/all_zero_percentage"] = buckets.get("0.0", 0) / len(groups)
    out["rollout/zero_std/all_one_percentage"] = buckets.get("1.0", 0) / len(groups)
    return out


def batch_metrics(
    rows: Sequence[MetricRow], *, reward_key: str | None, advantage_estimator: str
) -> Metrics:
    """Every batch key of one sealed step over its rows in batch order (MILES 8.2-8.4).

    `rollout/raw_reward` (per row), `rollout/num_training_samples`,
    `rollout/episode_raw_reward` (per rollout, PR 2710), `rollout/episode_response_length/*`,
    `rollout/episode_total_response_length/mean`, `rollout/response_len/*`,
    `rollout/truncated_ratio` and `rollout/zero_std/*`. An empty batch gives only
    `num_training_samples` 0 and `episode_raw_reward` 0.0.
    """
    out = _reward_metrics(rows, reward_key)
    out.update(_length_metrics(rows))
    out.update(
        zero_std_metrics(rows, reward_key=reward_key, advantage_estimator=advantage_estimator)
    )
    return out
