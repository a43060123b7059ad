"""Secured Kafka for real: Apache Kafka with a SASL_SSL listener, a CA made here, SCRAM users,
and ACLs enforced by the broker's StandardAuthorizer.

The broker's certificate is signed by a CA this module creates with `openssl`; the SCRAM
user is created with Kafka's own `kafka-configs` tool over the broker's internal listener,
which is anonymous and the only super user. Each test grants its principals, on its own
topics, the ACLs docs/kafka-security.md lists: with them the publisher's and the processor's
principals carry a run into Delta, and the publisher's cannot write decisions. A wrong
password, a wrong CA, plaintext to the TLS port and a missing ACL are each refused with one
line that says which: for the processor, the SDK, the gateway (which serves on, answering
503, and publishes once the ACLs are granted), the worker and the trainer.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from kafka.admin import (
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)
from kafka.errors import TopicAuthorizationFailedError

from gateway.producer import REFUSED_RETRY_S
from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from ingest.sdk.publisher import RolloutPublisher
from ingest.workers.control import ControlFollower
from schemas.errors import AccessRefusedError, BrokerUnavailableError, RolloutlakeError
from schemas.events import decode_event
from tests.integration.pipeline import event, publish, rows, sample
from tests.support.coalescing_proxy import coalescing_proxy
from tests.support.engine_server import write_dataset
from tests.support.gateway_support import (
    RunningGateway,
    consume_all,
    gateway_config,
    sample_events,
)
from tests.support.loopback_http import loopback_http
from tests.support.suite_kafka import SUITE_BOOTSTRAP_TIMEOUT_MS, SUITE_BROKER_START_S
from trainer.config import TrainerConfig
from trainer.outputs import StepSink
from trainer.tiny import tiny_tokenizer

SCRAM_USER, SCRAM_PASSWORD = "rollouts", f"scram-{uuid.uuid4().hex}"
PLAIN_USER, PLAIN_PASSWORD = "gateway", f"plain-{uuid.uuid4().hex}"
# A principal no test grants WRITE on any topic.
TRAINER_USER, TRAINER_PASSWORD = "trainer", f"plain-{uuid.uuid4().hex}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=folder)


def _make_broker_keystore(folder: Path) -> Path:
    """A PEM keystore (unencrypted PKCS#8 key + certificate for 127.0.0.1) signed by `ca`."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key",
             "-out", "broker.csr", "-subj", "/CN=localhost", cwd=folder)
    (folder / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "broker.pem",
             cwd=folder)
    _openssl("pkcs8", "-topk8", "-nocrypt", "-in", "broker.key", "-out", "broker.pk8",
             cwd=folder)
    keystore = folder / "keystore.pem"
    keystore.write_text((folder / "broker.pk8").read_text() + (folder / "broker.pem").read_text())
    return keystore


@dataclass(frozen=True)
class SecuredKafka:
    broker: EmbeddedBroker
    sasl_ssl: str
    """`host:port` of the SASL_SSL listener."""
    ca: Path
    other_ca: Path

    def super_user(self, prefix: str = "") -> KafkaSettings:
        """Settings for the internal listener, whose anonymous principal the ACLs do not
        bind: what an admin creates topics and grants ACLs with."""
        return KafkaSettings(bootstrap_servers=self.broker.bootstrap_servers,
                             topic_prefix=prefix, event_partitions=1, decision_partitions=1)

    def env(self, **overrides: str) -> dict[str, str]:
        """The ROLLOUTLAKE_KAFKA_* variables of the SCRAM user, with `overrides`."""
        values = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                  "sasl_username": SCRAM_USER, "sasl_password": SCRAM_PASSWORD,
                  "ssl_cafile": str(self.ca), **overrides}
        return {f"ROLLOUTLAKE_KAFKA_{key.upper()}": value for key, value in values.items()}


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> SecuredKafka:
    folder = tmp_path_factory.mktemp("tls")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    keystore = _make_broker_keystore(folder)
    sasl_port = free_port()
    plain_login = (f'org.apache.kafka.common.security.plain.PlainLoginModule required '
                   f'user_{PLAIN_USER}="{PLAIN_PASSWORD}" '
                   f'user_{TRAINER_USER}="{TRAINER_PASSWORD}";')
    scram_login = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    broker = EmbeddedBroker(free_port(), engine="kafka", kafka_listeners={"SASL_SSL": sasl_port},
                            kafka_properties={
                                "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-512",
                                "listener.name.sasl_ssl.plain.sasl.jaas.config": plain_login,
                                "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                                    scram_login,
                                "ssl.keystore.type": "PEM",
                                "ssl.keystore.location": str(keystore),
                                "authorizer.class.name": "org.apache.kafka.metadata."
                                                         "authorizer.StandardAuthorizer",
                                # the internal listeners: the tools, and the tests' admin
                                "super.users": "User:ANONYMOUS",
                            })
    with broker.start(SUITE_BROKER_START_S):
        created = broker.kafka_tool(
            "org.apache.kafka.tools.ConfigCommand", "--bootstrap-server",
            broker.bootstrap_servers, "--alter", "--entity-type", "users", "--entity-name",
            SCRAM_USER, "--add-config", f"SCRAM-SHA-512=[iterations=4096,password={SCRAM_PASSWORD}]",
        )
        assert created.returncode == 0, created.stderr
        yield SecuredKafka(broker, f"127.0.0.1:{sasl_port}", folder / "ca.pem",
                           folder / "other-ca.pem")


