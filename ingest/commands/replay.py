"""`rolloutlake replay`: re-derive a run's decisions and batches from the `events` archive.

The archive is the source of truth; the processor's pure core (assembly, filter chain,
batching, metrics) runs over it again, optionally under what-if settings
(`--config KEY=VALUE ...`, `ingest.core.whatif`), and writes the derived tables into
another lake (`--into`, never the original), then prints the diff against the original
(`ingest.io.whatif_diff`): a table, `--json`, `--plot FILE.png`. Same settings, same
archive: the same batches, which `--check` verifies against the original.

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
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task
from rich.text import Text

from ingest.core.assembly import FoldedGroup, fold_partition
from ingest.core.batching import Effects, RunBatcher
from ingest.core.decide import decide
from ingest.core.decided import DecidedGroup, Opened
from ingest.core.filters import load_filter
from ingest.core.ordering import DecisionMerge, timeout_micros
from ingest.core.rows import groups_table, metric_rows, steps_row
from ingest.core.whatif import WhatIf, parse_what_if
from ingest.io.archive import read_archive
from ingest.io.lake import Lake
from ingest.io.whatif_diff import compare_lakes, plot_diff, print_diff
from schemas.errors import ConfigError, RolloutlakeError
from schemas.events import RunConfig, run_id_argument
from schemas.tables import STEP_METRICS, STEPS


def archived_config(lake: Lake, run_id: str) -> RunConfig:
    """The run's config from its last archived `run_started` event."""
    rows = read_archive(lake, (pc.field("run_id") == run_id) & (pc.field("type") == "run_started"))
    if not rows:
        raise ConfigError(f"run {run_id} has no archived run_started; pass --config-file FILE")
    return RunConfig.model_validate(orjson.loads(rows[-1].payload)["config"])


def archived_items(lake: Lake, run_id: str, config: RunConfig,
                   progress: Callable[[int, int], object] = lambda done, total: None,
                   ) -> list[Opened | DecidedGroup]:
    """What the group stage published for the run (opened groups and decisions, with the
    same order keys), re-derived from the archive under `config`.

    Each events partition is folded in offset order as the group stage folds it after a
    restart (`fold_partition`); a group complete in the archive is decided at its
    completing event, any other at first event + `group_timeout_s` (the archive holds no
    event the group stage refused after a timeout). Groups never started are left out:
    the processor dead-letters them. `progress(done, total)` counts the events decided.
    """
    rows = read_archive(lake, (pc.field("run_id") == run_id) & (pc.field("type") != "run_started"))
    if not rows:
        raise RolloutlakeError(f"run {run_id} has no events in {lake.root}/events")
    items: list[Opened | DecidedGroup] = []
    done = 0
    for (_topic, partition), grouped in itertools.groupby(rows, lambda r: (r.topic, r.partition)):
        archived = list(grouped)
        events_of = Counter(r.group_index for r in archived)
        for folded in fold_partition(archived, lambda _run, _group: False).values():
            done += events_of.pop(folded.builder.group.group_index, 0)
            progress(done, len(rows))
            items.extend(group_items(folded, partition, config))
        done += sum(events_of.values())  # events of no group the fold kept
        progress(done, len(rows))
    return items


def group_items(folded: FoldedGroup, partition: int, config: RunConfig,
                ) -> list[Opened | DecidedGroup]:
    """What the group stage published for one group folded from events partition
    `partition`: its opened notice and its decision under `config`; nothing for a group
    never started (the processor dead-letters it)."""
    if folded.started is None:
        return []
    group = folded.builder.group
    started_us, started_offset, step = folded.started
    opened = Opened(group.run_id, group.group_index, step, started_us, partition,
                    started_offset)
    if folded.completed is not None:
        at_us, offset = folded.completed
    else:
        at_us, offset = folded.first_us + timeout_micros(config.group_timeout_s), -1
    decided = decide(group, config, at_us=at_us, source={"partition": partition, "offset": offset},
                     decided_at=at_us / 1e6, timed_out=folded.completed is None)
    return [opened, decided.group]


def batch_items(run_id: str, config: RunConfig, items: Iterable[Opened | DecidedGroup],
                applied: Callable[[], object] = lambda: None) -> list[Effects]:
    """Every item of the run applied to one `RunBatcher` in `OrderKey` order, as the batch
    stage's `DecisionMerge` releases them, then the flush; `applied()` after each item."""
    batcher = RunBatcher(run_id, config)
    merge = DecisionMerge(partitions=0)
    for item in items:
        merge.add(item.order_key(), item)
    effects = []
    for _key, item in merge.drain():
        effects.append(batcher.apply(item))
        applied()
    effects.append(batcher.flush())
    return effects


