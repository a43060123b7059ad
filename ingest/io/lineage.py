"""Lineage of a run's data through the lake: event -> group -> batch row -> trainer update.

One implementation for `rolloutlake audit` and the gateway's audit route. Three entries:
`group_lineage` (a group's events with their Kafka positions, its dead letters, decision,
samples, the batch rows it fed, the steps that sealed them and the `trainer_steps` rows
that trained on them), `row_lineage` (the same from one `training_batches` row) and
`trainer_step_lineage` (the other way: the rows, groups and events a trainer step
consumed, with the step's content hash checked against what the trainer verified).

Every read goes through a `Snapshot`: the latest versions, or the lake as of a moment
(Delta time travel, `parse_as_of`). What a trainer step consumed is always read at the
`batch_version` it trained on, the version the trainer pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from ingest.io.lake import Lake
from schemas.errors import InvalidInputError, NotFoundError
from schemas.tables import TABLES, TRAINING_BATCHES, content_sha256
from schemas.token_arrays import TOKEN_FIELDS

ROW_COLUMNS = [c for c in TRAINING_BATCHES.schema.names if c not in TOKEN_FIELDS]
EVENT_POSITION = [("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")]
RAW_PREVIEW_CHARS = 200  # of a dead letter's raw bytes; the full message stays in the lake


class LineageNotFound(NotFoundError):
    """The run, group, batch row or trainer step is not in the lake (at the snapshot)."""


@dataclass
class Snapshot:
    """The lake as lineage reads it: the latest versions, or as of `at`.

    `at` picks, per table, the last version committed at or before it. `batch_version`
    (from `--as-of VERSION`) is read exactly for `training_batches`; `at` is then that
    version's commit time.
    """

    lake: Lake
    at: datetime | None = None
    batch_version: int | None = None
    _versions: dict[str, int | None] = field(default_factory=dict, repr=False)

    @property
    def where(self) -> str:
        """' as of ...' for messages; '' for the latest versions."""
        if self.at is None:
            return ""
        if self.batch_version is not None:
            return f" as of training_batches version {self.batch_version} ({self.at.isoformat()})"
        return f" as of {self.at.isoformat()}"

    def _version_at(self, table: str, at: datetime) -> int | None:
        if table == TRAINING_BATCHES.name and self.batch_version is not None:
            return self.batch_version
        if table not in self._versions:
            self._versions[table] = self.lake.versions_as_of(table)(at)
        return self._versions[table]

    def read(self, table: str, *, filter: pc.Expression | None = None,
             columns: list[str] | None = None) -> pa.Table:
        if self.at is None:
            return self.lake.read(table, filter=filter, columns=columns)
        version = self._version_at(table, self.at)
        if version is None:  # the table did not exist yet
            empty = TABLES[table].empty()
            return empty.select(columns) if columns is not None else empty
        return self.lake.read(table, filter=filter, columns=columns, version=version)


def parse_as_of(lake: Lake, text: str | None) -> Snapshot:
    """A snapshot from `--as-of`: a `training_batches` version (an integer: the lake as it
    was when that version was committed) or an ISO 8601 timestamp (UTC unless it says)."""
    if text is None:
        return Snapshot(lake)
    if text.strip().isdigit():
        version = int(text)
        times = lake.commit_times(TRAINING_BATCHES.name)
        if version not in times:
            have = f"versions {min(times)}..{max(times)}" if times else "no training_batches table"
            raise InvalidInputError(f"as of {text!r}: training_batches has no version {version} "
                              f"({have})")
        return Snapshot(lake, at=times[version], batch_version=version)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInputError(f"as of {text!r}: neither a training_batches version (an integer) "
                          "nor an ISO 8601 timestamp such as 2026-12-01T12:00:00Z") from None
    return Snapshot(lake, at=at if at.tzinfo else at.replace(tzinfo=UTC))


class _Record(BaseModel):
    """A lineage answer: what `rolloutlake audit --json` prints and the gateway returns."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)


class GroupLineage(_Record):
    run_id: str
    group_index: int
    events: list[dict[str, Any]]
    """Archived events in (topic, partition, offset) order with `ingested_at`, `event_time`
    and the decoded payload."""
    dead_letters: list[dict[str, Any]]
    """Rejected messages of the group: position, error, `at`, `raw_preview`."""
    decision: dict[str, Any] | None
    """The `groups` row (decision, reason, step, batch_step, ...); None while undecided."""
    samples: list[dict[str, Any]]
    training_rows: list[dict[str, Any]]
    """The `training_batches` rows it fed, without token arrays."""
    steps: list[dict[str, Any]]
    """The `steps` rows that sealed those rows (batch_version, content_sha256, ...)."""
    trainer_steps: list[dict[str, Any]]
    """The `trainer_steps` rows that trained on them (loss, `update` = weights version)."""


class RowLineage(_Record):
    row: dict[str, Any]
    """The `training_batches` row, without token arrays."""
    group: GroupLineage
    """The lineage of the row's group."""


class ConsumedGroup(_Record):
    group_index: int
    positions: list[int]
    """The step's rows from this group."""
    decision: dict[str, Any] | None
    events: list[dict[str, Any]]
    """Archived events with their Kafka positions, payloads left out."""


