"""Arrow schemas of every Delta table in CONTRACT section 4, and the step content hash.

Each table is declared once here; writers, readers, the trainer and the tests all take
their column lists from `TABLES`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

UTC_MICROS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class TableSpec:
    """One Delta table of the lake: its folder name, Arrow schema and key columns."""

    name: str
    schema: pa.Schema
    key: tuple[str, ...]
    partition_by: tuple[str, ...] = ()
    # Large opaque columns (JSON payloads, token lists): written without dictionary
    # encoding or statistics, which cost time and never pay off for them.
    blob_columns: tuple[str, ...] = ()

    def empty(self) -> pa.Table:
        return self.schema.empty_table()


def utc_micros(seconds: float) -> int:
    """A `UTC_MICROS` column value from seconds since the epoch."""
    return int(seconds * 1_000_000)


def _f(name: str, type_: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


EVENTS = TableSpec(
    "events",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("event_id", pa.string(), False),
            _f("type", pa.string(), False),
            _f("group_index", pa.int64()),
            _f("rollout_id", pa.int64()),
            _f("topic", pa.string(), False),
            _f("partition", pa.int32(), False),
            _f("offset", pa.int64(), False),
            _f("ingested_at", UTC_MICROS, False),
            _f("payload", pa.string(), False),
            # Extension: the step of a `group_started` (prompts issued per step).
            _f("step", pa.int64()),
            # Extension: the event time the processor judged the event by (its `ts`, else
            # the Kafka record timestamp, never before its partition's watermark); null
            # for `run_started`. Timeouts and the order of decisions follow it.
            _f("event_time", UTC_MICROS),
        ]
    ),
    key=("run_id", "event_id"),
    partition_by=("run_id",),
    blob_columns=("payload",),
)

GROUPS = TableSpec(
    "groups",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("group_index", pa.int64(), False),
            _f("step", pa.int64()),
            _f("n_samples", pa.int32()),
            _f("decision", pa.string(), False),  # kept / dropped / surplus
            _f("reason", pa.string()),
            _f("batch_step", pa.int64()),
            _f("decided_at", UTC_MICROS, False),
            _f("mean_reward", pa.float64()),
            # Extensions: when the group's first event arrived, and its fragment count.
            _f("first_event_at", UTC_MICROS),
            _f("n_fragments", pa.int32()),
            # The event time the decision is ordered by (`ingest.core.ordering`), on the
            # clock of `steps.sealed_at`: a group counts in its step's metrics when it is
            # ordered before the step closes.
            _f("ordered_at", UTC_MICROS),
        ]
    ),
    key=("run_id", "group_index"),
    partition_by=("run_id",),
)

SAMPLES = TableSpec(
    "samples",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("group_index", pa.int64(), False),
            _f("rollout_id", pa.int64(), False),
            _f("fragment_index", pa.int32(), False),
            _f("status", pa.string(), False),  # completed / truncated / aborted / missing
            _f("reward", pa.float64()),
            _f("response_length", pa.int32(), False),
            _f("decision", pa.string(), False),
            _f("reason", pa.string()),
            # Extensions for audit: the group's step, Miles `index`, abort reason.
            _f("step", pa.int64()),
            _f("sample_index", pa.int64()),
            _f("abort_reason", pa.string()),
        ]
    ),
    key=("run_id", "group_index", "rollout_id", "fragment_index"),
    partition_by=("run_id",),
)

TRAINING_BATCHES = TableSpec(
    "training_batches",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("step", pa.int64(), False),
            _f("position", pa.int32(), False),
            _f("group_index", pa.int64(), False),
            _f("rollout_id", pa.int64(), False),
            _f("sample_index", pa.int64()),
            _f("fragment_index", pa.int32(), False),
            _f("prompt_tokens", pa.list_(pa.int32()), False),
            _f("response_tokens", pa.list_(pa.int32()), False),
            _f("loss_mask", pa.list_(pa.int8()), False),
            _f("rollout_log_probs", pa.list_(pa.float32())),
            _f("reward", pa.float64()),
            _f("advantage", pa.float64(), False),
            _f("status", pa.string(), False),
            _f("weight_version", pa.int64()),
        ]
    ),
    key=("run_id", "step", "position"),
    partition_by=("run_id",),
    blob_columns=("prompt_tokens", "response_tokens", "rollout_log_probs"),
)

STEPS = TableSpec(
    "steps",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("step", pa.int64(), False),
            _f("n_groups", pa.int32(), False),
            _f("n_samples", pa.int32(), False),  # training rows (fragments) in the batch
            _f("sealed_at", UTC_MICROS, False),
            _f("batch_version", pa.int64(), False),
            _f("content_sha256", pa.string(), False),
            _f("n_rollouts", pa.int32()),
            _f("n_tokens", pa.int64()),
        ]
    ),
    key=("run_id", "step"),
    partition_by=("run_id",),
)

STEP_METRICS = TableSpec(
    "step_metrics",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("step", pa.int64(), False),
            _f("key", pa.string(), False),
            _f("value", pa.float64(), False),
        ]
    ),
    key=("run_id", "step", "key"),
    partition_by=("run_id",),
)

DEAD_LETTERS = TableSpec(
    "dead_letters",
    pa.schema(
        [
            _f("topic", pa.string(), False),
            _f("partition", pa.int32(), False),
            _f("offset", pa.int64(), False),
            _f("error", pa.string(), False),
            _f("raw", pa.binary()),
            _f("at", UTC_MICROS, False),
            # Extensions so operators can find a run's rejects without parsing `raw`.
            _f("run_id", pa.string()),
            _f("group_index", pa.int64()),
        ]
    ),
    key=("topic", "partition", "offset"),
    blob_columns=("raw",),
)

TRAINER_STEPS = TableSpec(
    "trainer_steps",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("step", pa.int64(), False),
            _f("batch_version", pa.int64(), False),  # the training_batches version trained on
            _f("content_sha256", pa.string(), False),  # verified against the steps row
            _f("loss", pa.float64(), False),
            _f("pg_loss", pa.float64(), False),
            _f("pg_clipfrac", pa.float64(), False),
            _f("pg_clipfrac_low", pa.float64(), False),
            _f("pg_clipfrac_high", pa.float64(), False),
            _f("ppo_kl", pa.float64(), False),
            _f("kl", pa.float64()),  # KL to the reference model; null without one
            _f("entropy", pa.float64(), False),
            _f("grad_norm", pa.float64(), False),
            _f("lr", pa.float64(), False),
            _f("tokens", pa.int64(), False),  # prompt + response tokens of the step
            _f("loss_tokens", pa.int64(), False),
            _f("seconds", pa.float64(), False),  # forward, backward and optimizer step
            _f("update", pa.int64(), False),  # optimizer updates so far (weights version)
            _f("trained_at", UTC_MICROS, False),
            # loss tokens whose |logp - old_logp| exceeded the bound and was clamped
            _f("log_ratio_clamped_tokens", pa.int64()),
        ]
    ),
    key=("run_id", "step"),
    partition_by=("run_id",),
)

TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (EVENTS, GROUPS, SAMPLES, TRAINING_BATCHES, STEPS, STEP_METRICS, DEAD_LETTERS, TRAINER_STEPS)
}

# Columns of `training_batches` that make up a step's content (everything but the keys
# that locate the rows; position order is part of the hash through row order).
CONTENT_COLUMNS = tuple(
    name for name in TRAINING_BATCHES.schema.names if name not in ("run_id", "step")
)


def _column_digest(h: hashlib._Hash, column: pa.ChunkedArray | pa.Array) -> None:
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if pa.types.is_list(column.type):
        # Chunk by chunk, all lengths then all values: the same bytes as one combined
        # array, without copying the token lists (hashlib reads the numpy buffers in place
        # through `.data`, a memoryview).
        for chunk in chunks:
            lengths = pc.fill_null(pc.list_value_length(chunk), -1).to_numpy(zero_copy_only=False)
            h.update(np.ascontiguousarray(lengths, dtype="<i8").data)
        for chunk in chunks:
            values = pc.list_flatten(chunk)
            h.update(
                np.ascontiguousarray(values.to_numpy(zero_copy_only=False)).astype(
                    values.type.to_pandas_dtype(), copy=False
                ).data
            )
        return
    arr = pa.concat_arrays(chunks) if len(chunks) != 1 else chunks[0]
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    h.update(np.packbits(valid).tobytes())
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        filled = pc.fill_null(arr, "")
        h.update(np.ascontiguousarray(pc.utf8_length(filled).to_numpy(), dtype="<i8").tobytes())
        h.update("".join(filled.to_pylist()).encode())
        return
    zero = pa.scalar(0, arr.type)
    h.update(np.ascontiguousarray(pc.fill_null(arr, zero).to_numpy(zero_copy_only=False)).tobytes())


def content_sha256(rows: pa.Table) -> str:
    """Hash of a step's `training_batches` rows in position order.

    Logical, not physical: equal values give equal hashes whatever the chunking or buffer
    layout, so the trainer can verify what it read against the `steps` row.
    """
    h = hashlib.sha256()
    h.update(str(rows.num_rows).encode())
    for name in CONTENT_COLUMNS:
        h.update(name.encode())
        _column_digest(h, rows.column(name).cast(TRAINING_BATCHES.schema.field(name).type))
    return h.hexdigest()


# Gateway tables (docs/gateway.md). A dataset is stored as one Delta table per dataset
# under `datasets/<name>` with this schema; each upload is a new version (time travel).
DATASET_ROWS = TableSpec(
    "dataset_rows",
    pa.schema(
        [
            _f("row", pa.int64(), False),  # 0-based position in this dataset version
            _f("source_line", pa.int64(), False),  # 1-based JSONL line or Parquet row
            _f("prompt", pa.string(), False),  # JSON: a string or a list of chat messages
            _f("label", pa.string()),  # JSON, null when no label key was given
            _f("metadata", pa.string(), False),  # JSON object (tools under "tools")
            _f("prompt_len", pa.int64(), False),  # tokens or characters, see `length_unit`
        ]
    ),
    key=("row",),
)

# The prompt-serving cursor of each run: one row per committed batch of requests; the row
# with the highest `seq` is the current state. `seq` is also the Delta app-transaction
# version (`prompt-cursor-<run_id>`), so a replayed commit is skipped.
PROMPT_CURSOR = TableSpec(
    "prompt_cursor",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("seq", pa.int64(), False),
            _f("dataset", pa.string(), False),
            _f("dataset_version", pa.int64(), False),
            _f("seed", pa.int64(), False),
            _f("shuffle", pa.bool_(), False),
            _f("epoch", pa.int64(), False),
            _f("offset", pa.int64(), False),
            _f("next_group_index", pa.int64(), False),
            _f("recycle_rows", pa.list_(pa.int64()), False),  # FIFO of dataset rows
            _f("recycle_groups", pa.list_(pa.int64()), False),  # their original groups
            _f("issued_groups", pa.list_(pa.int64()), False),  # groups issued by this commit
            _f("issued_rows", pa.list_(pa.int64()), False),  # and their dataset rows
            _f("committed_at", UTC_MICROS, False),
        ]
    ),
    key=("run_id", "seq"),
    partition_by=("run_id",),
)

TABLES.update({spec.name: spec for spec in (DATASET_ROWS, PROMPT_CURSOR)})

# Appended for `rolloutlake wandb-sync`: one row per batch of steps logged to Weights &
# Biases. Its Delta txn (app id `wandb-sync/<project>/<wandb run id>`, version = the last
# logged step) is the durable resume point, so a restarted sync never re-logs a step.
WANDB_SYNC = TableSpec(
    "wandb_sync",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("wandb_run", pa.string(), False),  # "<project>/<wandb run id>"
            _f("last_step", pa.int64(), False),
            _f("n_steps", pa.int32(), False),
            _f("synced_at", UTC_MICROS, False),
        ]
    ),
    key=("run_id", "wandb_run", "last_step"),
)
TABLES[WANDB_SYNC.name] = WANDB_SYNC

# Appended for the gateway's prompt cursor checkpoints: where, per partition of the events
# topic, the roll-forward over `group_started` events may start for checkpoint `seq` of a
# run (every group_started of that run published after the checkpoint lies at or after
# these offsets). A missing row means "scan the partition from its beginning".
PROMPT_CURSOR_WAL = TableSpec(
    "prompt_cursor_wal",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("seq", pa.int64(), False),
            _f("topic", pa.string(), False),
            _f("partitions", pa.list_(pa.int32()), False),
            _f("offsets", pa.list_(pa.int64()), False),  # first offset to scan, per partition
            _f("committed_at", UTC_MICROS, False),
        ]
    ),
    key=("run_id", "seq"),
    partition_by=("run_id",),
)
TABLES[PROMPT_CURSOR_WAL.name] = PROMPT_CURSOR_WAL

# Appended so run configs outlive Kafka retention: one row per `run_started` the processor
# read, in `rollout.runs` order (a later one replaces the run's config). Its Delta txn
# (app id `runs@<topic>:<partition>`, version = offset) makes each row written once.
RUNS = TableSpec(
    "runs",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("event_id", pa.string(), False),
            _f("config", pa.string(), False),  # the run_started `config` object, as JSON
            _f("dataset", pa.string()),
            _f("topic", pa.string(), False),
            _f("partition", pa.int32(), False),
            _f("offset", pa.int64(), False),
            _f("ingested_at", UTC_MICROS, False),
        ]
    ),
    key=("topic", "partition", "offset"),
)
TABLES[RUNS.name] = RUNS

# Appended for the batch stage's restarts: a snapshot of its state for one partition of
# `rollout.decisions` as of `offset` (the last decision it covers), committed with the
# txn `batch_state@<topic>:<partition>` = offset. A restart resumes from the latest
# snapshot plus the decisions after it instead of replaying the topic from offset 0.
BATCH_STATE = TableSpec(
    "batch_state",
    pa.schema(
        [
            _f("topic", pa.string(), False),
            _f("partition", pa.int32(), False),
            _f("offset", pa.int64(), False),
            # sha256 of the decision at `offset` (key, headers, value): recognises the topic
            _f("fingerprint", pa.binary(), False),
            _f("format", pa.string(), False),  # how `state` is encoded
            _f("state", pa.binary(), False),
            _f("runs", pa.list_(pa.string()), False),
            _f("written_at", UTC_MICROS, False),
        ]
    ),
    key=("topic", "partition", "offset"),
    blob_columns=("state",),
)
TABLES[BATCH_STATE.name] = BATCH_STATE

# Appended by the gateway when a worker recycles a group in partial rollout (before the
# prompt-cursor checkpoint that queues the group): what each of its samples had generated,
# so the group's next serve continues them, also after a restart of worker or gateway.
# A retried recycle may append a group's rows again; readers keep one row per key.
RECYCLED_SAMPLES = TableSpec(
    "recycled_samples",
    pa.schema(
        [
            _f("run_id", pa.string(), False),
            _f("group_index", pa.int64(), False),  # the recycled group
            _f("rollout_id", pa.int64(), False),
            _f("status", pa.string(), False),  # completed, truncated, or aborted (partial)
            _f("response_tokens", pa.list_(pa.int32()), False),
            _f("rollout_log_probs", pa.list_(pa.float64()), False),
            _f("loss_mask", pa.list_(pa.int8()), False),
            # The weight version that generated each run of tokens, in order.
            _f("segment_tokens", pa.list_(pa.int64()), False),
            _f("segment_versions", pa.list_(pa.int64()), False),
            _f("start_rollout_id", pa.int64(), False),  # the step that first generated it
            _f("recycled_at", UTC_MICROS, False),
        ]
    ),
    key=("run_id", "group_index", "rollout_id"),
    partition_by=("run_id",),
    blob_columns=("response_tokens", "rollout_log_probs"),
)
TABLES[RECYCLED_SAMPLES.name] = RECYCLED_SAMPLES
