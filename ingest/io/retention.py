"""Retention: which table versions a run under retention still needs, and a vacuum that
keeps them.

A run is **under retention** while its newest archived event (`events.ingested_at`) or
sealed step (`steps.sealed_at`) is younger than the retention period, or while it is
named with `--keep-run`. Such a run must stay replayable and auditable:

- replay and plain audit read the latest version of each table, which vacuum never
  touches;
- the trainer and `audit --trainer-step` read `training_batches` at each step's
  `batch_version`, and `audit --as-of <batch version>` reads every audited table as of
  that version's commit. Those are the **pinned versions** of the run, and vacuum passes
  them to Delta as `keep_versions`, so no file they reference is deleted.

Compaction (`optimize`) only adds files and tombstones old ones, so it never breaks a
read; after it, the tombstoned files of pinned versions stay until their run leaves
retention.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import CommitFailedError

from ingest.io.lake import Lake, compaction_bins
from schemas.tables import TABLES, TRAINING_BATCHES

# Tables replay and audit read; the others (prompt cursors, snapshots, sync marks) follow
# Delta's own retention only.
AUDITED_TABLES = ("events", "groups", "samples", "training_batches", "steps", "step_metrics",
                  "dead_letters", "trainer_steps", "runs")


@dataclass(frozen=True)
class RetainedRun:
    run_id: str
    why: str  # "events until <time>" or "--keep-run"


def retained_runs(lake: Lake, *, hours: int, keep: frozenset[str] = frozenset(),
                  now: datetime | None = None) -> dict[str, RetainedRun]:
    """Runs under retention, by run id."""
    cutoff = (now or datetime.now(UTC)) - timedelta(hours=hours)
    newest: dict[str, datetime] = {}
    for table, column in (("events", "ingested_at"), ("steps", "sealed_at")):
        rows = lake.read(table, columns=["run_id", column])
        if rows.num_rows:
            latest = rows.group_by("run_id").aggregate([(column, "max")])
            for run_id, at in zip(latest["run_id"].to_pylist(),
                                  latest[f"{column}_max"].to_pylist(), strict=True):
                newest[run_id] = max(at, newest.get(run_id, at))
    found = {r: RetainedRun(r, f"newest data at {at.isoformat(timespec='seconds')}")
             for r, at in newest.items() if at > cutoff}
    found.update({r: RetainedRun(r, "--keep-run") for r in keep})
    return found


@dataclass
class PinnedVersions:
    """Per table, the versions retained runs read, and which runs read each."""

    by_table: dict[str, dict[int, set[str]]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, table: str, version: int, run_id: str) -> None:
        self.by_table[table].setdefault(version, set()).add(run_id)

    def versions(self, table: str) -> list[int]:
        return sorted(self.by_table.get(table, {}))

    def runs(self, table: str) -> list[str]:
        return sorted({r for runs in self.by_table.get(table, {}).values() for r in runs})


def pinned_versions(lake: Lake, runs: dict[str, RetainedRun]) -> PinnedVersions:
    """The batch versions of the runs' steps (and of their trainer steps), and for every
    other audited table its version as of each batch version's commit."""
    pinned = PinnedVersions()
    if not runs:
        return pinned
    of_runs = pc.field("run_id").isin(sorted(runs))
    batch_times = lake.commit_times(TRAINING_BATCHES.name)
    as_of = {table: lake.versions_as_of(table)
             for table in AUDITED_TABLES if table != TRAINING_BATCHES.name}
    for table in ("steps", "trainer_steps"):
        rows = lake.read(table, filter=of_runs, columns=["run_id", "batch_version"])
        for run_id, version in zip(rows["run_id"].to_pylist(),
                                   rows["batch_version"].to_pylist(), strict=True):
            if version not in batch_times:
                continue  # its log entry is gone: Delta can no longer read that version
            pinned.add(TRAINING_BATCHES.name, version, run_id)
            for other, version_at in as_of.items():
                found = version_at(batch_times[version])
                if found is not None:
                    pinned.add(other, found, run_id)
    return pinned


@dataclass(frozen=True)
class VacuumResult:
    table: str
    deleted: list[str]  # files removed (or, with dry_run, that would be)
    kept: int  # files Delta alone would have removed that pinned versions still need
    runs: list[str]  # retained runs whose pinned versions kept them

    def line(self, *, dry_run: bool) -> str:
        verb = "would delete" if dry_run else "deleted"
        text = f"{self.table}: {verb} {len(self.deleted)} files"
        if self.kept:
            text += (f"; refused to delete {self.kept} that runs under retention still need "
                     f"for replay and audit ({', '.join(self.runs)})")
        return text


def vacuum(lake: Lake, *, hours: int, runs: dict[str, RetainedRun],
           dry_run: bool = False) -> list[VacuumResult]:
    """Vacuum every table of the lake with `hours` of retention, keeping the files the
    pinned versions of `runs` (`retained_runs`) reference."""
    pinned = pinned_versions(lake, runs)
    results = []
    for table in TABLES:
        if not lake.exists(table):
            continue
        dt = lake.refresh(table)
        keep_versions = pinned.versions(table) or None
        # The user chose the period; pinned versions guard what retained runs read.
        listed = functools.partial(dt.vacuum, retention_hours=hours,
                                   enforce_retention_duration=False)
        # Both counted as dry runs: a real vacuum lists only what it found to delete.
        guarded = listed(dry_run=True, keep_versions=keep_versions)
        kept = len(set(listed(dry_run=True)) - set(guarded)) if keep_versions else 0
        deleted = guarded if dry_run else listed(dry_run=False, keep_versions=keep_versions)
        results.append(VacuumResult(table, sorted(deleted), kept,
                                    pinned.runs(table) if kept else []))
    return results


@dataclass(frozen=True)
class CompactResult:
    table: str
    added: int
    removed: int
    raced: bool = False  # another writer rewrote or removed some of the files meanwhile

    def line(self, *, dry_run: bool) -> str:
        if dry_run:
            return f"{self.table}: would compact {self.removed} small files"
        if self.raced:
            return (f"{self.table}: not compacted: another writer (a running processor's "
                    "compaction?) changed the same files meanwhile; run again")
        return f"{self.table}: compacted {self.removed} files into {self.added}"


def compact(lake: Lake, *, dry_run: bool = False) -> list[CompactResult]:
    """Compact every table's small files (`Lake.compact`). A dry run counts the files it
    would rewrite: those below COMPACTED_FILE_BYTES that share a partition with another."""
    results = []
    for table in TABLES:
        if not lake.exists(table):
            continue
        if not dry_run:
            try:
                done = lake.compact(table)
            except CommitFailedError:
                results.append(CompactResult(table, 0, 0, raced=True))
                continue
            results.append(CompactResult(table, done["added"], done["removed"]))
            continue
        bins = compaction_bins(pa.table(lake.refresh(table).get_add_actions(flatten=True)),
                               lake.spec(table).partition_by)
        results.append(CompactResult(table, 0, sum(len(files) for _, files in bins)))
    return results
