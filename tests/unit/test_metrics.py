"""Step metrics with Miles keys: every example table of MILES_SEMANTICS 8.1-8.4."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.core.metrics import (
    MetricRow,
    batch_metrics,
    drop_reason_metrics,
    metric_rows,
    offered_rewards,
    raw_reward_unfiltered,
    zero_std_metrics,
)
from ingest.core.model import FilterVerdict, Fragment, Group, Rollout

EP = "rollout/episode_response_length"
ZS = "rollout/zero_std"


def row(
    group: int = 0,
    index: int | None = 0,
    rollout_id: int | None = 0,
    reward: Any = 1.0,
    *,
    response_length: int = 4,
    loss_mask: list[int] | None = None,
    status: str = "completed",
    metadata: dict[str, Any] | None = None,
) -> MetricRow:
    if loss_mask is not None:
        response_length = len(loss_mask)
    return MetricRow(
        group_index=group,
        rollout_id=rollout_id,
        sample_index=index,
        reward=reward,
        response_length=response_length,
        effective_response_length=response_length if loss_mask is None else sum(loss_mask),
        status=status,
        metadata=metadata or {},
    )


def grouped(*groups: list[Any]) -> list[MetricRow]:
    """One singleton-rollout row per reward, group g getting group_index g."""
    out, index = [], 0
    for g, rewards in enumerate(groups):
        for rid, r in enumerate(rewards):
            out.append(row(g, index, rid, r))
            index += 1
    return out


def only(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(prefix)}


# ---------------------------------------------------------------- 8.1 filter stage


def test_drop_reason_metrics_counts_counted_drops_only():
    verdicts = [
        FilterVerdict(True),
        FilterVerdict(True, "kept_with_reason"),
        FilterVerdict(False, "zero_std_0.0"),
        FilterVerdict(False, "zero_std_0.0"),
        FilterVerdict(False, "group_has_aborted"),
        FilterVerdict(False, None, counted=False),
        FilterVerdict(False, "", counted=False),
        FilterVerdict(False, "cancelled_at_seal", counted=False),
    ]
    assert drop_reason_metrics(verdicts) == {
        "rollout/dynamic_filter/drop_zero_std_0.0": 2.0,
        "rollout/dynamic_filter/drop_group_has_aborted": 1.0,
    }


def test_drop_reason_metrics_has_no_zero_keys():
    assert drop_reason_metrics([]) == {}
    assert drop_reason_metrics(iter([FilterVerdict(True)] * 3)) == {}


def test_kept_and_dropped_groups_both_feed_unfiltered_reward():
    verdicts = [FilterVerdict(True), FilterVerdict(False, "zero_std_0")]
    assert drop_reason_metrics(verdicts) == {"rollout/dynamic_filter/drop_zero_std_0": 1.0}
    assert raw_reward_unfiltered([[1.0, 1.0], [0, 0]], None) == {
        "rollout/raw_reward_unfiltered": 0.5
    }


@pytest.mark.parametrize(
    ("offered", "reward_key", "expected"),
    [
        ([[{}, {"score": 0.5}]], "score", 0.5),  # the aborted sample's {} is skipped
        ([[1.0, 1.0], [0.0, 0.0]], None, 0.5),
        ([[[1.0], [0.0, 0.5]]], None, 0.5),  # nested: per fragment, not per rollout
        ([[{"reward_value": 0.25, "outcome": "x"}]], "reward_value", 0.25),
        ([[{"teacher": {"a": 1}, "student": {"a": 0}}]], None, None),
        ([], None, None),
        ([[1.0, None]], None, 1.0),
        ([[None, None]], None, None),
        ([[{"score": None}, {"score": 1}]], "score", 1.0),
        ([[True, False, 2]], None, 1.0),
        ([[1.0, 1.0, 1.0], [0.0]], None, 0.75),  # per fragment, so groups weigh by size
    ],
)
def test_raw_reward_unfiltered_table(offered: list[Any], reward_key: str | None, expected: Any):
    got = raw_reward_unfiltered(offered, reward_key)
    assert got == ({} if expected is None else {"rollout/raw_reward_unfiltered": expected})


def _group() -> Group:
    g = Group(run_id="r", group_index=5, started=True, n_samples=3, metadata={"src": "ds"})
    a = Rollout(rollout_id=0, status="truncated", reward={"score": 0.5}, sample_index=11)
    a.metadata = {"raw_reward": 0.25}
    for i in (1, 0):
        a.fragments[i] = Fragment(0, i, [1], [2] * (i + 2), loss_mask=[1] + [0] * (i + 1))
    b = Rollout(rollout_id=1, status="completed", reward={"score": 1.0}, sample_index=10)
    b.fragments[0] = Fragment(1, 0, [1], [3, 3, 3], metadata={"f": 1})
    c = Rollout(rollout_id=2, status="aborted", reward={}, sample_index=12)
    g.rollouts = {0: a, 1: b, 2: c}
    return g


def test_offered_rewards_counts_an_empty_aborted_rollout_once():
    rewards = offered_rewards(_group())
    assert rewards == [{"score": 1.0}, {"score": 0.5}, {"score": 0.5}, {}]
    assert raw_reward_unfiltered([rewards], "score") == {
        "rollout/raw_reward_unfiltered": pytest.approx(2.0 / 3)
    }


def test_metric_rows_from_group():
    rows = metric_rows(_group())
    assert [(r.rollout_id, r.sample_index) for r in rows] == [(1, 10), (0, 11), (0, 11)]
    assert [r.response_length for r in rows] == [3, 2, 3]
    assert [r.effective_response_length for r in rows] == [3, 1, 1]
    assert [r.status for r in rows] == ["completed", "truncated", "truncated"]
    assert rows[1].reward == rows[2].reward == {"score": 0.5}
    assert rows[0].metadata == {"src": "ds", "f": 1}
    assert rows[1].metadata == rows[2].metadata == {"src": "ds", "raw_reward": 0.25}
    assert all(r.group_index == 5 for r in rows)


# ---------------------------------------------------------------- 8.3 reward keys


@pytest.mark.parametrize(
    ("rows", "n", "episode"),
    [
        ([row(0, 0, 10, 1.0)] * 3 + [row(0, 1, 11, 0.0)], 4, 0.5),
        ([row(0, 0, 10, 0.0), row(0, 0, 10, 1.0), row(0, 1, 11, 1.0)], 3, 0.75),
        ([row(0, 0, 10, 1.0)] * 2 + [row(1, 1, 10, 0.0)], 3, 0.5),  # same id, two groups
        (
            [
                row(0, 5, None, 0.0, metadata={"raw_reward": 1.0}),
                row(0, None, None, 0.0, metadata={"raw_reward": 0.0}),
            ],
            2,
            0.5,
        ),
        ([], 0, 0.0),
        ([row(0, i, i, float(i)) for i in range(4)], 4, 1.5),
        ([row(0, 0, 0, {"a": 1.0}), row(0, 1, 1, {"a": 0.0})], 2, 0.0),  # no reward_key
    ],
)
def test_episode_reward_table(rows: list[MetricRow], n: int, episode: float):
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/num_training_samples"] == n
    assert m["rollout/episode_raw_reward"] == pytest.approx(episode)


def test_raw_reward_is_per_row_and_episode_is_per_rollout():
    rows = [row(0, 0, 10, 1.0)] * 3 + [row(0, 1, 11, 0.0)]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/raw_reward"] == 0.75
    assert m["rollout/episode_raw_reward"] == 0.5


def test_rows_without_any_id_fall_back_to_position():
    rows = [row(0, None, None, 1.0), row(0, None, None, 0.0), row(0, None, None, 0.0)]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/episode_raw_reward"] == pytest.approx(1 / 3)


def test_sample_index_key_when_rollout_id_missing():
    rows = [row(0, 4, None, 1.0), row(0, 4, None, 0.0), row(0, 5, None, 1.0)]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/episode_raw_reward"] == pytest.approx(0.75)


def test_reward_key_reads_dict_rewards():
    rows = [row(0, 0, 0, {"score": 1, "x": 9}), row(0, 1, 1, {"score": 0})]
    m = batch_metrics(rows, reward_key="score", advantage_estimator="grpo")
    assert m["rollout/raw_reward"] == 0.5 and m["rollout/episode_raw_reward"] == 0.5


def test_metadata_raw_reward_chosen_from_first_row_later_rows_without_it_skipped():
    # Quirk 12: Miles raises KeyError for the second row; we skip it.
    rows = [row(0, 0, 0, 0.0, metadata={"raw_reward": 1.0}), row(0, 1, 1, 0.0)]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/raw_reward"] == 1.0 and m["rollout/episode_raw_reward"] == 1.0
    assert m["rollout/num_training_samples"] == 2


def test_metadata_raw_reward_ignored_when_first_row_lacks_it():
    rows = [row(0, 0, 0, 0.0), row(0, 1, 1, 0.0, metadata={"raw_reward": 1.0})]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/raw_reward"] == 0.0


def test_non_numeric_rewards_are_skipped_and_all_non_numeric_omits_raw_reward():
    m = batch_metrics(
        [row(0, 0, 0, None), row(0, 1, 1, 1.0), row(0, 2, 2, {"a": 1})],
        reward_key=None,
        advantage_estimator="grpo",
    )
    assert m["rollout/raw_reward"] == 1.0 and m["rollout/episode_raw_reward"] == 1.0
    m = batch_metrics([row(0, 0, 0, None)], reward_key=None, advantage_estimator="grpo")
    assert "rollout/raw_reward" not in m and m["rollout/episode_raw_reward"] == 0.0


def test_empty_batch_has_only_count_and_episode_reward():
    assert batch_metrics([], reward_key=None, advantage_estimator="grpo") == {
        "rollout/num_training_samples": 0.0,
        "rollout/episode_raw_reward": 0.0,
    }


# ---------------------------------------------------------------- 8.3 length keys

LENGTH_ROWS = [
    row(0, 0, 10, loss_mask=[1, 1, 0, 0, 0]),
    row(0, 0, 10, loss_mask=[1, 1, 1, 0, 0, 0, 0]),
    row(0, 1, 11, loss_mask=[1] * 4),
    row(1, 2, 10, loss_mask=[1] * 6 + [0] * 2),
]


def test_episode_lengths_four_rows():
    m = batch_metrics(LENGTH_ROWS, reward_key=None, advantage_estimator="grpo")
    assert only(m, EP) == {f"{EP}/mean": 5.0, f"{EP}/median": 5.0, f"{EP}/max": 6.0, f"{EP}/min": 4.0}
    assert m["rollout/episode_total_response_length/mean"] == 8.0
    # Per row: effective lengths 2, 3, 4, 6.
    assert only(m, "rollout/response_len") == {
        "rollout/response_len/mean": 3.75,
        "rollout/response_len/median": 3.5,
        "rollout/response_len/max": 6.0,
        "rollout/response_len/min": 2.0,
    }


def test_episode_lengths_first_three_rows():
    m = batch_metrics(LENGTH_ROWS[:3], reward_key=None, advantage_estimator="grpo")
    assert m[f"{EP}/mean"] == 4.5
    assert m["rollout/episode_total_response_length/mean"] == 8.0


def test_truncated_ratio():
    rows = [row(status="truncated"), row(status="completed"), row(status="truncated"), row()]
    assert batch_metrics(rows, reward_key=None, advantage_estimator="grpo")[
        "rollout/truncated_ratio"
    ] == 0.5


# ---------------------------------------------------------------- 8.4 zero-std keys


def zs(*groups: list[Any], reward_key: str | None = None, est: str = "grpo") -> dict[str, float]:
    return zero_std_metrics(grouped(*groups), reward_key=reward_key, advantage_estimator=est)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (
            [[0.0, 0.5, 1.0, 0.7], [0.2, 0.8, 0.3, 0.6]],
            {f"{ZS}/all_zero_percentage": 0.0, f"{ZS}/all_one_percentage": 0.0},
        ),
        (
            [[1.0] * 4, [0.0] * 4, [0.0, 1.0, 0.0, 1.0]],
            {
                f"{ZS}/count_1.0": 1.0,
                f"{ZS}/count_0.0": 1.0,
                f"{ZS}/all_zero_percentage": 1 / 3,
                f"{ZS}/all_one_percentage": 1 / 3,
            },
        ),
        (
            [[0.5] * 4, [0.5] * 4],
            {f"{ZS}/count_0.5": 2.0, f"{ZS}/all_zero_percentage": 0.0, f"{ZS}/all_one_percentage": 0.0},
        ),
        (
            [[0.0, 0.0], [1.0, 1.0], [0.0, 1.0]],
            {
                f"{ZS}/count_0.0": 1.0,
                f"{ZS}/count_1.0": 1.0,
                f"{ZS}/all_zero_percentage": 1 / 3,
                f"{ZS}/all_one_percentage": 1 / 3,
            },
        ),
        (  # int rewards: buckets 0/1, so both percentages read 0 (quirk 11, kept)
            [[0, 0], [1, 1]],
            {
                f"{ZS}/count_0": 1.0,
                f"{ZS}/count_1": 1.0,
                f"{ZS}/all_zero_percentage": 0.0,
                f"{ZS}/all_one_percentage": 0.0,
            },
        ),
        (
            [[0.0], [1.0]],
            {
                f"{ZS}/count_0.0": 1.0,
                f"{ZS}/count_1.0": 1.0,
                f"{ZS}/all_zero_percentage": 0.5,
                f"{ZS}/all_one_percentage": 0.5,
            },
        ),
        (  # exact equality, unlike the filter's 1e-8
            [[1.0, 1.0 + 1e-12]],
            {f"{ZS}/all_zero_percentage": 0.0, f"{ZS}/all_one_percentage": 0.0},
        ),
        (
            [[0.96, 0.96], [True, True]],
            {
                f"{ZS}/count_1.0": 1.0,
                f"{ZS}/count_1": 1.0,
                f"{ZS}/all_zero_percentage": 0.0,
                f"{ZS}/all_one_percentage": 0.5,
            },
        ),
    ],
)
def test_zero_std_table(groups: list[list[Any]], expected: dict[str, float]):
    assert zs(*groups) == pytest.approx(expected)
    full = batch_metrics(grouped(*groups), reward_key=None, advantage_estimator="grpo")
    assert only(full, ZS) == pytest.approx(expected)


def test_zero_std_absent_for_ppo_and_no_rows():
    assert zs([1.0, 1.0], [0.0, 0.0], est="ppo") == {}
    assert only(batch_metrics(grouped([1.0, 1.0]), reward_key=None, advantage_estimator="ppo"), ZS) == {}
    assert zs() == {}


@pytest.mark.parametrize("bad", [{"score": 1.0}, None, "1.0"])
def test_any_non_numeric_reward_suppresses_zero_std(bad: Any):
    assert zs([0.0, 0.0], [1.0, 1.0], [0.0, bad]) == {}


def test_zero_std_reads_dict_rewards_through_reward_key():
    got = zs([{"score": 1.0}, {"score": 1.0}], [{"score": 0.0}, {"score": 1}], reward_key="score")
    assert got == {
        f"{ZS}/count_1.0": 1.0,
        f"{ZS}/all_zero_percentage": 0.0,
        f"{ZS}/all_one_percentage": 0.5,
    }
    assert zs([{"other": 1.0}, {"score": 1.0}], reward_key="score") == {}


def test_zero_std_groups_by_group_index_not_contiguity():
    rows = [row(0, 0, 0, 1.0), row(1, 1, 0, 0.0), row(0, 2, 1, 1.0), row(1, 3, 1, 1.0)]
    assert zero_std_metrics(rows, reward_key=None, advantage_estimator="grpo") == {
        f"{ZS}/count_1.0": 1.0,
        f"{ZS}/all_zero_percentage": 0.0,
        f"{ZS}/all_one_percentage": 0.5,
    }


# ---------------------------------------------------------------- properties

rewards_st = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(-2, 2, allow_nan=False))
row_st = st.builds(
    row,
    group=st.integers(0, 3),
    index=st.integers(0, 20),
    rollout_id=st.integers(0, 3),
    reward=rewards_st,
    response_length=st.integers(0, 50),
    status=st.sampled_from(["completed", "truncated"]),
)


@given(st.lists(row_st, max_size=20))
def test_batch_metric_invariants(rows: list[MetricRow]):
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/num_training_samples"] == len(rows)
    assert all(isinstance(v, float) for v in m.values())
    if not rows:
        return
    for prefix in (EP, "rollout/response_len"):
        assert m[f"{prefix}/min"] <= m[f"{prefix}/median"] <= m[f"{prefix}/max"]
        assert m[f"{prefix}/min"] <= m[f"{prefix}/mean"] <= m[f"{prefix}/max"]
    assert 0.0 <= m["rollout/truncated_ratio"] <= 1.0
    n_groups = len({r.group_index for r in rows})
    counts = sum(v for k, v in m.items() if k.startswith(f"{ZS}/count_"))
    assert counts <= n_groups
    assert m[f"{ZS}/all_zero_percentage"] + m[f"{ZS}/all_one_percentage"] <= 1.0 + 1e-12
    lo, hi = min(r.reward for r in rows), max(r.reward for r in rows)
    assert lo - 1e-12 <= m["rollout/episode_raw_reward"] <= hi + 1e-12


@given(st.lists(st.tuples(rewards_st, st.integers(0, 40)), min_size=1, max_size=20))
def test_singleton_rollouts_episode_keys_equal_row_keys(items: list[tuple[float, int]]):
    rows = [row(0, i, i, r, response_length=n) for i, (r, n) in enumerate(items)]
    m = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    assert m["rollout/episode_raw_reward"] == pytest.approx(m["rollout/raw_reward"])
    for stat in ("mean", "median", "max", "min"):
        assert m[f"{EP}/{stat}"] == m[f"rollout/response_len/{stat}"]
    assert m["rollout/episode_total_response_length/mean"] == pytest.approx(
        float(np.mean([n for _, n in items]))
    )


@given(st.lists(row_st, min_size=1, max_size=20), st.randoms())
def test_metrics_do_not_depend_on_row_order(rows: list[MetricRow], rnd: Any):
    shuffled = rows[:]
    rnd.shuffle(shuffled)
    a = batch_metrics(rows, reward_key=None, advantage_estimator="grpo")
    b = batch_metrics(shuffled, reward_key=None, advantage_estimator="grpo")
    # Zero-std buckets use a group's first reward, which shuffling may change.
    a = {k: v for k, v in a.items() if not k.startswith(ZS)}
    b = {k: v for k, v in b.items() if not k.startswith(ZS)}
    assert a == pytest.approx(b)


@given(st.lists(st.lists(rewards_st, min_size=1, max_size=6), min_size=1, max_size=6))
def test_raw_reward_unfiltered_is_the_flat_mean(groups: list[list[float]]):
    flat = [r for g in groups for r in g]
    got = raw_reward_unfiltered(groups, None)["rollout/raw_reward_unfiltered"]
    assert got == pytest.approx(float(np.mean(flat)))
