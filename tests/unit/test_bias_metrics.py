"""Bias-aware step metrics over hand-built decided groups."""

from __future__ import annotations

import pytest

from ingest.core.bias_metrics import GroupSummary, bias_metrics


def kept(*lengths: int) -> GroupSummary:
    return GroupSummary("kept", None, lengths, ["completed"] * len(lengths))


def dropped(reason: str, *lengths: int) -> GroupSummary:
    return GroupSummary("dropped", reason, lengths, ["completed"] * len(lengths))


def cancelled(lengths: list[int], statuses: list[str]) -> GroupSummary:
    return GroupSummary("dropped", "cancelled_at_seal", lengths, statuses, cancelled_at_seal=True)


def test_seed_like_step_counts_cancelled_apart_and_shows_completion_bias():
    # 6 prompts issued: 2 kept, 1 dropped all-right, 2 cancelled at seal, 1 never decided.
    groups = [
        kept(100, 120),
        kept(80, 90),
        dropped("zero_std_1.0", 40, 60),
        cancelled([300, 900], ["completed", "aborted"]),
        cancelled([700, 1100], ["aborted", "aborted"]),
    ]
    out = bias_metrics(groups, groups_issued=6)
    assert out["rollout/cancelled/groups"] == 2.0
    assert out["rollout/cancelled/samples"] == 3.0  # only the aborted fragments
    assert out["rollout/cancelled/mean_partial_response_length"] == pytest.approx(900.0)
    assert out["rollout/completion_bias"] == pytest.approx(3 / 6)
    assert out["rollout/response_len_kept/mean"] == pytest.approx(97.5)
    # The cancelled groups are not "dropped by the filter": their long answers stay out.
    assert out["rollout/response_len_dropped/mean"] == pytest.approx(50.0)


def test_unfiltered_complete_step_has_zero_bias_and_no_optional_means():
    out = bias_metrics([kept(10, 30), kept(20, 20)], groups_issued=2)
    assert out == {
        "rollout/cancelled/groups": 0.0,
        "rollout/cancelled/samples": 0.0,
        "rollout/completion_bias": 0.0,
        "rollout/response_len_kept/mean": 20.0,
    }


def test_timeouts_count_against_completion_and_surplus_is_neither_kept_nor_dropped():
    groups = [
        kept(10),
        GroupSummary("dropped", "group_timeout", [5], ["aborted"]),
        GroupSummary("surplus", None, [1000], ["completed"]),
    ]
    out = bias_metrics(groups, groups_issued=4)
    assert out["rollout/completion_bias"] == pytest.approx(2 / 4)  # timeout + undecided
    assert out["rollout/response_len_kept/mean"] == 10.0
    assert out["rollout/response_len_dropped/mean"] == 5.0


def test_no_issued_groups_leaves_completion_bias_absent():
    out = bias_metrics([], groups_issued=0)
    assert out == {"rollout/cancelled/groups": 0.0, "rollout/cancelled/samples": 0.0}


def test_mismatched_fragment_lists_are_a_caller_error():
    with pytest.raises(ValueError):
        bias_metrics([cancelled([1, 2], ["aborted"])], groups_issued=1)
