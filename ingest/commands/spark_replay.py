"""`rolloutlake replay --engine spark`: the same replay and what-if, spread over a Spark cluster.

A lake that outgrows one machine replays with Spark what `rolloutlake replay` replays in
one process, with the same code on each piece and so the same tables:

1. The run's `events` rows (delta-spark, `run_id` partition pruned) are grouped by
   (run, topic, partition, group) and each group, in any executor, is folded in offset
   order by `fold_partition` and decided by `ingest.core.decide` (`replay.group_items`):
   its opened notice and its decision. This is where the events are parsed and the
   filter chain runs, group by group, in parallel.
2. The items are grouped by run and each run's go through one `RunBatcher` in
   `OrderKey` order (`replay.batch_items`): batching is sequential within a run by
   design (a step seals when its batch is full, in decision order), and runs are
   independent. The run's rows come back as Arrow IPC chunks.
3. Each derived table (`groups`, `samples`, `training_batches`, `steps`,
   `step_metrics`) is appended with delta-spark to the `--into` lake, created first with
   the contract schema; `steps.batch_version` is the `training_batches` commit.

The what-if settings are `replay`'s (`--config`, `--config-file`), parsed and applied by
the same code before Spark starts, and the diff, `--json`, `--plot` and `--check` read
the written lake as they do after a one-process replay.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from ingest.commands.replay import (
    UNWRITTEN_VERSION,
    batch_items,
    derived_tables,
    group_items,
    with_batch_version,
)
from ingest.core.assembly import fold_partition
from ingest.core.decided import DecidedGroup, DecisionHeader, Opened
from ingest.io.archive import ARCHIVE_COLUMNS, archived_events
from ingest.io.lake import Lake
from ingest.io.spark import spark_session
from ingest.processor.decisions import decode_fragments, fragments_ipc
from schemas.errors import RolloutlakeError
from schemas.events import RunConfig
from schemas.tables import TABLES

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Stage 1 -> stage 2: one row per opened notice (no header) or decision (header and
# fragments), with the fields of its `OrderKey`.
ITEMS = pa.schema([
    pa.field("run_id", pa.string(), False),
    pa.field("group_index", pa.int64(), False),
    pa.field("step", pa.int64()),  # of an opened notice
    pa.field("at_us", pa.int64(), False),
    pa.field("partition", pa.int32(), False),
    pa.field("offset", pa.int64(), False),
    pa.field("header", pa.binary()),  # DecisionHeader JSON of a decision
    pa.field("fragments", pa.binary()),  # its FRAGMENTS rows as Arrow IPC
])
# Stage 2 -> the writes: a run's rows of one table, as Arrow IPC of at most CHUNK_ROWS rows.
CHUNKS = pa.schema([
    pa.field("table", pa.string(), False),
    pa.field("rows", pa.int64(), False),
    pa.field("chunk", pa.binary(), False),
])
# The tables written, in this order: `steps` names the `training_batches` commit.
DERIVED = ("groups", "samples", "training_batches", "steps", "step_metrics")
# Rows per chunk: a step's training rows with their tokens stay well below the 2 GiB an
# Arrow binary column can hold.
CHUNK_ROWS = 1024


@dataclass(frozen=True)
class SparkReplayed:
    groups: int
    events: int  # archived events of the run read, run_started aside
    seconds: float  # the Spark job, session start aside


def spark_replay(source: Lake, out: Lake, run_id: str, config: RunConfig, *,
                 master: str) -> SparkReplayed:
    """Re-derive the run from `source`'s events archive under `config` with Spark on
    `master`, into `out`."""
    spark = spark_session(master)
    try:
        return replay_with(spark, source, out, run_id, config)
    finally:
        spark.stop()


def replay_with(spark: SparkSession, source: Lake, out: Lake, run_id: str, config: RunConfig,
                ) -> SparkReplayed:
    """`spark_replay` on a session the caller owns."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    started = time.monotonic()
    events = (spark.read.format("delta").load(source.uri("events"))
              .where((F.col("run_id") == run_id) & (F.col("type") != "run_started")))
    n_events = events.count()
    if not n_events:
        raise RolloutlakeError(f"run {run_id} has no events in {source.root}/events")

    # Plain functions, not partials: pyspark reads the UDF kind off the annotations.
    def decide_group(table: pa.Table) -> pa.Table:
        return _decide_group(config, table)

    def batch_run(table: pa.Table) -> pa.Table:
        return _batch_run(config, table)

    items = (events.where(F.col("group_index").isNotNull()).select(*ARCHIVE_COLUMNS)
             .groupBy("run_id", "topic", "partition", "group_index")
             .applyInArrow(decide_group, from_arrow_schema(ITEMS)))
    chunks = (items.groupBy("run_id").applyInArrow(batch_run, from_arrow_schema(CHUNKS))
              .persist())
    try:
        rows_of = {row["table"]: row["rows"] for row in
                   chunks.groupBy("table").agg(F.sum("rows").alias("rows")).collect()}
        batch_version = UNWRITTEN_VERSION
        for name in (n for n in DERIVED if n in rows_of):
            out.ensure(name)  # the contract schema and partitioning, as replay creates them
            rows = (chunks.where(F.col("table") == name).select("chunk")
                    .mapInArrow(functools.partial(_decode_chunks, name, batch_version),
                                from_arrow_schema(TABLES[name].schema)))
            rows.write.format("delta").mode("append").save(out.uri(name))
            if name == "training_batches":
                batch_version = out.version(name)
    finally:
        chunks.unpersist()
    return SparkReplayed(rows_of.get("groups", 0), n_events, time.monotonic() - started)