def _cli(*args: str, env: dict[str, str],
         bootstrap_timeout_ms: int = 20_000) -> subprocess.CompletedProcess[str]:
    # Four times the default: under the suite's load the first TLS and SCRAM handshake with
    # the broker took longer than 5 s, once longer than 10 s, and the line must name the
    # refusal, not a timeout. (A refused client retries until the bootstrap timeout: each
    # error test waits it out.)
    args = (*args, "--bootstrap-timeout-ms", str(bootstrap_timeout_ms))
    return subprocess.run([sys.executable, "-m", "ingest.cli", *args], capture_output=True,
                          text=True, timeout=180, env={**os.environ, **env})


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    """The error a command stopped on, after what it logged while it ran."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.splitlines()[-1]


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The error a command stopped on, all it printed."""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return _last_line(result)


# docs/kafka-security.md, "ACLs": what each service's principal needs on the contract
# topics (DESCRIBE on each too) and on its consumer groups.
PROCESSOR_TOPIC_ACLS = {"events": ("READ",), "runs": ("READ",), "decisions": ("READ", "WRITE"),
                        "control": ("WRITE",), "deadletter": ("WRITE",)}
PUBLISHER_TOPIC_ACLS = {"events": ("WRITE",), "runs": ("WRITE",)}


def _grant(secured: SecuredKafka, user: str, prefix: str, topic_acls: dict[str, tuple[str, ...]],
           *, create: bool = False, group: bool = False) -> None:
    """Allow `user` the operations of `topic_acls` (plus DESCRIBE, and CREATE with `create`)
    on the contract topics under `prefix`, and READ on the processor's consumer groups
    (`<prefix>rolloutlake-*`) with `group`; returns once the broker lists them."""
    topics = KafkaSettings(topic_prefix=prefix).topics

    def acl(kind: ResourceType, name: str, operation: str,
            pattern: ACLResourcePatternType = ACLResourcePatternType.LITERAL) -> ACL:
        return ACL(f"User:{user}", "*", ACLOperation[operation], ACLPermissionType.ALLOW,
                   ResourcePattern(kind, name, pattern))

    acls = [acl(ResourceType.TOPIC, getattr(topics, topic), operation)
            for topic, operations in topic_acls.items()
            for operation in (*operations, "DESCRIBE", *(("CREATE",) if create else ()))]
    if group:
        acls.append(acl(ResourceType.GROUP, f"{prefix}rolloutlake", "READ",
                        ACLResourcePatternType.PREFIXED))
    admin = secured.super_user().admin()
    try:
        admin.create_acls(acls)
        mine = ACLFilter(f"User:{user}", None, ACLOperation.ANY, ACLPermissionType.ANY,
                         ResourcePatternFilter(ResourceType.ANY, None,
                                               ACLResourcePatternType.ANY))
        deadline = time.monotonic() + 30
        while True:
            listed, _ = admin.describe_acls(mine)
            if {(a.resource_pattern.resource_name, a.operation) for a in acls} <= {
                    (a.resource_pattern.resource_name, a.operation) for a in listed}:
                return
            assert time.monotonic() < deadline, "the broker did not list the new ACLs"
            time.sleep(0.1)
    finally:
        admin.close()


