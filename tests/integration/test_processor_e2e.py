"""The stream processor end to end: real Tansu broker, real Delta tables, CONTRACT 2-5."""

from __future__ import annotations

import orjson
import pyarrow.compute as pc
import pytest

from ingest.core.advantages import rollout_advantages
from ingest.io.lake import Lake
from schemas.tables import TABLES, content_sha256
from tests.integration.pipeline import (
    by_group,
    event,
    metrics,
    ordered_kafka,
    publish,
    rows,
    run_processor,
    sample,
)
from tests.support.suite_kafka import SUITE_BROKER_START_S

DAPO = {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
        "dynamic_sampling_filter_path": "ingest.core.filters.reward_nonzero_std"}


def started(run_id, group_index, step=0, n=2):
    return event("group_started", run_id, group_index=group_index, step=step, n_samples=n)


def contract_events(run_id: str) -> list:
    """Groups 0-11 of CONTRACT cases, interleaved with invalid events."""
    s = run_id
    dup_group = [started(s, 6), sample(s, 6, 0, 1.0, sample_index=60),
                 sample(s, 6, 1, 0.0, sample_index=61)]
    return [
        # 0: plain kept group.
        started(s, 0), sample(s, 0, 0, 1.0, sample_index=0), sample(s, 0, 1, 0.0, sample_index=1),
        # 1: compaction, fragments before and after their reward, rewards by event and inline.
        event("reward", s, group_index=1, rollout_id=0, reward=1.0),
        event("compaction_fragment", s, group_index=1, rollout_id=0, fragment_index=0,
              prompt_tokens=[1], response_tokens=[5, 6, 7], loss_mask=[1, 0, 1]),
        started(s, 1),
        sample(s, 1, 0, ..., sample_index=10, fragment_count=2),
        sample(s, 1, 1, 0.0, sample_index=11, fragment_count=2),
        event("compaction_fragment", s, group_index=1, rollout_id=1, fragment_index=0,
              prompt_tokens=[1], response_tokens=[8]),
        # 2, 3: zero std, float and int rewards (reasons differ).
        started(s, 2), sample(s, 2, 0, 0.0), sample(s, 2, 1, 0.0),
        started(s, 3), sample(s, 3, 0, 1), sample(s, 3, 1, 1),
        # an event for group 2, which is already decided
        sample(s, 2, 5, 1.0),
        # 4: an aborted rollout; 5: a failed (null) reward.
        started(s, 4), event("sample_aborted", s, group_index=4, rollout_id=0, reason="engine_error"),
        sample(s, 4, 1, 1.0),
        started(s, 5), sample(s, 5, 0, None), sample(s, 5, 1, 1.0),
        # 6: every event delivered twice; step 0 is full by then: surplus.
        *dup_group, *dup_group,
        # 7, 8: step 1.
        started(s, 7, step=1), sample(s, 7, 0, 0.5, sample_index=70), sample(s, 7, 1, 0.0),
        started(s, 8, step=1), sample(s, 8, 0, 0.0, sample_index=80), sample(s, 8, 1, 2.0),
        # invalid input, each dead-lettered
        b"{not json",
        {k: v for k, v in sample(s, 9, 0).items() if k != "status"},
        {**sample(s, 9, 0), "group_index": "nine"},
        {**sample(s, 9, 0), "loss_mask": [1]},
        # 9: a third rollout id exceeds n_samples=2 (the group is not complete yet)
        started(s, 9, step=2), sample(s, 9, 0, 1.0),
        event("reward", s, group_index=9, rollout_id=2, reward=0.0), sample(s, 9, 1, 1.0),
        sample(s, 9, 2, ...),
        # 10: a conflicting second reward; the first value stands.
        started(s, 10, step=2), sample(s, 10, 0, 1.0),
        event("reward", s, group_index=10, rollout_id=0, reward=0.0),
        sample(s, 10, 1, 0.0),
    ]


