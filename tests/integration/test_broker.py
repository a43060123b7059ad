"""`rolloutlake broker` on both engines as an operator runs it: start, stop, kill -9, errors."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from ingest.io.broker import ENGINES, EmbeddedBroker, free_port, port_is_free
from tests.support.suite_kafka import SUITE_BROKER_START_S

START_TIMEOUT_S = SUITE_BROKER_START_S + 30


def _wrapper(engine: str, port: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "broker", "--engine", engine, "--port", str(port),
         "--start-timeout-s", str(SUITE_BROKER_START_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_ready(wrapper: subprocess.Popen[str]) -> str:
    assert wrapper.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([wrapper.stdout], [], [], 1.0)
        if readable:
            line = wrapper.stdout.readline()
            assert line, f"the broker wrapper exited: {wrapper.wait()} {wrapper.stderr.read()}"
            if "ready at" in line:
                return line
    pytest.fail(f"the broker wrapper printed no ready line within {START_TIMEOUT_S:.0f} s")


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended since the listing (a clean-clone CI run)
            continue
    return children


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie waiting for its new parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _workdirs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"rolloutlake-broker-{pid}-*"))


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("engine", ENGINES)
def test_kill_9_of_the_wrapper_takes_the_broker_with_it(engine):
    port = free_port()
    wrapper = _wrapper(engine, port)
    children: list[int] = []
    try:
        _wait_ready(wrapper)
        children = _children(wrapper.pid)
        assert children, "the wrapper has no broker child"
        assert _workdirs(wrapper.pid), "the broker has no temporary directory"
        wrapper.kill()
        wrapper.wait()
        # The killed wrapper could not remove its temporary directory: the next broker
        # does. (Looked at at once: another test's broker starting meanwhile removes it too.)
        left_behind = _workdirs(wrapper.pid)
        assert left_behind
        assert _eventually(lambda: not any(_running(child) for child in children)), (
            f"the {engine} broker outlived kill -9 of its wrapper")
        assert _eventually(lambda: port_is_free("127.0.0.1", port)), f"port {port} still taken"
    finally:
        wrapper.kill()
        for child in children:
            if _running(child):
                os.kill(child, signal.SIGKILL)
    with EmbeddedBroker(free_port(), engine=engine).start(SUITE_BROKER_START_S):
        assert not any(path.exists() for path in left_behind)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_stops_the_broker_cleanly(engine, stop_signal):
    port = free_port()
    wrapper = _wrapper(engine, port)
    try:
        ready = _wait_ready(wrapper)
        assert f"ready at 127.0.0.1:{port}" in ready
        children = _children(wrapper.pid)
        wrapper.send_signal(stop_signal)
        stdout, stderr = wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, stderr
    assert stdout.strip().endswith("broker stopped")
    assert "Traceback" not in stderr
    assert not any(_running(child) for child in children)
    assert port_is_free("127.0.0.1", port)
    assert not _workdirs(wrapper.pid)


def _one_line_error(engine: str, port: int, env: dict[str, str] | None = None) -> str:
    wrapper = _wrapper(engine, port, env)
    stdout, stderr = wrapper.communicate(timeout=120)
    assert wrapper.returncode == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert not _workdirs(wrapper.pid)
    return lines[0]


def test_kafka_engine_errors_are_one_line(tmp_path):
    jars_missing = _one_line_error("kafka", free_port(), {"ROLLOUTLAKE_KAFKA_LIBS": str(tmp_path)})
    assert jars_missing == (f"rolloutlake broker: the Apache Kafka jars are not in {tmp_path}: "
                            "fetch them with `sh deploy/kafka/fetch.sh`")
    java_missing = _one_line_error("kafka", free_port(), {"JAVA_HOME": str(tmp_path)})
    assert java_missing.startswith(f"rolloutlake broker: the kafka engine needs Java 17 or later "
                                   f"and none was found on JAVA_HOME={tmp_path}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _one_line_error("kafka", port) == (
            f"rolloutlake broker: port {port} on 127.0.0.1 is already in use; "
            "pick another with --port")


def _fake_java(home: Path, script: str) -> str:
    java = home / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n" + script)
    java.chmod(0o755)
    return str(home)


def test_a_kafka_that_fails_to_start_says_why_in_one_line(tmp_path):
    format_fails = _fake_java(tmp_path / "format", "echo 'Invalid cluster.id' >&2; exit 1\n")
    assert _one_line_error("kafka", free_port(), {"JAVA_HOME": format_fails}) == (
        "rolloutlake broker: formatting Apache Kafka's storage failed: Invalid cluster.id")
    start_fails = _fake_java(tmp_path / "start", (
        'case "$*" in *StorageTool*) exit 0;; esac\n'
        "echo 'ERROR Exiting Kafka due to fatal exception' >&2; exit 1\n"))
    port = free_port()
    assert _one_line_error("kafka", port, {"JAVA_HOME": start_fails}) == (
        f"rolloutlake broker: Apache Kafka exited with code 1 while starting on "
        f"127.0.0.1:{port}: ERROR Exiting Kafka due to fatal exception")


def test_a_format_that_fails_with_a_stack_trace_names_its_root_cause(tmp_path):
    """Java prints a stack trace whose last line ("... 8 more") says nothing: the line
    names the trace's root cause (a CI run once showed only "... 8 more")."""
    trace = "\n".join([
        "echo 'Exception in thread \"main\" java.lang.RuntimeException: Failed to format' >&2",
        "echo '\tat kafka.tools.StorageTool$.main(StorageTool.scala:48)' >&2",
        "echo 'Caused by: java.nio.file.AccessDeniedException: /tmp/data/meta.properties' >&2",
        "echo '\tat java.base/sun.nio.fs.UnixException.translateToIOException(Unix.java:90)' >&2",
        "echo '\t... 8 more' >&2",
        "exit 1",
    ])
    java = _fake_java(tmp_path / "trace", trace + "\n")
    assert _one_line_error("kafka", free_port(), {"JAVA_HOME": java}) == (
        "rolloutlake broker: formatting Apache Kafka's storage failed: Caused by: "
        "java.nio.file.AccessDeniedException: /tmp/data/meta.properties")


