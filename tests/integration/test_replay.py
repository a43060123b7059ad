"""`rolloutlake replay --check` on lakes the real processor built from four events partitions.

The check compares every step's content hash, every group's decision and every step
metric of the re-derived run with the original; a replay under another batch size must
fail it, so the check can tell a difference.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor
from tests.integration.pipeline import by_group
from tests.support.suite_kafka import suite_kafka

# Closed loop: groups are issued ahead and cancelled at each seal (cancelled_at_seal,
# surplus), with aborts, missing rewards, compaction and duplicate deliveries, spread
# over four events partitions by their keys.
SIM = SimulationConfig(run_id="replayed", steps=3, rollout_batch_size=4, n_samples=4,
                       response_len_mean=32, prompt_len=8, compaction_rate=0.15,
                       duplicate_rate=0.05, abort_rate=0.04, missing_reward_rate=0.04,
                       seed=5, tokens_per_s=15.0)


def _replay(lake: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ingest.cli", "replay", "--lake", lake,
                           "--run", SIM.run_id, "--check", *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def four_partition_lake(broker, tmp_path) -> str:
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"rp{uuid.uuid4().hex[:8]}.", event_partitions=4,
                        decision_partitions=2)
    kafka.ensure_topics()
    lake = str(tmp_path / "lake")
    processor = Processor(ProcessorConfig(kafka=kafka, lake=lake, until_idle_s=3.0,
                                          max_poll_records=20))
    thread = threading.Thread(target=processor.run)
    thread.start()
    try:
        run_simulation(kafka, SIM, step_timeout_s=120.0)
    finally:
        thread.join(timeout=120)
        processor.stop()
        thread.join()
    assert not processor.errors, processor.errors
    return lake


@pytest.mark.one_broker("replay reads the lake, not the broker; the processor that builds "
                        "the lake runs on both brokers in test_event_time and the chaos test")
def test_replay_check_passes_on_a_four_partition_lake_and_fails_under_another_batch_size(
        four_partition_lake):
    lake = Lake(four_partition_lake)
    partitions = lake.read("events", filter=pc.field("type") != "run_started",
                           columns=["partition"]).column("partition").to_pylist()
    assert set(partitions) == {0, 1, 2, 3}
    decided = {g["decision"] for g in by_group(lake, SIM.run_id).values()}
    reasons = {g["reason"] for g in by_group(lake, SIM.run_id).values()}
    assert {"kept", "dropped", "surplus"} <= decided, decided
    assert "cancelled_at_seal" in reasons, reasons
    assert lake.read("steps").num_rows >= SIM.steps

    result = _replay(four_partition_lake)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every step hash, decision and metric equals the original" in result.stdout
    assert f"replay of run {SIM.run_id}:" in result.stdout

    other = _replay(four_partition_lake, "--config",
                    f"rollout_batch_size={SIM.rollout_batch_size + 1}")
    assert other.returncode == 1, other.stdout[-3000:] + other.stderr[-3000:]
    assert "check: steps differ from the original" in other.stdout
    assert "check: groups differ from the original" in other.stdout
