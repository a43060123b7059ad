"""Profile both processor stages over a pre-loaded stream, one form at a time.

    .venv/bin/python bench/profile_processor.py --form compact [--steps 2] [--out DIR]
    .venv/bin/python bench/profile_processor.py --form compact --steps 8 --py-spy

The stream of bench/pipeline.py goes into a fresh embedded broker first (JSON-list token
arrays, or the SDK's compact form). Then, by default, the group stage and the batch stage
run as two processes (`Processor` with `stages="groups"` / `"batches"`, until idle), as the
split processor runs them, each with cProfile enabled in its stage's thread (and in the
group stage's archiver thread). Prints each stage's cost per step of its loop (cumulative
seconds of the functions below) and its top functions by own time; the .prof files stay in
DIR.

`--py-spy` samples `rolloutlake process` itself instead, every thread of both its processes
(the Kafka clients' network threads, the Delta commits, the imports), at 250 Hz, counting
only samples where a thread is on the CPU: prints the CPU seconds of each thread and the
functions that hold most of it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pipeline import _spawn, preload, response_tokens, stream

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
        ("dead letters and run_started commits", "ingest/io/lake.py", "append"),
        ("waiting for the archiver", "ingest/processor/group_stage.py", "_archive_written"),
    ],
    # The group stage's archiver thread: a poll's archive commit and its decisions out.
    "groups archiver": [
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
    if stage == "groups":  # its archiver thread gets a profile of its own
        [group_stage] = processor.stages
        archiver = cProfile.Profile()
        job = group_stage._archive_and_publish

        def profiled_job(*args: Any) -> None:
            archiver.enable()
            try:
                job(*args)
            finally:
                archiver.disable()

        group_stage._archive_and_publish = profiled_job  # type: ignore[method-assign]

    def profiled(target) -> None:
        profiler.enable()
        try:
            loop(target)
        finally:
            profiler.disable()

    processor._loop = profiled  # the stage thread's target
    processor.run()
    profiler.dump_stats(str(out))
    if stage == "groups":
        archiver.dump_stats(str(out.with_name("groups archiver.prof")))


def report(stage: str, prof: Path, tokens: int) -> None:
    stats = pstats.Stats(str(prof))
    total = stats.total_tt
    print(f"\n{stage}: {total:.2f} s in its thread's profile ({tokens / total:,.0f} "
          "response tokens per second of it; polls that wait count too)")
    for label, path, name in STAGE_STEPS[stage]:
        seconds = _cumulative(stats, path, name)
        print(f"  {label:<36}{seconds:>8.2f} s {100 * seconds / total:>5.1f}%")
    print("  top functions by own time:")
    stats.sort_stats("tottime").print_stats(12)


SPY_RATE_HZ = 250
PROCESS_FRAMES = re.compile(r'(?:process \d+:"([^"]*)";)+')


def spy_processor(kafka: KafkaSettings, lake: str, out: Path) -> Path:
    """`rolloutlake process --until-idle` over the pre-loaded topic under py-spy; its raw
    (collapsed) samples go to `out`."""
    processor = _spawn(kafka, lake, idle_s=2.0, stderr=(out / "process.log").open("w"))
    time.sleep(0.4)  # py-spy attaches to an interpreter that has started
    samples = out / "py-spy.txt"
    spy = subprocess.run(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(processor.pid),
         "--subprocesses", "--threads", "--nonblocking", "--rate", str(SPY_RATE_HZ),
         "--format", "raw", "--output", str(samples)],
        capture_output=True, text=True)
    processor.wait(timeout=300)
    if spy.returncode != 0 or not samples.exists():
        raise SystemExit(f"py-spy failed: {spy.stderr.strip()[-500:]}")
    return samples


def _frame_name(frame: str) -> str:
    """`function (path:line)` as `function (path)`, the path from the package on."""
    name, _, where = frame.partition(" (")
    path = where.split(":")[0]
    for root in ("site-packages/", "/main/"):
        path = path.split(root)[-1]
    return f"{name} ({path})" if where else name


def report_spy(samples: Path, top: int) -> None:
    """CPU seconds per process and thread, and per thread the functions (inclusive) that
    hold the most of it."""
    threads: Counter[tuple[str, str]] = Counter()
    inclusive: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for line in samples.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        # A child's samples start with its parent's process frame, then its own; a
        # command line can hold ";" (the spawned child's does).
        processes = PROCESS_FRAMES.match(stack)
        if processes is None:
            continue
        process = "batch stage" if "spawn_main" in processes.group(1) else "group stage"
        thread, *frames = stack[processes.end():].split(";")
        key = (process, re.sub(r"thread \(\d+\)(: )?", "", thread) or "unnamed thread")
        threads[key] += int(count)
        for name in {_frame_name(f) for f in frames}:
            inclusive[key][name] += int(count)
    print(f"CPU seconds per thread (py-spy, {SPY_RATE_HZ} Hz, on-CPU samples only):")
    for (process, thread), count in threads.most_common():
        if count / SPY_RATE_HZ >= 0.05:
            print(f"  {count / SPY_RATE_HZ:6.2f} s  {process}: {thread}")
    for key, count in threads.most_common():
        if count / SPY_RATE_HZ < 0.2:
            continue
        print(f"\n{key[0]}: {key[1]}, functions by inclusive CPU seconds:")
        bootstrap = {"Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run"}
        shown = [(n, c) for n, c in inclusive[key].most_common()
                 if n.split(" (")[0] not in bootstrap]
        for name, count in shown[:top]:
            print(f"  {count / SPY_RATE_HZ:6.2f} s  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=["lists", "compact"], default="compact")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--response-len", type=float, default=2048.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the .prof files")
    parser.add_argument("--py-spy", action="store_true",
                        help="sample every thread of `rolloutlake process` with py-spy")
    parser.add_argument("--top", type=int, default=15, help="functions shown per thread")
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
        if args.py_spy:
            samples = spy_processor(kafka, str(out / "lake"), out)
            print(f"{args.form}: {tokens:,} response tokens; samples in {samples}")
            report_spy(samples, args.top)
            return
        procs = []
        for stage in ("groups", "batches"):
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
