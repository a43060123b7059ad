"""Hostile input straight to Kafka: the processor dead-letters it with a reason and goes on.

Events here bypass the SDK and the gateway (a plain kafka-python producer or raw bytes),
as a buggy or hostile worker would send them. Real Tansu broker, real Delta tables.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import orjson
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer

from ingest.core.assembly import GroupBuilder
from ingest.core.decided import DecisionHeader
from ingest.io.kafka import KafkaSettings, key_partition
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor
from schemas.events import event_group_key
from tests.integration.pipeline import by_group, event, publish, rows, run_processor, sample
from tests.support.suite_kafka import suite_kafka

CONFIG = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}


def started(run_id: str, group_index: int, **fields: Any) -> dict[str, Any]:
    """A two-sample group of step `group_index` (one kept group per step: none is surplus)."""
    return event("group_started", run_id, **{"group_index": group_index, "step": group_index,
                                             "n_samples": 2, **fields})


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def dead_letters_of(lake: Lake, run_id: str) -> list[dict[str, Any]]:
    return [r for r in rows(lake, "dead_letters") if r["run_id"] == run_id
            or (r["raw"] and r["raw"].find(run_id.encode()) >= 0)]


def test_events_the_tables_cannot_store_are_dead_lettered_and_the_run_goes_on(kafka, lake_root):
    """Each of these crashed the processor for every run (ArrowInvalid, OverflowError,
    RecursionError); now each is one dead letter naming the field, and the groups around
    them are decided from their valid events."""
    run = "bounds"
    g1 = sample(run, 1, 0)
    poison = {
        "response_tokens.0": orjson.dumps({**g1, "event_id": "p1", "response_tokens": [2**31]}),
        "sample_index": orjson.dumps({**g1, "event_id": "p2", "sample_index": 2**63}),
        "metadata": orjson.dumps({**g1, "event_id": "p3"})[:-1]
        + b',"metadata":' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}",
        "reward": orjson.dumps({**g1, "event_id": "p4"}).replace(b'"reward":1.0', b'"reward":NaN'),
        "rollout_log_probs": orjson.dumps({**g1, "event_id": "p5"}).replace(b"-0.5,", b"-1e400,", 1),
        "ts": orjson.dumps({**g1, "event_id": "p6", "ts": 1e300}),
    }
    events: list[Any] = [started(run, 0), sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0),
                         started(run, 1), *poison.values(),
                         sample(run, 1, 0, 1.0), sample(run, 1, 1, 0.5)]
    huge_group = {**sample(run, 0, 0), "event_id": "p7", "group_index": 2**63}
    publish(kafka, run, CONFIG, events, key_group=1)
    with KafkaProducer(bootstrap_servers=kafka.bootstrap_servers) as producer:
        producer.send(kafka.topics.events, key=f"{run}:{2**63}".encode(),
                      value=orjson.dumps(huge_group)).get(timeout=30)
    run_processor(kafka, lake_root, idle_s=2.0)
    groups = by_group(lake_root, run)
    assert {g: r["decision"] for g, r in groups.items()} == {0: "kept", 1: "kept"}
    assert groups[1]["mean_reward"] == 0.75  # the valid rewards, none of the poisoned ones
    errors = [r["error"] for r in rows(lake_root, "dead_letters")
              if r["raw"] and (b'"p' in r["raw"])]
    assert len(errors) == len(poison) + 1, errors
    for field in [*poison, "group_index"]:
        assert sum(f": {field}" in e for e in errors) >= 1, (field, errors)


def test_a_decision_that_cannot_be_encoded_drops_its_group_and_restarts_cleanly(
        kafka, lake_root):
    """A user filter's reason with a lone surrogate made the decision unencodable after the
    archive commit: the stage crashed, and again on every restart."""
    run = "unencodable"
    config = {**CONFIG, "dynamic_sampling_filter_path": "tests.support.user_filters.reason_not_utf8"}
    publish(kafka, run, config, [started(run, 0), sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
    run_processor(kafka, lake_root, idle_s=2.0)
    run_processor(kafka, lake_root, idle_s=1.0)  # a restart finds nothing to redo
    groups = by_group(lake_root, run)
    assert (groups[0]["decision"], groups[0]["reason"]) == ("dropped", "unstorable")
    errors = [r["error"] for r in rows(lake_root, "dead_letters") if r["run_id"] == run]
    assert len(errors) == 1 and errors[0].startswith("group 0 of run unencodable cannot be stored")


def test_a_record_whose_handling_fails_is_dead_lettered_not_fatal(kafka, lake_root, monkeypatch):
    """The last line of defence: a failure the schema did not foresee (here injected into
    group assembly) dead-letters that one record; the stage keeps going."""
    run = "defence"
    apply = GroupBuilder.apply

    def failing_apply(self, ev):
        if ev.event_id == "boom":
            raise RuntimeError("unforeseen")
        return apply(self, ev)

    monkeypatch.setattr(GroupBuilder, "apply", failing_apply)
    publish(kafka, run, CONFIG, [started(run, 0), sample(run, 0, 0, 1.0, event_id="boom"),
                                 sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
    run_processor(kafka, lake_root, idle_s=2.0)
    assert by_group(lake_root, run)[0]["decision"] == "kept"
    errors = [r["error"] for r in rows(lake_root, "dead_letters") if r["raw"] and b'"boom"' in r["raw"]]
    assert errors == ["cannot be processed: RuntimeError: unforeseen"]


def test_decisions_records_no_group_stage_sends_are_dead_lettered_and_the_run_goes_on(
        kafka, lake_root):
    """Records on rollout.decisions that no group stage sends (another producer on the
    topic) stopped the batch stage, and again at every restart, on the same record."""
    run = "decisions-poison"
    events = [started(run, 0), sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0),
              started(run, 1), sample(run, 1, 0, 1.0), sample(run, 1, 1, 0.0)]
    publish(kafka, run, CONFIG, events[:3])
    ordered_at = {"source": {"partition": 0, "offset": 0}, "at_us": 1}
    kept = DecisionHeader(run_id=run, group_index=99, step=0, n_samples=2, decision="kept",
                          reason=None, counted=True, decided_at=1.0, first_event_at=1.0,
                          **ordered_at)
    hostile = [
        ([("decision", b"not json")], b""),
        ([("decision", orjson.dumps({"run_id": run}))], b""),
        ([("opened", b'{"run_id": 5, "group_index": 1, "step": 0}')], b""),
        ([("watermark", b'{"partition": "x", "at_us": 1}')], b""),
        ([("decision", kept.to_json())], b"not an Arrow stream"),
    ]
    producer = kafka.producer()
    for headers, value in hostile:
        producer.send(kafka.topics.decisions, key=run.encode(), value=value, headers=headers)
    producer.flush()
    producer.close()
    publish(kafka, run, None, events[3:])
    run_processor(kafka, lake_root, idle_s=2.0)
    run_processor(kafka, lake_root, idle_s=1.0)  # a restart meets none of them again
    assert {g: r["decision"] for g, r in by_group(lake_root, run).items()} == {
        0: "kept", 1: "kept"}
    assert sorted(r["step"] for r in rows(lake_root, "steps", run)) == [0, 1]
    errors = sorted(r["error"] for r in rows(lake_root, "dead_letters")
                    if r["topic"] == kafka.topics.decisions)
    assert len(errors) == len(hostile)
    assert all(e.startswith("unreadable decisions record: its ") for e in errors)
    for named in ("'decision' header is not JSON", "'decision' header lacks",
                  "'opened' header's run_id", "'watermark' header's partition",
                  "value is not an Arrow IPC stream"):
        assert any(named in e for e in errors), named


def test_an_event_id_is_unique_within_its_run_across_groups_and_restarts(kafka, lake_root):
    """The events key is (run_id, event_id): an id reused by another group of the run is
    dead-lettered, also when the first use was archived before a restart; the same id in
    another run is another event."""
    run, other = "ids", "ids-other"
    publish(kafka, run, CONFIG, [started(run, 0), sample(run, 0, 0, 1.0, event_id="shared"),
                                 sample(run, 0, 1, 0.0)])
    run_processor(kafka, lake_root, idle_s=1.5)
    publish(kafka, run, None, [started(run, 1), sample(run, 1, 0, 1.0, event_id="shared"),
                               sample(run, 1, 0, 1.0), sample(run, 1, 1, 0.0),
                               started(run, 2, event_id="twice"),
                               {**sample(run, 3, 0, 1.0), "event_id": "twice"}])
    publish(kafka, other, CONFIG, [started(other, 0), sample(other, 0, 0, 1.0, event_id="shared"),
                                   sample(other, 0, 1, 0.0)])
    run_processor(kafka, lake_root, idle_s=1.5)
    assert {g: r["decision"] for g, r in by_group(lake_root, run).items()} == {0: "kept", 1: "kept"}
    assert by_group(lake_root, other)[0]["decision"] == "kept"
    archive = Lake(lake_root).read("events", columns=["run_id", "event_id", "group_index"])
    keys = list(zip(archive.column("run_id").to_pylist(), archive.column("event_id").to_pylist(),
                    strict=True))
    assert len(keys) == len(set(keys))
    owners = dict(zip(keys, archive.column("group_index").to_pylist(), strict=True))
    assert owners[(run, "shared")] == 0 and owners[(other, "shared")] == 0
    assert owners[(run, "twice")] == 2
    errors = sorted(r["error"] for r in rows(lake_root, "dead_letters") if r["run_id"] == run)
    assert errors == [f"event_id 'shared' is already used by group 0 of run {run}: an event "
                      "id is unique within its run",
                      f"event_id 'twice' is already used by group 2 of run {run}: an event id "
                      "is unique within its run"]


# ---------------------------------------------------------------- the poison fuzz


class RunningProcessor:
    """One processor for the whole module, polled in a thread until the module ends."""

    def __init__(self, kafka: KafkaSettings, lake_root: str):
        self.processor = Processor(ProcessorConfig(kafka=kafka, lake=lake_root))
        self.exit: list[BaseException | int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.exit.append(self.processor.run())
        except BaseException as err:  # noqa: BLE001 - the test reports it
            self.exit.append(err)

    def assert_running(self) -> None:
        assert self.thread.is_alive() and not self.processor.errors, (self.exit,
                                                                      self.processor.errors)

    def stop(self) -> None:
        self.processor.stop()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def fuzz_env(broker, tmp_path_factory):
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"fz{uuid.uuid4().hex[:8]}.", event_partitions=2,
                        decision_partitions=1)
    kafka.ensure_topics()
    lake_root = str(tmp_path_factory.mktemp("fuzzlake"))
    running = RunningProcessor(kafka, lake_root)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    yield kafka, Lake(lake_root), running, producer
    producer.close()
    running.assert_running()
    running.stop()
    assert running.exit == [0]


_json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
              | st.floats() | st.text(max_size=4))
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=12)

# Field values that break one bound of CONTRACT section 2, or the schema outright.
_bad_values = {
    "response_tokens": st.sampled_from([[2**31], [-1], [2**63], ["1"], [1.5], None]),
    "prompt_tokens": st.sampled_from([[2**40], "tokens", [[1]]]),
    "group_index": st.sampled_from([2**63, -1, 2**64 + 1, "0", 1.0, None]),
    "rollout_id": st.sampled_from([2**63, -5, True]),
    "sample_index": st.sampled_from([2**63, -1, 2**100]),
    "fragment_count": st.sampled_from([0, 2**31, 2**63]),
    "weight_version": st.sampled_from([-1, 2**63]),
    # 900: json.dumps itself stops near 1000 levels (orjson refuses past 1024 on its own).
    "metadata": st.integers(min_value=33, max_value=900).map(nested) | st.sampled_from(
        [{"x": [float("nan")]}, {"x": float("inf")}, [1], "m"]),
    "reward": st.sampled_from([float("nan"), float("inf"), [1.0], "1.0", nested(40)]),
    "rollout_log_probs": st.sampled_from([[float("nan")] * 4, [1e39] * 4, [0.0]]),
    "loss_mask": st.sampled_from([[2, 1, 1, 1], [1], "1111"]),
    "ts": st.sampled_from([float("nan"), 1e300, -1.0, "now"]),
    "run_id": st.sampled_from(["..", ".", "a/b", "", "x" * 200]),
    "event_id": st.sampled_from(["", "e" * 200, 7]),
    "status": st.sampled_from(["done", None, 1]),
    "schema_version": st.sampled_from([2, "1", None]),
    "type": st.sampled_from(["run_started", "sample_done", None, 3]),
}


@st.composite
def poison_record(draw, run_id: str) -> bytes:
    """Bytes the processor must refuse: not JSON, not an object, or one field out of bounds."""
    kind = draw(st.sampled_from(["bytes", "non-object", "field", "field", "field", "field"]))
    if kind == "bytes":
        return draw(st.binary(min_size=0, max_size=40).filter(lambda b: not b.strip().startswith(b"{")))
    if kind == "non-object":
        return json.dumps(draw(_json.filter(lambda v: not isinstance(v, dict)))).encode()
    body = sample(run_id, draw(st.integers(0, 3)), draw(st.integers(0, 1)),
                  metadata=draw(st.dictionaries(st.text(max_size=3), _json, max_size=2)))
    field = draw(st.sampled_from(sorted(_bad_values)))
    body[field] = draw(_bad_values[field])
    # json.dumps writes NaN, Infinity and integers of any size, as a careless producer would.
    return json.dumps(body).encode()


@st.composite
def fuzz_case(draw):
    """A run of 1-3 valid groups, interleaved with poison and schema-valid hostile events."""
    run_id = f"fz-{uuid.uuid4().hex[:12]}"
    n_groups = draw(st.integers(1, 3))
    valid: list[dict[str, Any]] = []
    for g in range(n_groups):
        valid += [started(run_id, g), sample(run_id, g, 0, draw(st.floats(-1, 1))),
                  sample(run_id, g, 1, draw(st.integers(-3, 3)))]
    hostile: list[tuple[str, dict[str, Any] | bytes]] = []
    for _ in range(draw(st.integers(1, 6))):
        hostile.append(("poison", draw(poison_record(run_id))))
    # Schema-valid but hostile: an event on the wrong partition for its key.
    hostile.append(("wrong_partition", sample(run_id, n_groups + 9, 0, 1.0)))
    order = draw(st.permutations(range(len(valid) + len(hostile))))
    records = [("valid", e) for e in valid] + hostile
    # Sent once the run is decided (before, they could take the place of a valid event):
    # another group reusing an id of the run, a third rollout of a two-sample group.
    later = [{**sample(run_id, n_groups + 5, 0), "event_id": draw(st.sampled_from(valid))["event_id"]},
             sample(run_id, draw(st.integers(0, n_groups - 1)), 2, 1.0)]
    return run_id, n_groups, [records[i] for i in order], later


def _send(producer: KafkaProducer, kafka: KafkaSettings, run_id: str, kind: str,
          body: dict[str, Any] | bytes) -> tuple[int, int]:
    value = body if isinstance(body, bytes) else orjson.dumps(body)
    group = body.get("group_index", 0) if isinstance(body, dict) else 0
    key = event_group_key(run_id, group if isinstance(group, int) else 0)
    partition = None
    if kind == "wrong_partition":
        partition = 1 - key_partition(key, 2)
    meta = producer.send(kafka.topics.events, key=key, value=value,
                         partition=partition).get(timeout=30)
    return meta.partition, meta.offset


# No shrinking: each example waits for the processor, and the failing case is printed whole.
@pytest.mark.one_broker("what is fuzzed is the processor's handling of the bytes; the tests "
                        "above send poison through both brokers")
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(case=fuzz_case())
def test_poison_fuzz_never_stops_the_processor(fuzz_env, case):
    """Every record sent is archived or dead-lettered (the poison ones dead-lettered, each
    with a reason), the valid groups are decided, and the processor never exits."""
    kafka, lake, running, producer = fuzz_env
    run_id, n_groups, records, later = case
    running.assert_running()
    producer.send(kafka.topics.runs, key=run_id.encode(), value=orjson.dumps(
        event("run_started", run_id, config=CONFIG))).get(timeout=30)
    sent = {_send(producer, kafka, run_id, kind, body): kind for kind, body in records}
    archived_at, errors, decided = _settle(lake, kafka, running, run_id, n_groups, sent)
    sent.update({_send(producer, kafka, run_id, "poison", body): "poison" for body in later})
    archived_at, errors, decided = _settle(lake, kafka, running, run_id, n_groups, sent)
    for position, kind in sent.items():
        if kind in ("poison", "wrong_partition"):
            assert errors.get(position), (position, kind)
    assert not archived_at & set(errors), "a record is both archived and rejected"
    assert {decided[g]["decision"] for g in range(n_groups)} <= {"kept", "dropped", "surplus"}


def _settle(lake: Lake, kafka: KafkaSettings, running: RunningProcessor, run_id: str,
            n_groups: int, sent: dict[tuple[int, int], str]):
    """Wait until every record sent is archived or dead-lettered and the groups decided."""
    # Room for a rejoin: on a starved machine (the process unscheduled for 5-8 s at a
    # time) both stages' sessions expired and their partitions were taken over again.
    deadline = time.monotonic() + 90
    while True:
        running.assert_running()
        topic = pc.field("topic") == kafka.topics.events
        archived = lake.read("events", filter=topic & (pc.field("run_id") == run_id),
                             columns=["partition", "offset"])
        dead = lake.read("dead_letters", filter=topic, columns=["partition", "offset", "error"])
        archived_at = set(zip(archived.column("partition").to_pylist(),
                              archived.column("offset").to_pylist(), strict=True))
        errors = dict(zip(zip(dead.column("partition").to_pylist(),
                              dead.column("offset").to_pylist(), strict=True),
                          dead.column("error").to_pylist(), strict=True))
        decided = by_group(lake, run_id)
        done = all(p in archived_at or p in errors for p in sent)
        if done and all(g in decided for g in range(n_groups)):
            return archived_at, errors, decided
        assert time.monotonic() < deadline, (
            run_id, [(p, k) for p, k in sent.items() if p not in archived_at and p not in errors],
            sorted(decided), errors)
        time.sleep(0.2)
