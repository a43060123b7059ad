"""`rolloutlake wandb-sync`: log a run's sealed-step metrics to Weights & Biases.

Runs the processor's W&B sink (`ingest.processor.wandb_sink`, which says how a restart
resumes) for one run, once or with `--follow` until stopped.
"""

from __future__ import annotations

import argparse
import signal
import threading

from ingest.io.lake import Lake
from ingest.processor.wandb_sink import DEFAULT_PROJECT, sync_run
from schemas.errors import ConfigError
from schemas.events import run_id_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True, help="Delta lake root (folder or s3:// URI)")
    parser.add_argument("--run", required=True, type=run_id_argument, dest="run_id", help="run id to sync")
    parser.add_argument("--project", default=DEFAULT_PROJECT, help="W&B project")
    parser.add_argument("--entity", default=None, help="W&B entity (team or user)")
    parser.add_argument("--wandb-id", default=None, help="W&B run id (default: the run id)")
    parser.add_argument("--wandb-dir", default=None, help="where W&B writes run files")
    parser.add_argument("--mode", choices=("offline", "online"), default=None,
                        help="W&B mode (default: $WANDB_MODE, else offline)")
    parser.add_argument("--follow", action="store_true", help="keep syncing steps as they seal")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between lake checks")


def run(args: argparse.Namespace) -> int:
    if args.poll <= 0:
        raise ConfigError("--poll must be > 0 seconds")
    lake = Lake(args.lake)
    if not args.follow and not lake.exists("steps"):
        raise ConfigError(f"--lake: no steps table under {args.lake}; is it the lake root?")
    stop = threading.Event()
    # SIGTERM (a service manager stopping --follow) ends the loop like Ctrl-C, so W&B's
    # finish() flushes what was logged.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    n = sync_run(
        lake, args.run_id, project=args.project, entity=args.entity,
        wandb_id=args.wandb_id, wandb_dir=args.wandb_dir, mode=args.mode,
        follow=args.follow, poll_s=args.poll, stop=stop,
    )
    print(f"logged {n} steps of run {args.run_id} to W&B")
    return 0
