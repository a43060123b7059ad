"""RunBatcher: step assignment, sealing, surplus and when steps close."""

from __future__ import annotations

import pyarrow as pa

from ingest.core.batching import RunBatcher
from ingest.core.decided import FRAGMENTS, DecidedGroup, DecisionHeader
from schemas.events import RunConfig


def _group(group_index: int, step: int, decision: str = "kept") -> DecidedGroup:
    rows = [
        {"rollout_id": r, "sample_index": group_index * 2 + r, "fragment_index": 0,
         "status": "completed", "abort_reason": None, "reward": float(r),
         "reward_json": str(float(r)), "weight_version": None, "response_length": 2,
         "effective_length": 2, "metadata_json": None, "prompt_tokens": [1],
         "response_tokens": [2, 3], "loss_mask": [1, 1], "rollout_log_probs": None}
        for r in range(2)
    ]
    header = DecisionHeader(run_id="r", group_index=group_index, step=step, n_samples=2,
                            decision=decision, reason=None, counted=True,
                            decided_at=float(group_index), first_event_at=0.0)
    return DecidedGroup(header, pa.Table.from_pylist(rows, schema=FRAGMENTS))


def _batcher(**config) -> RunBatcher:
    return RunBatcher("r", RunConfig(**{"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                                        **config}))


def test_out_of_order_seals_still_close_every_earlier_step():
    batcher = _batcher()
    closed = []
    for group_index, step in ((0, 0), (1, 2), (2, 1), (3, 3)):
        effects = batcher.offer(_group(group_index, step), now=float(group_index))
        closed.extend(s for s, _ in effects.closed)
    assert closed == [0, 1, 2]
    assert [s for s, _ in batcher.flush().closed] == [3]


def test_kept_group_for_a_sealed_step_is_surplus_unless_staleness_allows():
    strict = _batcher()
    strict.offer(_group(0, 0), now=0.0)
    assert strict.offer(_group(1, 0), now=1.0).groups[0]["decision"] == "surplus"
    stale = _batcher(max_staleness=1)
    stale.offer(_group(0, 0), now=0.0)
    row = stale.offer(_group(1, 0), now=1.0).groups[0]
    assert (row["decision"], row["batch_step"]) == ("kept", 1)


def test_a_repeated_decision_changes_nothing():
    batcher = _batcher(rollout_batch_size=2)
    assert batcher.offer(_group(0, 0), now=0.0).groups
    effects = batcher.offer(_group(0, 0), now=1.0)
    assert not effects.groups and not effects.sealed


def test_a_step_seals_at_the_batch_size_it_opened_with_after_a_config_lowers_it():
    """A later run_started (the batch stage swaps it in) lowers rollout_batch_size below
    the members of an open step: that step still seals, at the size it opened with, and
    steps opened afterwards use the new size."""
    batcher = _batcher(rollout_batch_size=3)
    assert not batcher.offer(_group(0, 0), now=0.0).sealed
    assert not batcher.offer(_group(1, 0), now=1.0).sealed
    batcher.config = RunConfig(n_samples_per_prompt=2, rollout_batch_size=1)
    sealed = batcher.offer(_group(2, 0), now=2.0).sealed
    assert [(s.step, s.n_groups) for s in sealed] == [(0, 3)]
    sealed = batcher.offer(_group(3, 1), now=3.0).sealed
    assert [(s.step, s.n_groups) for s in sealed] == [(1, 1)]


def _opened(batcher: RunBatcher, step: int, *group_indexes: int) -> None:
    for group_index in group_indexes:
        batcher.open(group_index, step, at=0.0)


def test_demand_counts_the_groups_a_step_still_needs_after_each_decision():
    """Batch of 2, 3 groups issued: a drop leaves 0 kept + 2 in flight (enough), the next
    drop 1 short, a kept group keeps it 1 short (reported once), the last drop 2 short."""
    batcher = _batcher(rollout_batch_size=2)
    _opened(batcher, 0, 0, 1, 2)
    seen = []
    for group_index, decision in ((0, "dropped"), (1, "dropped"), (2, "kept")):
        seen.append([(d.step, d.groups_needed, d.kept, d.in_flight, d.issued)
                     for d in batcher.offer(_group(group_index, 0, decision), now=1.0).demands])
    assert seen == [[(0, 0, 0, 2, 3)], [(0, 1, 0, 1, 3)], [(0, 1, 1, 0, 3)]]
    _opened(batcher, 0, 3, 4)
    assert [(d.groups_needed, d.in_flight, d.issued) for d in
            batcher.offer(_group(3, 0, "dropped"), now=2.0).demands] == [(0, 1, 5)]


def test_a_demand_with_the_same_need_and_kept_count_is_not_reported_again():
    """Batch of 2, 4 groups issued: the first drop still leaves 3 in flight, 0 needed,
    0 kept, which was reported; the second drop changes neither."""
    batcher = _batcher(rollout_batch_size=2)
    _opened(batcher, 0, 0, 1, 2, 3)
    assert [d.groups_needed for d in
            batcher.offer(_group(0, 0, "dropped"), now=0.0).demands] == [0]
    assert batcher.offer(_group(1, 0, "dropped"), now=1.0).demands == []


def test_a_sealed_step_reports_no_demand():
    batcher = _batcher(rollout_batch_size=1)
    _opened(batcher, 0, 0, 1)
    effects = batcher.offer(_group(0, 0), now=0.0)
    assert [s.step for s in effects.sealed] == [0] and effects.demands == []
    assert batcher.offer(_group(1, 0, "dropped"), now=1.0).demands == []
