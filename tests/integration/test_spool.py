"""The spool between one processor instance's stages (ingest/io/spool.py), with the real
broker and lake: decisions whose fragments stayed in the spool give the tables of
decisions that carried them through Kafka, whether the batch stage reads the spool's
files or finds them gone and re-assembles the groups from the archive."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.io.lake import Lake
from ingest.io.spool import HEADER, DecisionSpool
from ingest.processor.config import ProcessorConfig
from ingest.processor.decisions import LAKE
from ingest.processor.main import Processor
from tests.integration.pipeline import assert_keys_once, derived_tables, run_processor
from tests.support.suite_kafka import suite_kafka

SIM = SimulationConfig(run_id="spooled", steps=3, rollout_batch_size=2, n_samples=3,
                       response_len_mean=24, prompt_len=4, seed=11, mode="open",
                       surplus_per_step=1, compaction_rate=0.3, compact_arrays=True)


def _topics(broker) -> KafkaSettings:
    """Two events and two decisions partitions, read by every lake below."""
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix=f"spool{uuid.uuid4().hex[:8]}.",
                        event_partitions=2, decision_partitions=2)
    kafka.ensure_topics()
    return kafka


def _decision_records(kafka: KafkaSettings, lake_root: str) -> list:
    """The decisions records the lake's group stage sent (the topic is shared)."""
    lake_id = str(Lake(lake_root).refresh("events").metadata().id).encode()
    return [r for r in read_topics(kafka, [kafka.topics.decisions], what="the test",
                                   timeout_s=60)
            if (LAKE, lake_id) in r.headers and any(k == "decision" for k, _ in r.headers)]


def test_decisions_through_the_spool_give_the_tables_of_decisions_through_kafka(
        broker, tmp_path):
    kafka = _topics(broker)
    through_kafka, spooled = str(tmp_path / "kafka"), str(tmp_path / "spooled")
    spool_dir = tmp_path / "spool"
    processor = Processor(ProcessorConfig(kafka=kafka, lake=spooled, until_idle_s=3.0,
                                          consumer_group="spooled", spool_dir=str(spool_dir)))
    running = threading.Thread(target=processor.run)
    running.start()
    # The events come once the batch stage owns its partitions: the group stage leaves
    # fragments in the spool only for a batch stage that said so.
    assert processor.spool is not None
    deadline = time.monotonic() + 60
    while processor.spool.owned() != {0, 1}:
        assert time.monotonic() < deadline and running.is_alive()
        time.sleep(0.05)
    run_simulation(kafka, SIM)
    running.join()
    assert not processor.errors
    run_processor(kafka, through_kafka, consumer_group="through-kafka", spool=False)
    expected = derived_tables(Lake(through_kafka), SIM.run_id)
    assert len(expected["steps"]) == SIM.steps
    assert derived_tables(Lake(spooled), SIM.run_id) == expected
    assert_keys_once(Lake(spooled))
    # the kept groups' fragments went through the spool, and none of the other lake's
    carried = [r for r in _decision_records(kafka, spooled) if any(k == HEADER for k, _ in r.headers)]
    kept = sum(r["decision"] == "kept" for r in expected["groups"])
    assert len(carried) >= kept and all(r.value == b"" for r in carried)
    assert not any(k == HEADER for r in _decision_records(kafka, through_kafka)
                   for k, _ in r.headers)
    assert list(spool_dir.iterdir()) == []  # the instance's folder went with it


def test_a_batch_stage_that_finds_the_spool_gone_re_assembles_the_groups_from_the_archive(
        broker, tmp_path, caplog):
    kafka = _topics(broker)
    run_simulation(kafka, SIM)
    through_kafka, spooled = str(tmp_path / "kafka"), str(tmp_path / "spooled")
    run_processor(kafka, through_kafka, consumer_group="through-kafka", spool=False)
    # The group stage alone, as if its instance's batch stage owned every decisions
    # partition; that instance then goes away with its spool before reading any of them.
    spool = DecisionSpool.create(tmp_path / "spool")
    assert spool is not None
    spool.own({0, 1})
    config = ProcessorConfig(kafka=kafka, lake=spooled, until_idle_s=1.5,
                             consumer_group="spooled")
    Processor(config.model_copy(update={"stages": "groups"}), spool=spool).run()
    assert any(k == HEADER for r in _decision_records(kafka, spooled) for k, _ in r.headers)
    spool.remove()
    with caplog.at_level(logging.INFO, logger="ingest.processor.batch_stage"):
        Processor(config.model_copy(update={"stages": "batches"})).run()
    assert "re-assembled from the events archive" in caplog.text
    assert derived_tables(Lake(spooled), SIM.run_id) == derived_tables(
        Lake(through_kafka), SIM.run_id)
    assert_keys_once(Lake(spooled))
    assert not Path(spool.folder).exists()
