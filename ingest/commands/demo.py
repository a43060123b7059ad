"""`make demo` / `rolloutlake demo`: the whole RL loop, or the simulated pipeline.

`rolloutlake demo` runs the whole loop (`ingest.commands.loop`): a tiny policy on the vLLM
CPU engine learns a task through Kafka, the processor, Delta and the DeepSpeed trainer.
`rolloutlake demo --simulate` starts the embedded broker, the stream processor and the
simulator (closed loop, Miles rollout semantics) for 5 steps of 32 groups x 8 samples with
the DAPO filter, then prints one row per sealed step and where the tables are.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path

from rich.console import Console

from ingest.commands import loop
from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.commands.step_table import step_table
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor
from schemas.errors import RolloutlakeError

SIMULATED = {"steps": 5, "groups": 32, "n_samples": 8, "seed": 0}  # --simulate's defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", action="store_true",
                        help="the quick simulated pipeline (simulator, processor, Delta; no "
                             "engine or trainer): 5 steps of 32 groups x 8 samples by default")
    parser.add_argument("--lake", type=Path, default=None,
                        help="with --simulate: lake root (default: a fresh folder under ./lake/)")
    loop.add_arguments(parser)  # --steps, --groups, --n-samples and --seed serve both


def run(args: argparse.Namespace) -> int:
    if not args.simulate:
        return loop.run(args)
    for name, default in SIMULATED.items():
        if getattr(args, name, None) is None:  # loop flags leave unset values out
            setattr(args, name, default)
    # The demo owns its broker, and a failure there surfaces as a processor or simulator
    # error it reports; kafka-python's own records (slow-poll warnings on a busy machine,
    # reconnects) would only clutter the terminal the demo draws in.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    console = Console(width=None if Console().is_terminal else 120)
    root = args.lake or Path("lake") / time.strftime("demo-%Y%m%d-%H%M%S")
    run_id = "demo"
    sim = SimulationConfig(run_id=run_id, steps=args.steps, rollout_batch_size=args.groups,
                           n_samples=args.n_samples, seed=args.seed, tokens_per_s=1500.0)
    started = time.monotonic()
    with EmbeddedBroker(free_port()) as broker:
        console.print(f"broker: Tansu at {broker.bootstrap_servers} (memory storage)")
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        kafka.ensure_topics()
        processor = Processor(ProcessorConfig(kafka=kafka, lake=str(root), until_idle_s=3.0))
        thread = threading.Thread(target=processor.run, name="processor", daemon=True)
        thread.start()
        try:
            with console.status("simulating: steps seal as kept groups arrive") as status:
                def progress(step: int, stats: dict[str, int]) -> None:
                    status.update(f"step {step}/{sim.steps}: {stats['groups']} groups issued, "
                                  f"{stats['cancelled_groups']} cancelled at seal")

                stats = run_simulation(kafka, sim, progress=progress)
            with console.status("processor: committing the last decisions"):
                thread.join(timeout=120)
        finally:
            processor.stop()
        if processor.errors:
            raise RolloutlakeError(f"processor failed: {processor.errors[0]}")
    lake = Lake(root)
    console.print(step_table(lake, run_id))
    console.print(
        f"{stats['groups']} groups issued, {stats['events']} events published in "
        f"{time.monotonic() - started:.1f} s\n"
        f"tables (Delta Lake) under {root.resolve()}/: "
        + ", ".join(t for t in ("events", "groups", "samples", "training_batches", "steps",
                                "step_metrics", "dead_letters") if lake.exists(t))
    )
    return 0
