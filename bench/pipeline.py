"""Pipeline throughput and latency, side by side with bare Kafka and JSONL, in one run.

    .venv/bin/python bench/pipeline.py [--steps 4] [--response-len 2048] [--latency-steps 6]
    .venv/bin/python bench/pipeline.py --preloaded-only [--before TREE]   # only section 6

One simulated stream (DAPO-like groups, log-normal responses of ~2k tokens with log-probs)
goes through four paths on this machine, one after the other:
  1. JSONL: `json.dumps` + write of every event (what users do today; no grouping,
     no filters, no durability guarantees);
  2. bare Kafka: kafka-python produce + consume of the same bytes (the ceiling);
  3. rolloutlake: publish -> `rolloutlake process` (a separate process) -> sealed batches in
     Delta, timed from the first publish to the last `steps` row;
  4. replay: `rolloutlake replay` of path 3's run from its `events` archive into a fresh
     lake (the live processor's core over the archive), in events per second beside the
     live processor's;
  5. latency: the same pipeline paced below capacity; p50/p99 from a group's last event to
     its `groups` row, and from a step's last kept group to its `steps` row;
  6. pre-loaded: the stream already in Kafka, once with JSON-list token arrays and once in
     the SDK's compact form; per form, a bare consumer that reads and `orjson`-parses every
     message (the ceiling) beside `rolloutlake process --until-idle`, timed from its group
     stage joining its group to the last `steps` row (that run's own start-up left out) and
     all in from the spawn; and the bare cost of the processor's two Kafka hops (the
     compact events read, parsed and forwarded a group per message, read again in a second
     process). With `--before TREE` the compact processor of another source tree (e.g. an
     older commit exported with `git archive`) runs beside this one's, interleaved.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.compute as pc
from kafka import TopicPartition
from scratch import scratch_folder

from ingest.commands.replay import archived_config, replay_run, write_effects
from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.allocator import reuse_large_buffers
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.io.tail import TableTail
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from schemas.token_arrays import TOKEN_IDS, decode_token_array


def stream(sim: SimulationConfig) -> list[list[bytes]]:
    """Encoded events per group of the open-loop run (`sim.steps` steps seal)."""
    return [[orjson.dumps(e) for e in group.events] for group in open_loop_groups(sim)]


def response_tokens(groups: list[list[bytes]]) -> tuple[int, int]:
    tokens = samples = 0
    for events in groups:
        for raw in events:
            body = orjson.loads(raw)
            if body["type"] in ("sample_finished", "compaction_fragment"):
                tokens += len(decode_token_array(TOKEN_IDS, body["response_tokens"]))
                samples += body["type"] == "sample_finished"
    return tokens, samples


def bench_jsonl(groups: list[list[bytes]], folder: Path) -> float:
    decoded = [[orjson.loads(raw) for raw in events] for events in groups]
    start = time.perf_counter()
    with open(folder / "rollouts.jsonl", "w") as out:
        for events in decoded:
            for body in events:
                out.write(json.dumps(body) + "\n")
        out.flush()
    return time.perf_counter() - start


def bench_bare_kafka(kafka: KafkaSettings, groups: list[list[bytes]]) -> float:
    topic = _one_partition_topic(kafka, "bare")
    total = sum(len(e) for e in groups)
    consumer, _ = _from_start(kafka, topic)
    producer = kafka.producer()
    start = time.perf_counter()

    def produce() -> None:
        for events in groups:
            for raw in events:
                producer.send(topic, key=b"k", value=raw)
        producer.flush()

    thread = threading.Thread(target=produce)
    thread.start()
    seen = 0
    while seen < total:
        for records in consumer.poll(timeout_ms=200).values():
            seen += len(records)
    elapsed = time.perf_counter() - start
    thread.join()
    producer.close()
    consumer.close()
    return elapsed


def _spawn(kafka: KafkaSettings, lake: str, idle_s: float = 10.0,
           flags: tuple[str, ...] = (), stderr: Any = subprocess.DEVNULL,
           tree: Path | None = None) -> subprocess.Popen:
    # -m puts the working directory first on sys.path: `tree`'s own packages load.
    return subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
         kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
         "--event-partitions", "1", "--until-idle", str(idle_s), *flags],
        stderr=stderr, cwd=tree,
    )


def joined_at(log: str) -> dict[str, float]:
    """Wall-clock time of each stage's "joined consumer group" log line."""
    found = {}
    for line in log.splitlines():
        for role in ("groups", "batches"):
            if f"{role} stage: joined consumer group" in line:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                found.setdefault(f"{role} joined", stamp.timestamp())
    return found


