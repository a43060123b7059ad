"""Per-step metrics of a run recomputed with Spark over the Delta tables, checked against
`step_metrics` and timed against the single-process replay on the same lake.

    .venv/bin/python bench/spark_metrics.py --lake LAKE --run RUN [--master local[2]]
    .venv/bin/python bench/spark_metrics.py --simulate-steps 40   # builds a lake first

The processor computes a step's metrics in memory as it seals; a run that outgrows one
machine needs them (or a what-if variant of them) from the tables instead. The job reads
`training_batches` for the batch keys and `groups` + `samples` for the filter-stage keys
(CONTRACT section 5, docs/metrics.md), with the processor's window rule: a group counts
for step s when it was ordered before s closed, that is by the first seal at which s and
a later step are both sealed (`groups.ordered_at` against `steps.sealed_at`, both on the
event-time clock the batch stage orders decisions by, so it holds for any number of
partitions and instances; two decisions with the same microsecond are the one blind
spot, as the tables do not keep the order key's partition and offset). Two things the processor
saw are not in the tables, so runs that use them differ: a `metadata.raw_reward` override
of the reward, and whether a reward was an int (the tables keep float64, so an int run's
`zero_std/count_1` reads `count_1.0` here). docs/spark.md has the details.

Exit status: 0 when every covered key of every step equals `step_metrics` within
tolerance, 1 with one line per mismatch otherwise, 2 with a one-line error for bad
arguments, a lake or run without the tables, or a replay that fails.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Run as a script, bench/ is sys.path[0]; the repo root holds the packages imported below.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow.compute as pc  # noqa: E402
from pyspark.sql import Column, DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from ingest.core.reasons import CANCELLED_AT_SEAL, GROUP_TIMEOUT  # noqa: E402
from ingest.io.spark import spark_session  # noqa: E402

NOT_OFFERED = GROUP_TIMEOUT  # decided by the timeout, never offered to the filter chain

# Keys the job computes exactly; step_metrics keys outside these are the processor's alone
# (timing, prompts issued, bias-aware keys) and are not compared.
COVERED_KEYS = frozenset(
    [f"rollout/{k}" for k in (
        "raw_reward", "raw_reward_unfiltered", "num_training_samples", "episode_raw_reward",
        "truncated_ratio", "episode_total_response_length/mean", "groups_offered",
        "groups_kept", "groups_surplus", "groups_dropped", "groups_cancelled",
        "zero_std/all_zero_percentage", "zero_std/all_one_percentage",
    )]
    + [f"rollout/{prefix}/{stat}" for prefix in ("response_len", "episode_response_length")
       for stat in ("mean", "median", "max", "min")]
)
COVERED_PREFIXES = ("rollout/dynamic_filter/drop_", "rollout/zero_std/count_")

StepMetrics = dict[int, dict[str, float]]


def read_delta(spark: SparkSession, lake: str, table: str, run_id: str) -> DataFrame:
    return spark.read.format("delta").load(f"{lake}/{table}").where(F.col("run_id") == run_id)


def _stats(prefix: str, column: str) -> list[Column]:
    return [F.avg(column).alias(f"{prefix}/mean"),
            F.percentile(column, 0.5).alias(f"{prefix}/median"),
            F.max(column).cast("double").alias(f"{prefix}/max"),
            F.min(column).cast("double").alias(f"{prefix}/min")]


def batch_metrics(batches: DataFrame) -> StepMetrics:
    """Batch keys (MILES_SEMANTICS 8.2-8.4) per step, over the sealed training rows."""
    rows = batches.select(
        "step", "group_index", "rollout_id", "reward", "status",
        F.aggregate("loss_mask", F.lit(0), lambda acc, x: acc + x.cast("int")).alias("effective"),
        F.size("response_tokens").alias("length"),
    )
    per_row = rows.groupBy("step").agg(
        F.count(F.lit(1)).cast("double").alias("rollout/num_training_samples"),
        F.avg("reward").alias("rollout/raw_reward"),
        F.avg((F.col("status") == "truncated").cast("double")).alias("rollout/truncated_ratio"),
        *_stats("rollout/response_len", "effective"),
    )
    rollouts = rows.groupBy("step", "group_index", "rollout_id").agg(
        F.avg("reward").alias("reward"), F.sum("effective").alias("effective"),
        F.sum("length").alias("length"))
    per_rollout = rollouts.groupBy("step").agg(
        # Rollouts without a numeric reward are left out; none at all reads 0.0 (Miles).
        F.coalesce(F.avg("reward"), F.lit(0.0)).alias("rollout/episode_raw_reward"),
        F.avg("length").alias("rollout/episode_total_response_length/mean"),
        *_stats("rollout/episode_response_length", "effective"),
    )
    groups = rows.groupBy("step", "group_index").agg(
        F.min("reward").alias("lo"), F.max("reward").alias("hi"),
        F.first("reward").alias("first"),  # lo == hi: every reward is the first
        (F.count(F.lit(1)) - F.count("reward")).alias("non_numeric"),
    )
    out: StepMetrics = {}
    for row in per_row.join(per_rollout, "step").collect():
        out[row["step"]] = {k: float(v) for k, v in row.asDict().items()
                            if k != "step" and v is not None}
    zero_std: dict[int, dict[str, int]] = {}
    suppressed: set[int] = set()
    group_count: dict[int, int] = {}
    for row in groups.collect():
        step = row["step"]
        group_count[step] = group_count.get(step, 0) + 1
        if row["non_numeric"]:
            suppressed.add(step)  # one non-numeric reward suppresses every zero_std key
        elif row["lo"] == row["hi"]:
            bucket = str(round(row["first"], 1))
            zero_std.setdefault(step, {}).setdefault(bucket, 0)
            zero_std[step][bucket] += 1
    for step, n_groups in group_count.items():
        if step in suppressed:
            continue
        buckets = zero_std.get(step, {})
        for bucket, n in buckets.items():
            out[step][f"rollout/zero_std/count_{bucket}"] = float(n)
        out[step]["rollout/zero_std/all_zero_percentage"] = buckets.get("0.0", 0) / n_groups
        out[step]["rollout/zero_std/all_one_percentage"] = buckets.get("1.0", 0) / n_groups
    return out


def filter_metrics(groups: DataFrame, samples: DataFrame, steps: DataFrame) -> StepMetrics:
    """Filter-stage keys (MILES_SEMANTICS 8.1) and group counts per sealed step, over the
    groups decided into the step before it closed."""
    # Step s closes at the first seal that finds s sealed and a later step sealed too
    # (steps seal out of order when several are in flight); without one, at the flush.
    sealed = steps.select("step", "sealed_at")
    later = sealed.alias("s").join(sealed.alias("t"), F.col("t.step") > F.col("s.step"), "left")
    closes = later.groupBy(F.col("s.step").alias("step")).agg(
        F.when(F.min("t.sealed_at").isNotNull(),
               F.greatest(F.first("s.sealed_at"), F.min("t.sealed_at"))).alias("closed_at"))
    window = (
        groups.join(closes, "step")
        .where(F.col("closed_at").isNull() | (F.col("ordered_at") <= F.col("closed_at")))
        .select("step", "group_index", "decision", "reason")
    )
    cancelled = F.col("reason").eqNullSafe(CANCELLED_AT_SEAL)
    offered = ~cancelled & ~F.col("reason").eqNullSafe(NOT_OFFERED)
    counts = window.groupBy("step").agg(
        F.sum(offered.cast("int")).alias("rollout/groups_offered"),
        F.sum((offered & (F.col("decision") == "kept")).cast("int")).alias("rollout/groups_kept"),
        F.sum((offered & (F.col("decision") == "surplus")).cast("int"))
        .alias("rollout/groups_surplus"),
        F.sum(((F.col("decision") == "dropped") & ~cancelled).cast("int"))
        .alias("rollout/groups_dropped"),
        F.sum(cancelled.cast("int")).alias("rollout/groups_cancelled"),
    )
    drops = (window.where((F.col("decision") == "dropped") & F.col("reason").isNotNull() & ~cancelled)
             .groupBy("step", "reason").count())
    unfiltered = (
        samples.select("group_index", "reward")
        .join(window.where(offered).select("step", "group_index"), "group_index")
        .groupBy("step").agg(F.avg("reward").alias("rollout/raw_reward_unfiltered"))
    )
    out: StepMetrics = {}
    for row in counts.join(unfiltered, "step", "left").collect():
        out[row["step"]] = {k: float(v) for k, v in row.asDict().items()
                            if k != "step" and v is not None}
    for row in drops.collect():
        out[row["step"]][f"rollout/dynamic_filter/drop_{row['reason']}"] = float(row["count"])
    return out


def spark_step_metrics(spark: SparkSession, lake: str, run_id: str) -> StepMetrics:
    """Every covered key of every sealed step of the run, computed by Spark."""
    steps = read_delta(spark, lake, "steps", run_id)
    out = filter_metrics(read_delta(spark, lake, "groups", run_id),
                         read_delta(spark, lake, "samples", run_id), steps)
    for step, metrics in batch_metrics(read_delta(spark, lake, "training_batches", run_id)).items():
        out.setdefault(step, {}).update(metrics)
    return out


def recorded_step_metrics(spark: SparkSession, lake: str, run_id: str) -> StepMetrics:
    out: StepMetrics = {}
    for row in read_delta(spark, lake, "step_metrics", run_id).collect():
        out.setdefault(row["step"], {})[row["key"]] = row["value"]
    return out


def covered(key: str) -> bool:
    return key in COVERED_KEYS or key.startswith(COVERED_PREFIXES)


@dataclass(frozen=True)
class Mismatch:
    step: int
    key: str
    computed: float | None
    recorded: float | None

    def __str__(self) -> str:
        return f"step {self.step} {self.key}: spark {self.computed}, step_metrics {self.recorded}"


def mismatches(computed: StepMetrics, recorded: StepMetrics, *, rel_tol: float = 1e-9,
               abs_tol: float = 1e-9) -> list[Mismatch]:
    """Covered keys that differ, or that one side has and the other lacks, step by step.

    Only steps with recorded metrics are compared: a sealed step closes (and gets its
    metrics) when a later one seals or the processor flushes."""
    out = []
    for step in sorted(recorded):
        ours, theirs = computed.get(step, {}), recorded[step]
        for key in sorted(k for k in set(ours) | set(theirs) if covered(k)):
            a, b = ours.get(key), theirs.get(key)
            if a is None or b is None or not math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol):
                out.append(Mismatch(step, key, a, b))
    return out


# ---------------------------------------------------------------- the benchmark


def simulated_lake(root: Path, steps: int, seed: int) -> tuple[str, str]:
    """A lake with one simulated run processed by the real processor on an embedded broker."""
    from ingest.commands.simulate import SimulationConfig, run_simulation
    from ingest.io.broker import EmbeddedBroker, free_port
    from ingest.io.kafka import KafkaSettings
    from ingest.processor.config import ProcessorConfig
    from ingest.processor.main import Processor

    run_id = "spark-bench"
    sim = SimulationConfig(run_id=run_id, steps=steps, rollout_batch_size=16, n_samples=8,
                           response_len_mean=256, prompt_len=64, seed=seed, mode="open")
    lake = str(root / "lake")
    with EmbeddedBroker(free_port()) as broker:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers,
                              topic_prefix="bench.", event_partitions=2)
        kafka.ensure_topics()
        run_simulation(kafka, sim)
        Processor(ProcessorConfig(kafka=kafka, lake=lake, until_idle_s=3.0)).run()
    return lake, run_id


def replay_seconds(lake: str, run_id: str) -> float:
    """Wall time of `rolloutlake replay` on the run, a process of its own like the job."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ingest.cli", "replay", "--lake", lake,
                           "--run", run_id], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"rolloutlake replay exited {done.returncode}: {last}")
    return time.perf_counter() - start


