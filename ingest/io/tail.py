"""Tailing a run in the lake: rows appended since the last look, and steps as they seal.

The dashboards, `rolloutlake watch` and `rolloutlake wandb-sync --follow` all follow a
live run. Re-reading a table on every poll costs a scan of all its files; instead a tail
compares the Delta version (one log read) and, when it moved, reads only the data files it
has not seen (listed from the add actions of the log it already holds). A file rewritten
by compaction is read again, so consumers deduplicate on the table key (the step for
`StepTail`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import pyarrow as pa
import pyarrow.fs as pafs

from ingest.io.lake import Lake, pyarrow_dataset


class TableTail:
    """Rows of one run appended to one Delta table since the previous `poll`."""

    def __init__(self, lake: Lake, table: str, run_id: str, columns: Sequence[str] | None = None):
        # A private Lake: its DeltaTable handle is refreshed from a polling thread and must
        # not be shared with a writer or another poller.
        self._lake = Lake(lake.root, lake.storage_options)
        spec = lake.spec(table)
        self.table = table
        self.run_id = run_id
        self._partitioned = "run_id" in spec.partition_by
        # Data files hold no partition columns; an explicit schema also reads files
        # written before a column was added (as nulls).
        self._file_schema = pa.schema([f for f in spec.schema if f.name not in spec.partition_by])
        self.columns = [c for c in columns or spec.schema.names if c in self._file_schema.names]
        self.version: int | None = None
        self._seen: set[str] = set()
        self._filesystem: pafs.FileSystem | None = None

    def poll(self) -> pa.Table | None:
        """New rows of the run, or None when the table did not change (or does not exist).

        Never creates the table: readers must not write to the lake.
        """
        if not self._lake.exists(self.table):
            return None
        dt = self._lake.refresh(self.table)
        version = dt.version()
        if version == self.version:
            return None
        self.version = version
        # The add actions come from the log already in memory; building a pyarrow dataset
        # of the whole table instead costs ~5 ms per data file on every change.
        actions = dt.get_add_actions(flatten=True)
        paths = actions.column("path").to_pylist()
        runs = (actions.column("partition.run_id").to_pylist() if self._partitioned
                else [self.run_id] * len(paths))
        fresh = [p for p, r in zip(paths, runs, strict=True)
                 if r == self.run_id and p not in self._seen]
        self._seen.update(paths)
        if not fresh:
            return None
        if self._filesystem is None:
            self._filesystem = self._lake.table_filesystem(self.table, dt)
        files = pyarrow_dataset().dataset(fresh, schema=self._file_schema, format="parquet",
                                          filesystem=self._filesystem)
        return files.to_table(columns=self.columns)


@dataclass(slots=True)
class SealedStep:
    """A sealed step of a run with all its `step_metrics` values."""

    step: int
    sealed_at: datetime
    n_groups: int
    n_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


class StepTail:
    """Sealed steps of one run, each returned once, when both its rows are visible.

    A step is ready when its `steps` row and its `step_metrics` rows are in the lake; the
    processor writes a step's metrics in one commit, so the first metrics seen for a step
    are all of them (whichever of the two tables it commits first). Steps seal in step
    order (CONTRACT section 3: kept groups fill the oldest open step), so ready steps are
    returned sorted by step, and the step number is a resumable cursor.
    """

    def __init__(self, lake: Lake, run_id: str, after: int | None = None):
        self.run_id = run_id
        self.last_step = after  # highest step returned so far
        self._steps = TableTail(lake, "steps", run_id, ["step", "sealed_at", "n_groups", "n_samples"])
        self._metrics = TableTail(lake, "step_metrics", run_id, ["step", "key", "value"])
        self._sealed: dict[int, SealedStep] = {}
        self._values: dict[int, dict[str, float]] = {}

    def _unseen(self, step: int) -> bool:
        return self.last_step is None or step > self.last_step

    def poll(self) -> list[SealedStep]:
        """Steps that became ready since the previous poll, in step order."""
        # Metrics first: a step whose steps row lands between the two reads waits one poll
        # instead of being returned before its metrics.
        metrics = self._metrics.poll()
        if metrics is not None:
            for step, key, value in zip(
                metrics["step"].to_pylist(),
                metrics["key"].to_pylist(),
                metrics["value"].to_pylist(),
                strict=True,
            ):
                if self._unseen(step):
                    self._values.setdefault(step, {})[key] = value
        steps = self._steps.poll()
        if steps is not None:
            for row in steps.to_pylist():
                if self._unseen(row["step"]):
                    self._sealed[row["step"]] = SealedStep(
                        row["step"], row["sealed_at"], row["n_groups"], row["n_samples"]
                    )
        # A sealed step still waiting for its metrics holds back the steps after it, so the
        # cursor never passes a step that has not been returned.
        waiting = min((s for s in self._sealed if s not in self._values), default=None)
        ready = sorted(
            s for s in self._sealed if s in self._values and (waiting is None or s < waiting)
        )
        out = []
        for step in ready:
            sealed = self._sealed.pop(step)
            sealed.metrics = self._values.pop(step)
            out.append(sealed)
        if out:
            self.last_step = out[-1].step
        return out
