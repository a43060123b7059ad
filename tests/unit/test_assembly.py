"""Group assembly edge cases (pure core, no services)."""

from __future__ import annotations

from ingest.core.assembly import GroupBuilder
from schemas.events import parse_event


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
