"""The `rolloutlake` command as a user runs it: help, one-line errors, replay and audit."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest

from ingest.cli import COMMANDS
from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.launch import CHILD_REPORTED, BatchChild
from tests.integration.pipeline import ordered_kafka, run_processor

READS_THE_LAKE = pytest.mark.one_broker("replay and audit read the lake; the broker only builds it")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "ingest.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if "kafka." not in ln]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: rolloutlake" in result.stdout


def test_bad_flag_is_one_line():
    assert "unrecognized arguments: --bogus" in one_line_error(cli("process", "--lake", "x",
                                                                   "--bogus"))


@pytest.mark.parametrize(("flags", "expected"), [
    # `--until-idle` is the processor's older spelling of `--until-idle-s`.
    (["--until-idle", "0"], "rolloutlake process: --until-idle-s: Input should be greater than 0"),
    (["--until-idle-s", "soon"], "rolloutlake process: --until-idle-s: Input should be a valid "
                                 "number, unable to parse string as a number"),
    (["--event-partitions", "0"],
     "rolloutlake process: --event-partitions: Input should be greater than or equal to 1"),
    (["--watermark-lag-s", "-1"],
     "rolloutlake process: --watermark-lag-s: Input should be greater than or equal to 0"),
    (["--stages", "some"], "rolloutlake process: error: argument --stages: invalid choice: "
                           "'some' (choose from 'all', 'groups', 'batches') (see --help)"),
])
def test_invalid_processor_setting_names_the_flag(tmp_path, flags, expected):
    assert one_line_error(cli("process", "--lake", str(tmp_path), *flags)) == expected
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_a_required_flag_is_one_line():
    assert one_line_error(cli("process")) == (
        "rolloutlake process: error: the following arguments are required: --lake (see --help)")


def test_unreachable_broker_is_one_line(tmp_path):
    line = one_line_error(cli("process", "--bootstrap-servers", "127.0.0.1:1", "--lake",
                              str(tmp_path)))
    assert line == ("rolloutlake process: no Kafka broker answers at 127.0.0.1:1 "
                    "(KafkaTimeoutError; last: KafkaConnectionError: 111 ECONNREFUSED)")


def test_broker_port_taken_and_binary_missing(broker):
    port = broker.bootstrap_servers.rsplit(":", 1)[1]
    assert "already in use" in one_line_error(cli("broker", "--port", port))
    missing = one_line_error(cli("broker", "--port", "0",
                                 env={"ROLLOUTLAKE_TANSU_BIN": "/nonexistent/tansu"}))
    assert "binary not found" in missing


@pytest.mark.parametrize(("flags", "expected"), [
    (["--abort-rate", "1.5"],
     "rolloutlake simulate: --abort-rate: Input should be less than or equal to 1"),
    (["--steps", "two"], "rolloutlake simulate: --steps: Input should be a valid integer, "
                         "unable to parse string as an integer"),
    (["--bootstrap-servers", ""],
     "rolloutlake simulate: --bootstrap-servers: String should have at least 1 character"),
])
def test_invalid_simulation_setting_names_the_flag(flags, expected):
    assert one_line_error(cli("simulate", *flags)) == expected


def _gateway_config_file(tmp_path, values) -> str:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--port", "70000", "--allow-anonymous"],
     "--port: Input should be less than or equal to 65535"),
    (["--body-limit-bytes", "1", "--allow-anonymous"],
     "--body-limit-bytes: Input should be greater than or equal to 1024"),
    (["--publish-timeout-s", "0", "--allow-anonymous"],
     "--publish-timeout-s: Input should be greater than 0"),
    ([], "tokens: no bearer token is configured; set tokens_file or ROLLOUTLAKE_GATEWAY_TOKENS, "
         "or allow_anonymous=true for a local stack"),
    (["--tokens-file", "{tmp}/missing.json"],
     "--tokens-file: cannot read {tmp}/missing.json: No such file or directory"),
    # The config file's keys are the field names; `lake_root` became `lake`.
    (["--config", "{config}"], "lake_root: Extra inputs are not permitted"),
    (["--config", "{config}", "--lake", "{tmp}/lake"],
     "lake_root: Extra inputs are not permitted"),
    (["--config", "{not_json}"],
     "--config {tmp}/not.json: Expecting value: line 1 column 1 (char 0)"),
    (["--config", "{a_list}"], "--config {tmp}/list.json: must hold a JSON object"),
])
def test_invalid_gateway_setting_names_the_flag(tmp_path, flags, expected):
    config = _gateway_config_file(tmp_path, {"lake_root": "x", "allow_anonymous": True})
    (tmp_path / "not.json").write_text("port = 8000\n")
    (tmp_path / "list.json").write_text("[]\n")
    args = [flag.format(tmp=tmp_path, config=config, not_json=tmp_path / "not.json",
                        a_list=tmp_path / "list.json") for flag in flags]
    line = one_line_error(cli("gateway", "--state-dir", str(tmp_path / "state"), *args))
    assert line == f"rolloutlake gateway: {expected.format(tmp=tmp_path)}"


@pytest.mark.parametrize(("flags", "expected"), [
    (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
    (["--use-kl-loss"], "--kl-loss-coef: must be > 0 when --use-kl-loss is set"),
    (["--custom-pg-loss-reducer-function-path", "dr_grpo"],
     "--custom-pg-loss-reducer-function-path: 'dr_grpo' is not of the form 'module.function' "
     "or 'module:function'"),
    (["--deepspeed", "{tmp}/missing.json"], "--deepspeed: no such file: {tmp}/missing.json"),
    (["--model", "{tmp}/none"], "--model: '{tmp}/none' is neither 'tiny' nor a local model folder"),
    # Kafka settings are nested in every service; any Kafka flag turns publishing on.
    (["--topic-prefix", "t.", "--event-partitions", "0"],
     "--event-partitions: Input should be greater than or equal to 1"),
])
def test_invalid_trainer_setting_names_the_flag(tmp_path, flags, expected):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    args = [flag.format(tmp=tmp_path) for flag in flags]
    line = one_line_error(cli("trainer", "--lake", str(tmp_path / "lake"), "--run", "r1",
                              "--deepspeed", str(ds), *args))
    assert line == f"rolloutlake trainer: {expected.format(tmp=tmp_path)}"


def test_engine_setting_names_the_flag():
    assert one_line_error(cli("engine", "--port", "0")) == (
        "rolloutlake engine: --port: Input should be greater than or equal to 1")


LAKE_COMMANDS = [
    ["process", "--bootstrap-servers", "127.0.0.1:1", "--lake", "{lake}"],
    ["gateway", "--lake", "{lake}", "--port", "0"],
    ["trainer", "--lake", "{lake}", "--run", "r1", "--deepspeed", "ds.json"],
    ["replay", "--lake", "{lake}", "--run", "r1"],
    ["audit", "--lake", "{lake}", "--run", "r1", "--group", "0"],
    ["lake", "vacuum", "--lake", "{lake}"],
]


@pytest.mark.parametrize("command", LAKE_COMMANDS)
def test_unsafe_s3_commits_are_refused_at_start(command):
    env = {"AWS_S3_ALLOW_UNSAFE_RENAME": "true", "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
           "AWS_REGION": "us-east-1"}
    line = one_line_error(cli(*[arg.format(lake="s3://bucket/lake") for arg in command],
                              env=env))
    assert line.startswith(f"rolloutlake {command[0]}: ")
    assert "AWS_S3_ALLOW_UNSAFE_RENAME is set" in line


@pytest.mark.parametrize("command", LAKE_COMMANDS)
def test_lake_path_delta_cannot_address_is_refused(command, tmp_path):
    lake = str(tmp_path / "lake^1")  # delta-rs panics on it
    line = one_line_error(cli(*[arg.format(lake=lake) for arg in command]))
    assert line.startswith(f"rolloutlake {command[0]}: ")
    assert f"lake path {lake!r} contains '^'" in line
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_a_lake_folder_the_processor_cannot_make_is_one_line(broker, tmp_path):
    """The processor makes the lake's tables on its way up; a folder it cannot make was a
    traceback (a file where a folder of the path should be)."""
    (tmp_path / "file").write_text("in the way")
    lake = str(tmp_path / "file" / "lake")
    line = one_line_error(cli("process", "--lake", lake, "--bootstrap-servers",
                              broker.bootstrap_servers, "--topic-prefix", f"nf{os.getpid()}.",
                              "--until-idle-s", "1",
                              # its own: none of a killed processor's folders to remove
                              "--spool-dir", str(tmp_path / "spool")))
    assert line == (f"rolloutlake process: cannot create the lake's events table under {lake}: "
                    f"Not a directory ({lake}/events)")


@pytest.mark.slow
def test_demo_keeps_kafka_client_noise_out_of_the_terminal(tmp_path):
    lake = tmp_path / "demo-lake"
    result = cli("demo", "--simulate", "--steps", "1", "--groups", "2", "--n-samples", "2", "--lake", str(lake),
                 timeout=300)
    assert result.returncode == 0, result.stderr
    assert "sealed steps" in result.stdout
    noise = [ln for ln in result.stderr.splitlines() if "kafka." in ln or "ECONNREFUSED" in ln]
    assert noise == []
    assert Lake(str(lake)).exists("steps")


def test_schemas_export(tmp_path):
    result = cli("schemas", "--json-schema", str(tmp_path))
    assert result.returncode == 0
    schema = json.loads((tmp_path / "sample_finished.schema.json").read_text())
    assert {"event_id", "run_id", "response_tokens", "status"} <= set(schema["properties"])
    assert "group_index" in schema["required"]


@pytest.fixture(scope="module")
def simulated_lake(broker, tmp_path_factory) -> str:
    kafka = ordered_kafka(broker.bootstrap_servers, "cli.")
    sim = SimulationConfig(run_id="cli-run", steps=3, rollout_batch_size=3, n_samples=4,
                           response_len_mean=32, prompt_len=8, mode="open", seed=2)
    run_simulation(kafka, sim)
    root = str(tmp_path_factory.mktemp("cli-lake"))
    run_processor(kafka, root, idle_s=1.5)
    return root


@READS_THE_LAKE
def test_replay_reproduces_the_original_batches(simulated_lake, tmp_path):
    result = cli("replay", "--lake", simulated_lake, "--run", "cli-run", "--into",
                 str(tmp_path / "replayed"), "--check")
    assert result.returncode == 0, result.stderr
    assert "every step hash, decision and metric equals the original (3 steps)" in result.stdout
    lake = Lake(simulated_lake)
    events = lake.read("events", filter=(pc.field("run_id") == "cli-run")
                       & (pc.field("type") != "run_started")).num_rows
    groups = lake.read("groups", filter=pc.field("run_id") == "cli-run").num_rows
    assert re.search(rf"re-derived {groups} groups from {events} events in [0-9.]+ s "
                     r"\([0-9,]+ events/s\) into ", result.stdout), result.stdout


@READS_THE_LAKE
def test_replay_under_another_filter_keeps_zero_std_groups(simulated_lake, tmp_path):
    out = tmp_path / "nofilter"
    result = cli("replay", "--lake", simulated_lake, "--run", "cli-run", "--config",
                 "filter=none", "--into", str(out))
    assert result.returncode == 0, result.stderr
    groups = Lake(str(out)).read("groups").to_pylist()
    assert not any((g["reason"] or "").startswith("zero_std") for g in groups)
    original = Lake(simulated_lake).read("groups").to_pylist()
    assert any((g["reason"] or "").startswith("zero_std") for g in original)


@READS_THE_LAKE
def test_replay_errors_are_one_line(simulated_lake, tmp_path):
    assert "has no events" in one_line_error(
        cli("replay", "--lake", simulated_lake, "--run", "nope", "--config-file",
            str(_config_file(tmp_path))))
    line = one_line_error(cli("replay", "--lake", simulated_lake, "--run", "cli-run",
                              "--config", "filter=no.such.fn"))
    assert line == ("rolloutlake replay: filter path 'no.such.fn': cannot import module "
                    "'no.such': No module named 'no'")
    line = one_line_error(cli("replay", "--lake", simulated_lake, "--run", "cli-run",
                              "--config", "batch=3"))
    assert line.startswith("rolloutlake replay: --config 'batch=3': unknown key 'batch'")


@READS_THE_LAKE
def test_replay_without_out_leaves_no_temporary_lake(simulated_lake, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    result = cli("replay", "--lake", simulated_lake, "--run", "cli-run", "--check", env=env)
    assert result.returncode == 0, result.stderr
    assert "every step hash, decision and metric equals the original (3 steps)" in result.stdout
    assert list(scratch.iterdir()) == []
    # An error after the temporary lake exists (the run has no events).
    one_line_error(cli("replay", "--lake", simulated_lake, "--run", "nope", "--config-file",
                       str(_config_file(tmp_path)), env=env))
    assert list(scratch.iterdir()) == []


@READS_THE_LAKE
def test_replay_interrupted_removes_its_temporary_lake(simulated_lake, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # A filter that says when it is called and blocks, so Ctrl-C lands while the replay
    # is deciding groups.
    deciding = tmp_path / "deciding"
    (tmp_path / "blocking_filter.py").write_text(
        "import pathlib, time\n\ndef keep(args, samples, **kw):\n"
        f"    pathlib.Path({str(deciding)!r}).touch()\n    time.sleep(600)\n    return True\n")
    # PYTHONFAULTHANDLER: a replay that does not end is aborted with its threads' stacks.
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(tmp_path),
           "PYTHONFAULTHANDLER": "1"}
    # SIGINT at its default, as in a terminal: a suite started in the background of a
    # non-interactive shell inherits it ignored, and Python then raises no
    # KeyboardInterrupt (the replay slept on in its filter).
    process = subprocess.Popen(
        [sys.executable, "-m", "ingest.cli", "replay", "--lake", simulated_lake, "--run",
         "cli-run", "--config", "filter=blocking_filter.keep"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not deciding.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.1)
    assert list(scratch.glob("replay-cli-run-*"))
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, stderr = process.communicate(timeout=30)
        pytest.fail(f"the replay did not end on Ctrl-C: {stderr[-4000:]}")
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert list(scratch.iterdir()) == []


def _config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"n_samples_per_prompt": 4, "rollout_batch_size": 3}))
    return path


@READS_THE_LAKE
def test_audit_shows_events_and_decision(simulated_lake):
    result = cli("audit", "--lake", simulated_lake, "--run", "cli-run", "--group", "0")
    assert result.returncode == 0, result.stderr
    assert "group_started" in result.stdout and "decision:" in result.stdout
    missing = one_line_error(cli("audit", "--lake", simulated_lake, "--run", "cli-run",
                                 "--group", "99999"))
    assert "no archived events" in missing


def test_a_session_timeout_the_broker_refuses_is_one_line(broker, tmp_path):
    """Apache Kafka refuses a session timeout under group.min.session.timeout.ms (6000 by
    default); Tansu takes any, and the processor runs."""
    result = cli("process", "--lake", str(tmp_path / "lake"), "--bootstrap-servers",
                 broker.bootstrap_servers, "--topic-prefix", f"st{os.getpid()}.",
                 "--session-timeout-ms", "2000", "--until-idle-s", "2")
    if broker.engine == "kafka":
        assert one_line_error(result) == (
            "rolloutlake process: --session-timeout-ms: the broker refuses 2000 ms (outside its "
            "group.min.session.timeout.ms..group.max.session.timeout.ms; Apache Kafka's minimum "
            "is 6000 by default)")
    else:
        assert result.returncode == 0, result.stderr


# Runs `rolloutlake process` with every consumer-group member's start noted on stdout,
# with the lake's modules loaded by then.
_WATCHED_JOINS = """
import sys
from ingest import cli
from ingest.processor import membership

