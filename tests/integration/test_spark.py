"""delta-spark reads the lake the processor writes: every table, time travel to a step's
`batch_version`, the Spark metrics job (`bench/spark_metrics.py`) against step_metrics,
and `replay --engine spark` (as run and under a what-if) against `replay --into`.

Real parts: the Tansu broker, the processor, Delta on disk, a local Spark session with the
Delta jars resolved from Maven Central (Java 17 needed; a missing one fails, never skips).
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from bench.spark_metrics import (
    COVERED_KEYS,
    BenchError,
    Mismatch,
    filter_metrics,
    main,
    mismatches,
    read_delta,
    recorded_step_metrics,
    replay_seconds,
    spark_step_metrics,
)
from ingest.commands.replay import archived_config
from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.commands.spark_replay import replay_with
from ingest.core.whatif import parse_what_if
from ingest.io.lake import Lake
from ingest.io.spark import spark_session
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from schemas.tables import TABLES, TRAINING_BATCHES, content_sha256
from tests.integration.pipeline import run_processor
from tests.integration.test_cli import cli, one_line_error
from tests.support.metric_fixtures import contract_table
from tests.support.suite_kafka import suite_kafka

pytestmark = pytest.mark.one_broker("Spark reads the Delta tables; the broker only makes them")

# Compaction, aborts, missing rewards, truncation, duplicates and surplus all occur, so every
# filter reason and batch key has something to count.
RUNS = [
    SimulationConfig(run_id="spark-a", steps=4, rollout_batch_size=4, n_samples=4,
                     response_len_mean=24, max_response_len=40, prompt_len=8,
                     compaction_rate=0.2, abort_rate=0.05, missing_reward_rate=0.05,
                     duplicate_rate=0.05, seed=3, mode="open", surplus_per_step=1),
    SimulationConfig(run_id="spark-b", steps=2, rollout_batch_size=3, n_samples=2,
                     response_len_mean=16, prompt_len=4, seed=5, mode="open"),
]
PROCESSOR_TABLES = ["events", "groups", "samples", "training_batches", "steps", "step_metrics",
                    "dead_letters"]


@pytest.fixture(scope="module")
def lake(broker, tmp_path_factory) -> Lake:
    # Two event partitions: the processor reads several, as in production.
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix="spark.",
                          event_partitions=2, decision_partitions=1)
    kafka.ensure_topics()
    root = str(tmp_path_factory.mktemp("spark-lake"))
    with RolloutPublisher(kafka) as pub:  # one poison event, so dead_letters has a row
        pub.send_raw(pub.topics.events, event_group_key("spark-a", 0), b"{not json")
    # One processor start per run, the same consumer group each time: the second resumes
    # where the first stopped, and the runs' batches land in different table versions.
    for sim in RUNS:
        run_simulation(kafka, sim)
        run_processor(kafka, root, idle_s=3.0)
    return Lake(root)


@pytest.fixture(scope="module")
def spark():
    start = time.perf_counter()
    session = spark_session("local[2]", "1g")
    print(f"spark session started in {time.perf_counter() - start:.1f} s")
    yield session
    session.stop()


def sorted_rows(table: pa.Table, key: tuple[str, ...]) -> list[dict]:
    return table.sort_by([(k, "ascending") for k in key]).to_pylist()


def test_every_table_reads_the_same_in_spark_and_delta_rs(lake, spark):
    tables = sorted(name for name in TABLES if lake.exists(name))
    assert set(PROCESSOR_TABLES) <= set(tables)
    for name in tables:
        df = spark.read.format("delta").load(lake.uri(name))
        # Both sides print the Delta schema of the log (names, types, nullability, order).
        delta_rs_schema = orjson.loads(DeltaTable(lake.uri(name)).schema().to_json())
        assert df.schema.jsonValue() == delta_rs_schema, name
        key = TABLES[name].key
        ours, theirs = sorted_rows(df.toArrow(), key), sorted_rows(lake.read(name), key)
        assert len(ours) == len(theirs) > 0, name
        for spark_row, delta_rs_row in zip(ours, theirs, strict=True):
            assert spark_row == delta_rs_row, name


def test_time_travel_to_batch_version_gives_the_step_rows(lake, spark):
    uri = lake.uri("training_batches")
    steps = lake.read("steps").to_pylist()
    assert len(steps) == sum(sim.steps for sim in RUNS)
    versions = {run: [row["batch_version"] for row in steps if row["run_id"] == run]
                for run in ("spark-a", "spark-b")}
    assert max(versions["spark-a"]) < min(versions["spark-b"])  # commits to tell apart

    def spark_at(version: int) -> pa.Table:
        return spark.read.format("delta").option("versionAsOf", version).load(uri).toArrow()

    for version in sorted({row["batch_version"] for row in steps}):
        ours_at = spark_at(version)
        theirs_at = lake.read("training_batches", version=version)
        before = spark_at(version - 1)
        key = TRAINING_BATCHES.key
        assert sorted_rows(ours_at, key) == sorted_rows(theirs_at, key)  # the whole version
        for step in (row for row in steps if row["batch_version"] == version):
            where = (pc.field("run_id") == step["run_id"]) & (pc.field("step") == step["step"])
            ours = ours_at.filter(where).sort_by("position")
            assert ours.to_pylist() == theirs_at.filter(where).sort_by("position").to_pylist()
            assert ours.num_rows == step["n_samples"]
            assert content_sha256(ours.cast(TRAINING_BATCHES.schema)) == step["content_sha256"]
            # The step's rows arrive in that very commit.
            assert before.filter(where).num_rows == 0


def test_spark_metrics_job_matches_step_metrics(lake, spark):
    required = {"rollout/raw_reward", "rollout/raw_reward_unfiltered",
                "rollout/num_training_samples", "rollout/episode_raw_reward",
                "rollout/truncated_ratio", "rollout/groups_kept",
                *(f"rollout/response_len/{s}" for s in ("mean", "median", "max", "min"))}
    for sim in RUNS:
        start = time.perf_counter()
        computed = spark_step_metrics(spark, lake.root, sim.run_id)
        print(f"spark metrics of {sim.run_id}: {time.perf_counter() - start:.1f} s")
        recorded = recorded_step_metrics(spark, lake.root, sim.run_id)
        assert sorted(recorded) == list(range(sim.steps))
        assert mismatches(computed, recorded) == []
        for step, metrics in recorded.items():
            assert required <= set(computed[step]) & set(metrics), step
    # The run exercises the drop reasons and truncation the job must count.
    recorded = recorded_step_metrics(spark, lake.root, "spark-a")
    keys = {k for m in recorded.values() for k in m}
    for reason in ("zero_std_0.0", "zero_std_1.0", "group_has_aborted",
                   "group_has_missing_reward"):
        assert f"rollout/dynamic_filter/drop_{reason}" in keys
    assert any(m["rollout/truncated_ratio"] > 0 for m in recorded.values())
    assert any(m["rollout/groups_surplus"] > 0 for m in recorded.values())


def test_metrics_job_counts_a_group_only_while_its_step_is_open(spark, tmp_path):
    """Step 1 seals before step 0; step 0 then closes at its own seal, so its groups
    decided later are in the tables but not in its metrics. The last step closes at the
    flush and keeps everything."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    # (group_index, step, decision, reason, ordered_at s, rewards of its samples)
    decided = [
        (0, 0, "kept", None, 1, [1.0, 0.0]),
        (1, 0, "dropped", "zero_std_1.0", 2, [1.0, 1.0]),
        (4, 0, "dropped", "group_has_missing_reward", 7, [None, 1.0]),  # step 1 sealed: open
        (2, 0, "dropped", "group_has_aborted", 11, [None, 1.0]),  # after step 0 closed
        (3, 0, "surplus", None, 12, [1.0, 0.0]),  # after step 0 closed
        (10, 1, "kept", None, 4, [1.0, 0.0]),
        (11, 1, "dropped", "zero_std_0.0", 15, [0.0, 0.0]),
        (12, 1, "dropped", "group_timeout", 16, [1.0]),  # never offered
        (20, 2, "kept", None, 19, [1.0, 0.0]),
        (21, 2, "surplus", None, 30, [0.0, 1.0]),
        (22, 2, "dropped", "cancelled_at_seal", 25, [None, None]),
    ]
    sealed_at = {0: 10, 1: 5, 2: 20}
    groups = [{"run_id": "w", "group_index": g, "step": step, "decision": decision,
               "reason": reason, "decided_at": at(0), "ordered_at": at(t)}
              for g, step, decision, reason, t, _ in decided]
    samples = [{"run_id": "w", "group_index": g, "rollout_id": r, "fragment_index": 0,
                "status": "completed", "reward": reward, "response_length": 1,
                "decision": decision, "step": step}
               for g, step, decision, _, _, rewards in decided for r, reward in enumerate(rewards)]
    steps = [{"run_id": "w", "step": step, "n_groups": 1, "n_samples": 2, "sealed_at": at(t),
              "batch_version": 0, "content_sha256": ""} for step, t in sealed_at.items()]
    lake = Lake(tmp_path / "lake")
    for name, rows in (("groups", groups), ("samples", samples), ("steps", steps)):
        lake.append(name, contract_table(name, rows))
    computed = filter_metrics(*(read_delta(spark, lake.root, name, "w")
                                for name in ("groups", "samples", "steps")))
    counts = ("groups_offered", "groups_kept", "groups_surplus", "groups_dropped",
              "groups_cancelled")

    def expect(values: tuple[int, ...], unfiltered: float, drops: dict[str, float]) -> dict:
        out = {f"rollout/{k}": float(v) for k, v in zip(counts, values, strict=True)}
        out |= {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in drops.items()}
        return out | {"rollout/raw_reward_unfiltered": unfiltered}

    assert computed == {
        0: expect((3, 1, 0, 2, 0), 0.8, {"zero_std_1.0": 1.0, "group_has_missing_reward": 1.0}),
        1: expect((2, 1, 0, 2, 0), 0.25, {"zero_std_0.0": 1.0, "group_timeout": 1.0}),
        2: expect((2, 1, 1, 0, 1), 0.5, {}),
    }