class TrainerStepLineage(_Record):
    run_id: str
    step: int
    trainer_step: dict[str, Any]
    """The `trainer_steps` row (loss, batch_version, `update` = weights version produced)."""
    sealed: dict[str, Any] | None
    """The `steps` row of the step; None if the snapshot predates it."""
    content_verified: bool
    """The rows at the trained `batch_version` hash to the trainer's `content_sha256`."""
    groups: list[ConsumedGroup]
    """In the order their first row appears in the batch."""


def _of_run(run_id: str, *more: pc.Expression) -> pc.Expression:
    expr = pc.field("run_id") == run_id
    for extra in more:
        expr = expr & extra
    return expr


def _require_run(snap: Snapshot, run_id: str) -> None:
    for table in ("events", "steps", "groups"):
        if snap.read(table, filter=_of_run(run_id), columns=["run_id"]).num_rows:
            return
    raise LineageNotFound(f"run {run_id!r} has no events, groups or steps in "
                          f"{snap.lake.root}{snap.where}")


def _events(snap: Snapshot, in_groups: pc.Expression, *, payload: bool) -> pa.Table:
    columns = None if payload else [c for c in TABLES["events"].schema.names if c != "payload"]
    return snap.read("events", filter=in_groups, columns=columns).sort_by(EVENT_POSITION)


def _dead_letter(row: dict[str, Any]) -> dict[str, Any]:
    raw = row.pop("raw")
    row["raw_preview"] = None if raw is None else raw[:RAW_PREVIEW_CHARS].decode(errors="replace")
    return row


def group_lineage(snap: Snapshot, run_id: str, group_index: int) -> GroupLineage:
    in_group = _of_run(run_id, pc.field("group_index") == group_index)
    events = _events(snap, in_group, payload=True).to_pylist()
    dead = snap.read("dead_letters", filter=in_group).sort_by(EVENT_POSITION).to_pylist()
    decision = snap.read("groups", filter=in_group).to_pylist()
    samples = snap.read("samples", filter=in_group).sort_by(
        [("rollout_id", "ascending"), ("fragment_index", "ascending")]).to_pylist()
    rows = snap.read("training_batches", filter=in_group, columns=ROW_COLUMNS).sort_by(
        [("step", "ascending"), ("position", "ascending")]).to_pylist()
    if not events and not decision and not samples and not dead:
        _require_run(snap, run_id)
        raise LineageNotFound(f"group {group_index} of run {run_id!r} has no archived events, "
                              f"dead letters or decision{snap.where}")
    fed = pc.field("step").isin(sorted({r["step"] for r in rows}))
    steps = snap.read("steps", filter=_of_run(run_id, fed)).sort_by("step").to_pylist()
    trained = snap.read("trainer_steps", filter=_of_run(run_id, fed)).sort_by("step").to_pylist()
    return GroupLineage(
        run_id=run_id, group_index=group_index,
        events=[{**e, "payload": orjson.loads(e["payload"])} for e in events],
        dead_letters=[_dead_letter(d) for d in dead],
        decision=decision[0] if decision else None,
        samples=samples, training_rows=rows, steps=steps, trainer_steps=trained)


def row_lineage(snap: Snapshot, run_id: str, step: int, position: int) -> RowLineage:
    found = snap.read("training_batches", columns=ROW_COLUMNS, filter=_of_run(
        run_id, pc.field("step") == step, pc.field("position") == position)).to_pylist()
    if not found:
        _require_run(snap, run_id)
        raise LineageNotFound(f"run {run_id!r} has no training_batches row at step {step} "
                              f"position {position}{snap.where}")
    return RowLineage(row=found[0], group=group_lineage(snap, run_id, found[0]["group_index"]))


def trainer_step_lineage(snap: Snapshot, run_id: str, step: int) -> TrainerStepLineage:
    trained = snap.read("trainer_steps", filter=_of_run(run_id, pc.field("step") == step))
    if not trained.num_rows:
        _require_run(snap, run_id)
        known = sorted(snap.read("trainer_steps", filter=_of_run(run_id),
                                 columns=["step"])["step"].to_pylist())
        have = f"trained steps {known[0]}..{known[-1]}" if known else "no step trained"
        raise LineageNotFound(f"run {run_id!r} has no trainer_steps row for step {step}"
                              f"{snap.where} ({have})")
    row = trained.to_pylist()[0]
    sealed = snap.read("steps", filter=_of_run(run_id, pc.field("step") == step)).to_pylist()
    # What the trainer read: the step's rows at the version it pinned, whatever the snapshot.
    batch = snap.lake.read("training_batches", version=row["batch_version"],
                           filter=_of_run(run_id, pc.field("step") == step)).sort_by("position")
    positions: dict[int, list[int]] = {}
    for group_index, position in zip(batch["group_index"].to_pylist(),
                                     batch["position"].to_pylist(), strict=True):
        positions.setdefault(group_index, []).append(position)
    in_groups = _of_run(run_id, pc.field("group_index").isin(list(positions)))
    decisions = {d["group_index"]: d for d in snap.read("groups", filter=in_groups).to_pylist()}
    events: dict[int, list[dict[str, Any]]] = {}
    for e in _events(snap, in_groups, payload=False).to_pylist():
        events.setdefault(e["group_index"], []).append(e)
    return TrainerStepLineage(
        run_id=run_id, step=step, trainer_step=row,
        sealed=sealed[0] if sealed else None,
        content_verified=content_sha256(batch) == row["content_sha256"],
        groups=[ConsumedGroup(group_index=g, positions=p, decision=decisions.get(g),
                              events=events.get(g, []))
                for g, p in positions.items()])