def _as_user(secured: SecuredKafka, prefix: str, user: str, password: str,
             mechanism: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=secured.sasl_ssl, topic_prefix=prefix,
                         event_partitions=1, decision_partitions=1,
                         security_protocol="SASL_SSL", sasl_mechanism=mechanism,
                         sasl_username=user, sasl_password=password, ssl_cafile=secured.ca,
                         # the suite's: a SCRAM and TLS handshake on a loaded CI machine
                         # took longer than the 5 s default (a clean-clone run)
                         bootstrap_timeout_ms=SUITE_BOOTSTRAP_TIMEOUT_MS)


def test_scram_over_tls_carries_a_run_into_delta_with_the_documented_acls(secured, tmp_path):
    """The processor (SCRAM, from the environment) with the processor's ACLs creates the
    topics and turns what the SDK (PLAIN, explicit settings) published with the
    publisher's ACLs into Delta. The publisher's principal cannot forge a decision."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    _grant(secured, SCRAM_USER, prefix, PROCESSOR_TOPIC_ACLS, create=True, group=True)
    _grant(secured, PLAIN_USER, prefix, PUBLISHER_TOPIC_ACLS)
    _as_user(secured, prefix, SCRAM_USER, SCRAM_PASSWORD, "SCRAM-SHA-512").ensure_topics()
    sdk = _as_user(secured, prefix, PLAIN_USER, PLAIN_PASSWORD, "PLAIN")
    run = "secured-run"
    # The SDK makes sure of the topics it may see (it writes two of the five).
    publish(sdk, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1},
            [event("group_started", run, group_index=0, step=0, n_samples=2),
             sample(run, 0, 0, reward=1.0), sample(run, 0, 1, reward=0.0)])
    lake = tmp_path / "lake"
    result = _cli("process", "--bootstrap-servers", secured.sasl_ssl, "--lake", str(lake),
                  "--topic-prefix", prefix, "--event-partitions", "1", "--until-idle", "3",
                  env=secured.env())
    assert result.returncode == 0, result.stderr
    assert SCRAM_PASSWORD not in result.stderr + result.stdout
    groups = rows(str(lake), "groups", run)
    assert [(g["group_index"], g["decision"]) for g in groups] == [(0, "kept")]
    assert [s["step"] for s in rows(str(lake), "steps", run)] == [0]

    producer = sdk.producer()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            producer.send(sdk.topics.decisions, key=run.encode(), value=b"{}").get(timeout=30)
    finally:
        producer.close(timeout=0)


def test_a_processor_without_its_consumer_group_acl_is_one_line(secured, tmp_path):
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    _grant(secured, SCRAM_USER, prefix, PROCESSOR_TOPIC_ACLS, create=True)
    # A spool folder of its own: removing a killed processor's from the shared one logs a line.
    result = _cli("process", "--bootstrap-servers", secured.sasl_ssl, "--lake",
                  str(tmp_path / "lake"), "--topic-prefix", prefix, "--event-partitions", "1",
                  "--until-idle", "3", "--spool-dir", str(tmp_path / "spool"),
                  env=secured.env())
    # Both stages are refused; the user reads one of them.
    assert re.fullmatch(
        f"rolloutlake process: the broker at {re.escape(secured.sasl_ssl)} refuses SASL user "
        f"'{SCRAM_USER}' access to consumer group {re.escape(prefix)}rolloutlake-"
        r"(groups|batches): grant it the ACLs of the processor \(docs/kafka-security.md, "
        '"ACLs"\\)', _one_line(result))


def test_a_processor_that_may_not_read_the_runs_topic_is_one_line(secured, tmp_path):
    """Refused at the stages' first reads of the runs published so far."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    _grant(secured, SCRAM_USER, prefix, {**PROCESSOR_TOPIC_ACLS, "runs": ()}, create=True,
           group=True)
    publish(secured.super_user(prefix), "a-run",
            {"n_samples_per_prompt": 2, "rollout_batch_size": 1}, [])
    result = _cli("process", "--bootstrap-servers", secured.sasl_ssl, "--lake",
                  str(tmp_path / "lake"), "--topic-prefix", prefix, "--event-partitions", "1",
                  "--until-idle", "3", env=secured.env())
    # after the log lines of the join that went on meanwhile
    assert _last_line(result) == (
        f"rolloutlake process: the broker at {secured.sasl_ssl} refuses SASL user "
        f"'{SCRAM_USER}' access to topic {prefix}rollout.runs: grant it the ACLs of the "
        'processor (docs/kafka-security.md, "ACLs")')


