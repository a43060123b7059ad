"""`--until-idle` ends the processor only when nothing is left to do."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from ingest.processor.launch import BatchChild
from ingest.processor.main import Processor
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


def test_until_idle_waits_out_a_rebalance_that_waits_for_a_slow_member(broker, tmp_path):
    """Apache Kafka: a member that stopped polling holds a rebalance up for its
    max.poll.interval. A stage whose partition that rebalance revoked must not count the
    wait as idleness, as `--until-idle` does: it ends only once the stage took its
    partition over again."""
    if broker.engine != "kafka":
        pytest.skip("Tansu ends the rebalance after about 3 s, not the slow member's "
                    "max.poll.interval: too close to the idle time for a sure test")
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers,
                          topic_prefix=f"slow{time.monotonic_ns()}.", event_partitions=2)
    kafka.ensure_topics()
    publish(kafka, "slow", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
            [event("group_started", "slow", group_index=0, step=0, n_samples=1)])
    lake = Lake(str(tmp_path / "lake"))
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake.root), lake)
    members = []
    try:
        poll_until_idle(stage)
        group = stage.health.group_id
        slow = member(kafka, group, max_poll_interval_ms=8000)  # joins, then stops polling
        members.append(slow)
        deadline = time.monotonic() + 60
        while not slow.assignment():
            assert time.monotonic() < deadline, "the slow member did not join"
            stage.poll_once()  # the stage has to rejoin for the slow member to join
            slow.poll(timeout_ms=50)
        joiner = member(kafka, group)
        members.append(joiner)
        stop = threading.Event()
        joining = threading.Thread(target=lambda: [joiner.poll(timeout_ms=100)
                                                   for _ in iter(stop.is_set, True)])
        joining.start()
        try:
            while stage.owned:  # the joiner's rebalance revokes the stage's partition
                assert time.monotonic() < deadline + 60, "no rebalance revoked the partition"
                stage.poll_once()
            idle_since = None
            while idle_since is None or time.monotonic() - idle_since < 2.0:  # --until-idle 2
                stage.poll_once()
                idle_since = (idle_since or time.monotonic()) if stage.idle else None
        finally:
            stop.set()
            joining.join()
        assert stage.owned and stage.owned == {tp.partition for tp in stage.consumer.assignment()}
    finally:
        stage.close()
        for consumer in members:
            consumer.close()


def member(kafka: KafkaSettings, group: str, **overrides) -> KafkaConsumer:
    """Another member of the consumer group `group`."""
    consumer = kafka.consumer(group_id=group, session_timeout_ms=6000, **overrides)
    consumer.subscribe([kafka.topics.events])
    return consumer


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


def test_a_batch_stage_told_to_drain_before_it_runs_still_seals(broker, tmp_path):
    """A stopping processor tells its batch-stage child to drain (SIGTERM). An --until-idle
    parent can stop while the child still imports or waits for its configuration: the
    child must drain once its stage runs, not die with the decisions unsealed."""
    sim = SimulationConfig(run_id="early", steps=1, rollout_batch_size=1, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=5, mode="open")
    kafka = ordered_kafka(broker.bootstrap_servers, f"early{os.getpid()}.")
    run_simulation(kafka, sim)
    config = ProcessorConfig(kafka=kafka, lake=str(tmp_path / "lake"), until_idle_s=1.0)
    child = BatchChild()
    deadline = time.monotonic() + 60
    while not _catches(child.process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline and child.process.is_alive()
        time.sleep(0.01)
    os.kill(child.process.pid, signal.SIGTERM)
    groups = Processor(config.model_copy(update={"stages": "groups"}))  # the tables first
    child.configure(config, logging.WARNING)
    groups.run()
    child.process.join(120)
    assert child.process.exitcode == 0
    assert Lake(config.lake).read("steps", columns=["step"]).num_rows == sim.steps
