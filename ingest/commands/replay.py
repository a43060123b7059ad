"""`rolloutlake replay`: re-derive a run's decisions and batches from the `events` archive.

The archive is the source of truth; the processor's pure core (assembly, filter chain,
batching, metrics) runs over it again, optionally under another filter, reward key or
batch size, and writes the derived tables into another lake. Same settings, same archive:
the same batches, which `--check` verifies against the original `steps` hashes.

Same code path as the live processor: each events partition is folded in offset order
with the event times the processor archived (`fold_partition`, as the group stage does
after a restart), so groups complete and time out where they did live; each group is
decided by `ingest.core.decide`, and `RunBatcher.apply` takes the opened groups and
decisions in `OrderKey` order, the order the batch stage's `DecisionMerge` releases them
in, with any number of partitions.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import track

from ingest.commands.step_table import step_table
from ingest.core.assembly import fold_partition
from ingest.core.batching import Effects, RunBatcher
from ingest.core.decide import decide
from ingest.core.decided import DecidedGroup, Opened
from ingest.core.filters import load_filter
from ingest.core.ordering import DecisionMerge, micros
from ingest.core.rows import groups_table, metric_rows, steps_row
from ingest.io.archive import read_archive
from ingest.io.lake import Lake
from schemas.errors import ConfigError, RolloutlakeError
from schemas.events import RunConfig, run_id_argument
from schemas.tables import STEP_METRICS, STEPS


def archived_config(lake: Lake, run_id: str) -> RunConfig:
    """The run's config from its last archived `run_started` event."""
    rows = read_archive(lake, (pc.field("run_id") == run_id) & (pc.field("type") == "run_started"))
    if not rows:
        raise ConfigError(f"run {run_id} has no archived run_started; pass --config FILE")
    return RunConfig.model_validate(orjson.loads(rows[-1].payload)["config"])


def archived_items(lake: Lake, run_id: str, config: RunConfig) -> list[Opened | DecidedGroup]:
    """What the group stage published for the run (opened groups and decisions, with the
    same order keys), re-derived from the archive under `config`.

    Each events partition is folded in offset order as the group stage folds it after a
    restart (`fold_partition`); a group complete in the archive is decided at its
    completing event, any other at first event + `group_timeout_s` (the archive holds no
    event the group stage refused after a timeout). Groups never started are left out:
    the processor dead-letters them.
    """
    rows = read_archive(lake, (pc.field("run_id") == run_id) & (pc.field("type") != "run_started"))
    if not rows:
        raise RolloutlakeError(f"run {run_id} has no events in {lake.root}/events")
    timeout_us = micros(config.group_timeout_s)
    items: list[Opened | DecidedGroup] = []
    for (_topic, partition), archived in itertools.groupby(rows, lambda r: (r.topic, r.partition)):
        for folded in fold_partition(archived, lambda _run, _group: False).values():
            group = folded.builder.group
            if folded.started is None:
                continue
            started_us, started_offset, step = folded.started
            items.append(Opened(run_id, group.group_index, step, started_us, partition,
                                started_offset))
            if folded.completed is not None:
                at_us, offset = folded.completed
            else:
                at_us, offset = folded.first_us + timeout_us, -1
            decided = decide(group, config, at_us=at_us,
                             source={"partition": partition, "offset": offset},
                             decided_at=at_us / 1e6, timed_out=folded.completed is None)
            items.append(decided.group)
    return items


def replay_run(lake: Lake, run_id: str, config: RunConfig) -> list[Effects]:
    """Decide and batch every archived group of the run under `config`, applied in
    `OrderKey` order as the batch stage applies them."""
    batcher = RunBatcher(run_id, config)
    merge = DecisionMerge(partitions=0)
    for item in archived_items(lake, run_id, config):
        merge.add(item.order_key(), item)
    effects = [batcher.apply(item) for _key, item in
               track(merge.drain(), description=f"replaying {run_id}", transient=True)]
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
    if merged.sealed:
        version = out.append("training_batches", pa.concat_tables([s.rows for s in merged.sealed]))
        # Without marks, append skips only an empty table, and a sealed step has rows.
        assert version is not None
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
                        help="exit 1 unless every re-derived step hash, group decision and "
                             "step metric equals the original")


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
    started = time.monotonic()
    effects = replay_run(source, args.run, config)
    write_effects(out, args.run, effects)
    seconds = time.monotonic() - started
    console = Console()
    console.print(step_table(out, args.run))
    where = f"into {out.root}" if kept else "(pass --out DIR to keep the tables)"
    decided = sum(len(e.groups) for e in effects)
    console.print(f"re-derived {decided} groups in {seconds:.1f} s {where}")
    if not args.check:
        return 0
    differences = compare(source, out, args.run)
    if not differences:
        console.print(f"check: every step hash, decision and metric equals the original "
                      f"({len(_by_key(out, 'steps', args.run))} steps)")
        return 0
    for what, keys in differences.items():
        more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
        shown = ", ".join(map(str, keys[:10])) + more
        console.print(f"check: {what} differ from the original: {shown}")
    return 1


# What --check compares: each table's key -> the columns that must be equal.
_COMPARED = {
    "steps": (("step",), ("content_sha256",)),
    "groups": (("group_index",), ("decision", "reason", "batch_step", "step", "n_fragments",
                                  "mean_reward", "ordered_at")),
    "step_metrics": (("step", "key"), ("value",)),
}


def _by_key(lake: Lake, table: str, run_id: str) -> dict[tuple, tuple]:
    key, values = _COMPARED[table]
    rows = lake.read(table, filter=pc.field("run_id") == run_id,
                     columns=[*key, *values]).to_pylist()
    return {tuple(r[c] for c in key): tuple(r[c] for c in values) for r in rows}


def compare(original: Lake, derived: Lake, run_id: str) -> dict[str, list]:
    """Keys whose rows differ between the two lakes, per table: `steps` (the content
    hash), `groups` (decision, reason, step, batch step, fragments, mean reward, order
    time) and `step_metrics` (every value); empty when the replay equals the original."""
    out = {}
    for table in _COMPARED:
        a, b = _by_key(original, table, run_id), _by_key(derived, table, run_id)
        differing = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if differing:
            out[table] = [k[0] if len(k) == 1 else k for k in differing]
    return out
