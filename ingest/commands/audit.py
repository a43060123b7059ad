"""Audit one group: its archived events in order, its decision, its samples, its batch rows.

`group_audit` is the one implementation; `rolloutlake audit` prints it and the gateway
serves it at `GET /v1/runs/{run_id}/groups/{group_index}`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from ingest.io.lake import Lake
from schemas.errors import NotFoundError
from schemas.events import run_id_argument
from schemas.tables import TRAINING_BATCHES
from schemas.token_arrays import TOKEN_FIELDS, TOKEN_IDS, decode_token_array


class GroupNotFound(NotFoundError):
    """Nothing is archived or decided for the group."""


@dataclass
class GroupAuditData:
    events: list[dict[str, Any]]  # archived events in (partition, offset) order, payload decoded
    decision: dict[str, Any] | None  # the `groups` row; None while undecided
    samples: list[dict[str, Any]]
    training_rows: list[dict[str, Any]]  # without token arrays


def group_audit(lake: Lake, run_id: str, group_index: int) -> GroupAuditData:
    in_group = (pc.field("run_id") == run_id) & (pc.field("group_index") == group_index)
    events = lake.read("events", filter=in_group).sort_by([("partition", "ascending"),
                                                           ("offset", "ascending")])
    decision = lake.read("groups", filter=in_group).to_pylist()
    samples = lake.read("samples", filter=in_group).sort_by(
        [("rollout_id", "ascending"), ("fragment_index", "ascending")])
    columns = [c for c in TRAINING_BATCHES.schema.names if c not in TOKEN_FIELDS]
    training = lake.read("training_batches", filter=in_group, columns=columns).sort_by(
        [("step", "ascending"), ("position", "ascending")])
    if not events.num_rows and not decision and not samples.num_rows:
        raise GroupNotFound(f"group {group_index} of run {run_id!r} has no archived events "
                            "and no decision (yet)")
    return GroupAuditData(
        events=[{**e, "payload": orjson.loads(e["payload"])} for e in events.to_pylist()],
        decision=decision[0] if decision else None,
        samples=samples.to_pylist(),
        training_rows=training.to_pylist(),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True)
    parser.add_argument("--run", required=True, type=run_id_argument)
    parser.add_argument("--group", type=int, required=True, help="group_index")


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


def run(args: argparse.Namespace) -> int:
    audit = group_audit(Lake(args.lake), args.run, args.group)
    console = Console()
    events = Table(title=f"run {args.run}, group {args.group}: events in order")
    for column in ("partition", "offset", "type", "event_id", "what"):
        events.add_column(column)
    for e in audit.events:
        events.add_row(str(e["partition"]), str(e["offset"]), e["type"], e["event_id"],
                       _summary(e["payload"]))
    console.print(events)
    d = audit.decision
    console.print("decision: " + ("undecided" if d is None else
                  f"{d['decision']} (reason {d['reason']}), step {d['step']}, "
                  f"batch step {d['batch_step']}, mean reward {d['mean_reward']}"))
    for row in audit.training_rows:
        console.print(f"  fed step {row['step']} position {row['position']}: rollout "
                      f"{row['rollout_id']} fragment {row['fragment_index']}, reward "
                      f"{row['reward']}, advantage {row['advantage']:.4f}")
    return 0
