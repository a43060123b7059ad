"""`--until-idle` ends the processor only when nothing is left to do."""

from __future__ import annotations

import time

import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from tests.integration.pipeline import event, ordered_kafka, publish, run_processor


def test_a_backlog_longer_to_commit_than_the_idle_time_is_finished(broker, tmp_path):
    """Each poll's commits (several Delta tables) take longer than the idle time: the
    processor must not take that for idleness and stop in the middle of the backlog."""
    sim = SimulationConfig(run_id="backlog", steps=30, rollout_batch_size=2, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=4, mode="open",
                           surplus_per_step=1)
    kafka = ordered_kafka(broker.bootstrap_servers, f"idle{id(sim)}.")
    run_simulation(kafka, sim)
    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=0.05, max_poll_records=200)
    assert Lake(lake_root).read("steps", columns=["step"]).num_rows == sim.steps


@pytest.mark.one_broker("the test drives the consumer's rebalance callbacks itself")
def test_a_stage_between_a_revocation_and_its_next_take_over_is_not_idle(kafka, tmp_path):
    """A rejoin revokes every partition; the group assigns them again only once each
    member rejoined. The stage owns nothing meanwhile, and its partitions' work is still
    ahead (a group stage re-derives the decisions a killed owner archived but never
    published): `--until-idle` must not count it. A chaos run's last instance once exited
    there, joined to all four events partitions but before taking any over, and the held
    decisions of the run's last step never reached the tables."""
    publish(kafka, "rejoin", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
            [event("group_started", "rejoin", group_index=0, step=0, n_samples=1)])
    lake = Lake(str(tmp_path / "lake"))
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake.root), lake)
    try:
        poll_until_idle(stage)
        owned = set(stage.consumer.assignment())
        assert owned and stage.clocks  # took its partitions over

        stage.on_partitions_revoked(owned)  # as the consumer does when a rejoin starts
        for _ in range(5):
            stage.poll_once()
            assert not stage.idle and not stage.clocks

        stage.on_partitions_assigned(owned)  # the rejoin completed: the same partitions
        poll_until_idle(stage)
        assert set(stage.clocks) == {tp.partition for tp in owned}
    finally:
        stage.close()


def poll_until_idle(stage: GroupStage, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    stage.poll_once()
    while not stage.idle:
        assert time.monotonic() < deadline, "the stage did not become idle"
        stage.poll_once()
