"""`rolloutlake replay`: re-derive a run's decisions and batches from the `events` archive.

The archive is the source of truth; the processor's pure core (assembly, filter chain,
batching, metrics) runs over it again, optionally under another filter, reward key or
batch size, and writes the derived tables into another lake. Same settings, same archive:
the same batches, which `--check` verifies against the original `steps` hashes.

Order: each events partition is re-read in offset order with the event times the
processor archived, so groups complete and time out exactly where they did live; the
batcher then applies opened groups and decisions in `OrderKey` order, the order the batch
stage applies them in (`ingest.core.ordering`), with any number of partitions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import track

from ingest.core.assembly import GroupBuilder
from ingest.core.batching import Effects, RunBatcher, groups_table, metric_rows, steps_row
from ingest.core.decided import DecidedGroup, fragments_table, header_for
from ingest.core.filters import FilterArgs, apply_filter_chain, load_filter
from ingest.core.model import FilterVerdict
from ingest.core.ordering import DECIDED, OPENED, DecisionMerge, OrderKey, TimeoutQueue, micros
from ingest.io.lake import Lake
from schemas.errors import ConfigError, RolloutlakeError
from schemas.events import RunConfig, parse_event, run_id_argument
from schemas.tables import STEP_METRICS, STEPS


def archived_config(lake: Lake, run_id: str) -> RunConfig:
    """The run's config from its last archived `run_started` event."""
    table = lake.read("events", columns=["offset", "payload"],
                      filter=(pc.field("run_id") == run_id) & (pc.field("type") == "run_started"))
    if table.num_rows == 0:
        raise ConfigError(f"run {run_id} has no archived run_started; pass --config FILE")
    payload = table.sort_by("offset").column("payload")[-1].as_py()
    return RunConfig.model_validate(orjson.loads(payload)["config"])


@dataclass
class ArchivedGroup:
    """A group re-assembled from the archive, with the event time it is ordered by."""

    builder: GroupBuilder
    at_us: int  # completing event; for a timeout, first event + group_timeout_s
    partition: int
    offset: int  # of the completing event; -1 for a timeout
    complete: bool = False
    started: tuple[int, int] | None = None  # event time and offset of its group_started


def archived_groups(lake: Lake, run_id: str, timeout_s: float) -> list[ArchivedGroup]:
    """Groups of the run rebuilt from the archive as the group stage built them: per
    events partition in offset order, timed out once the partition's event time passed
    first event + `timeout_s`. Groups still open at the end of the archive are timed out
    at their deadline; groups never started are left out (the processor dead-letters them)."""
    archive = lake.read("events",
                        filter=(pc.field("run_id") == run_id) & (pc.field("type") != "run_started"),
                        columns=["group_index", "topic", "partition", "offset", "ingested_at",
                                 "event_time", "payload"])
    if archive.num_rows == 0:
        raise RolloutlakeError(f"run {run_id} has no events in {lake.root}/events")
    archive = archive.sort_by([("topic", "ascending"), ("partition", "ascending"),
                               ("offset", "ascending")])
    timeout_us = micros(timeout_s)
    out: list[ArchivedGroup] = []
    open_groups: dict[int, ArchivedGroup] = {}
    decided: set[int] = set()
    queues: dict[tuple[str, int], TimeoutQueue] = {}

    def expire(queue: TimeoutQueue, watermark_us: int) -> None:
        for deadline_us, _run, group_index in queue.due(watermark_us, lambda _r: timeout_us):
            found = open_groups.get(group_index)
            if found is not None and not found.complete:
                found.at_us, found.offset = deadline_us, -1
                out.append(open_groups.pop(group_index))
                decided.add(group_index)

    for group_index, topic, partition, offset, ingested_at, event_time, payload in zip(
        *(archive.column(c).to_pylist() for c in archive.column_names), strict=True
    ):
        at_us = micros((event_time or ingested_at).timestamp())
        queue = queues.setdefault((topic, partition), TimeoutQueue())
        found = open_groups.get(group_index)
        if found is None:
            if group_index in decided:
                continue  # the processor refused events of a decided group
            found = open_groups[group_index] = ArchivedGroup(
                GroupBuilder(run_id, group_index, at_us / 1e6), at_us, partition, -1)
            queue.add(run_id, group_index, at_us)
        event = parse_event(orjson.loads(payload))
        found.builder.apply(event)
        if event.type == "group_started":
            found.started = (at_us, offset)
        if found.builder.group.complete:
            found.at_us, found.offset, found.complete = at_us, offset, True
            out.append(open_groups.pop(group_index))
            decided.add(group_index)
        expire(queue, at_us)
    for found in open_groups.values():
        found.at_us = micros(found.builder.group.first_event_at) + timeout_us
        found.offset = -1
        out.append(found)
    return [g for g in out if g.builder.group.started]