@pytest.fixture(scope="module")
def scenario(broker, tmp_path_factory):
    kafka = ordered_kafka(broker.bootstrap_servers, "e2e.")
    publish(kafka, "contract", DAPO, contract_events("contract"))
    filt = "filt"
    publish(kafka, filt, {**DAPO, "rollout_batch_size": 3,
                          "dynamic_sampling_filter_path":
                          "tests.support.user_filters.explode_on_group_3"},
            [e for g in range(4) for e in (started(filt, g), sample(filt, g, 0, 1.0),
                                           sample(filt, g, 1, 0.0))])
    slow = "slow"
    publish(kafka, slow, {**DAPO, "group_timeout_s": 1.0},
            [started(slow, 0), sample(slow, 0, 0, 1.0), sample(slow, 1, 0, 1.0)])
    lake_root = str(tmp_path_factory.mktemp("lake"))
    run_processor(kafka, lake_root, idle_s=2.5)
    return Lake(lake_root)


def test_filter_chain_reasons(scenario):
    groups = by_group(scenario, "contract")
    decided = {g: (r["decision"], r["reason"]) for g, r in groups.items()}
    assert decided == {
        0: ("kept", None), 1: ("kept", None), 2: ("dropped", "zero_std_0.0"),
        3: ("dropped", "zero_std_1"), 4: ("dropped", "group_has_aborted"),
        5: ("dropped", "group_has_missing_reward"), 6: ("surplus", None),
        7: ("kept", None), 8: ("kept", None), 9: ("kept", None), 10: ("kept", None),
    }
    assert groups[0]["batch_step"] == 0 and groups[7]["batch_step"] == 1
    assert groups[6]["batch_step"] is None
    assert groups[10]["mean_reward"] == 0.5  # rollout 0 kept its first reward, 1.0


