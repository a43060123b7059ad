"""The Delta Lake side: one `Lake` per root folder (local or s3://), exactly-once appends.

Exactly once comes from Delta, not Kafka: each commit carries the source positions it
covers as app transactions (`app_id` -> last offset). Before committing, the writer reads
the recorded version and drops the commit when it is not newer, because delta-rs accepts
a lower version silently.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import logging
import posixpath
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pa_fs
import pyarrow.parquet as pq
from deltalake import (
    ColumnProperties,
    CommitProperties,
    DeltaTable,
    Transaction,
    WriterProperties,
    write_deltalake,
)
from deltalake import Field as DeltaField
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction

from ingest.io.lake_location import lake_path_problem, lake_storage_options
from schemas.errors import ConfigError
from schemas.tables import TABLES, TableSpec

if TYPE_CHECKING:
    import pyarrow.dataset as ds

log = logging.getLogger(__name__)

MAX_COMMIT_RETRIES = 10


def pyarrow_dataset() -> ModuleType:
    """`pyarrow.dataset`, imported on first use: it imports pandas, 0.25 s of the
    processor's 0.7 s of imports, which a stage's first table read does while its
    consumer-group join waits on the broker (processor/stage.py) instead of before the
    join starts. Every table read imports it (deltalake's `to_pyarrow_dataset`)."""
    import pyarrow.dataset

    return pyarrow.dataset


@dataclass(frozen=True)
class TxnMark:
    """One source position a commit covers: `app_id` advanced to `version`."""

    app_id: str
    version: int


class Lake:
    """A folder of Delta tables named after `schemas.tables.TABLES`."""

    def __init__(self, root: str | Path, storage_options: Mapping[str, str] | None = None):
        problem = lake_path_problem(str(root))
        if problem is not None:
            raise ConfigError(problem)
        self.root = str(root).rstrip("/")
        self.storage_options = lake_storage_options(self.root, storage_options)
        self._tables: dict[str, DeltaTable] = {}
        self.after_commit: Callable[[str], None] | None = None  # called with the table's name

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}"

    def spec(self, table: str) -> TableSpec:
        return TABLES[table]

    def ensure(self, table: str) -> DeltaTable:
        """Open the table, creating it empty with its contract schema on first use."""
        dt = self._tables.get(table)
        if dt is not None:
            return dt
        spec = self.spec(table)
        if not self.is_local or Path(self.uri(table)).exists():
            try:
                dt = DeltaTable(self.uri(table), storage_options=self.storage_options or None)
            except TableNotFoundError:
                dt = None
            else:
                _add_extension_columns(dt, spec)
        if dt is None:
            if self.is_local:
                try:
                    Path(self.uri(table)).mkdir(parents=True, exist_ok=True)
                except OSError as err:  # a file in the way, no permission, a read-only disk
                    raise ConfigError(
                        f"cannot create the lake's {table} table under {self.root}: "
                        f"{err.strerror} ({err.filename})") from None
            dt = DeltaTable.create(
                self.uri(table),
                schema=spec.schema,
                partition_by=list(spec.partition_by) or None,
                mode="ignore",
                name=spec.name,
                storage_options=self.storage_options or None,
            )
        self._tables[table] = dt
        return dt

    @property
    def is_local(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")

    def exists(self, table: str) -> bool:
        if table in self._tables:
            return True
        return DeltaTable.is_deltatable(self.uri(table), storage_options=self.storage_options or None)

    def refresh(self, table: str) -> DeltaTable:
        dt = self.ensure(table)
        dt.update_incremental()
        return dt

    def txn_version(self, table: str, app_id: str) -> int | None:
        return self.refresh(table).transaction_version(app_id)

    def append(self, table: str, rows: pa.Table, marks: Iterable[TxnMark] = ()) -> int | None:
        """Append `rows` with `marks` in one commit, unless every mark is already recorded.

        Returns the new table version, or None when the commit was skipped as a replay.
        A mark whose recorded version is already >= its version is left out of the commit;
        callers filter their rows per mark beforehand (`rows_after`), so a partially
        covered batch never duplicates rows.
        """
        marks = list(marks)
        spec = self.spec(table)
        rows = rows.select(spec.schema.names).cast(spec.schema)
        dt = self.ensure(table)
        for attempt in range(MAX_COMMIT_RETRIES):
            # The loaded snapshot is current for the app ids this process writes; another
            # writer's commit surfaces as CommitFailedError and the retry reloads.
            fresh = [m for m in marks if _is_newer(dt.transaction_version(m.app_id), m.version)]
            if marks and not fresh:
                return None
            if rows.num_rows == 0 and not fresh:
                return None
            try:
                # deltalake's overloads leave out the writer_properties=None it takes.
                write_deltalake(  # type: ignore[call-overload]
                    dt,
                    rows,
                    mode="append",
                    writer_properties=_writer_properties(spec),
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(m.app_id, m.version) for m in fresh]
                    ),
                    storage_options=self.storage_options or None,
                )
            except CommitFailedError:
                # Expected now and then (a background compaction, another instance's
                # commit): only running out of retries is worth a user's attention.
                log.info("concurrent commit on %s, retrying (%d)", table, attempt + 1)
                dt.update_incremental()
                continue
            # write_deltalake moved `dt` to the version it committed (a reload would cost
            # another listing of the log per commit).
            if self.after_commit is not None:
                self.after_commit(table)
            return dt.version()
        raise CommitFailedError(f"{table}: gave up after {MAX_COMMIT_RETRIES} concurrent commits")

    def compact(self, table: str) -> dict[str, int]:
        """Rewrite the table's small files into larger ones, per partition, in one commit,
        with the table's own writer properties; the rows stay as they were, the old files
        are tombstoned (removed by a later vacuum).

        Not delta-rs's optimize: deltalake 1.6.6 lets a second optimize commit files that
        another one already rewrote (its conflict check passes removes marked as no data
        change), so two processes compacting a table at once put its rows in twice. Here
        the removes are marked as data changes, which the conflict check does catch: of
        two compactions of the same files the second fails (CommitFailedError), and an
        append that races one retries as for any concurrent commit (`append`).
        """
        dt = self.refresh(table)
        spec = self.spec(table)
        bins = compaction_bins(pa.table(dt.get_add_actions(flatten=True)), spec.partition_by)
        if not bins:
            return {"added": 0, "removed": 0}
        files = self.table_filesystem(table, dt)
        file_schema = pa.schema([f for f in spec.schema if f.name not in spec.partition_by])
        plain = [f.name for f in file_schema if f.name not in spec.blob_columns]
        now = int(datetime.now(UTC).timestamp() * 1000)
        actions: list[AddAction | RemoveAction] = []
        for partition_values, small in bins:
            rows = pyarrow_dataset().dataset([f["path"] for f in small], schema=file_schema,
                                             format="parquet", filesystem=files).to_table()
            path = posixpath.join(posixpath.dirname(small[0]["path"]),
                                  f"part-{uuid.uuid4()}-compacted.snappy.parquet")
            pq.write_table(rows, path, filesystem=files, use_dictionary=plain,
                           write_statistics=plain)
            size = files.get_file_info(path).size
            actions.append(AddAction(path, size, partition_values, now, True,
                                     _file_stats(rows, plain)))
            actions.extend(RemoveAction(f["path"], True, now, f["size_bytes"], partition_values)
                           for f in small)
        dt.create_write_transaction(actions, mode="append", schema=dt.schema(),
                                    partition_by=list(spec.partition_by) or None)
        return {"added": len(bins), "removed": len(actions) - len(bins)}

    def table_filesystem(self, table: str, dt: DeltaTable) -> pa_fs.FileSystem:
        """A filesystem rooted at the table's folder, where add-action paths are relative:
        pyarrow's own on a local lake (delta-rs's routes every read through a Python
        handler), Delta's handler with the lake's credentials on an object store."""
        if self.is_local:
            root = self.uri(table).removeprefix("file://")
            return pa_fs.SubTreeFileSystem(str(Path(root).resolve()), pa_fs.LocalFileSystem())
        return dt.to_pyarrow_dataset().filesystem

    def version(self, table: str) -> int:
        return self.refresh(table).version()

    def active_files(self, table: str) -> int:
        return len(self.refresh(table).file_uris())

    def commit_times(self, table: str) -> dict[int, datetime]:
        """When each version of the table still in its log was committed (Delta's commit
        timestamps, UTC); {} when the table does not exist."""
        if not self.exists(table):
            return {}
        return {entry["version"]: datetime.fromtimestamp(entry["timestamp"] / 1000, UTC)
                for entry in self.refresh(table).history()}

    def versions_as_of(self, table: str) -> Callable[[datetime], int | None]:
        """The table's version as of a moment: the last committed at or before it; None
        when the table did not exist yet. (delta-rs's `load_as_version` moves a moment
        before the first commit to version 0 instead.) One read of the history, then a
        bisection per moment."""
        commits = sorted((at, v) for v, at in self.commit_times(table).items())
        times = [at for at, _ in commits]
        latest = list(itertools.accumulate((v for _, v in commits), max))

        def version_at(at: datetime) -> int | None:
            i = bisect.bisect_right(times, at)
            return latest[i - 1] if i else None
        return version_at

    def first_version_with(self, table: str, prune: str) -> int | None:
        """The first version of an append-only table holding rows that match `prune` (a SQL
        predicate), found by bisection over the versions; None when no version does."""
        latest = self.version(table)
        return _first_true(0, latest, lambda v: self.read(table, version=v, prune=prune,
                                                          columns=[]).num_rows > 0)

    def read(
        self,
        table: str,
        *,
        filter: pc.Expression | None = None,
        columns: list[str] | None = None,
        version: int | None = None,
        prune: str | None = None,
    ) -> pa.Table:
        """Read a table (optionally at a version) with a pushed-down filter.

        `prune` is a SQL predicate (`"run_id = 'r1' AND step = 3"`) that delta-rs applies to
        the files' min/max statistics in the log before any file is opened, so a read of
        one step stays O(1) however many commits the table has.
        """
        if not self.exists(table):
            empty = self.spec(table).empty()
            return empty.select(columns) if columns else empty
        if version is None:
            dt = self.refresh(table)
        else:
            dt = DeltaTable(
                self.uri(table), version=version, storage_options=self.storage_options or None
            )
        local = self.table_filesystem(table, dt) if self.is_local else None
        dataset: ds.Dataset = dt.to_pyarrow_dataset(file_pruning_predicate=prune,
                                                    filesystem=local)
        return dataset.to_table(filter=filter, columns=columns)


