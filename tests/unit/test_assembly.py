"""GroupBuilder: events in any order into one group; duplicates, conflicts, edge cases."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.commands.simulate import SimulationConfig, generate_group
from ingest.core.assembly import GroupBuilder
from schemas.events import parse_event


def _plain(value):
    """A group as nested dicts and lists: token arrays are numpy arrays, whose `==` is
    elementwise, so groups compare through this."""
    if dataclasses.is_dataclass(value):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tolist())
    return value


def _event(kind: str, event_id: str, **fields):
    return parse_event({"type": kind, "schema_version": 1, "run_id": "r", "event_id": event_id,
                        "group_index": 0, **fields})


def _fragment(event_id: str, index: int):
    return _event("compaction_fragment", event_id, rollout_id=0, fragment_index=index,
                  prompt_tokens=[1], response_tokens=[2])


def test_fragment_beyond_the_count_leaves_the_rollout_when_the_count_arrives():
    builder = GroupBuilder("r", 0, 0.0)
    assert builder.apply(_event("group_started", "start", step=0, n_samples=1)).accepted
    assert builder.apply(_fragment("stray", 5)).accepted  # the count is not known yet
    assert builder.apply(_fragment("first", 0)).accepted
    last = builder.apply(_event("sample_finished", "last", rollout_id=0, status="completed",
                                prompt_tokens=[1], response_tokens=[3], reward=1.0,
                                fragment_count=2))
    assert last.accepted
    assert last.evicted == (("stray", "fragment_index 5 is not below the rollout's "
                                       "fragment_count 2"),)
    assert sorted(builder.group.rollouts[0].fragments) == [0, 1]
    assert builder.group.complete
    assert builder.apply(_fragment("stray", 5)).status == "duplicate"


def test_fragment_beyond_a_known_count_is_rejected():
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(_event("sample_finished", "last", rollout_id=0, status="completed",
                         prompt_tokens=[1], response_tokens=[3], reward=1.0, fragment_count=2))
    result = builder.apply(_fragment("late", 2))
    assert result.status == "rejected"
    assert result.reason == "fragment_index 2 is not below the rollout's fragment_count 2"


def _finished(event_id: str, rollout_id: int, reward=1.0, **fields):
    body = dict(rollout_id=rollout_id, status="completed", prompt_tokens=[1],
                response_tokens=[2, 3], **fields)
    if reward is not ...:
        body["reward"] = reward
    return _event("sample_finished", event_id, **body)


def test_rollouts_come_out_in_sample_index_order_and_fragments_in_index_order():
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(_event("group_started", "start", step=0, n_samples=3))
    builder.apply(_finished("b", 1, sample_index=9))
    builder.apply(_finished("c", 2))  # no sample_index: after those with one
    builder.apply(_fragment("f1", 1))
    builder.apply(_event("sample_finished", "a", rollout_id=0, status="completed",
                         prompt_tokens=[1], response_tokens=[4], reward=0.0, sample_index=4,
                         fragment_count=3, fragment_index=2))
    builder.apply(_fragment("f0", 0))
    group = builder.group
    assert group.complete
    assert [r.rollout_id for r in group.ordered_rollouts()] == [0, 1, 2]
    assert [f.fragment_index for f in group.rollouts[0].ordered_fragments()] == [0, 1, 2]
    assert [f.event_id for f in group.rollouts[0].ordered_fragments()] == ["f0", "f1", "a"]


def test_a_redelivered_event_is_a_duplicate_and_changes_nothing():
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(_event("group_started", "start", step=0, n_samples=1))
    assert builder.apply(_finished("done", 0, reward=1.0)).accepted
    before = copy.deepcopy(builder.group)
    assert builder.apply(_finished("done", 0, reward=0.0)).status == "duplicate"
    assert builder.apply(_event("group_started", "start", step=5, n_samples=1)).status == "duplicate"
    assert _plain(builder.group) == _plain(before)


def test_a_conflicting_reward_is_rejected_and_the_first_stands():
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(_finished("done", 0, reward=1))
    # The same score as a float is no conflict; a bool is another payload.
    assert builder.apply(_event("reward", "same", rollout_id=0, reward=1.0)).accepted
    for event_id, reward in (("other", 0.5), ("bool", True)):
        result = builder.apply(_event("reward", event_id, rollout_id=0, reward=reward))
        assert result.status == "rejected"
        assert result.reason == (f"conflicting reward for rollout 0: {reward!r} after 1 "
                                 "(the first value stands)")
    assert builder.group.rollouts[0].reward == 1
    separate = GroupBuilder("r", 1, 0.0)
    separate.apply(_event("reward", "first", rollout_id=0, reward=0.0))
    result = separate.apply(_finished("late", 0, reward=1.0))
    assert result.status == "rejected" and result.reason.startswith("conflicting reward")
    assert 0 not in separate.group.rollouts[0].fragments  # rejected whole


def test_events_that_contradict_the_group_are_rejected_with_a_reason():
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(_event("group_started", "start", step=0, n_samples=1))
    builder.apply(_finished("done", 0))
    cases = [
        (_event("group_started", "again", step=0, n_samples=1),
         "group 0 already has a group_started event"),
        (_finished("extra", 1), "rollout 1 exceeds the group's n_samples=1 (rollouts [0] "
                                "already present)"),
        (_event("sample_aborted", "abort", rollout_id=0, reason="cancelled"),
         "rollout 0 already finished; it cannot be aborted"),
        (_finished("twice", 0), "rollout 0 already has a sample_finished event"),
    ]
    for event, reason in cases:
        result = builder.apply(event)
        assert (result.status, result.reason) == ("rejected", reason)
    assert not {"again", "extra", "abort", "twice"} & builder.event_ids


_SIM = SimulationConfig(run_id="r", n_samples=4, response_len_mean=6, prompt_len=3,
                        compaction_rate=0.4, abort_rate=0.15, missing_reward_rate=0.1,
                        separate_reward_rate=0.5, duplicate_rate=0.0, out_of_order=False)


def _assembled(events: list[dict]) -> GroupBuilder:
    builder = GroupBuilder("r", events[0]["group_index"], 0.0)
    for body in events:
        builder.apply(parse_event(body))
    return builder


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), data=st.data())
def test_any_order_and_any_duplication_of_a_groups_events_gives_the_same_group(seed, data):
    events = generate_group(_SIM.model_copy(update={"seed": seed}), seed % 7, 0).events
    reference = _assembled(events)
    assert reference.group.complete
    duplicated = data.draw(st.lists(st.sampled_from(range(len(events))), max_size=6))
    order = data.draw(st.permutations([*range(len(events)), *duplicated]))
    builder = _assembled([events[i] for i in order])
    assert _plain(builder.group) == _plain(reference.group)
    assert builder.event_ids == reference.event_ids
