"""User filters see Miles samples: `sample.response` is the rollout's `response_text`."""

from __future__ import annotations

import pytest

from tests.integration.pipeline import (
    by_group,
    event,
    ordered_kafka,
    publish,
    rows,
    run_processor,
    sample,
)

pytestmark = pytest.mark.one_broker(
    "what a user filter sees of a sample; the broker path runs on both engines elsewhere")


def test_a_filter_reading_sample_response_decides_on_the_response_text(broker, lake_root):
    """`MilesSample` had no `response` (the filter raised, its group was dead-lettered as
    `filter_error`) and `response_text` was dropped on the way."""
    kafka = ordered_kafka(broker.bootstrap_servers, "miles-response.")
    run = "texts"
    config = {"n_samples_per_prompt": 2, "rollout_batch_size": 1,
              "dynamic_sampling_filter_path": "tests.support.user_filters.keep_boxed_answers"}
    events = []
    for group, texts in enumerate([("so \\boxed{4}", "no idea"), ("four", None)]):
        events.append(event("group_started", run, group_index=group, step=group, n_samples=2))
        for rollout, text in enumerate(texts):
            fields = {} if text is None else {"response_text": text}
            events.append(sample(run, group, rollout, float(rollout), **fields))
    publish(kafka, run, config, events)
    run_processor(kafka, lake_root, idle_s=1.5)
    decided = {g: (r["decision"], r["reason"]) for g, r in by_group(lake_root, run).items()}
    assert decided == {0: ("kept", None), 1: ("dropped", "no_answer")}
    assert [r for r in rows(lake_root, "dead_letters") if r["run_id"] == run] == []
