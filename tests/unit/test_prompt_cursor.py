"""The prompt cursor's order and roll-forward (pure: no Kafka, no Delta, no HTTP)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.prompts.cursor import Cursor, Issued, roll_forward, take
from schemas.errors import InconsistentStateError


def cursor(**fields) -> Cursor:
    return Cursor(**{"run_id": "r", "seq": 0, "dataset": "d", "dataset_version": 3,
                     "seed": 7, "shuffle": True, **fields})


def rows(issued: list[Issued]) -> list[int]:
    return [i.row for i in issued]


def test_epochs_are_the_seeded_permutations_rolled_over():
    after, issued = take(cursor(), 5, 12)
    epochs = [np.random.default_rng(7 + e).permutation(5).tolist() for e in range(3)]
    assert rows(issued) == (epochs[0] + epochs[1] + epochs[2])[:12]
    assert [i.epoch for i in issued] == [0] * 5 + [1] * 5 + [2] * 2
    assert [i.group_index for i in issued] == list(range(12))
    assert (after.epoch, after.offset, after.next_group_index) == (2, 2, 12)


def test_unshuffled_serves_the_original_order():
    _, issued = take(cursor(shuffle=False, offset=3), 4, 6)
    assert rows(issued) == [3, 0, 1, 2, 3, 0]


def test_recycled_groups_come_first_then_the_epoch_continues():
    start = cursor(shuffle=False, next_group_index=10, offset=1,
                   recycle_rows=(4, 2, 9), recycle_groups=(3, 1, 8))
    after, issued = take(start, 12, 2)
    assert issued == [Issued(10, 4, None, 3), Issued(11, 2, None, 1)]
    assert (after.recycle_rows, after.recycle_groups, after.offset) == ((9,), (8,), 1)
    after, issued = take(after, 12, 2)
    assert issued == [Issued(12, 9, None, 8), Issued(13, 1, 0, None)]
    assert after.recycle_groups == () and after.offset == 2


@given(n_rows=st.integers(1, 9), first=st.integers(0, 20), second=st.integers(0, 20),
       shuffle=st.booleans(), recycled=st.integers(0, 4))
def test_two_takes_issue_what_one_take_of_both_counts_issues(n_rows, first, second, shuffle,
                                                              recycled):
    start = cursor(shuffle=shuffle, recycle_rows=tuple(range(recycled)),
                   recycle_groups=tuple(range(100, 100 + recycled)))
    middle, a = take(start, n_rows, first)
    end, b = take(middle, n_rows, second)
    together, both = take(start, n_rows, first + second)
    assert a + b == both
    assert end == together


def logged(base: Cursor, issued: list[Issued]) -> dict[int, set[tuple[str, int | None, int]]]:
    return {i.group_index: {(base.dataset, base.dataset_version, i.row)} for i in issued}


def test_roll_forward_replays_the_log_up_to_its_first_gap():
    base = cursor()
    expected, issued = take(base, 6, 4)
    log = logged(base, issued)
    log[5] = {("d", 3, 0)}  # after the gap at 4: a failed batch, issued again
    after, replayed = roll_forward(base, 6, log)
    assert replayed == issued and after == expected


def test_roll_forward_accepts_a_group_logged_twice_with_other_refs_too():
    base = cursor()
    _, issued = take(base, 6, 2)
    log = logged(base, issued)
    log[1].add(("other", 1, 5))
    assert roll_forward(base, 6, log)[1] == issued


def test_roll_forward_refuses_a_log_that_names_other_rows():
    base = cursor()
    _, issued = take(base, 6, 2)
    log = logged(base, issued)
    log[1] = {("d", 3, (issued[1].row + 1) % 6)}
    with pytest.raises(InconsistentStateError, match="group 1 was published with prompt"):
        roll_forward(base, 6, log)


def test_describe_is_the_api_view():
    shown = cursor(recycle_rows=(4,), recycle_groups=(2,), seq=5).describe()
    assert shown == {"dataset": "d", "dataset_version": 3, "seed": 7, "shuffle": True,
                     "epoch": 0, "offset": 0, "next_group_index": 0, "recycle_groups": [2],
                     "seq": 5}