def test_mismatches_names_each_differing_missing_or_extra_key():
    recorded = {0: {"rollout/raw_reward": 0.5, "rollout/groups_kept": 4.0,
                    "rollout/dynamic_filter/drop_zero_std_1.0": 2.0, "perf/rollout_time": 3.0}}
    computed = {0: {"rollout/raw_reward": 0.5 + 1e-12, "rollout/groups_kept": 5.0,
                    "rollout/dynamic_filter/drop_zero_std_0.0": 1.0}}
    assert mismatches(computed, recorded) == [
        Mismatch(0, "rollout/dynamic_filter/drop_zero_std_0.0", 1.0, None),
        Mismatch(0, "rollout/dynamic_filter/drop_zero_std_1.0", None, 2.0),
        Mismatch(0, "rollout/groups_kept", 5.0, 4.0),
    ]
    assert mismatches({}, recorded)[0] == Mismatch(0, "rollout/dynamic_filter/drop_zero_std_1.0",
                                                   None, 2.0)
    assert "perf/rollout_time" not in COVERED_KEYS


@pytest.mark.parametrize("argv, message", [
    ([], "pass --lake and --run, or --simulate-steps N"),
    (["--lake", "lake"], "pass --lake and --run, or --simulate-steps N"),
    (["--simulate-steps", "0"], "--simulate-steps must be >= 1, got 0"),
    (["--simulate-steps", "2", "--run", "r"], "--simulate-steps builds its own lake"),
])
def test_metrics_job_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_metrics_job_names_the_lake_or_run_it_cannot_use(lake, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [([str(tmp_path / "missing"), "spark-a"], f"--lake {tmp_path / 'missing'}: no such folder"),
             ([str(empty), "spark-a"], f"--lake {empty} has no step_metrics table"),
             ([lake.root, "nope"], f"--run nope: no step_metrics rows in {lake.root}")]
    for (root, run), message in cases:
        assert main(["--lake", root, "--run", run]) == 2  # before any Spark session starts
        assert capsys.readouterr().err == f"error: {message}\n"


def test_a_failing_replay_is_one_line(tmp_path):
    with pytest.raises(BenchError) as failed:
        replay_seconds(str(tmp_path), "r1")
    assert str(failed.value) == f"rolloutlake replay exited 2: rolloutlake replay: no events table under {tmp_path}"


# ---------------------------------------------------------------- replay --engine spark

# A what-if that changes decisions (the DAPO filter off) and steps (smaller batches).
WHAT_IF = ("filter=none", "rollout_batch_size=3")
DERIVED_TABLES = ("groups", "samples", "training_batches", "steps", "step_metrics")


def rows_by_key(lake: Lake, table: str, run_id: str) -> list[dict]:
    return sorted_rows(lake.read(table, filter=pc.field("run_id") == run_id), TABLES[table].key)


def replay_into(lake: Lake, into, config: tuple[str, ...]) -> Lake:
    done = cli("replay", "--lake", lake.root, "--run", "spark-a", "--into", str(into),
               *(("--config", *config) if config else ()))
    assert done.returncode == 0, done.stderr
    return Lake(str(into))


@pytest.mark.parametrize("config", [(), WHAT_IF], ids=["as-run", "what-if"])
def test_spark_replay_equals_replay_into(lake, spark, tmp_path, config):
    local = replay_into(lake, tmp_path / "local", config)
    spark_lake = Lake(tmp_path / "spark")
    # The command's own parsing and config, then the job on this module's session.
    run_config = parse_what_if(config).apply(archived_config(lake, "spark-a"))
    start = time.perf_counter()
    done = replay_with(spark, lake, spark_lake, "spark-a", run_config)
    print(f"spark replay of spark-a {config}: {time.perf_counter() - start:.1f} s")
    groups = rows_by_key(local, "groups", "spark-a")
    assert done.groups == len(groups)
    assert done.events == lake.read("events", filter=(pc.field("run_id") == "spark-a")
                                    & (pc.field("type") != "run_started")).num_rows
    # Surplus and filter drops on both sides of the comparison.
    assert {"kept", "dropped", "surplus"} <= {g["decision"] for g in groups}
    # Every row of every derived table: step hashes, decisions (reason, batch step) and
    # metric values among them.
    for table in DERIVED_TABLES:
        ours, theirs = rows_by_key(spark_lake, table, "spark-a"), rows_by_key(local, table, "spark-a")
        assert len(ours) == len(theirs) > 0, table
        for spark_row, local_row in zip(ours, theirs, strict=True):
            assert spark_row == local_row, table
    # delta-spark wrote the contract schema.
    for table in DERIVED_TABLES:
        assert spark_lake.read(table).schema == TABLES[table].schema, table
    hashes = {s["step"]: s["content_sha256"] for s in rows_by_key(spark_lake, "steps", "spark-a")}
    original = {s["step"]: s["content_sha256"] for s in rows_by_key(lake, "steps", "spark-a")}
    if config:
        # The keys took effect: steps and decisions differ from the original's.
        assert hashes != original
        assert not any((g["reason"] or "").startswith("zero_std") for g in groups)
    else:
        assert hashes == original


def test_replay_engine_spark_checks_against_the_original(lake, tmp_path):
    into = tmp_path / "spark"
    done = cli("replay", "--lake", lake.root, "--run", "spark-b", "--into", str(into),
               "--engine", "spark", "--spark-master", "local[2]", "--check", timeout=600)
    assert done.returncode == 0, done.stderr
    steps = len(rows_by_key(lake, "steps", "spark-b"))
    assert f"every step hash, decision and metric equals the original ({steps} steps)" in done.stdout
    groups = len(rows_by_key(lake, "groups", "spark-b"))
    assert re.search(rf"re-derived {groups} groups from \d+ events in [0-9.]+ s \([0-9,]+ "
                     r"events/s; Spark, its session start aside\) into ", done.stdout), done.stdout


def test_replay_engine_spark_refuses_bad_input_before_spark_starts(lake, tmp_path):
    def error(*args: str) -> str:
        return one_line_error(cli("replay", "--lake", lake.root, "--engine", "spark", *args))

    assert error("--run", "spark-a", "--config", "nope=1") == (
        "rolloutlake replay: --config 'nope=1': unknown key 'nope' (keys: filter, "
        "rollout_batch_size, over_sampling_batch_size, advantage_estimator, "
        "std_normalization, reward_key, max_staleness, arg.NAME for a user filter's argument)")
    assert error("--run", "nope", "--into", str(tmp_path / "x")) == (
        "rolloutlake replay: run nope has no archived run_started; pass --config-file FILE")
    assert error("--run", "spark-a", "--into", lake.root) == (
        f"rolloutlake replay: --into {lake.root} is the original lake; a replay never "
        "writes into it, pass another folder")
    assert not (tmp_path / "x").exists()
