"""A real `rolloutlake engine` (vLLM CPU, tiny policy) for the modules that test against one,
and the worker command line they run against it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ingest.io.broker import free_port
from ingest.io.kafka import read_topics
from schemas.events import parse_event
from tests.support.engine_under_test import engine_flags, engine_under_test

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ingest.cli"]
# Room for samples that take seconds to generate: a seal has to land in the middle of one
# also when a loaded machine delays it (the partial-rollout test).
MAX_MODEL_LEN = 2048


@dataclass
class RunningEngine:
    url: str
    process: subprocess.Popen[str]
    tiny_dir: Path
    log_file: Path


@contextmanager
def running_engine(root: Path) -> Iterator[RunningEngine]:
    """`rolloutlake engine` (the engine under test) on a free port with the tiny policy under `root`; fails the test
    when it does not start, terminates it afterwards."""
    port = free_port()
    log_file = root / "engine.log"
    process = subprocess.Popen(
        [*CLI, "engine", "--port", str(port), "--tiny-dir", str(root / "tiny"),
         "--max-model-len", str(MAX_MODEL_LEN), *engine_flags(engine_under_test()),
         "--log-file", str(log_file)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = process.stdout.readline()  # the command prints one line once /health answers
    if "engine ready" not in ready:
        process.kill()
        pytest.fail(f"rolloutlake engine did not start: {ready}{process.stderr.read()}")
    try:
        yield RunningEngine(f"http://127.0.0.1:{port}", process, root / "tiny", log_file)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)


def write_dataset(path: Path, rows_: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def worker_command(engine: RunningEngine, kafka, run_id: str, dataset: Path, reward_path: str,
                   *extra: str) -> list[str]:
    return [*CLI, "worker", "--run", run_id, "--prompt-data", str(dataset),
            "--label-key", "label", "--tokenizer", str(engine.tiny_dir),
            "--custom-rm-path", reward_path, "--engine", engine_under_test(),
            "--engine-url", engine.url,
            "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
            *extra]


def published(kafka, run_id: str, idle_s: float = 3.0) -> list:
    """Every event of the run on `rollout.events`, read back from the broker."""
    events = [parse_event(json.loads(record.value))
              for record in read_topics(kafka, [kafka.topics.events], what="test",
                                        timeout_s=120, quiet_ms=int(idle_s * 1000))]
    return [e for e in events if e.run_id == run_id]
