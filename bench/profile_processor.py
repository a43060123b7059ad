"""Profile both processor stages (cProfile) over a pre-loaded stream, one form at a time.

    .venv/bin/python bench/profile_processor.py --form compact [--steps 2] [--out DIR]

The stream of bench/pipeline.py goes into a fresh embedded broker first (JSON-list token
arrays, or the SDK's compact form); then the group stage and the batch stage run as two
processes (`Processor` with `stages="groups"` / `"batches"`, until idle), as the split
processor runs them, each with cProfile enabled in its stage's thread. Prints each stage's
cost per step of its loop (cumulative seconds of the functions below) and its top
functions by own time; the .prof files stay in DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import preload, response_tokens, stream

from ingest.commands.simulate import SimulationConfig
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor

# (stage, label, function of ingest/ whose cumulative time is the label's cost)
STAGE_STEPS = {
    "groups": [
        ("Kafka fetch + record decode", "kafka/consumer/group.py", "poll"),
        ("event decode + validation", "schemas/events.py", "decode_event"),
        ("group assembly", "ingest/core/assembly.py", "apply"),
        ("filter chain", "ingest/core/filters.py", "apply_filter_chain"),
        ("fragments -> Arrow", "ingest/core/decided.py", "fragments_table"),
        ("events archive -> Arrow", "ingest/processor/group_stage.py", "table"),
        ("Delta appends (Parquet + commit)", "ingest/io/lake.py", "append"),
        ("decisions -> Arrow IPC + produce", "ingest/processor/group_stage.py", "_publish"),
    ],
    "batches": [
        ("Kafka fetch + record decode", "kafka/consumer/group.py", "poll"),
        ("decision IPC decode", "ingest/processor/decisions.py", "decode_fragments"),
        ("batcher (rows, advantages, hash)", "ingest/core/batching.py", "offer"),
        ("content_sha256", "schemas/tables.py", "content_sha256"),
        ("Delta appends (Parquet + commit)", "ingest/io/lake.py", "append"),
    ],
}


def _cumulative(stats: pstats.Stats, path: str, name: str) -> float:
    return sum(entry[3] for (file, _line, func), entry in stats.stats.items()
               if file.endswith(path) and func == name)


def profile_stage(stage: str, bootstrap_servers: str, prefix: str, lake: str, out: Path) -> None:
    """Run one stage until idle with the profiler on in its thread; write `out`."""
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=prefix,
                          event_partitions=1, decision_partitions=1)
    processor = Processor(ProcessorConfig(kafka=kafka, lake=lake, until_idle_s=3.0,
                                          stages=stage))
    profiler = cProfile.Profile()
    loop = processor._loop

    def profiled(target) -> None:
        profiler.enable()
        try:
            loop(target)
        finally:
            profiler.disable()

    processor._loop = profiled  # the stage thread's target
    processor.run()
    profiler.dump_stats(str(out))


def report(stage: str, prof: Path, tokens: int) -> None:
    stats = pstats.Stats(str(prof))
    total = stats.total_tt
    print(f"\n{stage} stage: {total:.2f} s in its thread's profile ({tokens / total:,.0f} "
          "response tokens per second of it; polls that wait count too)")
    for label, path, name in STAGE_STEPS[stage]:
        seconds = _cumulative(stats, path, name)
        print(f"  {label:<36}{seconds:>8.2f} s {100 * seconds / total:>5.1f}%")
    print("  top functions by own time:")
    stats.sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=["lists", "compact"], default="compact")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--response-len", type=float, default=2048.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the .prof files")
    parser.add_argument("--child", nargs=4, metavar=("STAGE", "SERVERS", "PREFIX", "LAKE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        stage, servers, prefix, lake = args.child
        profile_stage(stage, servers, prefix, lake, args.out / f"{stage}.prof")
        return
    sim = SimulationConfig(run_id="bench", steps=args.steps, rollout_batch_size=32, n_samples=8,
                           response_len_mean=args.response_len, prompt_len=256, mode="open",
                           duplicate_rate=0.0, seed=3)
    groups = stream(sim.model_copy(update={"compact_arrays": args.form == "compact"}))
    tokens, _ = response_tokens(groups)
    out = args.out or Path(tempfile.mkdtemp(prefix="rolloutlake-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(free_port()) as broker:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="prof.",
                              event_partitions=1, decision_partitions=1)
        preload(kafka, sim.run_id, sim.run_config(), groups)
        procs = []
        for stage in STAGE_STEPS:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--out", str(out), "--child", stage,
                 kafka.bootstrap_servers, kafka.topic_prefix, str(out / "lake")],
                stderr=(out / f"{stage}.log").open("wb")))
            time.sleep(5)  # the first one creates the tables
        for proc in procs:
            proc.wait(timeout=600)
    print(f"{args.form}: {tokens:,} response tokens; profiles in {out}")
    for stage in STAGE_STEPS:
        report(stage, out / f"{stage}.prof", tokens)


if __name__ == "__main__":
    main()