@dataclass(frozen=True)
class Replayed:
    effects: list[Effects]
    events: int  # archived events of the run read, run_started aside
    seconds: float

    @property
    def groups(self) -> int:
        return sum(len(e.groups) for e in self.effects)


class _Rate(ProgressColumn):
    """The task's speed in its own unit (`add_task(..., unit=...)`)."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0:,.0f} {task.fields['unit']}/s",
                    style="progress.data.speed")


def replay_run(lake: Lake, run_id: str, config: RunConfig) -> Replayed:
    """Decide and batch every archived group of the run under `config`, applied in
    `OrderKey` order as the batch stage applies them; a progress bar on stderr while it
    runs."""
    started = time.monotonic()
    console = Console(stderr=True)
    # Not on a terminal (a pipe, a log file) no bar is drawn at all.
    with Progress(*Progress.get_default_columns(), _Rate(), console=console,
                  transient=True, disable=not console.is_terminal) as progress:
        deciding = progress.add_task(f"replaying {run_id}: deciding groups", total=None,
                                     unit="events")
        events = 0

        def decided(done: int, total: int) -> None:
            nonlocal events
            events = total
            progress.update(deciding, completed=done, total=total)
        items = archived_items(lake, run_id, config, decided)
        batching = progress.add_task(f"replaying {run_id}: batching", total=len(items),
                                     unit="decisions")
        effects = batch_items(run_id, config, items, lambda: progress.advance(batching))
    return Replayed(effects, events, time.monotonic() - started)


def derived_tables(run_id: str, effects: list[Effects]) -> dict[str, pa.Table]:
    """The run's re-derived rows by table (tables without rows left out). Their
    `steps.batch_version` is -1: the `training_batches` version is known once written."""
    merged = Effects()
    for e in effects:
        merged.extend(e)
    tables = {}
    if merged.groups:
        tables["groups"] = groups_table(merged.groups)
    if merged.samples:
        tables["samples"] = pa.concat_tables(merged.samples)
    if merged.sealed:
        tables["training_batches"] = pa.concat_tables([s.rows for s in merged.sealed])
        tables["steps"] = pa.Table.from_pylist(
            [steps_row(run_id, s, UNWRITTEN_VERSION) for s in merged.sealed], schema=STEPS.schema)
    metrics = [row for step, m in merged.closed for row in metric_rows(run_id, step, m)]
    if metrics:
        tables["step_metrics"] = pa.Table.from_pylist(metrics, schema=STEP_METRICS.schema)
    return tables


UNWRITTEN_VERSION = -1  # `steps.batch_version` until `training_batches` is written


def write_effects(out: Lake, run_id: str, effects: list[Effects]) -> None:
    tables = derived_tables(run_id, effects)
    steps = tables.pop("steps", None)
    for name, rows in tables.items():
        version = out.append(name, rows)
        if name == "training_batches" and steps is not None:
            # Without marks, append skips only an empty table, and a sealed step has rows.
            assert version is not None
            out.append("steps", with_batch_version(steps, version))


def with_batch_version(steps: pa.Table, version: int) -> pa.Table:
    column = steps.schema.get_field_index("batch_version")
    return steps.set_column(column, steps.schema.field(column),
                            pa.array([version] * steps.num_rows, pa.int64()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True, help="lake holding the run's events archive")
    parser.add_argument("--run", required=True, type=run_id_argument, help="run id")
    parser.add_argument("--config", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="what-if settings over the run's config: filter, "
                             "rollout_batch_size, over_sampling_batch_size, "
                             "advantage_estimator, std_normalization, reward_key, "
                             "max_staleness, arg.NAME (docs/replay-audit.md)")
    parser.add_argument("--config-file", type=Path, metavar="FILE",
                        help="JSON file with the run's config (default: the archived run_started)")
    parser.add_argument("--into", metavar="LAKE",
                        help="lake to write the re-derived tables to, outside the original "
                             "(default: a temporary one, removed when replay ends)")
    parser.add_argument("--json", action="store_true",
                        help="print the diff against the original as JSON (the rest to stderr)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="write the metric curves, original vs what-if, to a PNG")
    parser.add_argument("--engine", choices=("local", "spark"), default="local",
                        help="local: replay in this process; spark: with Spark over the "
                             "lake (groups decided in parallel, runs batched apart), "
                             "written with delta-spark (docs/spark.md)")
    parser.add_argument("--spark-master", default="local[*]", metavar="URL",
                        help="Spark master of --engine spark (default local[*])")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every re-derived step hash, group decision and "
                             "step metric equals the original")


def _config(args: argparse.Namespace, source: Lake, what_if: WhatIf) -> RunConfig:
    if args.config_file is None:
        config = archived_config(source, args.run)
    else:
        try:
            body: dict[str, Any] = orjson.loads(args.config_file.read_bytes())
            config = RunConfig.model_validate(body)
        except (OSError, orjson.JSONDecodeError) as err:
            raise ConfigError(f"--config-file {args.config_file}: {err}") from None
        except ValueError as err:
            raise ConfigError(f"--config-file {args.config_file}: {err}".splitlines()[0]) from None
    return what_if.apply(config)


def _location(lake: Lake) -> str:
    """The lake's root as a comparable prefix: resolved when local, the URI otherwise."""
    if lake.is_local:
        return str(Path(lake.root.removeprefix("file://")).resolve()) + "/"
    return lake.root + "/"