def replay_run(lake: Lake, run_id: str, config: RunConfig) -> list[Effects]:
    """Decide and batch every archived group of the run under `config`, in the order the
    batch stage applies them."""
    batcher = RunBatcher(run_id, config)
    args = FilterArgs.from_config(config)
    user_filter = load_filter(config.resolved_filter_path)
    merge = DecisionMerge(partitions=0)
    for found in archived_groups(lake, run_id, config.group_timeout_s):
        gi = found.builder.group.group_index
        if found.started is not None:
            at_us, offset = found.started
            merge.add(OrderKey(at_us, found.partition, offset, OPENED, run_id, gi), found)
        merge.add(OrderKey(found.at_us, found.partition, found.offset, DECIDED, run_id, gi),
                  found)
    effects: list[Effects] = []
    for key, found in track(merge.drain(), description=f"replaying {run_id}", transient=True):
        group = found.builder.group
        if key.kind == OPENED:
            batcher.open(group.group_index, group.step, key.at_us / 1e6)
            continue
        if not found.complete:
            verdict, offered = FilterVerdict(False, "group_timeout"), False
        else:
            try:
                verdict = apply_filter_chain(args, group, user_filter)
            except Exception:  # noqa: BLE001 - the processor records these as filter_error
                verdict = FilterVerdict(False, "filter_error")
            offered = True
        header = header_for(group, verdict, decided_at=key.at_us / 1e6, source={},
                            at_us=key.at_us, offered=offered)
        fragments = fragments_table(group, config.reward_key, with_tokens=verdict.keep)
        effects.append(batcher.offer(DecidedGroup(header, fragments), now=key.at_us / 1e6))
    effects.append(batcher.flush())
    return effects


def write_effects(out: Lake, run_id: str, effects: list[Effects]) -> None:
    merged = Effects()
    for e in effects:
        merged.extend(e)
    if merged.groups:
        out.append("groups", groups_table(merged.groups))
    if merged.samples:
        out.append("samples", pa.concat_tables(merged.samples))
    version = None
    if merged.sealed:
        version = out.append("training_batches", pa.concat_tables([s.rows for s in merged.sealed]))
        out.append("steps", pa.Table.from_pylist(
            [steps_row(run_id, s, version) for s in merged.sealed], schema=STEPS.schema))
    metrics = [row for step, m in merged.closed for row in metric_rows(run_id, step, m)]
    if metrics:
        out.append("step_metrics", pa.Table.from_pylist(metrics, schema=STEP_METRICS.schema))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True, help="lake holding the run's events archive")
    parser.add_argument("--run", required=True, type=run_id_argument, help="run id")
    parser.add_argument("--config", type=Path,
                        help="JSON file with the run's config (default: the archived run_started)")
    parser.add_argument("--filter", dest="filter_path",
                        help="another dynamic_sampling_filter_path ('none' for no filter)")
    parser.add_argument("--rollout-batch-size", type=int)
    parser.add_argument("--reward-key")
    parser.add_argument("--out", help="lake to write the derived tables to (default: a temporary "
                                      "one, removed when replay ends)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every re-derived step hash equals the original")


def _config(args: argparse.Namespace, source: Lake) -> RunConfig:
    if args.config is None:
        body: dict[str, Any] = archived_config(source, args.run).model_dump(exclude_none=True)
    else:
        try:
            body = orjson.loads(args.config.read_bytes())
        except (OSError, orjson.JSONDecodeError) as err:
            raise ConfigError(f"--config {args.config}: {err}") from None
    if args.filter_path is not None:
        body["dynamic_sampling_filter_path"] = None if args.filter_path == "none" else args.filter_path
    if args.rollout_batch_size is not None:
        body["rollout_batch_size"] = args.rollout_batch_size
        body["over_sampling_batch_size"] = max(args.rollout_batch_size,
                                               body.get("over_sampling_batch_size") or 0)
    if args.reward_key is not None:
        body["reward_key"] = args.reward_key
    try:
        return RunConfig.model_validate(body)
    except ValueError as err:
        raise ConfigError(f"run config: {err}".splitlines()[0]) from None


def run(args: argparse.Namespace) -> int:
    source = Lake(args.lake)
    if not source.exists("events"):
        raise RolloutlakeError(f"no events table under {args.lake}")
    config = _config(args, source)
    load_filter(config.resolved_filter_path)  # fail before any work on a bad path
    if args.out is not None:
        return _replay_into(source, Lake(args.out), args, config, kept=True)
    # Without --out the derived tables are only for the report and the check: removed on
    # every exit, an error or Ctrl-C included.
    with tempfile.TemporaryDirectory(prefix=f"replay-{args.run}-") as out_root:
        return _replay_into(source, Lake(out_root), args, config, kept=False)


def _replay_into(source: Lake, out: Lake, args: argparse.Namespace, config: RunConfig,
                 *, kept: bool) -> int:
    from ingest.commands.demo import step_table

    started = time.monotonic()
    write_effects(out, args.run, replay_run(source, args.run, config))
    console = Console()
    console.print(step_table(out, args.run))
    where = f"into {out.root}" if kept else "(pass --out DIR to keep the tables)"
    console.print(f"re-derived in {time.monotonic() - started:.1f} s {where}")
    if not args.check:
        return 0
    original = {r["step"]: r["content_sha256"]
                for r in source.read("steps", filter=pc.field("run_id") == args.run).to_pylist()}
    derived = {r["step"]: r["content_sha256"]
               for r in out.read("steps", filter=pc.field("run_id") == args.run).to_pylist()}
    if original == derived:
        console.print(f"check: all {len(derived)} steps equal the original hashes")
        return 0
    differing = sorted(s for s in original.keys() | derived.keys()
                       if original.get(s) != derived.get(s))
    console.print(f"check: steps {differing} differ from the original")
    return 1
