"""Helpers for end-to-end tests: publish raw events, run the processor until idle, read."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pyarrow.compute as pc

from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.kafka import KafkaSettings, poll_in_group, subscribe_once_listed
from ingest.io.lake import Lake
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from ingest.processor.main import Processor
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from schemas.tables import TABLES
from tests.support.suite_kafka import suite_kafka

_ids = itertools.count()


def event(kind: str, run_id: str, **fields: Any) -> dict[str, Any]:
    """A contract event as a dict, with a fresh event_id unless one is given."""
    fields.setdefault("event_id", f"e{next(_ids)}")
    return {"type": kind, "schema_version": 1, "run_id": run_id, **fields}


def sample(run_id: str, group_index: int, rollout_id: int, reward: Any = 1.0, *,
           length: int = 4, **fields: Any) -> dict[str, Any]:
    body = dict(group_index=group_index, rollout_id=rollout_id, status="completed",
                prompt_tokens=[1, 2], response_tokens=list(range(10, 10 + length)),
                rollout_log_probs=[-0.5] * length)
    if reward is not ...:
        body["reward"] = reward
    body.update(fields)
    return event("sample_finished", run_id, **body)


def publish(kafka: KafkaSettings, run_id: str, config: dict[str, Any] | None,
            events: list[dict[str, Any] | bytes], *, key_group: int = 0) -> None:
    """Publish `run_started` (when a config is given) then events as raw bytes, in order."""
    with RolloutPublisher(kafka) as pub:
        if config is not None:
            pub.run_started(run_id, config)
            pub.flush()
        for body in events:
            if isinstance(body, bytes):
                pub.send_raw(pub.topics.events, event_group_key(run_id, key_group), body)
                continue
            key = event_group_key(run_id, body.get("group_index", key_group))
            pub.send_raw(pub.topics.events, key, orjson.dumps(body))


def publish_open_loop(kafka: KafkaSettings, sim: SimulationConfig, *,
                      pause_s: float | None = None) -> None:
    """Publish a simulated open-loop run: `run_started`, then every group's events.

    With `pause_s` each group is flushed before the pause, so a processor reading alongside
    meets the run as a stream; without it the groups go out in the producer's batches.
    """
    with RolloutPublisher(kafka) as pub:
        pub.run_started(sim.run_id, sim.run_config(), event_id="run")
        pub.flush()
        for group in open_loop_groups(sim):
            for body in group.events:
                pub.send_raw(pub.topics.events, event_group_key(sim.run_id, body["group_index"]),
                             orjson.dumps(body))
            if pause_s is not None:
                pub.flush()
                time.sleep(pause_s)


def ordered_kafka(bootstrap_servers: str, prefix: str) -> KafkaSettings:
    """Fresh topics with one partition each, topics created: decisions then follow publish
    order, so which group of a step ends up surplus is determined by the test."""
    kafka = suite_kafka(bootstrap_servers, topic_prefix=prefix, event_partitions=1,
                        decision_partitions=1)
    kafka.ensure_topics()
    return kafka


def run_processor(kafka: KafkaSettings, lake_root: str, idle_s: float = 1.5,
                  **config: Any) -> Processor:
    processor = Processor(ProcessorConfig(kafka=kafka, lake=lake_root, until_idle_s=idle_s,
                                          **config))
    processor.run()
    return processor


def rows(lake: Lake | str, table: str, run_id: str | None = None) -> list[dict[str, Any]]:
    lake = lake if isinstance(lake, Lake) else Lake(lake)
    flt = None if run_id is None or table == "dead_letters" else pc.field("run_id") == run_id
    return lake.read(table, filter=flt).to_pylist()


def run_rows(lake: Lake | str, table: str, columns: list[str], run_id: str) -> list[tuple]:
    """`columns` of the run's rows of `table` as sorted tuples: two lakes compare whatever
    order their commits wrote the rows in."""
    lake = lake if isinstance(lake, Lake) else Lake(lake)
    read = lake.read(table, columns=columns, filter=pc.field("run_id") == run_id)
    return sorted(zip(*(read.column(c).to_pylist() for c in columns), strict=True))


def sorted_run_table(lake: Lake, name: str, run_id: str, sort: list[str]
                     ) -> list[dict[str, Any]]:
    """The run's rows of `name` in `sort` order, without the run id and the wall clock of
    a decision (`decided_at`): what two runs over the same events must agree on."""
    table = lake.read(name, filter=pc.field("run_id") == run_id).drop_columns(["run_id"])
    if "decided_at" in table.column_names:
        table = table.drop_columns(["decided_at"])
    return table.sort_by([(c, "ascending") for c in sort]).to_pylist()


def derived_tables(lake: Lake, run_id: str) -> dict[str, list[dict[str, Any]]]:
    """What the processor derived for a run: its groups, samples, training batches and
    steps (the step's content, not its commit's times and versions)."""
    return {
        "groups": sorted_run_table(lake, "groups", run_id, ["group_index"]),
        "samples": sorted_run_table(lake, "samples", run_id,
                                    ["group_index", "rollout_id", "fragment_index"]),
        "training_batches": sorted_run_table(lake, "training_batches", run_id,
                                             ["step", "position"]),
        "steps": [{k: r[k] for k in ("step", "n_samples", "n_tokens", "content_sha256")}
                  for r in sorted_run_table(lake, "steps", run_id, ["step"])],
    }


def by_group(lake: Lake | str, run_id: str) -> dict[int, dict[str, Any]]:
    return {r["group_index"]: r for r in rows(lake, "groups", run_id)}


def metrics(lake: Lake | str, run_id: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for r in rows(lake, "step_metrics", run_id):
        out.setdefault(r["step"], {})[r["key"]] = r["value"]
    return out


def assert_keys_once(lake: Lake) -> None:
    """Every table of the lake holds each of its key tuples once (CONTRACT section 4)."""
    for spec in TABLES.values():
        if not lake.exists(spec.name):
            continue
        keys = lake.read(spec.name, columns=list(spec.key))
        rows = list(zip(*(keys.column(c).to_pylist() for c in spec.key), strict=True))
        assert len(rows) == len(set(rows)), f"{spec.name} holds a key twice"


STUCK_SESSION_TIMEOUT_MS = 40_000


def stuck_member(kafka: KafkaSettings, group_id: str) -> Any:
    """A member of `group_id` on the events topic that joined and then stops polling: the
    broker holds the group's next rebalance for it. The caller closes it.

    Its session outlasts a starved machine's freezes (CI: 17 s, in which kafka-python's
    10 s default let the broker drop it and the processor's join then went through)."""
    consumer = kafka.consumer(group_id=group_id, session_timeout_ms=STUCK_SESSION_TIMEOUT_MS,
                              heartbeat_interval_ms=STUCK_SESSION_TIMEOUT_MS // 10)
    subscribe_once_listed(consumer, kafka.topics.events, timeout_s=30)
    deadline = time.monotonic() + 60
    while not consumer.assignment() and time.monotonic() < deadline:
        # The join waited out in one call: kafka-python drops a join that completes between
        # two polls, and Tansu answers one after half the session timeout.
        poll_in_group(consumer, 200, join_wait_ms=STUCK_SESSION_TIMEOUT_MS)
    if not consumer.assignment():
        consumer.close()
        raise AssertionError(f"a member of {group_id} did not join within 60 s")
    return consumer


def poll_until_idle(stage: GroupStage, timeout_s: float = 60.0) -> None:
    """Poll `stage` (in this process) until it is idle; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    stage.poll_once()
    while not stage.idle:
        assert time.monotonic() < deadline, "the stage did not become idle"
        stage.poll_once()


def poll_in_thread(stage: GroupStage | BatchStage, until: Callable[[], bool]
                   ) -> tuple[threading.Thread, list[BaseException]]:
    """Poll `stage` on a thread of its own until `until()`, its first error (kept in the
    returned list) or 120 s, so a stage that never gets there ends too."""
    failures: list[BaseException] = []
    gives_up_at = time.monotonic() + 120

    def poll() -> None:
        try:
            while not until() and time.monotonic() < gives_up_at:
                stage.poll_once()
        except BaseException as error:
            failures.append(error)

    polling = threading.Thread(target=poll, daemon=True)
    polling.start()
    return polling, failures