def test_another_command_refused_by_the_acls_is_one_line(secured):
    """`rolloutlake simulate` follows the decisions in its closed loop: as a publisher's
    principal it may publish, not read them."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    _grant(secured, PLAIN_USER, prefix, PUBLISHER_TOPIC_ACLS)
    secured.super_user(prefix).ensure_topics()
    result = _cli("simulate", "--bootstrap-servers", secured.sasl_ssl, "--topic-prefix", prefix,
                  "--steps", "1", "--rollout-batch-size", "1", "--n-samples", "2",
                  env=secured.env(sasl_mechanism="PLAIN", sasl_username=PLAIN_USER,
                                  sasl_password=PLAIN_PASSWORD))
    # after kafka-python's own log lines: "Topic ... is not authorized for this client"
    assert re.fullmatch(
        f"rolloutlake simulate: the Kafka broker refuses access to topic "
        f"({re.escape(prefix)}rollout.(control|decisions)(, )?)+ \\(the ACLs each service "
        'needs: docs/kafka-security.md, "ACLs"\\)', _last_line(result))


def test_a_principal_that_may_not_see_the_topics_is_told_which(secured, tmp_path):
    """The publisher's principal cannot run the processor: the topics it may neither see
    nor create are named, not a CreateTopics response."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    _grant(secured, PLAIN_USER, prefix, PUBLISHER_TOPIC_ACLS)
    topics = KafkaSettings(topic_prefix=prefix).topics
    result = _cli("process", "--bootstrap-servers", secured.sasl_ssl, "--lake",
                  str(tmp_path / "lake"), "--topic-prefix", prefix,
                  "--spool-dir", str(tmp_path / "spool"),
                  env=secured.env(sasl_mechanism="PLAIN", sasl_username=PLAIN_USER,
                                  sasl_password=PLAIN_PASSWORD))
    assert _one_line(result) == (
        f"rolloutlake process: SASL user '{PLAIN_USER}' may neither see nor create "
        f"{topics.runs}, {topics.events}, {topics.decisions}, {topics.control}, "
        f"{topics.deadletter} on {secured.sasl_ssl}: grant it DESCRIBE on existing topics, "
        'or CREATE to let rolloutlake create them (docs/kafka-security.md, "ACLs")')


