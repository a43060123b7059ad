"""Row builders: the contract tables' rows of decided groups and sealed steps.

Pure: `RunBatcher` (`ingest.core.batching`) calls them as it decides and seals, and the
batch stage and replay turn its `Effects` into tables with them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ingest.core.advantages import AdvantageRow, row_advantages
from ingest.core.decided import DecidedGroup, DecisionHeader
from schemas.events import RunConfig
from schemas.tables import GROUPS, TRAINING_BATCHES, utc_micros


@dataclass(slots=True)
class SealedBatch:
    """The training batch of one sealed step: its `training_batches` rows and `steps` facts."""

    step: int
    rows: pa.Table  # training_batches rows in position order
    n_groups: int
    n_rollouts: int
    n_tokens: int
    sealed_at: float
    content_sha256: str


def groups_table(rows: list[dict[str, Any]]) -> pa.Table:
    """`groups` rows of `Effects.groups` (times in seconds) as a contract table."""
    return pa.Table.from_pylist(
        [{**r, "decided_at": utc_micros(r["decided_at"]),
          "first_event_at": utc_micros(r["first_event_at"])} for r in rows],
        schema=GROUPS.schema,
    )


def steps_row(run_id: str, sealed: SealedBatch, batch_version: int) -> dict[str, Any]:
    """The `steps` row of a sealed step whose rows are in `training_batches` version
    `batch_version`."""
    return {
        "run_id": run_id, "step": sealed.step, "n_groups": sealed.n_groups,
        "n_samples": sealed.rows.num_rows, "sealed_at": utc_micros(sealed.sealed_at),
        "batch_version": batch_version, "content_sha256": sealed.content_sha256,
        "n_rollouts": sealed.n_rollouts, "n_tokens": sealed.n_tokens,
    }


def metric_rows(run_id: str, step: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
    """`step_metrics` rows of one closed step, keys in order."""
    return [{"run_id": run_id, "step": step, "key": k, "value": float(v)}
            for k, v in sorted(metrics.items())]


def training_rows(run_id: str, step: int, members: list[DecidedGroup],
                   config: RunConfig) -> pa.Table:
    """The step's rows in position order, with per-rollout advantages broadcast."""
    table = pa.concat_tables(
        [
            m.fragments.append_column(
                "group_index", pa.array([m.header.group_index] * m.fragments.num_rows, pa.int64())
            )
            for m in members
        ]
    )
    n = table.num_rows
    advantage_rows = [
        AdvantageRow(g, r, 0.0 if w is None else w)
        for g, r, w in zip(
            table.column("group_index").to_pylist(),
            table.column("rollout_id").to_pylist(),
            table.column("reward").to_pylist(),
            strict=True,
        )
    ]
    advantages = row_advantages(advantage_rows, config.advantage_estimator,
                                config.std_normalization)
    generated = {
        "run_id": pa.array([run_id] * n, pa.string()),
        "step": pa.array([step] * n, pa.int64()),
        "position": pa.array(range(n), pa.int32()),
        "advantage": pa.array(advantages, pa.float64()),
    }
    columns = [
        generated[name] if name in generated else table.column(name)
        for name in TRAINING_BATCHES.schema.names
    ]
    return pa.Table.from_arrays(columns, schema=TRAINING_BATCHES.schema)


def group_row(header: DecisionHeader, decision: str, reason: str | None,
               batch_step: int | None, fragments: pa.Table) -> dict[str, Any]:
    rewards = [r for r in fragments.column("reward").to_pylist() if r is not None]
    return {
        "run_id": header.run_id,
        "group_index": header.group_index,
        "step": header.step,
        "n_samples": header.n_samples,
        "decision": decision,
        "reason": reason,
        "batch_step": batch_step,
        "decided_at": header.decided_at,
        "mean_reward": statistics.fmean(rewards) if rewards else None,
        "first_event_at": header.first_event_at,
        "n_fragments": fragments.num_rows,
        "ordered_at": header.at_us,
    }


def sample_rows(header: DecisionHeader, fragments: pa.Table, decision: str,
                 reason: str | None) -> pa.Table:
    n = fragments.num_rows
    return pa.table(
        {
            "run_id": pa.array([header.run_id] * n, pa.string()),
            "group_index": pa.array([header.group_index] * n, pa.int64()),
            "rollout_id": fragments.column("rollout_id"),
            "fragment_index": fragments.column("fragment_index"),
            "status": fragments.column("status"),
            "reward": fragments.column("reward"),
            "response_length": fragments.column("response_length"),
            "decision": pa.array([decision] * n, pa.string()),
            "reason": pa.array([reason] * n, pa.string()),
            "step": pa.array([header.step] * n, pa.int64()),
            "sample_index": fragments.column("sample_index"),
            "abort_reason": fragments.column("abort_reason"),
        }
    )
