"""Restart time of the batch stage on a long run: from its snapshot vs replaying from 0.

    .venv/bin/python bench/restart.py [--steps 1000]

A simulated run of `--steps` steps is processed once (embedded broker, local lake). Then a
fresh batch stage is started on the same topics and lake and timed until it has caught
up (joined its consumer group, restored, read to the end of `rollout.decisions`):
  1. after a clean stop: from the snapshot written at the stop;
  2. as after a kill: that last snapshot deleted, so it resumes from the one before
     (up to `--snapshot-every` decisions back);
  3. with `batch_state` removed, so it replays every decision from offset 0 (the only
     way before snapshots existed).
Joining the consumer group takes about the same in all (half a session timeout on Tansu)
and is reported apart from the take-over (reading the snapshot, checking the topic).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from deltalake import DeltaTable

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor


def restart(config: ProcessorConfig, group: str, label: str) -> None:
    """Time a fresh batch stage: join, take over, catch up; print it."""
    config = config.model_copy(update={"consumer_group": group, "stages": "batches"})
    start = time.perf_counter()
    stage = BatchStage(config, Lake(config.lake))
    take_over, took = stage._take_over, []

    def timed_take_over(assigned: set) -> None:
        began = time.perf_counter()
        take_over(assigned)
        took.append(time.perf_counter() - began)

    stage._take_over = timed_take_over
    joined_at = None
    read = 0
    while joined_at is None or not stage.caught_up:
        read += stage.poll_once()
        if joined_at is None and stage.joined:
            joined_at = time.perf_counter()
    done = time.perf_counter()
    stage.close()
    print(f"{label:<34} join {joined_at - start - took[0]:4.1f} s, take over {took[0]:.2f} s, "
          f"catch up {done - joined_at:5.2f} s: {read:6d} decisions read, resumed at "
          f"{stage.resumed_from}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    sim = SimulationConfig(run_id="long", steps=args.steps, rollout_batch_size=2, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=1, mode="open",
                           surplus_per_step=1)
    with EmbeddedBroker(free_port()) as broker, tempfile.TemporaryDirectory() as folder:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, event_partitions=1,
                              decision_partitions=1)
        kafka.ensure_topics()
        lake_root = str(Path(folder) / "lake")
        config = ProcessorConfig(kafka=kafka, lake=lake_root, until_idle_s=3.0,
                                 stages="all")
        events = run_simulation(kafka, sim)["events"]
        start = time.perf_counter()
        Processor(config).run()
        lake = Lake(lake_root)
        steps = lake.read("steps", columns=["step"]).num_rows
        print(f"run: {steps} steps, {events} events, processed in "
              f"{time.perf_counter() - start:.1f} s; "
              f"{lake.read('batch_state', columns=['offset']).num_rows} snapshots")
        restart(config, "after-stop", "after a clean stop (snapshot):")
        snapshots = DeltaTable(lake.uri("batch_state"))
        snapshots.delete(f"offset = {max(lake.read('batch_state', columns=['offset']).column(0).to_pylist())}")
        restart(config, "after-kill", "as after a kill (older snapshot):")
        shutil.rmtree(Path(lake_root) / "batch_state")
        restart(config, "from-zero", "without snapshots (replay from 0):")


if __name__ == "__main__":
    main()
