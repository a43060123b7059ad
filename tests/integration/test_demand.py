"""`demand` on `rollout.control`: the processor says how many more groups an open step
needs after each decision that changed it (CONTRACT section 1; docs/worker.md)."""

from __future__ import annotations

import orjson

from schemas.control import Demand
from tests.integration.pipeline import event, ordered_kafka, publish, run_processor, sample
from tests.support.gateway_support import consume_all

DAPO = {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
        "dynamic_sampling_filter_path": "ingest.core.filters.reward_nonzero_std"}


def started(run_id: str, group_index: int, step: int = 0) -> dict:
    return event("group_started", run_id, group_index=group_index, step=step, n_samples=2)


def group(run_id: str, group_index: int, rewards: tuple[float, float]) -> list[dict]:
    return [sample(run_id, group_index, r, reward) for r, reward in enumerate(rewards)]


def control(kafka, run_id: str) -> list[dict]:
    bodies = [orjson.loads(r.value) for r in consume_all(kafka, kafka.topics.control)]
    return [b for b in bodies if b["run_id"] == run_id]


def test_processor_publishes_each_changed_demand_of_an_open_step_and_none_after_its_seal(
        broker, lake_root):
    kafka = ordered_kafka(broker.bootstrap_servers, "demand.")
    run_id = "demand-run"
    kept, zero_std = (0.0, 1.0), (1.0, 1.0)
    # Batch of 2, three groups issued: drop, keep, drop -> one group short.
    publish(kafka, run_id, DAPO, [started(run_id, g) for g in range(3)]
            + group(run_id, 0, zero_std) + group(run_id, 1, kept) + group(run_id, 2, zero_std))
    run_processor(kafka, lake_root)
    demands = [Demand.model_validate(b) for b in control(kafka, run_id)]
    assert [(d.step, d.groups_needed, d.kept, d.in_flight, d.issued) for d in demands] == [
        (0, 0, 0, 2, 3),  # group 0 dropped: 2 in flight may still fill the batch
        (0, 0, 1, 1, 3),  # group 1 kept
        (0, 1, 1, 0, 3),  # group 2 dropped: nothing in flight, one group short
    ]

    # Two more issued; the first kept seals the step: no demand for it any more.
    publish(kafka, run_id, None, [started(run_id, 3), started(run_id, 4)]
            + group(run_id, 3, kept) + group(run_id, 4, zero_std))
    run_processor(kafka, lake_root)
    later = control(kafka, run_id)[len(demands):]
    assert [b["type"] for b in later] == ["step_sealed"]