def test_a_refused_gateway_says_whom_and_serves_once_granted(secured, lake_root, tmp_path,
                                                              caplog):
    """A gateway whose principal may not see the topics answers 503 naming principal and
    topics (not "no Kafka broker answers"), says so once in its log and in /healthz, and
    publishes once the ACLs are granted, without a restart."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    topics = KafkaSettings(topic_prefix=prefix).topics
    refusal = (f"SASL user '{PLAIN_USER}' may neither see nor create {topics.runs}, "
               f"{topics.events} on {secured.sasl_ssl}: grant it DESCRIBE on existing topics, "
               'or CREATE to let rolloutlake create them (docs/kafka-security.md, "ACLs")')
    config = gateway_config(_as_user(secured, prefix, PLAIN_USER, PLAIN_PASSWORD, "PLAIN"),
                            lake_root, tmp_path / "state", retry_after_s=7)
    events = sample_events("run-a", 0)
    with RunningGateway(config) as gw, gw.client() as client:
        refused = client.post("/v1/events", json=events)
        assert (refused.status_code, refused.json()) == (503, {"detail": refusal})
        assert refused.headers["Retry-After"] == "7"
        assert client.get("/healthz").json() == {"status": "ok", "kafka": "refused",
                                                 "kafka_error": refusal, "lake": lake_root}
        unread = client.get("/v1/runs")  # the run registry reads the runs topic
        assert (unread.status_code, unread.json()) == (503, {"detail": (
            f"the broker at {secured.sasl_ssl} refuses SASL user '{PLAIN_USER}' access to "
            f'topic {topics.runs}: grant it the ACLs of the publishers (docs/kafka-security.md, '
            '"ACLs")')})
        _grant(secured, PLAIN_USER, prefix, PUBLISHER_TOPIC_ACLS)
        deadline = time.monotonic() + 3 * REFUSED_RETRY_S
        while client.get("/healthz").json()["kafka"] != "connected":
            assert time.monotonic() < deadline, "the gateway did not connect once granted"
            time.sleep(0.5)
        assert client.post("/v1/events", json=events).status_code == 202
    published = consume_all(secured.super_user(prefix), topics.events)
    assert sorted(decode_event(r.value).event_id for r in published) == sorted(
        e["event_id"] for e in events)
    # as an error, once per cause (test_gateway_events.py checks the once, on an outage)
    assert [r.getMessage() for r in caplog.records if "may neither see" in r.getMessage()] == [
        f"{refusal}; trying again every {REFUSED_RETRY_S:g} s"]


def test_a_gateway_refused_a_write_names_the_topic_and_keeps_its_connection(
        secured, lake_root, tmp_path):
    """Allowed to see the events topic but not to write it: the send is refused, the answer
    says by whom, and the gateway's producer is sound, not replaced as after an outage."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    _grant(secured, PLAIN_USER, prefix, {"events": (), "runs": ("WRITE",)})
    topics = KafkaSettings(topic_prefix=prefix).topics
    config = gateway_config(_as_user(secured, prefix, PLAIN_USER, PLAIN_PASSWORD, "PLAIN"),
                            lake_root, tmp_path / "state")
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.get("/healthz").json()["kafka"] == "connected"
        for _ in range(2):
            refused = client.post("/v1/events", json=sample_events("run-a", 0))
            assert (refused.status_code, refused.json()) == (503, {"detail": (
                f"the broker at {secured.sasl_ssl} refuses SASL user '{PLAIN_USER}' access to "
                f"topic {topics.events}: grant it the ACLs of the publishers "
                '(docs/kafka-security.md, "ACLs")')})
            assert client.get("/healthz").json()["kafka"] == "connected"


def test_a_publisher_refused_a_write_is_told_by_whom(secured):
    """The SDK's flush names principal and topic, where it said "not acknowledged"."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    _grant(secured, PLAIN_USER, prefix, {"events": ("WRITE",), "runs": ()})
    settings = _as_user(secured, prefix, PLAIN_USER, PLAIN_PASSWORD, "PLAIN")
    with RolloutPublisher(settings) as publisher:
        publisher.run_started("run-a", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
        with pytest.raises(AccessRefusedError) as refused:
            publisher.flush()
    assert str(refused.value) == (
        f"the broker at {secured.sasl_ssl} refuses SASL user '{PLAIN_USER}' access to topic "
        f"{settings.topics.runs}: grant it the ACLs of the publishers "
        '(docs/kafka-security.md, "ACLs")')


def test_a_worker_that_may_not_read_the_control_topic_is_told_by_whom(secured):
    """The worker's control follower, refused its first fetch, reports it (the worker stops
    on the report); its thread died with a traceback, and the worker went on deaf to the
    seals and demands of its run."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    _grant(secured, PLAIN_USER, prefix, {**PUBLISHER_TOPIC_ACLS, "control": ()})
    settings = _as_user(secured, prefix, PLAIN_USER, PLAIN_PASSWORD, "PLAIN")
    reported: queue.Queue[RolloutlakeError] = queue.Queue()
    follower = ControlFollower(settings, "run-a", on_message=print,
                               on_error=reported.put).start()
    try:
        refused = reported.get(timeout=60)
    finally:
        follower.stop()
    assert isinstance(refused, AccessRefusedError)
    assert str(refused) == (
        f"the broker at {secured.sasl_ssl} refuses SASL user '{PLAIN_USER}' access to topic "
        f"{settings.topics.control}: grant it the ACLs of the publishers "
        '(docs/kafka-security.md, "ACLs")')