def _add_extension_columns(dt: DeltaTable, spec: TableSpec) -> None:
    """Add the contract's newer (nullable) columns to a table created before them; its
    older rows read them as null."""
    present = {f.name for f in dt.schema().fields}
    missing = [f for f in spec.schema if f.name not in present]
    if not missing:
        return
    try:
        dt.alter.add_columns([DeltaField.from_arrow(f) for f in missing])
    except CommitFailedError:  # another writer added them first
        dt.update_incremental()
    log.info("%s: added columns %s", spec.name, ", ".join(f.name for f in missing))


@functools.cache
def _writer_properties(spec: TableSpec) -> WriterProperties | None:
    if not spec.blob_columns:
        return None
    blob = ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE")
    return WriterProperties(column_properties={name: blob for name in spec.blob_columns})


# A compacted file's size ceiling: files below it are compacted, in bins up to it.
COMPACTED_FILE_BYTES = 64 * 1024 * 1024
# Delta's own truncation length for string statistics: longer values get none here.
STATS_STRING_CHARS = 32


def compaction_bins(adds: pa.Table, partition_by: tuple[str, ...]
                     ) -> list[tuple[dict[str, str | None], list[dict]]]:
    """The table's small files (add actions), per partition, in bins of two files or more
    and up to COMPACTED_FILE_BYTES together."""
    columns = ["path", "size_bytes", *(f"partition.{c}" for c in partition_by)]
    by_partition: dict[tuple, list[dict]] = {}
    for add in adds.select(columns).to_pylist():
        if add["size_bytes"] < COMPACTED_FILE_BYTES:
            values = tuple(add[f"partition.{c}"] for c in partition_by)
            by_partition.setdefault(values, []).append(add)
    bins = []
    for values, small in by_partition.items():
        partition = {c: None if v is None else str(v)
                     for c, v in zip(partition_by, values, strict=True)}
        current: list[dict] = []
        for add in small:
            if current and sum(f["size_bytes"] for f in current) + add["size_bytes"] \
                    > COMPACTED_FILE_BYTES:
                bins.append((partition, current))
                current = []
            current.append(add)
        bins.append((partition, current))
    return [(partition, files) for partition, files in bins if len(files) > 1]


