"""Helpers for the gateway integration tests: a real uvicorn server in a thread.

The app runs exactly as in production (lifespan, middleware, real Kafka, real Delta); the
tests talk to it over loopback HTTP with httpx.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig, hash_token, load_config
from ingest.io.broker import free_port
from ingest.io.kafka import KafkaSettings, read_topics

# How long a test's HTTP request may wait: under the suite's load a process was not
# scheduled for seconds at a time, and a first /openapi.json once took over 10 s.
CLIENT_TIMEOUT_S = 60

# token -> (name, scopes, runs)
TOKENS: dict[str, tuple[str, list[str], list[str] | None]] = {
    "admin-token": ("admin", ["write"], None),
    "reader-token": ("reader", ["read"], None),
    "run-a-writer": ("run-a-writer", ["write"], ["run-a"]),
    "run-a-reader": ("run-a-reader", ["read"], ["run-a"]),
}


def token_specs() -> list[dict[str, Any]]:
    return [{"name": name, "sha256": hash_token(token), "scopes": scopes, "runs": runs}
            for token, (name, scopes, runs) in TOKENS.items()]


def gateway_config(kafka: KafkaSettings, lake_root: str, state_dir: Path,
                   **overrides: Any) -> GatewayConfig:
    values: dict[str, Any] = {
        "kafka": kafka.model_dump(), "lake": lake_root, "state_dir": state_dir,
        "port": free_port(), "tokens": token_specs(), "publish_timeout_s": 5,
    }
    values.update(overrides)
    return load_config(values, env={})


class ServedGateway:
    """A gateway the tests reach over loopback HTTP at `url`."""

    url: str

    def client(self, token: str | None = "admin-token", **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=CLIENT_TIMEOUT_S,
                            **kwargs)

    def openapi_schema(self) -> Any:
        """The served OpenAPI schema, loaded by schemathesis (whose own timeout is 10 s)."""
        import schemathesis  # only the schema tests load it

        return schemathesis.openapi.from_url(f"{self.url}/openapi.json",
                                             timeout=CLIENT_TIMEOUT_S)


class RunningGateway(ServedGateway):
    """`create_app(config)` served by uvicorn on a free loopback port."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=config.port, log_config=None, access_log=False,
            timeout_graceful_shutdown=5,
        ))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{config.port}"

    def __enter__(self) -> RunningGateway:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class GatewayProcess(ServedGateway):
    """`rolloutlake gateway --config <file>` in its own process, as deployed; `kill()`
    ends it with SIGKILL (no graceful shutdown, no final checkpoint)."""

    def __init__(self, config: GatewayConfig, config_file: Path):
        self.config = config
        self.config_file = config_file
        self.url = f"http://127.0.0.1:{config.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> GatewayProcess:
        self.config_file.write_text(json.dumps(self.config.model_dump(mode="json")))
        root = Path(__file__).resolve().parents[2]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ingest.cli", "gateway", "--config", str(self.config_file)],
            cwd=root, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"gateway exited with {self.process.returncode}: {err[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).json()["kafka"] == "connected":
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("gateway process did not become ready")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to checkpoint or flush."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM: graceful shutdown (drain, final checkpoint, flush)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.kill()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()


def sample_events(run_id: str, group_index: int, n: int = 2, tokens: int = 64,
                  step: int = 0) -> list[dict[str, Any]]:
    """A realistic group: its `group_started` and `n` finished samples with rewards."""
    events: list[dict[str, Any]] = [{
        "event_id": uuid.uuid4().hex, "type": "group_started", "schema_version": 1,
        "run_id": run_id, "group_index": group_index, "step": step, "n_samples": n,
        "prompt": "What is 2+2?",
    }]
    for rollout in range(n):
        events.append({
            "event_id": uuid.uuid4().hex, "type": "sample_finished", "schema_version": 1,
            "run_id": run_id, "group_index": group_index, "rollout_id": rollout,
            "status": "completed", "prompt_tokens": list(range(32)),
            "response_tokens": list(range(1000, 1000 + tokens)),
            "rollout_log_probs": [-0.5] * tokens, "reward": float(rollout % 2),
        })
    return events


def consume_all(kafka: KafkaSettings, topic: str) -> list[Any]:
    """Every record of `topic`, from the beginning to its current end."""
    return read_topics(kafka, [topic], what="test", timeout_s=60)


def unique_run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"