def test_unknown_engine_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "broker", "--engine", "redpanda"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("rolloutlake broker: error: argument --engine: invalid choice: "
                           "'redpanda' (choose from ")


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_start_timeout_that_is_not_a_positive_number_is_one_line(value):
    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "broker", "--start-timeout-s", value],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"rolloutlake broker: error: argument --start-timeout-s: {value!r} is not a positive "
        "number of seconds (see --help)")


def test_a_broker_slower_than_its_start_timeout_is_one_line_and_leaves_no_process():
    """A JVM does not answer within half a second."""
    port = free_port()
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "broker", "--engine", "kafka", "--port", str(port),
         "--start-timeout-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = wrapper.communicate(timeout=60)
    assert wrapper.returncode == 2
    assert err.strip() == (f"rolloutlake broker: Apache Kafka did not answer on "
                           f"127.0.0.1:{port} within 0.5 s")
    # The JVM it started is gone (its command line names the broker's work folder), and so
    # is the folder.
    workdir = f"{tempfile.gettempdir()}/rolloutlake-broker-{wrapper.pid}-"
    assert not list(Path(tempfile.gettempdir()).glob(f"rolloutlake-broker-{wrapper.pid}-*"))
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if workdir in cmdline.read_bytes().decode(errors="replace"):
                left.append(cmdline.parent.name)
        except OSError:
            continue
    assert left == []


def test_the_kafka_node_does_not_fence_its_own_broker_over_a_freeze():
    """On a starved machine the controller of the embedded node fenced its own broker
    (9 s without a heartbeat, Kafka's default), and topic creation failed with "All brokers
    are currently fenced": the running node must tolerate a minute."""
    session = "broker.session.timeout.ms"
    with EmbeddedBroker(free_port(), engine="kafka").start(SUITE_BROKER_START_S) as broker:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap_servers,
                                 request_timeout_ms=30_000)
        try:
            described = admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, "1", configs=[session])],
                config_filter="all")
        finally:
            admin.close()
    assert int(described["broker"]["1"][session]["value"]) >= 60_000
