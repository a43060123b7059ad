"""Producers with another partitioner than murmur2 (CONTRACT section 1): librdkafka-based
clients hash keys with CRC32 by default and put a group's events elsewhere. The processor
dead-letters such events with the fix instead of assembling half a group."""

from __future__ import annotations

import confluent_kafka
import orjson
from kafka.partitioner.default import murmur2

from ingest.io.kafka import key_partition
from tests.integration.pipeline import by_group, event, publish, rows, run_processor, sample
from tests.support.suite_kafka import suite_kafka

GROUPS = 12
PARTITIONS = 4


def test_key_partition_is_the_java_clients_murmur2():
    # org.apache.kafka.common.utils.UtilsTest: murmur2("21") == -973932308,
    # murmur2("foobar") == -790332482; the partition is toPositive(hash) % partitions.
    assert key_partition(b"21", 1000) == (-973932308 & 0x7FFFFFFF) % 1000
    assert key_partition(b"foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7


def _produce(bootstrap: str, topic: str, run_id: str, partitioner: str | None) -> dict[int, int]:
    """Every event of GROUPS groups through confluent-kafka; returns group -> partition."""
    conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"}
    if partitioner is not None:
        conf["partitioner"] = partitioner
    producer = confluent_kafka.Producer(conf)
    placed: dict[int, set[int]] = {}
    failures: list[str] = []

    def delivered(err, msg) -> None:
        if err is not None:
            failures.append(str(err))
        else:
            placed.setdefault(orjson.loads(msg.value())["group_index"], set()).add(msg.partition())

    for g in range(GROUPS):
        for body in (event("group_started", run_id, group_index=g, step=g, n_samples=2),
                     sample(run_id, g, 0, 1.0), sample(run_id, g, 1, 0.0)):
            producer.produce(topic, key=f"{run_id}:{g}".encode(), value=orjson.dumps(body),
                             on_delivery=delivered)
    assert producer.flush(30) == 0 and not failures, failures
    assert all(len(parts) == 1 for parts in placed.values())  # keyed alike: one partition
    return {g: parts.pop() for g, parts in placed.items()}


def test_a_librdkafka_producer_needs_murmur2_random(broker, tmp_path):
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix="partitioners.",
                          event_partitions=PARTITIONS, decision_partitions=1)
    kafka.ensure_topics()
    lake_root = str(tmp_path / "lake")
    config = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}
    publish(kafka, "crc", config, [])
    publish(kafka, "murmur", config, [])
    crc = _produce(kafka.bootstrap_servers, kafka.topics.events, "crc", None)
    murmur = _produce(kafka.bootstrap_servers, kafka.topics.events, "murmur", "murmur2_random")
    run_processor(kafka, lake_root, idle_s=2.0)

    def java_partition(run_id: str, g: int) -> int:
        return (murmur2(f"{run_id}:{g}".encode()) & 0x7FFFFFFF) % PARTITIONS

    assert all(murmur[g] == java_partition("murmur", g) for g in range(GROUPS))
    assert set(by_group(lake_root, "murmur")) == set(range(GROUPS))
    misplaced = {g for g in range(GROUPS) if crc[g] != java_partition("crc", g)}
    assert misplaced, "CRC32 placed every key like murmur2: the test shows nothing"
    assert set(by_group(lake_root, "crc")) == set(range(GROUPS)) - misplaced
    dead = [r for r in rows(lake_root, "dead_letters") if r["run_id"] == "crc"]
    assert sorted(r["group_index"] for r in dead) == sorted(g for g in misplaced for _ in range(3))
    for row in dead:
        assert "partitioner=murmur2_random" in row["error"], row["error"]
        assert f"belongs on partition {java_partition('crc', row['group_index'])}" in row["error"]
    assert [r for r in rows(lake_root, "dead_letters") if r["run_id"] == "murmur"] == []
