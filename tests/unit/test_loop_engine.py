"""The loop hands its engine kind to the worker and loads its policy the way that engine
reloads weights (no engine runs: a loopback HTTP server records the calls)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from ingest.commands.loop import LoopConfig, _load_policy, worker_command
from ingest.io.kafka import KafkaSettings
from tests.support.loopback_http import loopback_http

KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9092", topic_prefix="t.")
GATEWAY = "http://127.0.0.1:8080"


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_the_worker_runs_on_the_loops_sglang_engine_without_a_seed():
    command = worker_command(LoopConfig(engine="sglang", seed=7), KAFKA,
                             "http://127.0.0.1:30000", Path("/p"), GATEWAY, Path("/w.token"))
    assert flag(command, "--engine") == "sglang"
    assert flag(command, "--engine-url") == "http://127.0.0.1:30000"
    assert "--seed" not in command  # the worker refuses --seed with --engine sglang


def test_the_worker_runs_on_vllm_with_the_loops_seed_by_default():
    command = worker_command(LoopConfig(seed=7), KAFKA, "http://127.0.0.1:8000", Path("/p"),
                             GATEWAY, Path("/w.token"))
    assert (flag(command, "--engine"), flag(command, "--seed")) == ("vllm", "7")


@pytest.fixture
def recording_engine() -> Iterator[tuple[str, list[tuple[str, object]]]]:
    """A loopback server that answers every POST 200 `{"success": true}` and records it."""
    calls: list[tuple[str, object]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            calls.append((self.path, json.loads(raw) if raw else None))
            answer = b'{"success": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with loopback_http(Handler) as url:
        yield url, calls


def test_a_running_sglang_engine_gets_the_policy_through_update_weights_from_disk(
        recording_engine):
    url, calls = recording_engine
    asyncio.run(_load_policy("sglang", url, Path("/runs/loop/policy")))
    assert calls == [
        ("/pause_generation", {}), ("/flush_cache", None),
        ("/update_weights_from_disk", {"model_path": "/runs/loop/policy",
                                       "weight_version": "0"}),
        ("/continue_generation", {})]


def test_a_running_vllm_engine_gets_the_policy_through_reload_weights(recording_engine):
    url, calls = recording_engine
    asyncio.run(_load_policy("vllm", url, Path("/runs/loop/policy")))
    assert calls == [
        ("/pause?mode=wait", None),
        ("/collective_rpc", {"method": "reload_weights",
                             "kwargs": {"weights_path": "/runs/loop/policy"}}),
        ("/resume", None)]
