"""The replay/what-if diff over two real Delta lakes: what `replay --check` rests on."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa

from ingest.io.lake import Lake
from ingest.io.whatif_diff import compare_lakes
from schemas.tables import GROUPS, STEP_METRICS, STEPS

AT = datetime(2026, 1, 1, tzinfo=UTC)


def _group(index: int, **changes) -> dict:
    row = dict(run_id="r", group_index=index, step=0, n_samples=2, decision="kept",
               reason=None, batch_step=0, decided_at=AT, mean_reward=0.5, first_event_at=AT,
               n_fragments=2, ordered_at=AT)
    return {**row, **changes}


def _lake(root, groups: list[dict], sha: str = "abc", reward: float = 0.5) -> Lake:
    lake = Lake(str(root))
    lake.append("groups", pa.Table.from_pylist(groups, schema=GROUPS.schema))
    lake.append("steps", pa.Table.from_pylist([dict(
        run_id="r", step=0, n_groups=len(groups), n_samples=4, sealed_at=AT, batch_version=0,
        content_sha256=sha, n_rollouts=4, n_tokens=16)], schema=STEPS.schema))
    lake.append("step_metrics", pa.Table.from_pylist([
        dict(run_id="r", step=0, key="rollout/raw_reward", value=reward)],
        schema=STEP_METRICS.schema))
    return lake


def test_equal_lakes_have_no_differences(tmp_path):
    original = _lake(tmp_path / "a", [_group(0), _group(1)])
    derived = _lake(tmp_path / "b", [_group(0), _group(1)])
    assert compare_lakes(original, derived, "r").differences() == {}


def test_a_group_whose_decision_stands_but_whose_mean_reward_differs_is_a_difference(tmp_path):
    original = _lake(tmp_path / "a", [_group(0), _group(1)])
    derived = _lake(tmp_path / "b", [_group(0), _group(1, mean_reward=0.75)])
    diff = compare_lakes(original, derived, "r")
    assert diff.differences() == {"groups": [1]}
    [change] = diff.groups
    assert change.why == "same decision, mean_reward differ"


def test_steps_and_metrics_that_differ_are_named_by_their_keys(tmp_path):
    original = _lake(tmp_path / "a", [_group(0)])
    derived = _lake(tmp_path / "b", [_group(0)], sha="def", reward=0.25)
    assert compare_lakes(original, derived, "r").differences() == {
        "steps": [0], "step_metrics": [(0, "rollout/raw_reward")]}