def _target(source: Lake, into: str, run_id: str) -> Lake:
    """The `--into` lake; ConfigError if it is the original lake, lies inside it, or already
    holds the run (its rows would be appended twice)."""
    out = Lake(into)
    if _location(out) == _location(source):
        raise ConfigError(f"--into {into} is the original lake; a replay never writes into it, "
                          "pass another folder")
    if _location(out).startswith(_location(source)):
        raise ConfigError(f"--into {into} lies inside the original lake {source.root}; a "
                          "replay never writes into it, pass a folder outside it")
    if out.exists("groups") and out.read("groups", filter=pc.field("run_id") == run_id,
                                          columns=["group_index"]).num_rows:
        raise ConfigError(f"--into {into} already holds run {run_id}; pass an empty lake")
    return out


def run(args: argparse.Namespace) -> int:
    source = Lake(args.lake)
    if not source.exists("events"):
        raise RolloutlakeError(f"no events table under {args.lake}")
    what_if = parse_what_if(args.config)
    config = _config(args, source, what_if)
    load_filter(config.resolved_filter_path)  # fail before any work on a bad path
    if args.into is not None:
        return _replay_into(source, _target(source, args.into, args.run), args, what_if,
                            config, kept=True)
    # Without --into the derived tables are only for the report and the check: removed on
    # every exit, an error or Ctrl-C included.
    with tempfile.TemporaryDirectory(prefix=f"replay-{args.run}-") as out_root:
        return _replay_into(source, Lake(out_root), args, what_if, config, kept=False)


def _replay_into(source: Lake, out: Lake, args: argparse.Namespace, what_if: WhatIf,
                 config: RunConfig, *, kept: bool) -> int:
    if args.engine == "spark":
        from ingest.commands.spark_replay import spark_replay

        done = spark_replay(source, out, args.run, config, master=args.spark_master)
        groups, events, seconds = done.groups, done.events, done.seconds
    else:
        replayed = replay_run(source, args.run, config)
        write_effects(out, args.run, replayed.effects)
        groups, events, seconds = replayed.groups, replayed.events, replayed.seconds
    diff = compare_lakes(source, out, args.run)
    # stdout holds only the JSON then; lines are not wrapped, so a pipe or log gets them whole
    console = Console(stderr=args.json, soft_wrap=True)
    if args.plot is not None:
        try:
            plot_diff(diff, args.plot, title=f"run {args.run}: original vs what-if "
                                             f"({what_if.describe()})")
        except OSError as err:
            raise RolloutlakeError(f"--plot {args.plot}: {err.strerror}") from None
    if args.json:
        sys.stdout.buffer.write(diff.to_json() + b"\n")
    else:
        if what_if.overrides:
            console.print(f"what-if: {what_if.describe()}")
        changed = what_if.overrides or args.config_file is not None
        print_diff(diff, console, what="what-if" if changed else "replay")
    where = f"into {out.root}" if kept else "(pass --into LAKE to keep the tables)"
    rate = events / seconds if seconds else 0.0
    engine = "; Spark, its session start aside" if args.engine == "spark" else ""
    console.print(f"re-derived {groups} groups from {events} events in {seconds:.1f} s "
                  f"({rate:,.0f} events/s{engine}) {where}")
    if not args.check:
        return 0
    differences = diff.differences()
    if not differences:
        console.print(f"check: every step hash, decision and metric equals the original "
                      f"({diff.steps_compared} steps)")
        return 0
    for what, keys in differences.items():
        more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
        shown = ", ".join(map(str, keys[:10])) + more
        console.print(f"check: {what} differ from the original: {shown}")
    return 1

