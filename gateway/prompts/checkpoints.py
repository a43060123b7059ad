"""The Delta checkpoints of the prompt cursors: `prompt_cursor` (one row per checkpoint,
with the groups issued since the previous one) and `prompt_cursor_wal` (where on the
events topic the roll-forward after each checkpoint starts); and `recycled_samples`, the
partial rollouts of recycled groups."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gateway.prompts.cursor import Cursor
from ingest.io.lake import Lake, TxnMark
from schemas.tables import PROMPT_CURSOR, PROMPT_CURSOR_WAL, RECYCLED_SAMPLES


class CursorCheckpoints:
    """Reads and appends the checkpoints of every run's cursor; `topic` is the events topic
    whose offsets the log positions refer to."""

    def __init__(self, lake: Lake, topic: str):
        self.lake = lake
        self.topic = topic

    def last(self, run_id: str) -> Cursor | None:
        """The run's latest checkpoint; None before the first."""
        table = self._rows(run_id)
        if table.num_rows == 0:
            return None
        last = table.take([pc.index(table["seq"], pc.max(table["seq"])).as_py()]).to_pylist()[0]
        return Cursor(
            run_id=run_id, seq=last["seq"], dataset=last["dataset"],
            dataset_version=last["dataset_version"], seed=last["seed"], shuffle=last["shuffle"],
            epoch=last["epoch"], offset=last["offset"], next_group_index=last["next_group_index"],
            recycle_rows=tuple(last["recycle_rows"]), recycle_groups=tuple(last["recycle_groups"]),
        )

    def log_start(self, run_id: str, seq: int) -> dict[int, int]:
        """Where the log of checkpoint `seq` starts, per partition ({} = from the beginning)."""
        if not self.lake.exists(PROMPT_CURSOR_WAL.name):
            return {}
        table = self.lake.read(PROMPT_CURSOR_WAL.name, filter=(pc.field("run_id") == run_id)
                               & (pc.field("seq") == seq))
        for row in table.to_pylist()[-1:]:
            if row["topic"] == self.topic:
                return dict(zip(row["partitions"], row["offsets"], strict=True))
        return {}

    def issued_rows(self, run_id: str) -> dict[int, int]:
        """group -> row of every group some checkpoint of the run records."""
        table = self._rows(run_id)
        return dict(zip(pc.list_flatten(table["issued_groups"]).to_pylist(),
                        pc.list_flatten(table["issued_rows"]).to_pylist(), strict=True))

    def write(self, run_id: str, cursor: Cursor, issued: list[tuple[int, int]],
              offsets: dict[int, int]) -> int | None:
        """Append checkpoint seq+1 with the (group, row) pairs `issued` since the previous
        one, its log offsets first; None if that seq already exists (another writer)."""
        seq = cursor.seq + 1
        now = datetime.now(UTC)
        parts = sorted(offsets)
        self.lake.append(PROMPT_CURSOR_WAL.name, pa.Table.from_pylist([{
            "run_id": run_id, "seq": seq, "topic": self.topic,
            "partitions": parts, "offsets": [offsets[p] for p in parts], "committed_at": now,
        }], schema=PROMPT_CURSOR_WAL.schema))
        row = {**replace(cursor, seq=seq).__dict__, "recycle_rows": list(cursor.recycle_rows),
               "recycle_groups": list(cursor.recycle_groups),
               "issued_groups": [g for g, _ in issued], "issued_rows": [r for _, r in issued],
               "committed_at": now}
        table = pa.Table.from_pylist([row], schema=PROMPT_CURSOR.schema)
        version = self.lake.append(PROMPT_CURSOR.name, table,
                                   marks=[TxnMark(f"prompt-cursor-{run_id}", seq)])
        return None if version is None else seq

    def _rows(self, run_id: str) -> pa.Table:
        return self.lake.read(PROMPT_CURSOR.name, filter=pc.field("run_id") == run_id)


class RecycledSamples:
    """The `recycled_samples` rows of every run: `RecycledSample` dicts in, the same out."""

    def __init__(self, lake: Lake):
        self.lake = lake

    def write(self, run_id: str, samples: list[dict[str, Any]]) -> None:
        now = datetime.now(UTC)
        rows = [{**{k: v for k, v in s.items() if k != "segments"}, "run_id": run_id,
                 "segment_tokens": [seg["tokens"] for seg in s["segments"]],
                 "segment_versions": [seg["weight_version"] for seg in s["segments"]],
                 "recycled_at": now} for s in samples]
        self.lake.append(RECYCLED_SAMPLES.name,
                         pa.Table.from_pylist(rows, schema=RECYCLED_SAMPLES.schema))

    def read(self, run_id: str, groups: tuple[int, ...]) -> dict[int, list[dict[str, Any]]]:
        """group -> its samples, for the `groups` given, one per rollout (the last written)."""
        if not groups or not self.lake.exists(RECYCLED_SAMPLES.name):
            return {}
        table = self.lake.read(RECYCLED_SAMPLES.name, filter=(pc.field("run_id") == run_id)
                               & pc.field("group_index").isin(list(groups)))
        latest: dict[tuple[int, int], dict[str, Any]] = {}
        for row in table.sort_by("recycled_at").to_pylist():
            segments = [{"tokens": n, "weight_version": v} for n, v in
                        zip(row.pop("segment_tokens"), row.pop("segment_versions"), strict=True)]
            del row["run_id"], row["recycled_at"]
            latest[(row["group_index"], row["rollout_id"])] = {**row, "segments": segments}
        out: dict[int, list[dict[str, Any]]] = {}
        for (group, _), sample in sorted(latest.items()):
            out.setdefault(group, []).append(sample)
        return out
