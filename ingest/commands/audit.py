"""`rolloutlake audit`: the lineage of a group, a batch row or a trainer step, printed.

The queries are `ingest.io.lineage` (the gateway serves the same at
`GET /v1/runs/{run_id}/groups/{group_index}`); this module only picks one and prints it,
as tables or as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from ingest.io.lake import Lake
from ingest.io.lineage import (
    GroupLineage,
    TrainerStepLineage,
    group_lineage,
    parse_as_of,
    row_lineage,
    trainer_step_lineage,
)
from schemas.errors import ConfigError
from schemas.events import run_id_argument
from schemas.token_arrays import TOKEN_IDS, decode_token_array


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True)
    parser.add_argument("--run", required=True, type=run_id_argument)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--group", type=int, help="group_index: the group's lineage")
    which.add_argument("--step", type=int,
                       help="with --position: the lineage of one training_batches row")
    which.add_argument("--trainer-step", type=int,
                       help="a trained step: the groups and events it consumed")
    parser.add_argument("--position", type=int, help="row position within --step")
    parser.add_argument("--as-of", metavar="VERSION|TIMESTAMP",
                        help="read the lake as it was: a training_batches version (as of its "
                             "commit) or an ISO 8601 timestamp")
    parser.add_argument("--json", action="store_true", help="print the lineage as JSON")


def run(args: argparse.Namespace) -> int:
    if (args.step is None) != (args.position is None):
        raise ConfigError("--step and --position go together (one training_batches row)")
    snap = parse_as_of(Lake(args.lake), args.as_of)
    if args.trainer_step is not None:
        found: Any = trainer_step_lineage(snap, args.run, args.trainer_step)
    elif args.step is not None:
        found = row_lineage(snap, args.run, args.step, args.position)
    else:
        found = group_lineage(snap, args.run, args.group)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(found.model_dump(), option=orjson.OPT_INDENT_2
                                             | orjson.OPT_NON_STR_KEYS) + b"\n")
        return 0
    console = Console()
    if snap.where:
        console.print(f"lake {args.lake}{snap.where}")
    if isinstance(found, TrainerStepLineage):
        _print_trainer_step(console, found)
    elif isinstance(found, GroupLineage):
        _print_group(console, found)
    else:
        row = found.row
        console.print(f"training row: step {row['step']} position {row['position']}, group "
                      f"{row['group_index']} rollout {row['rollout_id']} fragment "
                      f"{row['fragment_index']}, reward {row['reward']}, advantage "
                      f"{row['advantage']:.4f}")
        _print_group(console, found.group)
    return 0


def _summary(payload: dict[str, Any]) -> str:
    kind = payload["type"]
    if kind == "group_started":
        return f"step {payload['step']}, n_samples {payload['n_samples']}"
    parts = [f"rollout {payload.get('rollout_id')}"]
    if "response_tokens" in payload:
        # a JSON list or a compact array: both decode to the same tokens
        tokens = decode_token_array(TOKEN_IDS, payload["response_tokens"])
        parts.append(f"{len(tokens)} tokens")
    for key in ("fragment_index", "status", "reward", "reason"):
        if key in payload:
            parts.append(f"{key} {payload[key]}")
    return ", ".join(parts)


def _trained(t: dict[str, Any]) -> str:
    return (f"trained step {t['step']} at batch version {t['batch_version']}: loss "
            f"{t['loss']:.6g}, produced weights version {t['update']}, at {t['trained_at']}")


def _print_group(console: Console, g: GroupLineage) -> None:
    events = Table(title=f"run {g.run_id}, group {g.group_index}: events in order")
    for column in ("topic:partition@offset", "ingested_at", "type", "event_id", "what"):
        events.add_column(column, overflow="fold")
    for e in g.events:
        events.add_row(f"{e['topic']}:{e['partition']}@{e['offset']}",
                       e["ingested_at"].isoformat(timespec="milliseconds"), e["type"],
                       e["event_id"], _summary(e["payload"]))
    console.print(events)
    for letter in g.dead_letters:
        console.print(f"dead letter {letter['topic']}:{letter['partition']}@{letter['offset']} "
                      f"at {letter['at'].isoformat()}: {letter['error']}")
    d = g.decision
    console.print("decision: " + ("undecided" if d is None else
                  f"{d['decision']} (reason {d['reason']}), step {d['step']}, "
                  f"batch step {d['batch_step']}, mean reward {d['mean_reward']}"))
    for row in g.training_rows:
        console.print(f"  fed step {row['step']} position {row['position']}: rollout "
                      f"{row['rollout_id']} fragment {row['fragment_index']}, reward "
                      f"{row['reward']}, advantage {row['advantage']:.4f}")
    for s in g.steps:
        console.print(f"sealed step {s['step']} at batch version {s['batch_version']}, "
                      f"content {s['content_sha256'][:12]}")
    for t in g.trainer_steps:
        console.print(_trained(t))
    if g.steps and not g.trainer_steps:
        console.print("not trained on (no trainer_steps row for its steps)")


def _print_trainer_step(console: Console, t: TrainerStepLineage) -> None:
    console.print(_trained(t.trainer_step))
    console.print("content: " + ("the rows at that batch version hash to what the trainer "
                                 "verified" if t.content_verified else
                                 "the rows at that batch version do NOT hash to what the "
                                 "trainer verified"))
    table = Table(title=f"run {t.run_id}, trainer step {t.step}: groups consumed")
    for column in ("group", "rows", "decision", "events", "first event", "last event"):
        table.add_column(column)
    for g in t.groups:
        d = g.decision
        where = [f"{e['topic']}:{e['partition']}@{e['offset']}" for e in g.events]
        table.add_row(str(g.group_index), f"{g.positions[0]}..{g.positions[-1]}",
                      "undecided" if d is None else f"{d['decision']} ({d['reason']})",
                      str(len(g.events)), where[0] if where else "", where[-1] if where else "")
    console.print(table)