def preload(kafka: KafkaSettings, run_id: str, config: dict, groups: list[list[bytes]]) -> None:
    """Publish the run's config and every event, and wait until all are acknowledged."""
    kafka.ensure_topics()
    with RolloutPublisher(kafka) as pub:
        pub.run_started(run_id, config)
        for index, events in enumerate(groups):
            key = event_group_key(run_id, index)
            for raw in events:
                pub.send_raw(pub.topics.events, key, raw)


def _one_partition_topic(kafka: KafkaSettings, name: str) -> str:
    """Create the bench's own topic `name` (under the topic prefix), one partition."""
    from kafka.admin import NewTopic

    topic = f"{kafka.topic_prefix}{name}"
    admin = kafka.admin()
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    return topic


def _from_start(kafka: KafkaSettings, topic: str) -> tuple[Any, int]:
    """A consumer outside any group at the start of the one-partition `topic`, and the
    topic's end offset."""
    consumer = kafka.consumer(group_id=None)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    consumer.seek_to_beginning(tp)
    return consumer, end


def bench_consume_parse(kafka: KafkaSettings) -> float:
    """The ceiling: one kafka-python consumer reads the pre-loaded events topic to its end
    and parses every message with orjson."""
    consumer, end = _from_start(kafka, kafka.topics.events)
    start = time.perf_counter()
    position = 0
    while position < end:
        for records in consumer.poll(timeout_ms=200).values():
            for record in records:
                orjson.loads(record.value)
            position = records[-1].offset + 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return elapsed


def _read_forwarded(kafka: KafkaSettings, topic: str, expect: int, ready: Any, done: Any) -> None:
    """The second hop's reader (a process of its own, as the batch stage is): reads `topic`
    from its start until `expect` records came, then reports the wall-clock time."""
    consumer, _ = _from_start(kafka, topic)
    consumer.poll(timeout_ms=100)
    ready.set()
    seen = 0
    while seen < expect:
        for records in consumer.poll(timeout_ms=200).values():
            seen += len(records)
    done.put(time.time())
    consumer.close()


def bench_two_hops(kafka: KafkaSettings, groups: int, label: str) -> float:
    """The bare cost of the processor's two Kafka hops: this process reads the pre-loaded
    events topic to its end, `orjson`-parses every message and forwards each group's events
    as one message (about a decision's size) to a topic of its own, uncompressed as
    decisions are; a second process reads that topic to its end. Seconds from the first
    read to the second reader's last record; no grouping, no validation, no lake."""
    topic = _one_partition_topic(kafka, f"two-hops-{label}")
    spawn = multiprocessing.get_context("spawn")
    ready, done = spawn.Event(), spawn.Queue()
    reader = spawn.Process(target=_read_forwarded, args=(kafka, topic, groups, ready, done))
    reader.start()
    if not ready.wait(timeout=60):
        raise SystemExit("the two-hop reader did not start")
    consumer, end = _from_start(kafka, kafka.topics.events)
    producer = kafka.producer(compression_type=None)
    start = time.time()
    position, key, values = 0, None, []
    while position < end:
        for records in consumer.poll(timeout_ms=200).values():
            for record in records:
                orjson.loads(record.value)
                if record.key != key and values:
                    producer.send(topic, key=key, value=b"".join(values))
                    values = []
                key = record.key
                values.append(record.value)
            position = records[-1].offset + 1
    producer.send(topic, key=key, value=b"".join(values))
    producer.flush()
    finished = done.get(timeout=120)
    reader.join(timeout=30)
    producer.close()
    consumer.close()
    return finished - start


def commits(table: Path) -> list[tuple[float, list[str], dict[str, int]]]:
    """(commit timestamp in s, files added, app transactions) of each commit, in order."""
    out = []
    for log in sorted((table / "_delta_log").glob("*.json")):
        at, added, txns = 0.0, [], {}
        for line in log.read_text().splitlines():
            action = json.loads(line)
            if "commitInfo" in action:
                at = action["commitInfo"]["timestamp"] / 1000
            elif "add" in action:
                added.append(action["add"]["path"])
            elif "txn" in action:
                txns[action["txn"]["appId"]] = action["txn"]["version"]
        out.append((at, added, txns))
    return out


