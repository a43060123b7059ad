"""`--until-idle` ends the processor only when nothing is left to do."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.launch import BatchChild
from ingest.processor.main import Processor
from tests.integration.pipeline import ordered_kafka, run_processor


def test_a_backlog_longer_to_commit_than_the_idle_time_is_finished(broker, tmp_path):
    """Each poll's commits (several Delta tables) take longer than the idle time: the
    processor must not take that for idleness and stop in the middle of the backlog."""
    sim = SimulationConfig(run_id="backlog", steps=30, rollout_batch_size=2, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=4, mode="open",
                           surplus_per_step=1)
    kafka = ordered_kafka(broker.bootstrap_servers, f"idle{id(sim)}.")
    run_simulation(kafka, sim)
    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=0.05, max_poll_records=200)
    assert Lake(lake_root).read("steps", columns=["step"]).num_rows == sim.steps


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


def test_a_batch_stage_told_to_drain_before_it_runs_still_seals(broker, tmp_path):
    """A stopping processor tells its batch-stage child to drain (SIGTERM). An --until-idle
    parent can stop while the child still imports or waits for its configuration: the
    child must drain once its stage runs, not die with the decisions unsealed."""
    sim = SimulationConfig(run_id="early", steps=1, rollout_batch_size=1, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=5, mode="open")
    kafka = ordered_kafka(broker.bootstrap_servers, f"early{os.getpid()}.")
    run_simulation(kafka, sim)
    config = ProcessorConfig(kafka=kafka, lake=str(tmp_path / "lake"), until_idle_s=1.0)
    child = BatchChild()
    deadline = time.monotonic() + 60
    while not _catches(child.process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline and child.process.is_alive()
        time.sleep(0.01)
    os.kill(child.process.pid, signal.SIGTERM)
    groups = Processor(config.model_copy(update={"stages": "groups"}))  # the tables first
    child.configure(config, logging.WARNING)
    groups.run()
    child.process.join(120)
    assert child.process.exitcode == 0
    assert Lake(config.lake).read("steps", columns=["step"]).num_rows == sim.steps
