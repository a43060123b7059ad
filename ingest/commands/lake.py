"""`rolloutlake lake optimize|vacuum`: compaction and vacuum that keep runs replayable.

`optimize` rewrites small files into large ones; `vacuum` deletes files no version newer
than `--retention-hours` references, except those that runs under retention still read
(`ingest.io.retention` defines both). One line per table says what was done, and what was
refused.
"""

from __future__ import annotations

import argparse

from ingest.io.lake import Lake
from ingest.io.retention import compact, retained_runs, vacuum
from schemas.events import run_id_argument

DEFAULT_RETENTION_HOURS = 168  # Delta's default deletedFileRetentionDuration, one week


def _hours(text: str) -> int:
    try:
        hours = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of hours") from None
    if hours < 0:
        raise argparse.ArgumentTypeError(f"{hours} is negative")
    return hours


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    optimize = actions.add_parser("optimize", help="compact small files of every table")
    clean = actions.add_parser("vacuum", help="delete files older versions no longer need, "
                                              "keeping what runs under retention read")
    for sub in (optimize, clean):
        sub.add_argument("--lake", required=True)
        sub.add_argument("--dry-run", action="store_true", help="say what would be done")
    clean.add_argument("--retention-hours", type=_hours, default=DEFAULT_RETENTION_HOURS,
                       help="delete only files removed from the table more than this long "
                            "ago; a run whose newest event or step is younger is under "
                            f"retention (default {DEFAULT_RETENTION_HOURS})")
    clean.add_argument("--keep-run", action="append", default=[], type=run_id_argument,
                       metavar="RUN", help="keep this run under retention whatever its age "
                                           "(repeatable)")


def run(args: argparse.Namespace) -> int:
    lake = Lake(args.lake)
    if args.action == "optimize":
        for result in compact(lake, dry_run=args.dry_run):
            print(result.line(dry_run=args.dry_run))
        return 0
    runs = retained_runs(lake, hours=args.retention_hours, keep=frozenset(args.keep_run))
    print("runs under retention: " + (", ".join(f"{r.run_id} ({r.why})" for r in runs.values())
                                      or "none"))
    for vacuumed in vacuum(lake, hours=args.retention_hours, runs=runs, dry_run=args.dry_run):
        print(vacuumed.line(dry_run=args.dry_run))
    return 0
