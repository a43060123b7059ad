"""`rolloutlake replay`: re-derive a run's decisions and batches from the `events` archive.

The archive is the source of truth; the processor's pure core (assembly, filter chain,
batching, metrics) runs over it again, optionally under another filter, reward key or
batch size, and writes the derived tables into another lake. Same settings, same archive:
the same batches, which `--check` verifies against the original `steps` hashes.

Order: decisions are re-made in archive order (ingestion time, then partition and
offset), which is the processor's order for a single events partition; with several
partitions the interleaving of groups can differ, and with it which groups are surplus.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
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
from ingest.core.model import FilterVerdict
from ingest.filters import FilterArgs, apply_filter_chain, load_filter
from ingest.lake import Lake
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


def archived_groups(lake: Lake, run_id: str) -> Iterator[tuple[GroupBuilder, bool]]:
    """Groups of the run rebuilt from the archive, in completion order; (builder, complete)."""
    archive = lake.read("events",
                        filter=(pc.field("run_id") == run_id) & (pc.field("type") != "run_started"),
                        columns=["group_index", "partition", "offset", "ingested_at", "payload"])
    if archive.num_rows == 0:
        raise RolloutlakeError(f"run {run_id} has no events in {lake.root}/events")
    archive = archive.sort_by([("ingested_at", "ascending"), ("partition", "ascending"),
                               ("offset", "ascending")])
    builders: dict[int, GroupBuilder] = {}
    for group_index, _p, _o, ingested_at, payload in zip(
        *(archive.column(c).to_pylist() for c in archive.column_names), strict=True
    ):
        builder = builders.get(group_index)
        if builder is None:
            builder = builders[group_index] = GroupBuilder(run_id, group_index,
                                                           ingested_at.timestamp())
        if builder.group.complete:
            continue
        builder.apply(parse_event(orjson.loads(payload)))
        if builder.group.complete:
            yield builder, True
    for builder in builders.values():
        if not builder.group.complete:
            yield builder, False


def replay_run(lake: Lake, run_id: str, config: RunConfig) -> list[Effects]:
    """Decide and batch every archived group of the run under `config`."""
    batcher = RunBatcher(run_id, config)
    args = FilterArgs.from_config(config)
    user_filter = load_filter(config.resolved_filter_path)
    effects: list[Effects] = []
    groups = list(archived_groups(lake, run_id))
    for builder, complete in track(groups, description=f"replaying {run_id}", transient=True):
        group = builder.group
        if group.started:
            batcher.open(group.group_index, group.step, group.first_event_at)
        if not complete:
            if not group.started:
                continue  # the processor dead-letters such groups
            verdict, offered = FilterVerdict(False, "group_timeout"), False
        else:
            try:
                verdict = apply_filter_chain(args, group, user_filter)
            except Exception:  # noqa: BLE001 - the processor records these as filter_error
                verdict = FilterVerdict(False, "filter_error")
            offered = True
        header = header_for(group, verdict, decided_at=group.first_event_at, source={},
                            offered=offered)
        fragments = fragments_table(group, config.reward_key, with_tokens=verdict.keep)
        effects.append(batcher.offer(DecidedGroup(header, fragments), now=header.decided_at))
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
    from ingest.demo import step_table

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
