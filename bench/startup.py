"""Processor start to its first committed batch, side by side, with the phases in between.

    .venv/bin/python bench/startup.py [--repeat 5] [--engine tansu]
        [--variant LABEL=TREE[:FLAGS]] ...

Each variant runs `python -m ingest.cli process --until-idle` from the source tree TREE
(`.` for this checkout; another tree, e.g. an older commit exported with `git archive`,
measures before and after in one run) with extra FLAGS (comma-separated, as in
`--session-timeout-ms,6000`). Every run gets its own topics (pre-loaded with the same
one-group run: one group of two short samples, one step), lake and consumer group, so each
is a first start; a run ends (kill -9) at its first `steps` row. The variants run interleaved, `--repeat` rounds, on the same embedded
broker. Per variant: best and median of

  * joined: the processor spawned to the log line of each stage joining its group;
  * steps row: to the step's row in `steps` (the first committed batch; the lake is
    watched by listing the table's log every 5 ms and reading it only when that changed,
    so the watching takes little of the two cores from the processor),

and each variant's best and median against the first variant's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import joined_at, preload, stream
from scratch import scratch_folder

from ingest.commands.simulate import SimulationConfig
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.io.tail import TableTail

TINY = SimulationConfig(run_id="startup", steps=1, rollout_batch_size=1, n_samples=2,
                        response_len_mean=8, prompt_len=4, mode="open", filter_path=None,
                        surplus_per_step=0, abort_rate=0, missing_reward_rate=0, seed=1)
RUN_LIMIT_S = 120.0
PHASES = ("groups joined", "batches joined", "steps row")


def parse_variant(text: str) -> tuple[str, Path, list[str]]:
    label, sep, rest = text.partition("=")
    tree, _, flags = rest.partition(":")
    if not sep or not label or not tree:
        raise SystemExit(f"--variant {text!r}: expected LABEL=TREE[:FLAGS]")
    path = Path(tree).resolve()
    if not (path / "ingest" / "cli.py").is_file():
        raise SystemExit(f"--variant {text!r}: {path} holds no ingest/cli.py")
    return label, path, [f for f in flags.split(",") if f]


def run_once(kafka: KafkaSettings, tree: Path, flags: list[str], lake: str,
             group: str) -> dict[str, float]:
    """Seconds from spawning `rolloutlake process` to each phase."""
    command = [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
               kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
               "--consumer-group", group, "--event-partitions", "1",
               "--decision-partitions", "1", *flags]
    steps = TableTail(Lake(lake), "steps", TINY.run_id, ["step"])
    steps_log = Path(Lake(lake).uri("steps")) / "_delta_log"
    log_seen: list[str] = []
    sealed_at = None
    with tempfile.TemporaryFile("w+") as log:
        wall, start = time.time(), time.perf_counter()
        # -m puts the working directory first on sys.path: the tree's own packages load.
        processor = subprocess.Popen(command, cwd=tree, stderr=log, stdout=subprocess.DEVNULL)
        deadline = start + RUN_LIMIT_S
        while sealed_at is None and processor.poll() is None and time.perf_counter() < deadline:
            listed = sorted(os.listdir(steps_log)) if steps_log.is_dir() else []
            if listed != log_seen:
                log_seen = listed
                rows = steps.poll()
                if rows is not None and rows.num_rows:
                    sealed_at = time.perf_counter()
            time.sleep(0.005)
        # Killed, not stopped: its batch stage dies with it (and a stop would be timed too).
        processor.kill()
        processor.wait()
        log.seek(0)
        text = log.read()
    if sealed_at is None:
        raise SystemExit(f"{tree}: no steps row within {RUN_LIMIT_S:g} s:\n{text[-2000:]}")
    seconds = {name: at - wall for name, at in joined_at(text).items()}
    seconds["steps row"] = sealed_at - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[],
                        help="LABEL=TREE[:FLAGS]; default: this checkout as it is")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--engine", default="tansu", choices=("tansu", "kafka"))
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["now=."]]
    groups = stream(TINY)
    folder = scratch_folder("rolloutlake-startup-")
    times: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
    load_before = os.getloadavg()[0]
    with EmbeddedBroker(free_port(), engine=args.engine) as broker:
        for rep in range(args.repeat):
            for index, (label, tree, flags) in enumerate(variants):
                name = f"r{rep}v{index}"
                kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers,
                                      topic_prefix=f"{name}.", event_partitions=1,
                                      decision_partitions=1)
                preload(kafka, TINY.run_id, TINY.run_config(), groups)
                times[label].append(run_once(kafka, tree, flags, str(folder / name),
                                             f"startup-{os.getpid()}-{name}"))
    print(f"processor spawned -> phase, seconds, {args.repeat} interleaved runs per variant "
          f"({broker.name}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
          "after)")
    print(f"{'best / median':<14}" + "".join(f"{p:>18}" for p in PHASES))
    first = variants[0][0]
    for label, _, _ in variants:
        cells = []
        for phase in PHASES:
            values = [run[phase] for run in times[label] if phase in run]
            cells.append(f"{min(values):.2f} / {statistics.median(values):.2f}" if values
                         else "n/a")
        print(f"{label:<14}" + "".join(f"{c:>18}" for c in cells))
    for label, _, _ in variants[1:]:
        steps = {v: [run["steps row"] for run in times[v]] for v in (first, label)}
        print(f"steps row, {first} / {label}: best {min(steps[first]) / min(steps[label]):.2f}x, "
              f"median {statistics.median(steps[first]) / statistics.median(steps[label]):.2f}x")
    for label, _, _ in variants:
        print(f"{label} runs, steps row (groups joined, batches joined): " + ", ".join(
            f"{run['steps row']:.2f} ({run.get('groups joined', 0):.2f}, "
            f"{run.get('batches joined', 0):.2f})" for run in times[label]))


if __name__ == "__main__":
    main()
