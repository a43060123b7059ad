"""`--until-idle` ends the processor only when nothing is left to do."""

from __future__ import annotations

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
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