class _EngineThatNeverAnswers(BaseHTTPRequestHandler):
    """Healthy, and holds every generation request open: a worker stays in its first step."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        time.sleep(600)

    def log_message(self, *args: object) -> None:
        pass


def test_a_worker_refused_its_control_topic_stops_with_one_line(secured, tmp_path):
    """The follower's report ends `rolloutlake worker`, which otherwise waited for seals it
    could not hear (here, on an engine that never answers)."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    _grant(secured, PLAIN_USER, prefix, {**PUBLISHER_TOPIC_ACLS, "control": ()})
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with loopback_http(_EngineThatNeverAnswers) as engine_url:
        result = _cli("worker", "--run", "run-a", "--prompt-data",
                      str(write_dataset(tmp_path / "prompts.jsonl", [{"input": "1+1="}])),
                      "--tokenizer", str(tmp_path / "tokenizer"), "--engine", "vllm",
                      "--engine-url", engine_url,
                      "--custom-rm-path", "tests.support.user_rewards.digit_share_or_raise",
                      "--bootstrap-servers", secured.sasl_ssl, "--topic-prefix", prefix,
                      env=secured.env(sasl_mechanism="PLAIN", sasl_username=PLAIN_USER,
                                      sasl_password=PLAIN_PASSWORD))
    topics = KafkaSettings(topic_prefix=prefix).topics
    assert _last_line(result) == (
        f"rolloutlake worker: the broker at {secured.sasl_ssl} refuses SASL user "
        f"'{PLAIN_USER}' access to topic {topics.control}: grant it the ACLs of the "
        'publishers (docs/kafka-security.md, "ACLs")')


def test_a_trainer_that_may_not_write_the_control_topic_is_told_by_whom(secured, tmp_path):
    """May WRITE no topic at all, so the broker refuses its idempotent producer an id:
    kafka-python reports a plain KafkaError, which said that `weights_updated` was "not
    acknowledged within 30 s"."""
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    secured.super_user(prefix).ensure_topics()
    _grant(secured, TRAINER_USER, prefix, {"control": ()})
    settings = _as_user(secured, prefix, TRAINER_USER, TRAINER_PASSWORD, "PLAIN")
    (tmp_path / "ds.json").write_text("{}")
    config = TrainerConfig(lake=str(tmp_path / "lake"), run_id="run-t",
                           deepspeed=tmp_path / "ds.json", output_dir=tmp_path / "out",
                           wandb_mode="disabled", kafka=settings)
    sink = StepSink(config, Lake(config.lake))
    try:
        with pytest.raises(AccessRefusedError) as refused:
            sink.publish_weights(1, tmp_path / "out" / "step_1", 1)
    finally:
        sink.close()
    assert str(refused.value) == (
        f"the broker at {secured.sasl_ssl} refuses SASL user '{TRAINER_USER}' an idempotent "
        "producer (it needs WRITE on a topic): grant it the ACLs of the trainer "
        '(docs/kafka-security.md, "ACLs")')


def test_sasl_plain_over_tls_is_accepted(secured):
    settings = KafkaSettings(bootstrap_servers=secured.sasl_ssl, security_protocol="SASL_SSL",
                             sasl_mechanism="PLAIN", sasl_username=PLAIN_USER,
                             sasl_password=PLAIN_PASSWORD, ssl_cafile=secured.ca)
    admin = settings.admin()
    try:
        assert isinstance(admin.list_topics(), list)
    finally:
        admin.close()


