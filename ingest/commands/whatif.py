"""`rolloutlake whatif`: the diff of a run re-derived into another lake against the original.

The what-if lake comes from `rolloutlake replay --lake L --run R --out L2` under other
settings; this command compares L2 with L (`ingest.io.whatif_diff`) and prints the groups
whose decision changed and why, the steps whose content changed and the metric deltas, as
a table or `--json`, and with `--plot FILE` a PNG of the metric curves side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from ingest.io.lake import Lake
from ingest.io.whatif_diff import compare_lakes, plot_diff, print_diff
from schemas.errors import RolloutlakeError
from schemas.events import run_id_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", required=True, help="the original lake")
    parser.add_argument("--what-if", required=True, help="the lake the run was replayed into")
    parser.add_argument("--run", required=True, type=run_id_argument)
    parser.add_argument("--json", action="store_true", help="print the diff as JSON")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="write the metric curves, original (blue) vs what-if (orange)")


def run(args: argparse.Namespace) -> int:
    original, what_if = Lake(args.lake), Lake(args.what_if)
    if original.root == what_if.root:
        raise RolloutlakeError("--what-if is the original lake; replay the run into another one")
    diff = compare_lakes(original, what_if, args.run)
    if args.plot is not None:
        try:
            plot_diff(diff, args.plot)
        except OSError as err:
            raise RolloutlakeError(f"--plot {args.plot}: {err.strerror}") from None
    if args.json:
        sys.stdout.buffer.write(diff.to_json() + b"\n")
    else:
        print_diff(diff, Console())
    return 0