def _file_stats(rows: pa.Table, columns: list[str]) -> str:
    """The Delta statistics of a data file holding `rows`: readers prune files by them, so
    only exact ones (integers, short strings; null counts of flat columns)."""
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in columns:
        column = rows.column(name)
        kind = column.type
        if pa.types.is_nested(kind):
            continue
        nulls[name] = column.null_count
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind)) \
                or column.null_count == len(column):
            continue
        bounds = pc.min_max(column).as_py()
        if pa.types.is_string(kind) and max(len(bounds["min"]), len(bounds["max"])) \
                > STATS_STRING_CHARS:
            continue
        low[name], high[name] = bounds["min"], bounds["max"]
    return json.dumps({"numRecords": rows.num_rows, "minValues": low, "maxValues": high,
                       "nullCount": nulls})


def _first_true(lo: int, hi: int, test: Callable[[int], bool]) -> int | None:
    """The smallest v in [lo, hi] with test(v), for a test that stays true once true."""
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if test(mid):
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    return found


def _is_newer(recorded: int | None, version: int) -> bool:
    """Whether `version` advances an app transaction (version 0 is a real version)."""
    return recorded is None or recorded < version


class BackgroundCompaction:
    """Compacts a table's small files (`Lake.compact`) in a thread of its own after every
    `every` commits of `lake` to it: a delta-rs append costs time in proportion to the
    files the table holds (10 ms on a fresh table, 48 ms at 400 one-row files, 15 ms again
    once they are compacted), so a stage committing every poll keeps its commits cheap.
    The thread has its own table handles; an append that races a compaction retries
    (`Lake.append`), and a compaction that loses to another writer waits for the next turn."""

    def __init__(self, lake: Lake, tables: Iterable[str], every: int):
        self.every = every
        self.tables = set(tables)
        self.commits: dict[str, int] = dict.fromkeys(self.tables, 0)
        self.compactor = Lake(lake.root, lake.storage_options)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        self.running: dict[str, Future[None]] = {}
        # Tables whose turn came again while they were being compacted: once more right
        # after, or a table appended to faster than it compacts keeps growing.
        self.again: set[str] = set()
        if every:
            lake.after_commit = self.committed

    def committed(self, table: str) -> None:
        if table not in self.tables:
            return
        self.commits[table] += 1
        if self.commits[table] % self.every:
            return
        running = self.running.get(table)
        if running is not None and not running.done():
            self.again.add(table)
            return
        self.running[table] = self.pool.submit(self._compact, table)

    def _compact(self, table: str) -> None:
        while True:
            self.again.discard(table)
            try:
                self.compactor.compact(table)
            except (DeltaError, OSError) as err:
                log.warning("compacting %s's small files failed (%s); trying again after %d "
                            "more commits", table, err, self.every)
                return
            if table not in self.again:
                return

    def close(self) -> None:
        """Wait for a compaction in progress (a cut one would leave only orphan files)."""
        self.pool.shutdown(wait=True)
