"""`rolloutlake watch`: a live terminal table of a run's sealed steps, for remote shells.

Tails `steps` and `step_metrics` (ingest.io.tail) and redraws the latest steps with the
numbers an RL engineer checks first: kept vs dropped groups, the three reward readings,
the completion bias and the over-sampling cost.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ingest.io.lake import Lake
from ingest.io.tail import SealedStep, StepTail
from schemas.errors import ConfigError
from schemas.events import run_id_argument

DROP_PREFIX = "rollout/dynamic_filter/drop_"
# (header, metric key, format); a missing key shows as "-".
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("kept", "rollout/groups_kept", "{:.0f}"),
    ("cancelled", "rollout/groups_cancelled", "{:.0f}"),
    ("issued", "rollout/prompts_issued", "{:.0f}"),
    ("raw_reward", "rollout/raw_reward", "{:.3f}"),
    ("unfiltered", "rollout/raw_reward_unfiltered", "{:.3f}"),
    ("episode", "rollout/episode_raw_reward", "{:.3f}"),
    ("compl. bias", "rollout/completion_bias", "{:.2f}"),
    ("resp len", "rollout/response_len/mean", "{:.0f}"),
    ("rollout s", "perf/rollout_time", "{:.1f}"),
)


def _cell(metrics: dict[str, float], key: str, fmt: str) -> str:
    return fmt.format(metrics[key]) if key in metrics else "-"


def render(run_id: str, steps: list[SealedStep]) -> Table:
    """The table for the latest `steps` (oldest first)."""
    table = Table(title=f"run {run_id}: {len(steps)} latest sealed steps", expand=False)
    table.add_column("step", justify="right", style="bold")
    table.add_column("sealed", justify="right")
    table.add_column("dropped (by reason)", justify="left")
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="right")
    for s in steps:
        drops = {k[len(DROP_PREFIX):]: v for k, v in s.metrics.items() if k.startswith(DROP_PREFIX)}
        dropped = " ".join(f"{r}={v:.0f}" for r, v in sorted(drops.items())) or "-"
        table.add_row(
            str(s.step), s.sealed_at.strftime("%H:%M:%S"), dropped,
            *(_cell(s.metrics, key, fmt) for _, key, fmt in COLUMNS),
        )
    return table


def watch(lake: Lake, run_id: str, *, rows: int, poll_s: float, console: Console,
          once: bool = False) -> None:
    tail = StepTail(lake, run_id)
    latest: deque[SealedStep] = deque(maxlen=rows)
    latest.extend(tail.poll())
    if once:
        console.print(render(run_id, list(latest)))
        return
    with Live(render(run_id, list(latest)), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(poll_s)
            new = tail.poll()
            if new:
                latest.extend(new)
                live.update(render(run_id, list(latest)), refresh=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True, help="Delta lake root (folder or s3:// URI)")
    parser.add_argument("--run", required=True, type=run_id_argument, dest="run_id", help="run id to watch")
    parser.add_argument("--rows", type=int, default=20, help="latest steps shown")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between lake checks")
    parser.add_argument("--once", action="store_true", help="print the table once and exit")


def run(args: argparse.Namespace) -> int:
    if args.rows < 1 or args.poll <= 0:
        raise ConfigError("--rows must be >= 1 and --poll > 0")
    lake = Lake(args.lake)
    if not lake.exists("steps"):
        raise ConfigError(f"--lake: no steps table under {args.lake}; is it the lake root?")
    watch(lake, args.run_id, rows=args.rows, poll_s=args.poll, console=Console(), once=args.once)
    return 0
