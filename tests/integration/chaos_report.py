"""What a chaos run did with the groups whose `groups` row differs from the reference run's.

For each such group: its rows in both lakes, every decision and `opened` notice of it on
`rollout.decisions` (offset, key fields) with the offset at which the watermarks that
followed let the batch stage release it, its `samples` and dead letters in the chaos lake,
each `batch_state` snapshot of its run (whether its batcher had applied the group, whether
its merge held it), each table's recorded offset per decisions partition; then the kill
and spawn timeline and the instances' log lines about take-overs, restarts and warnings.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import orjson
import pyarrow.compute as pc

from ingest.core.ordering import Bound, watermark_bound
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.io.lake import Lake
from ingest.processor.decisions import decision_header, opened_notice, watermark_notice
from ingest.processor.offsets import app_id
from tests.integration.pipeline import by_group

TABLES_WITH_MARKS = ("training_batches", "steps", "samples", "groups", "dead_letters",
                     "batch_state")
LOG_MARKERS = ("resuming at offset", "rebuilt", "sent again", "came after", "WARNING", "ERROR",
               "Traceback", "Error")
MAX_LOG_LINES = 60
MAX_GROUPS = 5  # described in full; the others are only listed


def differing_groups(got: Lake, ref: Lake, run_id: str) -> list[int]:
    """Groups whose `groups` row (wall-clock column aside) is not the reference's."""
    def comparable(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if row is None else {k: v for k, v in row.items() if k != "decided_at"}

    mine, theirs = by_group(got, run_id), by_group(ref, run_id)
    return sorted(g for g in mine.keys() | theirs.keys()
                  if comparable(mine.get(g)) != comparable(theirs.get(g)))


def _decisions_records(kafka: KafkaSettings) -> list[Any]:
    return read_topics(kafka, [kafka.topics.decisions], what="chaos report", timeout_s=120,
                       quiet_ms=2000)


def _release_offsets(records: list[Any], event_partitions: int
                     ) -> dict[tuple[int, int], int | None]:
    """(decisions partition, offset) of each decision or notice -> the offset of the first
    record on its partition at or after it whose arrival put every events partition's
    bound past its position (`ordering.Bound`; None: never)."""
    out: dict[tuple[int, int], int | None] = {}
    waiting: dict[int, list[tuple[Bound, int]]] = {}  # partition -> [(position, offset)]
    marks: dict[int, dict[int, Bound]] = {}
    for record in records:
        mark = watermark_notice(record)
        item = opened_notice(record) or decision_header(record)
        if mark is not None:
            seen = marks.setdefault(record.partition, {})
            bound = watermark_bound(mark["partition"], mark["at_us"], mark.get("next_offset"))
            seen[mark["partition"]] = max(seen.get(mark["partition"], bound), bound)
        elif item is not None:
            out[(record.partition, record.offset)] = None
            waiting.setdefault(record.partition, []).append(
                (item.order_key().position(), record.offset))
        seen = marks.get(record.partition, {})
        if len(seen) == event_partitions:
            frontier = min(seen.values())
            still = []
            for position, offset in waiting.get(record.partition, []):
                if position < frontier:
                    out[(record.partition, offset)] = record.offset
                else:
                    still.append((position, offset))
            waiting[record.partition] = still
    return out


def _snapshots(lake: Lake, run_id: str, group: int) -> list[str]:
    """The group in each decisions partition's snapshots: the first, each one where it
    changed, and the latest."""
    lines, last = [], {}
    rows = sorted(lake.read("batch_state").to_pylist(), key=lambda r: (r["partition"], r["offset"]))
    for i, row in enumerate(rows):
        try:
            state = pickle.loads(row["state"])
        except Exception as err:  # noqa: BLE001 - a report line, not a failure
            lines.append(f"  snapshot p{row['partition']}@{row['offset']}: does not load ({err})")
            continue
        batcher = state.batchers.get(run_id)
        held = [key for key, _ in state.merge.drain() if key.group_index == group]  # a copy
        seen = (None if batcher is None else group in batcher.opened,
                None if batcher is None else group in batcher.decided, held)
        latest = i + 1 == len(rows) or rows[i + 1]["partition"] != row["partition"]
        if seen != last.get(row["partition"]) or latest:
            lines.append(f"  snapshot p{row['partition']}@{row['offset']}: opened {seen[0]}, "
                         f"applied {seen[1]}, held {held}, released "
                         f"{state.merge.released}")
        last[row["partition"]] = seen
    return lines


def report(kafka: KafkaSettings, got: Lake, ref: Lake, run_id: str, logs: Path,
           timeline: list[str]) -> str:
    groups = differing_groups(got, ref, run_id)
    if not groups:
        return "no group differs"
    records = _decisions_records(kafka)
    released = _release_offsets(records, kafka.event_partitions)
    mine, theirs = by_group(got, run_id), by_group(ref, run_id)
    lines = [f"groups that differ: {groups}"]
    for group in groups[:MAX_GROUPS]:
        lines.append(f"group {group}: chaos {mine.get(group)}")
        lines.append(f"  reference {theirs.get(group)}")
        for record in records:
            opened = opened_notice(record)
            header = decision_header(record)
            if opened is not None and opened.group_index == group:
                lines.append(f"  opened p{record.partition}@{record.offset} ts "
                             f"{record.timestamp} key {opened.order_key()} released at "
                             f"{released[(record.partition, record.offset)]}")
            elif header is not None and header.group_index == group:
                lines.append(f"  decision p{record.partition}@{record.offset} ts "
                             f"{record.timestamp} {header.decision}/{header.reason} key "
                             f"{header.order_key()} released at "
                             f"{released[(record.partition, record.offset)]}")
        where = (pc.field("run_id") == run_id) & (pc.field("group_index") == group)
        samples = got.read("samples", filter=where, columns=["rollout_id", "decision"])
        lines.append(f"  chaos samples rows {samples.num_rows}")
        for dead in got.read("dead_letters", filter=pc.field("group_index") == group,
                             columns=["partition", "offset", "error"]).to_pylist():
            lines.append(f"  dead letter {dead}")
        lines.extend(_snapshots(got, run_id, group))
    topic = kafka.topics.decisions
    for partition in sorted({r.partition for r in records}):
        marks = {t: got.txn_version(t, app_id(t, topic, partition)) for t in TABLES_WITH_MARKS}
        last = max(r.offset for r in records if r.partition == partition)
        lines.append(f"decisions p{partition}: last offset {last}, recorded {orjson.dumps(marks).decode()}")
    lines.extend(_timeline_and_logs(logs, timeline))
    return "\n".join(lines)


def stall_report(kafka: KafkaSettings, got: Lake, run_id: str, logs: Path,
                 timeline: list[str]) -> str:
    """Why a step did not seal: the run's decisions on `rollout.decisions` that the
    watermarks after them never released, each events partition's last watermark per
    decisions partition, the steps the lake holds, then the timeline and the logs."""
    lines = []
    try:
        records = _decisions_records(kafka)
    except TimeoutError as err:  # the report goes on with what the lake and logs say
        lines.append(f"decisions not read: {err}")
        records = []
    released = _release_offsets(records, kafka.event_partitions)
    for record in records:
        header = decision_header(record)
        if header is not None and header.run_id == run_id:
            at = released[(record.partition, record.offset)]
            lines.append(f"decision p{record.partition}@{record.offset} group "
                         f"{header.group_index} step {header.step} {header.decision} key "
                         f"{header.order_key()} released at {at}")
    last_marks: dict[tuple[int, int], dict[str, Any]] = {}
    for record in records:
        mark = watermark_notice(record)
        if mark is not None:
            last_marks[(record.partition, mark["partition"])] = {**mark, "offset": record.offset}
    lines.extend(f"last watermark on decisions p{p} of events p{e}: {mark}"
                 for (p, e), mark in sorted(last_marks.items()))
    steps = got.read("steps").to_pylist() if got.exists("steps") else []
    lines.append(f"steps in the lake: {sorted(r['step'] for r in steps if r['run_id'] == run_id)}")
    lines.extend(_timeline_and_logs(logs, timeline))
    return "\n".join(lines)


def _timeline_and_logs(logs: Path, timeline: list[str]) -> list[str]:
    lines = ["timeline:"]
    lines.extend(f"  {entry}" for entry in timeline)
    for log in sorted(logs.iterdir()):
        marked = [line for line in log.read_text(errors="replace").splitlines()
                  if any(m in line for m in LOG_MARKERS)]
        lines.append(f"{log.name}: {len(marked)} lines of note")
        lines.extend(f"  {line[:300]}" for line in marked[-MAX_LOG_LINES:])
    return lines
