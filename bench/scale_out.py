"""Events per second of one vs two `rolloutlake process` instances in one consumer group.

    .venv/bin/python bench/scale_out.py [--steps 30] [--instances 1 2]

N instances (each a group stage plus its batch-stage child, as deployed) join one consumer
group on fresh topics with 4 events and 2 decisions partitions; once every instance owns
events partitions (their `--status-dir` files), one simulated run is published and the
time runs from its first event to the last `steps` row. On a machine with fewer cores
than processes the ratio shows the overhead of scaling out, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake


def events_partitions(status: Path) -> list[int]:
    path = status / "groups.json"
    return (json.loads(path.read_text())["partitions"] or []) if path.exists() else []


def process(broker: str, sim: SimulationConfig, instances: int, folder: Path) -> tuple[int, float]:
    """Events published, and seconds from the first one to the last sealed step."""
    kafka = KafkaSettings(bootstrap_servers=broker, topic_prefix=f"bench{instances}.",
                          event_partitions=4, decision_partitions=2)
    kafka.ensure_topics()
    lake_root = str(folder / f"lake{instances}")
    statuses = [folder / f"status{instances}-{i}" for i in range(instances)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
         kafka.bootstrap_servers, "--lake", lake_root, "--topic-prefix", kafka.topic_prefix,
         "--consumer-group", f"bench{instances}", "--status-dir", str(status)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for status in statuses]
    try:
        owned: list[list[int]] = []
        while sorted(sum(owned, [])) != [0, 1, 2, 3] or not all(owned):
            owned = [events_partitions(s) for s in statuses]
            time.sleep(0.1)
        start = time.perf_counter()
        events = run_simulation(kafka, sim)["events"]
        lake = Lake(lake_root)
        while lake.read("steps", columns=["step"]).num_rows < sim.steps:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("an instance exited early")
            time.sleep(0.05)
        return events, time.perf_counter() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    sim = SimulationConfig(run_id="scale", steps=args.steps, rollout_batch_size=4, n_samples=4,
                           response_len_mean=64, prompt_len=16, seed=2, mode="open",
                           surplus_per_step=1)
    with EmbeddedBroker(free_port()) as broker, tempfile.TemporaryDirectory() as folder:
        for n in args.instances:
            events, seconds = process(broker.bootstrap_servers, sim, n, Path(folder))
            print(f"{n} instance(s): {events} events, {sim.steps} steps in {seconds:.1f} s: "
                  f"{events / seconds:,.0f} events/s")


if __name__ == "__main__":
    main()