class BenchError(Exception):
    """A lake, run or replay this benchmark cannot use; its message is one line."""


def check_lake(lake: str, run_id: str) -> None:
    """Refuse a lake without the run's step metrics before a Spark session starts."""
    from ingest.io.lake import Lake

    if not os.path.isdir(lake):
        raise BenchError(f"--lake {lake}: no such folder")
    tables = Lake(lake)
    for table in ("step_metrics", "steps", "groups", "samples", "training_batches"):
        if not tables.exists(table):
            raise BenchError(f"--lake {lake} has no {table} table")
    if tables.read("step_metrics", columns=["step"],
                   filter=pc.field("run_id") == run_id).num_rows == 0:
        raise BenchError(f"--run {run_id}: no step_metrics rows in {lake}")


def _report(found: Iterable[Mismatch]) -> int:
    found = list(found)
    for m in found:
        print(f"mismatch: {m}")
    return 1 if found else 0


def _compare_and_time(lake: str, run_id: str, args: argparse.Namespace) -> int:
    start = time.perf_counter()
    spark = spark_session(args.master, args.driver_memory)
    session_s = time.perf_counter() - start
    start = time.perf_counter()
    computed = spark_step_metrics(spark, lake, run_id)
    job_s = time.perf_counter() - start
    recorded = recorded_step_metrics(spark, lake, run_id)
    spark.stop()
    n_keys = sum(1 for m in recorded.values() for k in m if covered(k))
    status = _report(mismatches(computed, recorded))
    print(f"spark ({args.master}): {len(recorded)} steps, {n_keys} keys compared, "
          f"{'mismatches above' if status else 'all equal'}")
    print(f"spark session start {session_s:.1f} s, job {job_s:.1f} s")
    if not args.no_replay:
        replay_s = replay_seconds(lake, run_id)
        print(f"single-process replay {replay_s:.1f} s; spark job / replay = "
              f"{job_s / replay_s:.2f} (with session start "
              f"{(session_s + job_s) / replay_s:.2f})")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", help="lake holding the processed run")
    parser.add_argument("--run", help="run id")
    parser.add_argument("--simulate-steps", type=int,
                        help="build a lake with a simulated run of this many steps first")
    parser.add_argument("--seed", type=int, default=0, help="simulation seed")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--no-replay", action="store_true", help="skip the replay timing")
    args = parser.parse_args(argv)
    if args.simulate_steps is None:
        if args.lake is None or args.run is None:
            parser.error("pass --lake and --run, or --simulate-steps N")
    elif args.lake is not None or args.run is not None:
        parser.error("--simulate-steps builds its own lake: pass it without --lake and --run")
    elif args.simulate_steps < 1:
        parser.error(f"--simulate-steps must be >= 1, got {args.simulate_steps}")
    with tempfile.TemporaryDirectory(prefix="spark-bench-") as tmp:
        lake, run_id = args.lake, args.run
        if args.simulate_steps is not None:
            start = time.perf_counter()
            lake, run_id = simulated_lake(Path(tmp), args.simulate_steps, args.seed)
            print(f"simulated and processed {args.simulate_steps} steps "
                  f"in {time.perf_counter() - start:.1f} s")
        lake = os.path.abspath(lake)
        try:
            check_lake(lake, run_id)
            status = _compare_and_time(lake, run_id, args)
        except BenchError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