def bench_process_preloaded(kafka: KafkaSettings, run_id: str, lake_root: str,
                            expect_steps: int, flags: tuple[str, ...] = (),
                            tree: Path | None = None) -> tuple[float, float]:
    """Seconds from spawning `rolloutlake process` to the commit of the last `steps` row
    over the pre-loaded topic, and from its group stage joining its group (the start-up,
    imports and join, of this very run left out) to that commit.

    The commit's own `commitInfo.timestamp`, read once the processor has exited: a reader
    tailing the lake while it runs would take CPU from it on this two-core machine.
    """
    with tempfile.TemporaryFile("w+") as log:
        wall = time.time()
        processor = _spawn(kafka, lake_root, idle_s=2.0, flags=flags, stderr=log, tree=tree)
        processor.wait(timeout=300)
        log.seek(0)
        text = log.read()
    joined = joined_at(text).get("groups joined")
    if joined is None:
        raise SystemExit(f"rolloutlake process never joined its group:\n{text[-2000:]}")
    steps = Lake(lake_root).read("steps", columns=["step"], filter=pc.field("run_id") == run_id)
    if steps.num_rows != expect_steps:
        raise SystemExit(f"rolloutlake process sealed {steps.num_rows} of {expect_steps} "
                         f"steps:\n{text[-2000:]}")
    last = max(at for at, added, _ in commits(Path(lake_root) / "steps") if added)
    return last - wall, last - joined


# Each processor path of the pre-loaded section: (the form of its stream, its flags, the
# source tree it runs from: None for this checkout).
PRELOADED_PATHS: dict[str, tuple[str, tuple[str, ...], Path | None]] = {
    "JSON lists": ("JSON lists", (), None), "compact": ("compact", (), None),
    "compact, 1 process": ("compact", ("--single-process",), None)}


def preloaded_section(settings, sim: SimulationConfig, folder: Path, repeat: int,
                      before: Path | None = None) -> None:
    """Each path `repeat` times, interleaved; the best time of each counts (the machine is
    shared: the best is the run least disturbed by others). With `before` (another source
    tree, e.g. an older commit exported with `git archive`), the compact path runs from it
    too, so a change is measured against the code before it in the same run."""
    paths = dict(PRELOADED_PATHS)
    if before is not None:
        paths["compact, before"] = ("compact", (), before)
    forms = {"JSON lists": stream(sim.model_copy(update={"compact_arrays": False})),
             "compact": stream(sim)}
    tokens, samples = response_tokens(forms["compact"])
    topics, sizes = {}, {}
    for index, (name, stream_) in enumerate(forms.items()):
        topics[name] = settings(f"pre{index}.")
        preload(topics[name], sim.run_id, sim.run_config(), stream_)
        sizes[name] = sum(len(raw) for events in stream_ for raw in events)
    times: dict[str, list[float]] = {}
    for rep in range(repeat):
        for form in forms:
            times.setdefault(f"{form} ceiling", []).append(bench_consume_parse(topics[form]))
        times.setdefault("two hops", []).append(
            bench_two_hops(topics["compact"], len(forms["compact"]), str(rep)))
        for path, (form, flags, tree) in paths.items():
            lake = folder / f"lake-{path.replace(' ', '-').replace(',', '')}-{rep}"
            total, processing = bench_process_preloaded(topics[form], sim.run_id, str(lake),
                                                        sim.steps, flags, tree)
            times.setdefault(f"{path} all in", []).append(total)
            times.setdefault(path, []).append(processing)
    print(f"\npre-loaded stream, {tokens:,} response tokens ({samples} samples), best of "
          f"{repeat}; process s: from the group stage joining its group to the last steps "
          "row; all in s: from the spawn (imports and joins too)")
    print(f"{'path':<20}{'MiB':>6}{'ceiling s':>11}{'ceiling tok/s':>15}{'process s':>11}"
          f"{'process tok/s':>15}{'vs ceiling':>12}{'all in s':>10}{'all in tok/s':>14}")
    best = {}
    for path, (form, _, _) in paths.items():
        ceiling = min(times[f"{form} ceiling"])
        seconds = best[path] = min(times[path])
        all_in = min(times[f"{path} all in"])
        print(f"{path:<20}{sizes[form] / 2**20:>6.0f}{ceiling:>11.2f}{tokens / ceiling:>15,.0f}"
              f"{seconds:>11.2f}{tokens / seconds:>15,.0f}{ceiling / seconds:>11.2f}x"
              f"{all_in:>10.2f}{tokens / all_in:>14,.0f}")
    lists_ceiling, two_hops = min(times["JSON lists ceiling"]), min(times["two hops"])
    print(f"compact, two bare Kafka hops (read + orjson + forward per group, read in a second "
          f"process): {two_hops:.2f} s, {tokens / two_hops:,.0f} tokens/s; compact process vs "
          f"it: {two_hops / best['compact']:.2f}x")
    print(f"compact vs JSON lists, process: {best['JSON lists'] / best['compact']:.2f}x faster; "
          f"compact process vs the JSON-list ceiling: {lists_ceiling / best['compact']:.2f}x; "
          f"two processes vs one: {best['compact, 1 process'] / best['compact']:.2f}x faster")
    if before is not None:
        print(f"compact, this tree vs {before}: {best['compact, before'] / best['compact']:.2f}x "
              "faster from the join")