def test_every_fragment_is_audited_once(scenario):
    samples = rows(scenario, "samples", "contract")
    keys = [(r["group_index"], r["rollout_id"], r["fragment_index"]) for r in samples]
    assert len(keys) == len(set(keys))
    assert sorted(k for k in keys if k[0] == 1) == [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert sum(1 for k in keys if k[0] == 6) == 2  # duplicates applied once
    aborted = [r for r in samples if r["group_index"] == 4 and r["rollout_id"] == 0]
    assert aborted[0]["status"] == "aborted" and aborted[0]["decision"] == "dropped"


def test_sealed_batches_rows_advantages_and_hash(scenario):
    steps = {r["step"]: r for r in rows(scenario, "steps", "contract")}
    assert sorted(steps) == [0, 1, 2]
    batch = scenario.read("training_batches", version=steps[0]["batch_version"],
                          filter=(pc.field("run_id") == "contract") & (pc.field("step") == 0))
    batch = batch.sort_by("position")
    assert steps[0]["content_sha256"] == content_sha256(batch)
    assert steps[0]["n_groups"] == 2 and steps[0]["n_samples"] == batch.num_rows == 6
    assert batch.column("group_index").to_pylist() == [0, 0, 1, 1, 1, 1]
    assert batch.column("fragment_index").to_pylist() == [0, 0, 0, 1, 0, 1]
    assert batch.column("loss_mask").to_pylist()[2] == [1, 0, 1]
    expected = rollout_advantages([1.0, 0.0], "grpo", True)
    assert batch.column("advantage").to_pylist() == [expected[0], expected[1], expected[0],
                                                    expected[0], expected[1], expected[1]]
    assert batch.column("rollout_log_probs").to_pylist()[0] == [-0.5] * 4


def test_step_metrics_follow_miles_keys(scenario):
    m = metrics(scenario, "contract")
    step0 = m[0]
    assert step0["rollout/dynamic_filter/drop_zero_std_0.0"] == 1
    assert step0["rollout/dynamic_filter/drop_zero_std_1"] == 1
    assert step0["rollout/dynamic_filter/drop_group_has_aborted"] == 1
    assert step0["rollout/dynamic_filter/drop_group_has_missing_reward"] == 1
    assert step0["rollout/groups_kept"] == 2 and step0["rollout/groups_surplus"] == 1
    assert step0["rollout/groups_offered"] == 7
    assert step0["rollout/prompts_issued"] == 7
    # Per-fragment means: offered groups 0-6, every numeric reward, kept or not.
    unfiltered = [1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0]
    assert step0["rollout/raw_reward_unfiltered"] == pytest.approx(sum(unfiltered) / len(unfiltered))
    assert step0["rollout/raw_reward"] == pytest.approx(3 / 6)  # per row: 1,0,1,1,0,0
    assert step0["rollout/episode_raw_reward"] == pytest.approx(0.5)  # per rollout: 1,0,1,0
    assert step0["rollout/num_training_samples"] == 6
    assert 1 in m  # step 1 closes at shutdown


def test_invalid_input_is_dead_lettered_with_reasons(scenario):
    errors = [r["error"] for r in rows(scenario, "dead_letters")
              if r["topic"].startswith("e2e.") and r["run_id"] in (None, "contract")]
    expected = ["not valid UTF-8 JSON", "status: required field is missing",
                "group_index: Input should be a valid integer", "loss_mask has 1 entries",
                "exceeds the group's n_samples=2", "conflicting reward for rollout 0",
                "group 2 of run contract is already decided"]
    for fragment in expected:
        assert sum(fragment in e for e in errors) == 1, (fragment, errors)
    assert len(errors) == len(expected)
    raws = [r["raw"] for r in rows(scenario, "dead_letters") if r["raw"] == b"{not json"]
    assert raws == [b"{not json"]


def test_user_filter_that_raises_dead_letters_its_group(scenario):
    groups = by_group(scenario, "filt")
    assert groups[3]["decision"] == "dropped" and groups[3]["reason"] == "filter_error"
    assert [groups[g]["decision"] for g in range(3)] == ["kept"] * 3
    errors = [r["error"] for r in rows(scenario, "dead_letters") if r["run_id"] == "filt"]
    assert errors == ["filter tests.support.user_filters.explode_on_group_3 raised "
                      "ValueError: reward model returned garbage for group 3"]
    assert [r["step"] for r in rows(scenario, "steps", "filt")] == [0]


def test_group_timeouts(scenario):
    groups = by_group(scenario, "slow")
    assert groups == {0: groups[0]} and groups[0]["reason"] == "group_timeout"
    errors = [r for r in rows(scenario, "dead_letters") if r["run_id"] == "slow"]
    assert len(errors) == 1 and errors[0]["group_index"] == 1
    assert errors[0]["error"].startswith("no group_started: no group_started within 1 s")
    assert orjson.loads(errors[0]["raw"])["rollout_id"] == 0


def test_every_table_holds_each_key_once(scenario):
    for spec in TABLES.values():
        if not scenario.exists(spec.name):
            continue
        table = scenario.read(spec.name, columns=list(spec.key))
        keys = list(zip(*(table.column(c).to_pylist() for c in spec.key), strict=True))
        assert len(keys) == len(set(keys)), spec.name


def test_a_recreated_topic_is_refused_not_skipped(broker, tmp_path):
    """A lake that consumed a topic refuses the same topic recreated empty (memory broker
    restarted): resuming would skip every new event as already processed."""
    from ingest.io.broker import EmbeddedBroker, free_port
    from schemas.errors import RolloutlakeError

    first = ordered_kafka(broker.bootstrap_servers, "recreated.")
    publish(first, "r", DAPO, [started("r", 0), sample("r", 0, 0, 1.0), sample("r", 0, 1, 0.0)])
    run_processor(first, str(tmp_path), idle_s=1.0)
    with EmbeddedBroker(free_port(), engine=broker.engine).start(SUITE_BROKER_START_S) as restarted:
        with pytest.raises(RolloutlakeError, match="the topic was recreated"):
            run_processor(ordered_kafka(restarted.bootstrap_servers, "recreated."),
                          str(tmp_path), idle_s=1.0)
