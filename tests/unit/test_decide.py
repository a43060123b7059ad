"""`ingest.core.decide`: a group and its run config -> a decision, and cancelled at seal."""

from __future__ import annotations

import pytest

from ingest.core.decide import decide, reason_at_seal
from ingest.core.model import Fragment, Group, Rollout
from schemas.events import DAPO_FILTER_PATH, RunConfig

FILTERS = "tests.support.user_filters"


def _group(*rewards: float, aborts: tuple[tuple[str, float | None], ...] = ()) -> Group:
    """A complete group: one finished rollout per reward, then one aborted rollout per
    (reason, ts) in `aborts`."""
    group = Group(run_id="r", group_index=3, step=0, n_samples=len(rewards) + len(aborts),
                  started=True, first_event_at=5.0)
    for rid, reward in enumerate(rewards):
        rollout = Rollout(rollout_id=rid, status="completed", fragment_count=1, reward=reward,
                          reward_known=True, sample_index=rid)
        rollout.fragments[0] = Fragment(rid, 0, [1], [2, 3])
        group.rollouts[rid] = rollout
    for rid, (reason, ts) in enumerate(aborts, start=len(rewards)):
        group.rollouts[rid] = Rollout(rollout_id=rid, status="aborted", abort_reason=reason,
                                      metadata={} if ts is None else {"abort_ts": ts})
    return group


def _config(filter_path: str | None = DAPO_FILTER_PATH) -> RunConfig:
    return RunConfig(n_samples_per_prompt=2, rollout_batch_size=1,
                     dynamic_sampling_filter_path=filter_path)


def _decide(group: Group, config: RunConfig, **kwargs):
    return decide(group, config, at_us=9_000_000, source={"partition": 1, "offset": 4},
                  decided_at=100.0, **kwargs)


def test_a_group_with_reward_variance_is_kept_with_its_tokens_and_order_key():
    decided = _decide(_group(0.0, 1.0), _config())
    header = decided.group.header
    assert (header.decision, header.reason, header.offered, decided.error) == (
        "kept", None, True, None)
    assert decided.group.fragments.column("response_tokens").to_pylist() == [[2, 3], [2, 3]]
    assert (header.at_us, header.source, header.first_event_at) == (
        9_000_000, {"partition": 1, "offset": 4}, 5.0)


def test_a_dropped_group_travels_without_tokens():
    decided = _decide(_group(1.0, 1.0), _config())
    assert (decided.group.header.decision, decided.group.header.reason) == (
        "dropped", "zero_std_1.0")
    assert decided.group.fragments.column("response_tokens").to_pylist() == [[], []]


def test_a_timed_out_group_is_never_offered_to_the_filter():
    decided = _decide(_group(0.0), _config(f"{FILTERS}.explode_on_group_3"), timed_out=True)
    header = decided.group.header
    assert (header.decision, header.reason, header.offered, decided.error) == (
        "dropped", "group_timeout", False, None)


def test_a_filter_that_raises_drops_the_group_with_an_error_to_dead_letter():
    decided = _decide(_group(0.0, 1.0), _config(f"{FILTERS}.explode_on_group_3"))
    assert decided.group.header.reason == "filter_error"
    assert decided.error.startswith(f"filter {FILTERS}.explode_on_group_3 raised ")


def test_a_filter_that_does_not_load_drops_the_group_with_the_load_error():
    decided = _decide(_group(0.0, 1.0), _config(f"{FILTERS}.no_such_filter"))
    assert decided.group.header.reason == "filter_error"
    assert "has no attribute 'no_such_filter'" in decided.error


def test_a_decision_that_cannot_be_encoded_is_unstorable_without_fragments():
    decided = _decide(_group(0.0, 1.0), _config(f"{FILTERS}.reason_not_utf8"))
    assert decided.group.header.reason == "unstorable"
    assert decided.group.fragments.num_rows == 0
    assert decided.error.startswith("group 3 of run r cannot be stored: ")


@pytest.mark.parametrize(
    ("aborts", "sealed_at", "reason"),
    [
        ((("cancelled", 10.0),), 10.0, "cancelled_at_seal"),  # at the seal
        ((("cancelled", 12.0), ("cancelled", 11.0)), 10.0, "cancelled_at_seal"),
        ((("cancelled", 9.0),), 10.0, "group_has_aborted"),  # cancelled before the seal
        ((("cancelled", 12.0), ("cancelled", 9.0)), 10.0, "group_has_aborted"),
        ((("cancelled", 12.0), ("engine_error", 12.0)), 10.0, "group_has_aborted"),
        ((("cancelled", None),), 10.0, "group_has_aborted"),  # no time: not provable
        ((("cancelled", 12.0),), None, "group_has_aborted"),  # its step is not sealed
    ],
)
def test_cancelled_at_seal_needs_every_abort_cancelled_at_or_after_the_seal(
        aborts, sealed_at, reason):
    header = _decide(_group(1.0, aborts=aborts), _config()).group.header
    assert header.reason == "group_has_aborted"  # the group stage cannot know the seal
    assert reason_at_seal(header, sealed_at) == reason