class Watcher(threading.Thread):
    """Tails `groups` and `steps` and records when each row first became visible."""

    def __init__(self, lake_root: str, run_id: str):
        super().__init__(daemon=True)
        lake = Lake(lake_root)
        self.tails = {"groups": TableTail(lake, "groups", run_id, ["group_index"]),
                      "steps": TableTail(lake, "steps", run_id, ["step"])}
        self.group_seen: dict[int, float] = {}
        self.step_seen: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for table, seen, column in (("groups", self.group_seen, "group_index"),
                                        ("steps", self.step_seen, "step")):
                rows = self.tails[table].poll()
                now = time.perf_counter()
                for key in [] if rows is None else rows.column(column).to_pylist():
                    seen.setdefault(key, now)
            time.sleep(0.01)


def _warm_up(pub: RolloutPublisher, lake_root: str) -> None:
    """Seal a one-group run first, so timing starts with both stages up and joined."""
    pub.run_started("warmup", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
    pub.group_started("warmup", group_index=0, step=0, n_samples=2)
    for rollout, reward in ((0, 1.0), (1, 0.0)):
        pub.sample_finished("warmup", group_index=0, rollout_id=rollout, status="completed",
                            prompt_tokens=[1], response_tokens=[2], reward=reward)
    pub.flush()
    tail = TableTail(Lake(lake_root), "steps", "warmup", ["step"])
    deadline = time.monotonic() + 120
    while not tail.poll() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_pipeline(kafka: KafkaSettings, sim: SimulationConfig, groups: list[list[bytes]],
                 lake_root: str, pace_s: float, expect_steps: int) -> tuple[float, dict, Watcher]:
    kafka.ensure_topics()
    processor = _spawn(kafka, lake_root)
    watcher = Watcher(lake_root, sim.run_id)
    sent_at: dict[int, float] = {}
    with RolloutPublisher(kafka) as pub:
        pub.run_started(sim.run_id, sim.run_config())
        _warm_up(pub, lake_root)
        watcher.start()
        start = time.perf_counter()
        for index, events in enumerate(groups):
            key = event_group_key(sim.run_id, index)
            for raw in events:
                pub.send_raw(pub.topics.events, key, raw)
            if pace_s:
                pub.flush()
                sent_at[index] = time.perf_counter()
                time.sleep(pace_s)
        pub.flush()
    while len(watcher.step_seen) < expect_steps and processor.poll() is None:
        time.sleep(0.01)
    elapsed = max(watcher.step_seen.values(), default=time.perf_counter()) - start
    watcher.stop.set()
    processor.wait(timeout=120)
    return elapsed, sent_at, watcher


def bench_replay(lake_root: str, run_id: str, out_root: str) -> float:
    """Seconds `rolloutlake replay` takes to re-derive the run into a fresh lake."""
    lake = Lake(lake_root)
    start = time.perf_counter()
    write_effects(Lake(out_root), run_id,
                  replay_run(lake, run_id, archived_config(lake, run_id)).effects)
    return time.perf_counter() - start


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    p50, p99 = np.percentile(values, [50, 99])
    return f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of the throughput run")
    parser.add_argument("--response-len", type=float, default=2048.0)
    parser.add_argument("--latency-steps", type=int, default=6)
    parser.add_argument("--preloaded-only", action="store_true",
                        help="run only the pre-loaded section (6)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each path in the pre-loaded section (the best counts)")
    parser.add_argument("--before", type=Path, default=None, metavar="TREE",
                        help="another source tree whose processor runs the compact path too")
    args = parser.parse_args()
    # The bare paths read with the processor's allocator settings: a ceiling is what reading
    # costs at best (the default allocator faults every fetch response in again).
    reuse_large_buffers()
    sim = SimulationConfig(run_id="bench", steps=args.steps, rollout_batch_size=32, n_samples=8,
                           response_len_mean=args.response_len, prompt_len=256, mode="open",
                           duplicate_rate=0.0, seed=3)
    groups = stream(sim)  # compact token arrays, as the SDK sends them
    tokens, samples = response_tokens(groups)
    size = sum(len(raw) for events in groups for raw in events)
    print(f"stream: {len(groups)} groups, {samples} samples, {tokens / samples:.0f} response "
          f"tokens per sample, {size / 2**20:.0f} MiB of JSON events (compact token arrays)")
    folder = scratch_folder("rolloutlake-bench-")
    with EmbeddedBroker(free_port()) as broker:
        def settings(prefix: str) -> KafkaSettings:
            return KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=prefix,
                                 event_partitions=1, decision_partitions=1)

        if args.preloaded_only:
            preloaded_section(settings, sim, folder, args.repeat, args.before)
            return

        # what users do today: JSON lists
        jsonl_s = bench_jsonl(stream(sim.model_copy(update={"compact_arrays": False})), folder)
        bare_s = bench_bare_kafka(settings("bare."), groups)
        pipe_s, _, watcher = run_pipeline(settings("pipe."), sim, groups, str(folder / "lake"),
                                          pace_s=0.0, expect_steps=args.steps)
        sealed = Lake(str(folder / "lake")).read("steps", columns=["n_tokens"],
                                              filter=pc.field("run_id") == sim.run_id)
        steps = sealed.num_rows
        replay_s = bench_replay(str(folder / "lake"), sim.run_id, str(folder / "replayed"))
        paced = sim.model_copy(update={"steps": args.latency_steps, "seed": 4})
        _, sent_at, lat = run_pipeline(settings("lat."), paced, stream(paced),
                                       str(folder / "lake-latency"), pace_s=0.05,
                                       expect_steps=args.latency_steps)
        preloaded_section(settings, sim, folder, args.repeat)
    decided = [lat.group_seen[g] - t for g, t in sent_at.items() if g in lat.group_seen]
    lake = Lake(str(folder / "lake-latency"))
    batch = lake.read("groups", columns=["group_index", "batch_step"],
                      filter=pc.field("decision") == "kept")
    last_kept: dict[int, float] = {}
    for g, s in zip(batch.column("group_index").to_pylist(), batch.column("batch_step").to_pylist(),
                    strict=True):
        if g in sent_at:
            last_kept[s] = max(last_kept.get(s, 0.0), sent_at[g])
    sealed_lat = [lat.step_seen[s] - t for s, t in last_kept.items() if s in lat.step_seen]

    print(f"\n{'path':<34}{'seconds':>9}{'samples/s':>12}{'resp tokens/s':>16}{'vs bare Kafka':>15}")
    for name, seconds in (("JSONL dump (json.dumps + write)", jsonl_s),
                          ("bare kafka-python produce+consume", bare_s),
                          ("rolloutlake publish -> sealed", pipe_s)):
        print(f"{name:<34}{seconds:>9.2f}{samples / seconds:>12,.0f}{tokens / seconds:>16,.0f}"
              f"{bare_s / seconds:>14.2f}x")
    events = sum(len(e) for e in groups)
    print(f"\nevents/s, live processor (publish -> sealed): {events / pipe_s:,.0f}; "
          f"replay from the archive: {events / replay_s:,.0f} ({replay_s:.2f} s)")
    print(f"sealed steps: {steps} ({int(pc.sum(sealed.column('n_tokens')).as_py() or 0):,} "
          "tokens in batches)")
    print(f"latency, group's last event -> groups row in Delta: {percentiles(decided)}")
    print(f"latency, step's last kept group -> steps row:       {percentiles(sealed_lat)}")


if __name__ == "__main__":
    main()