def _decide_group(config: RunConfig, table: pa.Table) -> pa.Table:
    """Stage 1, one group's events of one partition: its opened notice and decision."""
    rows = archived_events(table)
    out: list[dict] = []
    for folded in fold_partition(rows, lambda _run, _group: False).values():
        for item in group_items(folded, rows[0].partition, config):
            if isinstance(item, Opened):
                out.append({"run_id": item.run_id, "group_index": item.group_index,
                            "step": item.step, "at_us": item.at_us,
                            "partition": item.partition, "offset": item.offset})
            else:
                key = item.order_key()
                out.append({"run_id": key.run_id, "group_index": key.group_index,
                            "at_us": key.at_us, "partition": key.partition,
                            "offset": key.offset, "header": item.header.to_json(),
                            "fragments": fragments_ipc(item.fragments)})
    return pa.Table.from_pylist(out, schema=ITEMS)


def _batch_run(config: RunConfig, table: pa.Table) -> pa.Table:
    """Stage 2, one run's items: batched in `OrderKey` order, its rows as chunks."""
    run_id = table.column("run_id")[0].as_py()
    items: list[Opened | DecidedGroup] = [
        Opened(row["run_id"], row["group_index"], row["step"], row["at_us"], row["partition"],
               row["offset"]) if row["header"] is None
        else DecidedGroup(DecisionHeader.from_json(row["header"]),
                          decode_fragments(row["fragments"]))
        for row in table.to_pylist()
    ]
    out = []
    for name, rows in derived_tables(run_id, batch_items(run_id, config, items)).items():
        for batch in rows.to_batches(max_chunksize=CHUNK_ROWS):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            out.append(pa.record_batch([[name], [batch.num_rows], [sink.getvalue().to_pybytes()]],
                                       schema=CHUNKS))
    # One chunk per Arrow batch, so no batch Spark takes grows past one chunk.
    return pa.Table.from_batches(out, schema=CHUNKS)


def _decode_chunks(table: str, batch_version: int, batches: Iterator[pa.RecordBatch],
                   ) -> Iterator[pa.RecordBatch]:
    """The rows of a table's chunks; `steps` rows with the training_batches version."""
    for batch in batches:
        for chunk in batch.column("chunk").to_pylist():
            with pa.ipc.open_stream(pa.py_buffer(chunk)) as reader:
                rows = reader.read_all()
            if table == "steps":
                rows = with_batch_version(rows, batch_version)
            yield from rows.to_batches()
