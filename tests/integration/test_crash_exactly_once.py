"""Chaos: two processors in one consumer group, kill -9 at random moments, groups in flight.

The closed-loop simulator drives a run the way Miles does (groups issued ahead, cancelled
at each seal), over 4 events partitions, while two `rolloutlake process` instances share
the work in one consumer group. One is killed with SIGKILL at random moments and
restarted, the other is restarted too. Afterwards every table must hold each key once and
equal, value for value, an uninterrupted run over the same events (wall-clock columns
aside), and `replay --check` must pass.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.io.lake import Lake
from ingest.processor.membership import SESSION_TIMEOUTS_MS
from schemas.tables import TABLES
from tests.integration import chaos_report
from tests.integration.pipeline import assert_keys_once, run_processor
from tests.support.suite_kafka import suite_kafka

SIM = SimulationConfig(
    run_id="chaos", steps=7, rollout_batch_size=4, n_samples=4, response_len_mean=48,
    prompt_len=16, compaction_rate=0.15, duplicate_rate=0.05, abort_rate=0.03,
    missing_reward_rate=0.03, seed=11, tokens_per_s=60.0,  # about a second per group
)
KILLS = 8
MAX_KILLS = 12  # while the run is still going; each kill stalls its partitions a while
GROUP = "chaos"
SESSION_TIMEOUT_S = max(SESSION_TIMEOUTS_MS) / 1000  # the longest a stage may join with
# Columns that hold the wall clock or a table version (commit history), not the data.
NOT_COMPARED = {
    "events": {"ingested_at", "topic"},
    "groups": {"decided_at"},
    "steps": {"batch_version"},
    "dead_letters": {"at", "topic"},
}


def _kafka(broker, prefix: str) -> KafkaSettings:
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix=prefix,
                          event_partitions=4, decision_partitions=2)
    kafka.ensure_topics()
    return kafka


TIMELINE: list[str] = []  # kills and spawns of the running test, for its failure report


def _spawn(kafka: KafkaSettings, lake: str, logs, until_idle: float | None = None):
    """A processor instance; its log goes to a file (a pipe nobody reads would fill up and
    stall it)."""
    cmd = [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
           kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
           "--event-partitions", "4", "--consumer-group", f"{kafka.topic_prefix}{GROUP}",
           # compactions then race the other instance's appends, and the kills
           "--compact-every", "5"]
    if until_idle is not None:
        cmd += ["--until-idle", str(until_idle)]
    log = logs / f"instance-{len(list(logs.iterdir()))}.log"
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    process.log = log
    TIMELINE.append(f"{time.time():.3f} spawn {log.name} pid {process.pid}")
    return process


def _kill(process: subprocess.Popen) -> None:
    assert process.poll() is None, process.log.read_text()[-3000:]
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    TIMELINE.append(f"{time.time():.3f} kill {process.log.name}")


def _copy_topics(source: KafkaSettings, target: KafkaSettings) -> int:
    """Every record of the runs and events topics, into the same partitions with the
    same timestamps: the reference run reads exactly the events the chaos run read."""
    producer = target.producer()
    copied = 0
    for src, dst in ((source.topics.runs, target.topics.runs),
                     (source.topics.events, target.topics.events)):
        for r in read_topics(source, [src], what="test", timeout_s=120, quiet_ms=2000):
            producer.send(dst, partition=r.partition, key=r.key, value=r.value,
                          timestamp_ms=r.timestamp)
            copied += 1
    producer.flush()
    producer.close()
    return copied


def _rows(lake: Lake, table: str) -> list[tuple]:
    spec = TABLES[table]
    data = lake.read(table)
    if "run_id" in data.column_names and table != "dead_letters":
        data = data.filter(pc.field("run_id") == SIM.run_id)
    columns = [c for c in data.column_names if c not in NOT_COMPARED.get(table, set())]
    rows = data.select(columns).to_pylist()
    key = [c for c in spec.key if c in columns]
    return sorted((tuple(r[c] for c in key), tuple(sorted(r.items(), key=lambda kv: kv[0])))
                  for r in rows)


@pytest.mark.slow
def test_two_instances_killed_at_random_moments_change_nothing(broker, tmp_path):
    seed = int(os.environ.get("ROLLOUTLAKE_CHAOS_SEED", random.SystemRandom().randrange(2**32)))
    print(f"chaos seed {seed} (set ROLLOUTLAKE_CHAOS_SEED to repeat the kill schedule)")
    rng = random.Random(seed)
    TIMELINE.clear()
    chaos = _kafka(broker, f"chaos{uuid.uuid4().hex[:6]}.")
    chaos_lake = str(tmp_path / "chaos")
    logs = tmp_path / "logs"
    logs.mkdir()

    failures: list[BaseException] = []

    def simulate() -> None:
        try:
            run_simulation(chaos, SIM, step_timeout_s=150.0)
        except BaseException as err:  # reported by the test thread
            failures.append(err)

    started = time.monotonic()
    victim, other = _spawn(chaos, chaos_lake, logs), _spawn(chaos, chaos_lake, logs)
    simulation = threading.Thread(target=simulate)
    simulation.start()
    kills = 0
    while kills < KILLS or (simulation.is_alive() and kills < MAX_KILLS):
        time.sleep(rng.uniform(1.5, 4.5))
        _kill(victim)
        kills += 1
        victim = _spawn(chaos, chaos_lake, logs)
        if kills == KILLS // 2:
            _kill(other)  # the other instance restarts once too
            other = _spawn(chaos, chaos_lake, logs)
    simulation.join(timeout=200)
    phases = {"chaos": time.monotonic() - started}
    if failures:
        pytest.fail(f"{failures[0]} (seed {seed}; logs in {logs})\n"
                    + chaos_report.stall_report(chaos, Lake(chaos_lake), SIM.run_id, logs,
                                                TIMELINE))
    assert not simulation.is_alive(), "the simulation did not finish"
    _kill(victim)
    _kill(other)
    # Once the killed members' sessions have expired, one instance gets every partition:
    # it drains what is left and closes the last steps.
    time.sleep(SESSION_TIMEOUT_S + 1)
    final = _spawn(chaos, chaos_lake, logs, until_idle=4.0)
    assert final.wait(timeout=240) == 0, final.log.read_text()[-3000:]
    phases["drain"] = time.monotonic() - started - sum(phases.values())

    reference = _kafka(broker, f"ref{uuid.uuid4().hex[:6]}.")
    assert _copy_topics(chaos, reference) > 0
    reference_lake = str(tmp_path / "reference")
    run_processor(reference, reference_lake, idle_s=4.0,
                  consumer_group=f"{reference.topic_prefix}chaos-reference")
    phases["reference"] = time.monotonic() - started - sum(phases.values())
    out_of_order = sum(log.read_text().count("came after later ones") for log in logs.iterdir())
    print(f"{kills} kills, {out_of_order} decisions out of order; seconds per phase: "
          + ", ".join(f"{name} {s:.0f}" for name, s in phases.items()))

    got, ref = Lake(chaos_lake), Lake(reference_lake)
    assert_keys_once(got)
    assert len(_rows(ref, "steps")) >= SIM.steps
    for table in ("events", "groups", "samples", "training_batches", "steps", "step_metrics",
                  "dead_letters"):
        if _rows(got, table) != _rows(ref, table):
            try:
                what = chaos_report.report(chaos, got, ref, SIM.run_id, logs, TIMELINE)
            except Exception as err:  # noqa: BLE001 - the difference is the failure, not this
                what = f"(no report: {type(err).__name__}: {err})"
            pytest.fail(f"{table} differs from the reference (seed {seed}; logs in {logs})\n"
                        + what)

    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "replay", "--lake", chaos_lake, "--run",
         SIM.run_id, "--into", str(tmp_path / "replayed"), "--check"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
