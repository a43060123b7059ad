"""`rolloutlake up`: the whole local stack in one command: broker, processor, gateway.

The embedded broker (Tansu, memory storage) runs as a child process, the stream processor
as `python -m ingest.cli process` in a fresh interpreter (subprocess = fork + immediate
exec, so no delta-rs state is inherited: delta-rs panics in a forked child that uses it),
and the gateway in this process. Ctrl-C stops the gateway (flushing its producer), then
the processor, then the broker.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

from gateway.config import load_config
from gateway.main import serve
from ingest.io.broker import DEFAULT_PORT, EmbeddedBroker

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--broker-port", type=int, default=DEFAULT_PORT,
                        help=f"embedded broker port (default {DEFAULT_PORT})")
    parser.add_argument("--bootstrap-servers",
                        help="use this Kafka instead of starting the embedded broker")
    parser.add_argument("--lake", default="./lake", help="Delta lake root (default ./lake)")
    parser.add_argument("--state-dir", default="./gateway-state", help="gateway state folder")
    parser.add_argument("--tokens-file", type=Path,
                        help="hashed tokens; without one the local gateway needs no token")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run(args: argparse.Namespace) -> int:
    config = load_config({
        "port": args.port, "lake": args.lake, "state_dir": args.state_dir,
        "tokens_file": args.tokens_file, "allow_anonymous": args.tokens_file is None,
        "kafka": {"bootstrap_servers": args.bootstrap_servers or f"127.0.0.1:{args.broker_port}"},
    })
    broker = None if args.bootstrap_servers else EmbeddedBroker(args.broker_port).start()
    try:
        config.kafka.ensure_topics()
        processor = subprocess.Popen([
            sys.executable, "-m", "ingest.cli", "process",
            "--bootstrap-servers", config.kafka.bootstrap_servers, "--lake", config.lake,
            "--event-partitions", str(config.kafka.event_partitions),
        ])
        try:
            print(f"rolloutlake up: gateway http://{config.host}:{config.port}  "
                  f"kafka {config.kafka.bootstrap_servers}  lake {config.lake}", flush=True)
            serve(config)
        finally:
            _stop(processor)
    finally:
        if broker is not None:
            broker.stop()
    return 0