start = membership.GroupMember.__init__

def noted(self, config, role):
    loaded = [m for m in ("numpy", "pyarrow", "deltalake") if m in sys.modules]
    print("member", role, *loaded, flush=True)
    start(self, config, role)

membership.GroupMember.__init__ = noted
sys.exit(cli.main(sys.argv[1:]))
"""


def test_the_group_stage_starts_joining_before_the_lake_modules_load(broker, tmp_path):
    """Most of a start is the consumer groups' joins (Tansu holds a JoinGroup for half the
    session timeout): the group stage's member starts joining before deltalake, pyarrow
    and numpy load, so their imports and the tables happen while the broker holds it."""
    sim = SimulationConfig(run_id="early-join", steps=1, rollout_batch_size=1, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=3, mode="open")
    kafka = ordered_kafka(broker.bootstrap_servers, f"ej{os.getpid()}.")
    run_simulation(kafka, sim)
    lake = tmp_path / "lake"
    result = subprocess.run(
        [sys.executable, "-c", _WATCHED_JOINS, "process", "--lake", str(lake),
         "--bootstrap-servers", broker.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
         "--until-idle-s", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["member groups"]  # the child's is its own process
    assert Lake(str(lake)).read("steps", columns=["step"]).num_rows == sim.steps


@pytest.mark.one_broker("only Apache Kafka refuses a session timeout", engine="kafka")
def test_a_batch_stage_child_sends_its_error_to_the_parent_at_once(broker, tmp_path, capfd):
    """Both stages meet a refused flag at once; the parent says it (its own error first),
    so the child sends its own to the parent instead of printing it. It once slept 15 s
    before printing, so that the parent's line came first."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"child{os.getpid()}.")
    config = ProcessorConfig(kafka=kafka, lake=str(tmp_path / "lake"), session_timeout_ms=2000)
    child = BatchChild()
    child.configure(config, logging.WARNING)
    child.tables_ready(None)
    child.process.join(60)
    assert child.process.exitcode == CHILD_REPORTED
    assert child.reported_error() == (
        "--session-timeout-ms: the broker refuses 2000 ms (outside its "
        "group.min.session.timeout.ms..group.max.session.timeout.ms; Apache Kafka's minimum "
        "is 6000 by default)")
    assert "rolloutlake process:" not in capfd.readouterr().err  # the parent's to say


def test_without_a_session_timeout_the_stages_join_with_the_shortest_the_broker_takes(
        broker, tmp_path):
    """Tansu takes 2000 ms, where a join takes 1 s instead of 3 s at 6000; Apache Kafka
    refuses it, and each stage joins with 6000 ms instead."""
    status = tmp_path / "status"
    result = cli("process", "--lake", str(tmp_path / "lake"), "--bootstrap-servers",
                 broker.bootstrap_servers, "--topic-prefix", f"sd{os.getpid()}.",
                 "--status-dir", str(status), "--until-idle-s", "2")
    assert result.returncode == 0, result.stderr
    joined_with = {stage: json.loads((status / f"{stage}.json").read_text())["session_timeout_ms"]
                   for stage in ("groups", "batches")}
    refusals = [line for line in result.stderr.splitlines()
                if "the broker refuses a 2000 ms session timeout; joining with 6000 ms" in line]
    if broker.engine == "kafka":
        assert joined_with == {"groups": 6000, "batches": 6000}
        assert len(refusals) == 2, result.stderr
    else:
        assert joined_with == {"groups": 2000, "batches": 2000}
        assert refusals == [], result.stderr