@pytest.fixture(scope="module")
def refusals(secured, tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The refused connections, run at once: each waits out its bootstrap timeout, which
    is longer here than alone (four handshakes at once on a loaded machine: at 20 s the
    SCRAM refusal was once not back in time)."""
    lake = str(tmp_path_factory.mktemp("refused"))
    cases = {
        "wrong password": (secured.sasl_ssl, secured.env(sasl_password="wrong")),
        "wrong ca": (secured.sasl_ssl, secured.env(ssl_cafile=str(secured.other_ca))),
        "plaintext to tls": (secured.sasl_ssl, {}),
        "tls to plaintext": (secured.broker.bootstrap_servers, secured.env()),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = {name: pool.submit(_cli, "process", "--bootstrap-servers", servers,
                                  "--lake", lake, env=env, bootstrap_timeout_ms=45_000)
                for name, (servers, env) in cases.items()}
        return {name: run.result() for name, run in runs.items()}


def test_wrong_password_is_one_line(secured, refusals):
    line = _one_line(refusals["wrong password"])
    assert line == (f"rolloutlake process: cannot connect to Kafka at {secured.sasl_ssl}: "
                    f"SASL SCRAM-SHA-512 login of user '{SCRAM_USER}' was refused "
                    "(wrong username or password?)")


def test_a_refusal_read_together_with_the_close_is_still_a_refusal(secured):
    """A loaded client reads the broker's SASL error and its close in one pass: kafka-python
    3.0 dropped such an answer, and the user read "no Kafka broker answers" after every try
    failed the same way (clean-clone CI; 10 of 16 refused logins under CPU load)."""
    host, port = secured.sasl_ssl.rsplit(":", 1)
    with coalescing_proxy((host, int(port))) as proxied:
        settings = KafkaSettings(bootstrap_servers=proxied, security_protocol="SASL_SSL",
                                 sasl_mechanism="SCRAM-SHA-512", sasl_username=SCRAM_USER,
                                 sasl_password="wrong", ssl_cafile=secured.ca,
                                 bootstrap_timeout_ms=10_000)
        with pytest.raises(BrokerUnavailableError) as refused:
            settings.admin()
    assert str(refused.value) == (f"cannot connect to Kafka at {proxied}: SASL SCRAM-SHA-512 "
                                  f"login of user '{SCRAM_USER}' was refused "
                                  "(wrong username or password?)")


def test_wrong_ca_is_one_line(secured, refusals):
    line = _one_line(refusals["wrong ca"])
    assert line.startswith(f"rolloutlake process: cannot connect to Kafka at {secured.sasl_ssl}: "
                           f"the broker's TLS certificate is not trusted by {secured.other_ca}")


def test_plaintext_to_the_tls_port_is_one_line(secured, refusals):
    line = _one_line(refusals["plaintext to tls"])
    assert line.startswith(f"rolloutlake process: cannot connect to Kafka at {secured.sasl_ssl}: "
                           "the broker closed the connection: it may expect TLS")


def test_tls_to_the_plaintext_port_is_one_line(refusals):
    assert "the broker does not speak TLS on that port" in _one_line(refusals["tls to plaintext"])


@pytest.mark.parametrize(("env", "expected"), [
    ({"ROLLOUTLAKE_KAFKA_SECURITY_PROTOCOL": "TLS"},
     "rolloutlake process: ROLLOUTLAKE_KAFKA_SECURITY_PROTOCOL: Input should be 'PLAINTEXT', "
     "'SSL', 'SASL_PLAINTEXT' or 'SASL_SSL'"),
    ({"ROLLOUTLAKE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"},
     "rolloutlake process: kafka security_protocol SASL_SSL needs sasl_mechanism, "
     "sasl_username and sasl_password (sasl_mechanism is not set)"),
    ({"ROLLOUTLAKE_KAFKA_SECURITY_PROTOCOL": "SSL", "ROLLOUTLAKE_KAFKA_SSL_CAFILE": "/nonexistent.pem"},
     "rolloutlake process: kafka ssl_cafile: no such file: /nonexistent.pem"),
    ({"ROLLOUTLAKE_KAFKA_SASL_PASSWORD_FILE": "/nonexistent"},
     "rolloutlake process: ROLLOUTLAKE_KAFKA_SASL_PASSWORD_FILE: cannot read /nonexistent: "
     "No such file or directory"),
])
def test_invalid_security_settings_name_their_variable(tmp_path, env, expected):
    assert _one_line(_cli("process", "--lake", str(tmp_path), env=env)) == expected


def test_password_from_a_file(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("from-a-file\n")
    monkeypatch.setenv("ROLLOUTLAKE_KAFKA_SASL_PASSWORD_FILE", str(secret))
    settings = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                             sasl_username="u")
    assert settings.security_options()["sasl_plain_password"] == "from-a-file"
    assert "from-a-file" not in repr(settings) + settings.model_dump_json()
