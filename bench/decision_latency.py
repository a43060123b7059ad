"""Where a group's decision latency goes, hop by hop, and how a Delta commit's cost grows.

    .venv/bin/python bench/decision_latency.py [--steps 6] [--commits 500]

1. The latency run of bench/pipeline.py (DAPO-like groups of 8 x ~2k-token samples, one
   group every 50 ms, one events partition), then, per group, from the Delta logs: its
   last event sent -> the `events` commit that archived it (group stage) -> its decision
   record sent (the record's CreateTime) -> the `samples` commit holding its rows (batch
   stage) -> the `groups` commit holding its row.
   Commit times are the commits' own `commitInfo.timestamp`s, so the figures carry no
   reader's polling delay.
   Run with the batch stage's background compaction off (`--compact-every 0`) and at its
   default, interleaved (`--rounds`).
2. One-row appends to a fresh table, `--commits` of them, through `Lake.append` (what both
   stages do): the mean cost per 50 commits as the table's files accumulate.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pipeline import _spawn, _warm_up, commits, stream
from scratch import scratch_folder

from ingest.commands.simulate import SimulationConfig
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.io.lake import BackgroundCompaction, Lake, TxnMark
from ingest.processor.config import ProcessorConfig
from ingest.processor.decisions import decision_header
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key

RUN = "latency"
COMPACT_EVERY = ProcessorConfig.model_fields["compact_every"].default  # the processor's


def first_commit_of_each_group(table: Path) -> dict[int, float]:
    seen: dict[int, float] = {}
    for at, added, _ in commits(table):
        for path in added:
            if f"run_id={RUN}" in path:
                for group in pq.read_table(table / path, columns=["group_index"],
                                           partitioning=None).column(0).to_pylist():
                    seen.setdefault(group, at)
    return seen


def decision_times(kafka: KafkaSettings) -> dict[int, float]:
    """When the group stage sent each group's decision: the record's CreateTime, in s."""
    sent: dict[int, float] = {}
    for record in read_topics(kafka, [kafka.topics.decisions], what="bench", timeout_s=120):
        header = decision_header(record)
        if header is not None and header.run_id == RUN:
            sent.setdefault(header.group_index, record.timestamp / 1000)
    return sent


def percentiles(values: list[float]) -> str:
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1000
    return f"p50 {p50:4.0f}   p90 {p90:4.0f}   p99 {p99:4.0f} ms"


def hops(steps: int, compact_every: int) -> None:
    sim = SimulationConfig(run_id=RUN, steps=steps, rollout_batch_size=32, n_samples=8,
                           response_len_mean=2048, prompt_len=256, mode="open",
                           duplicate_rate=0.0, seed=4)
    groups = stream(sim)
    root = scratch_folder("rolloutlake-latency-") / "lake"
    sent: dict[int, float] = {}
    with EmbeddedBroker(free_port()) as broker:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="lat.",
                              event_partitions=1, decision_partitions=1)
        kafka.ensure_topics()
        processor = _spawn(kafka, str(root), idle_s=3.0,
                           flags=("--compact-every", str(compact_every)))
        with RolloutPublisher(kafka) as pub:
            pub.run_started(RUN, sim.run_config())
            _warm_up(pub, str(root))
            for index, events in enumerate(groups):
                for raw in events:
                    pub.send_raw(pub.topics.events, event_group_key(RUN, index), raw)
                pub.flush()
                sent[index] = time.time()
                time.sleep(0.05)
        processor.wait(timeout=600)
        published = decision_times(kafka)
    archive = Lake(str(root)).read("events", columns=["run_id", "group_index", "offset"])
    last_offset: dict[int, int] = {}
    for run_id, group, offset in zip(*(archive.column(c).to_pylist()
                                       for c in ("run_id", "group_index", "offset")), strict=True):
        if run_id == RUN:
            last_offset[group] = max(last_offset.get(group, -1), offset)
    archived = [(max(txns.values()), at) for at, _, txns in commits(root / "events") if txns]
    samples, decided = (first_commit_of_each_group(root / t) for t in ("samples", "groups"))
    rows = []
    for group, at in sent.items():
        archived_at = next(t for mark, t in archived if mark >= last_offset[group])
        rows.append((archived_at - at, published[group] - archived_at,
                     samples[group] - published[group], decided[group] - samples[group],
                     decided[group] - at))
    print(f"--compact-every {compact_every}: {len(rows)} groups, one every 50 ms; ms from the "
          "group's last event sent")
    for name, column in zip(("sent -> events commit (group stage)",
                             "events commit -> decision sent (group stage)",
                             "decision sent -> samples commit (batch stage)",
                             "samples -> groups commit", "total: sent -> groups row"),
                            zip(*rows, strict=True), strict=True):
        print(f"  {name:<48}{percentiles(list(column))}")
    for table in ("events", "samples", "groups"):
        times = [at for at, _, _ in commits(root / table)]
        print(f"  {table}: {len(times)} commits, median {np.median(np.diff(times)) * 1000:.0f} ms "
              "apart")


def growth(count: int) -> None:
    print(f"one-row appends through Lake.append, mean of each 50 ({count} commits, one file each):")
    for compact in (0, COMPACT_EVERY):
        lake = Lake(str(scratch_folder("rolloutlake-commits-")))
        compaction = BackgroundCompaction(lake, ["dead_letters"], compact)
        schema = lake.spec("dead_letters").schema
        row = {f.name: None for f in schema}
        row.update(topic="t", partition=0, offset=0, error="e", at=datetime.now(UTC))
        table = pa.Table.from_pylist([row], schema=schema)
        costs = []
        for version in range(count):
            started = time.perf_counter()
            lake.append("dead_letters", table, [TxnMark("bench", version)])
            costs.append(time.perf_counter() - started)
        compaction.close()
        print(f"  compacted every {compact or 'never':>5}: " + "  ".join(
            f"{at}: {np.mean(costs[at:at + 50]) * 1000:.1f} ms" for at in range(0, count, 100)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=1,
                        help="latency runs per setting, interleaved")
    parser.add_argument("--compact-every", type=int, action="append",
                        help="the settings to run (default: 0 and the processor's default)")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for compact_every in args.compact_every or (0, COMPACT_EVERY):
            hops(args.steps, compact_every)
    growth(args.commits)


if __name__ == "__main__":
    main()
