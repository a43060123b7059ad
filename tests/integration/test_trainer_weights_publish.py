"""The trainer's `weights_updated` publish against a broker that dies under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from ingest.io.broker import EmbeddedBroker, free_port
from tests.support.suite_kafka import SUITE_BROKER_START_S

# One trainer's outputs (rank 0's StepSink) in a process of its own, so that its exit, and
# what kafka-python's exit handler prints and waits for there, is seen too. The first publish is
# acknowledged; the broker is killed before the second.
SINK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from ingest.io.kafka import KafkaSettings
    from ingest.io.lake import Lake
    from schemas.errors import BrokerUnavailableError
    from trainer.config import TrainerConfig
    from trainer.outputs import StepSink

    servers, broker_pid, root = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    (root / "ds.json").write_text("{}")
    config = TrainerConfig(
        lake=str(root / "lake"), run_id="run-w", deepspeed=root / "ds.json",
        output_dir=root / "out", wandb_mode="disabled",
        kafka=KafkaSettings(bootstrap_servers=servers, topic_prefix="weights."),
    )
    sink = StepSink(config, Lake(config.lake))
    sink.publish_weights(1, root / "out" / "step_1", 1)
    os.kill(broker_pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        sink.publish_weights(2, root / "out" / "step_2", 2)
    except BrokerUnavailableError as err:
        print(f"refused after {time.monotonic() - started:.1f}s: {err}", flush=True)
    sink.close()
    print(f"closed after {time.monotonic() - started:.1f}s", flush=True)
""")


def test_a_weights_publish_on_a_dead_broker_says_so_and_lets_the_trainer_exit(tmp_path):
    """The publish waited 30 s for its acknowledgement, then let kafka-python's
    KafkaTimeoutError out, which `rolloutlake trainer` printed as a traceback (and
    kafka-python's exit handler printed two more, closing a producer that still held the
    record). It is now the one-line error of an unreachable broker that says the step will
    be published again, the producer is dropped, and the process ends soon after."""
    broker = EmbeddedBroker(free_port()).start(SUITE_BROKER_START_S)
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", SINK_SCRIPT, broker.bootstrap_servers,
             str(broker.process.pid), str(tmp_path)],
            capture_output=True, text=True, timeout=240,
        )
        took = time.monotonic() - started
    finally:
        if broker.process.poll() is None:
            os.kill(broker.process.pid, signal.SIGKILL)
        broker.stop()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused after "), done.stdout + done.stderr
    assert "weights_updated for step 2" in lines[0] and "not acknowledged" in lines[0]
    assert "a restart publishes it again" in lines[0]
    assert lines[1].startswith("closed after ")
    assert "Traceback" not in done.stderr
    assert took < 75, (took, done.stdout, done.stderr)
