"""Advantages over unique rollouts (CONTRACT 3, MILES_SEMANTICS 9) and reward reading."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ingest.core.advantages import (
    AdvantageRow,
    check_rollout_rewards,
    rollout_advantages,
    row_advantages,
)
from ingest.core.rewards import is_missing_reward, numeric_reward

CENTRED = ("grpo", "gspo", "reinforce_plus_plus_baseline")
ALL = (*CENTRED, "none")


def rows(*spec: tuple[Any, Any, float]) -> list[AdvantageRow]:
    return [AdvantageRow(g, rid, r) for g, rid, r in spec]


# ---------------------------------------------------------------- rollout_advantages


@pytest.mark.parametrize(
    ("rewards", "estimator", "std", "expected"),
    [
        ([1, 2, 3, 4], "grpo", False, [-1.5, -0.5, 0.5, 1.5]),
        ([10, 20, 30, 40], "grpo", False, [-15, -5, 5, 15]),
        ([1, 2, 3, 4], "grpo", True, [-1.16189, -0.38730, 0.38730, 1.16189]),
        ([1, 2, 3, 4], "gspo", True, [-1.16189, -0.38730, 0.38730, 1.16189]),
        ([1, 2, 3, 4], "reinforce_plus_plus_baseline", True, [-1.5, -0.5, 0.5, 1.5]),
        ([3, 3, 3, 3], "grpo", True, [0, 0, 0, 0]),  # std 0: no division
        ([0, 1], "grpo", True, [-0.70711, 0.70711]),
        ([1, 2, 3, 4], "none", True, [1, 2, 3, 4]),
        ([0.5, -1.0], "none", False, [0.5, -1.0]),
        ([5.0], "grpo", True, [0.0]),  # one rollout: centred only
        ([5.0], "none", True, [5.0]),
        ([], "grpo", True, []),
    ],
)
def test_rollout_advantages_table(
    rewards: list[float], estimator: str, std: bool, expected: list[float]
):
    got = rollout_advantages(rewards, estimator, std)
    assert got == pytest.approx(expected, abs=1e-5)
    assert all(type(x) is float for x in got)


def test_std_epsilon_is_added_to_the_divisor():
    # std of [0, 2] is sqrt(2); the result is 1 / (sqrt(2) + 1e-6), not 1 / sqrt(2).
    got = rollout_advantages([0.0, 2.0], "grpo", True)
    assert got[1] == pytest.approx(1.0 / (math.sqrt(2) + 1e-6), rel=1e-12)
    assert got[1] != pytest.approx(1.0 / math.sqrt(2), rel=1e-9)


def test_tiny_nonzero_std_is_divided():
    got = rollout_advantages([1.0, 1.0 + 1e-9], "grpo", True)
    std = float(np.std([1.0, 1.0 + 1e-9], ddof=1))
    assert got[1] == pytest.approx(0.5e-9 / (std + 1e-6), rel=1e-3)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="unknown advantage_estimator 'ppo'"):
        rollout_advantages([1.0, 2.0], "ppo", True)


# ---------------------------------------------------------------- row_advantages (MILES 9)


@pytest.mark.parametrize(
    ("spec", "estimator", "std", "expected"),
    [
        (
            [(0, i, r) for i, r in enumerate([1, 2, 3, 4])]
            + [(1, i, r) for i, r in enumerate([10, 20, 30, 40])],
            "grpo",
            False,
            [-1.5, -0.5, 0.5, 1.5, -15, -5, 5, 15],
        ),
        (
            [(0, 10, 0), (0, 11, 1), (0, 11, 1), (0, 11, 1), (1, 20, 2), (1, 20, 2), (1, 21, 4)],
            "grpo",
            False,
            [-0.5, 0.5, 0.5, 0.5, -1, -1, 1],
        ),
        # std over 2 rollouts, not 3 rows
        ([(0, 10, 0), (0, 11, 1), (0, 11, 1)], "grpo", True, [-0.70711, 0.70711, 0.70711]),
        # the two 2s are siblings of one rollout
        ([(0, 1, 2), (0, 1, 2), (0, 2, 6)], "grpo", False, [-2, -2, 2]),
        # group_index need not be contiguous
        ([(0, 0, 0), (1, 1, 10), (0, 2, 2), (1, 3, 14)], "grpo", False, [-1, -2, 1, 2]),
        # rows with no rollout_id: each row is its own rollout
        ([(0, None, 0), (0, None, 2)], "grpo", False, [-1, 1]),
        # the same rollout_id in two groups is two rollouts
        ([(0, 5, 1), (0, 6, 3), (1, 5, 10), (1, 6, 20)], "grpo", False, [-1, 1, -5, 5]),
        ([(0, 0, 1), (0, 1, 2)], "none", True, [1, 2]),
        ([(0, 0, 1), (0, 1, 2), (0, 1, 2)], "reinforce_plus_plus_baseline", True, [-0.5, 0.5, 0.5]),
        ([], "grpo", True, []),
    ],
)
def test_row_advantages_table(
    spec: list[tuple[Any, Any, float]], estimator: str, std: bool, expected: list[float]
):
    assert row_advantages(rows(*spec), estimator, std) == pytest.approx(expected, abs=1e-5)


def test_dict_rewards_read_through_reward_key_then_normalized():
    raw = [{"score": 2, "x": 0}, {"score": 2, "x": 1}, {"score": 6}]
    values = [numeric_reward(r, "score") for r in raw]
    assert values == [2.0, 2.0, 6.0]
    spec = [(0, 1, values[0]), (0, 1, values[1]), (0, 2, values[2])]
    assert row_advantages(rows(*spec), "grpo", False) == pytest.approx([-2, -2, 2])


def test_siblings_with_different_rewards_raise_miles_message():
    spec = [(0, 10, 0.0), (0, 11, 2.0), (0, 11, 6.0)]
    with pytest.raises(ValueError) as info:
        row_advantages(rows(*spec), "grpo", True)
    assert str(info.value) == (
        "all samples in rollout 11 must share one reward; rows [1, 2] have rewards [2.0, 6.0]"
    )


def test_check_rollout_rewards():
    assert check_rollout_rewards(3, [1.5, 1.5, 1.5]) == 1.5
    assert math.isnan(check_rollout_rewards(3, [math.nan, math.nan]))
    with pytest.raises(ValueError) as info:
        check_rollout_rewards(7, [1.0, 1.0, 0.0])
    assert str(info.value) == (
        "all samples in rollout 7 must share one reward; rows [0, 1, 2] have rewards "
        "[1.0, 1.0, 0.0]"
    )
    with pytest.raises(ValueError, match=r"rows \[4, 9\] have rewards \[1.0, 2.0\]"):
        check_rollout_rewards(7, [1.0, 2.0], rows=[4, 9])
    with pytest.raises(ValueError, match="has no rows"):
        check_rollout_rewards(7, [])


# ---------------------------------------------------------------- reward reading


@pytest.mark.parametrize(
    ("reward", "key", "expected"),
    [
        (None, None, None),
        (True, None, 1.0),
        (False, None, 0.0),
        (3, None, 3.0),
        (0.5, None, 0.5),
        (0.5, "score", 0.5),
        ({"score": 2}, "score", 2.0),
        ({"score": True}, "score", 1.0),
        ({"score": 2}, None, None),
        ({"other": 1}, "score", None),
        ({"score": None}, "score", None),
        ({"score": "x"}, "score", None),
        ({"score": {"inner": 1}}, "score", None),
        ("1.0", None, None),
        ([1.0], None, None),
    ],
)
def test_numeric_reward(reward: Any, key: str | None, expected: float | None):
    got = numeric_reward(reward, key)
    assert got == expected
    assert got is None or type(got) is float


@pytest.mark.parametrize(
    ("reward", "key", "missing"),
    [
        (None, None, True),
        (None, "score", True),
        (0.0, None, False),
        (0, "score", False),
        (False, None, False),
        ({"score": 1.0}, None, True),
        ({"score": 1.0}, "", True),
        ({"other": 1.0}, "score", True),
        ({"score": None}, "score", True),
        ({"score": 0.0}, "score", False),
    ],
)
def test_is_missing_reward(reward: Any, key: str | None, missing: bool):
    assert is_missing_reward(reward, key) is missing


# ---------------------------------------------------------------- properties

reward_values = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)
reward_lists = st.lists(reward_values, min_size=1, max_size=16)


@given(reward_lists, st.sampled_from(CENTRED), st.booleans())
def test_centred_advantages_sum_to_zero(rewards: list[float], estimator: str, std: bool):
    adv = rollout_advantages(rewards, estimator, std)
    assert len(adv) == len(rewards)
    assert abs(sum(adv)) <= 1e-9 * len(rewards) * max(1.0, max(abs(r) for r in rewards))


@given(reward_lists, st.sampled_from(ALL), st.booleans(), st.randoms())
def test_advantages_are_permutation_equivariant(
    rewards: list[float], estimator: str, std: bool, rnd: Any
):
    order = list(range(len(rewards)))
    rnd.shuffle(order)
    base = rollout_advantages(rewards, estimator, std)
    permuted = rollout_advantages([rewards[i] for i in order], estimator, std)
    assert permuted == pytest.approx([base[i] for i in order], rel=1e-9, abs=1e-9)


@given(reward_values, st.integers(1, 16), st.sampled_from(CENTRED), st.booleans())
def test_constant_rewards_give_zero_advantages(value: float, n: int, estimator: str, std: bool):
    assert rollout_advantages([value] * n, estimator, std) == [0.0] * n


@given(reward_lists, st.booleans())
def test_none_estimator_is_identity(rewards: list[float], std: bool):
    assert rollout_advantages(rewards, "none", std) == rewards


@given(st.lists(reward_values, min_size=2, max_size=16).filter(lambda r: np.std(r, ddof=1) > 1e-3))
def test_std_normalized_advantages_have_unit_scale(rewards: list[float]):
    std = float(np.std(rewards, ddof=1))
    adv = rollout_advantages(rewards, "grpo", True)
    # Dividing by std + 1e-6 gives an unbiased std of std / (std + 1e-6).
    assert float(np.std(adv, ddof=1)) == pytest.approx(std / (std + 1e-6), rel=1e-9)


@given(reward_lists, st.floats(-100, 100, allow_nan=False), st.sampled_from(CENTRED))
def test_centred_advantages_ignore_a_shift(rewards: list[float], shift: float, estimator: str):
    base = rollout_advantages(rewards, estimator, True)
    shifted = rollout_advantages([r + shift for r in rewards], estimator, True)
    spread = max(rewards) - min(rewards)
    if spread == 0 or spread > 1e-3:  # skip rounding-dominated near-constant inputs
        assert shifted == pytest.approx(base, rel=1e-6, abs=1e-6)


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=24),
    st.sampled_from(ALL),
    st.booleans(),
)
def test_row_advantages_broadcast_and_match_rollout_level(
    keys: list[tuple[int, int]], estimator: str, std: bool
):
    # One reward per (group, rollout), repeated on every row of the rollout.
    reward_of = {k: float(k[0] * 10 + k[1] ** 2) for k in keys}
    batch = [AdvantageRow(g, rid, reward_of[(g, rid)]) for g, rid in keys]
    adv = row_advantages(batch, estimator, std)
    by_rollout: dict[tuple[int, int], set[float]] = {}
    for k, a in zip(keys, adv, strict=True):
        by_rollout.setdefault(k, set()).add(a)
    assert all(len(v) == 1 for v in by_rollout.values())  # siblings share an advantage
    for g in {k[0] for k in keys}:
        rids = list(dict.fromkeys(rid for gg, rid in keys if gg == g))
        expected = rollout_advantages([reward_of[(g, r)] for r in rids], estimator, std)
        assert [by_rollout[(g, r)].pop() for r in rids] == pytest.approx(expected)


def _miles_float32_grpo(rewards: list[float]) -> list[float]:
    """Miles' group normalization, transcribed: float32 tensors, unbiased std + 1e-6."""
    r = torch.tensor(rewards, dtype=torch.float32)
    return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


def test_agrees_with_miles_float32_on_ordinary_groups():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        rewards = (torch.rand(8, generator=gen, dtype=torch.float64) * 2 - 1).tolist()
        ours = rollout_advantages(rewards, "grpo", True)
        assert ours == pytest.approx(_miles_float32_grpo(rewards), rel=1e-5, abs=1e-5)


def test_constant_group_is_exactly_zero_where_miles_float32_is_not():
    # The documented difference (DESIGN, Miles quirks): float32 rounding gives Miles a
    # non-zero std for eight 0.7 rewards, and +0.056 per rollout.
    assert rollout_advantages([0.7] * 8, "grpo", True) == [0.0] * 8
    assert _miles_float32_grpo([0.7] * 8)[0] == pytest.approx(0.056, abs=1e-3)
