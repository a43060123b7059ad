"""How a processor stage is doing: joining, running or cut off from the broker.

kafka-python retries a lost broker forever and only logs each attempt, so the stage
watches its connections itself: one line when the broker goes away, one when it is back,
and an error after `broker_timeout_s`, so an operator (or an orchestrator restarting the
pod) learns of it. The same state goes to a status file that `--status-dir` names.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from schemas.errors import BrokerUnavailableError, RolloutlakeError

log = logging.getLogger(__name__)

State = Literal["joining", "running", "broker-unreachable", "stopped", "failed"]
JOIN_REPORT_S = 5.0  # a join this slow is reported; Tansu takes about half a session timeout
REPORT_EVERY_S = 30.0


def broker_reachable(client: Any) -> bool:
    """Whether a kafka-python consumer or producer holds a live connection to a broker.

    kafka-python has no public call for this; `_client.connected` is its own check.
    """
    net = client._client
    return any(net.connected(broker.node_id) for broker in net.cluster.brokers())


def broker_connections(client: Any) -> set[Any]:
    """The open connections of a kafka-python consumer or producer, as its own connection
    objects (held, so that a new one is never taken for an old one): a connection not
    seen before is a (re)connection, such as to a broker that restarted.
    """
    return {conn for conn in client._client._manager._conns.values() if conn.connected}


class FreezeWatch:
    """Counts the times this process stopped running for more than `FREEZE_S`: SIGSTOP, a
    paused container, a descheduled VM. A frozen stage cannot see a topic deleted and
    created again meanwhile (its client's metadata still gives the old topic id), so it
    checks its partitions once it runs again. A thread that ticks every `TICK_S` tells:
    every thread of the process stops at once. (CPU starvation counts too; a check is
    cheap.)"""

    TICK_S = 0.1
    FREEZE_S = 1.0
    _lock = threading.Lock()
    _started = False
    count = 0

    @classmethod
    def freezes(cls) -> int:
        """How many freezes so far; the first call starts the watch."""
        with cls._lock:
            if not cls._started:
                cls._started = True
                threading.Thread(target=cls._tick, name="freeze-watch", daemon=True).start()
        return cls.count

    @classmethod
    def _tick(cls) -> None:
        last = time.monotonic()
        while True:
            time.sleep(cls.TICK_S)
            now = time.monotonic()
            if now - last > cls.FREEZE_S:
                log.info("the process did not run for %.1f s", now - last)
                cls.count += 1
            last = now


def topic_id(client: Any, topic: str) -> Any:
    """The broker's id of `topic` (a UUID; None where the broker has none), from the
    client's metadata: a recreated topic gets a new one."""
    return client._client.cluster.topic_id(topic)


@dataclass
class StageHealth:
    """State of one stage, updated by its poll loop and read by the status writer."""

    role: str
    group_id: str
    bootstrap_servers: str
    broker_timeout_s: float
    join_timeout_s: float
    state: State = "joining"
    started_at: float = field(default_factory=time.monotonic)
    unreachable_since: float | None = None
    last_report: float | None = None  # of the last "waiting to join" line
    partitions: list[int] | None = None  # None until the stage joined its group
    last_commit_at: float | None = None  # wall clock, for people
    lag: int | None = None
    error: str | None = None
    session_timeout_ms: int | None = None  # the one the stage's consumer joins with
    report_level: int = logging.WARNING  # of the broker-lost lines

    def observe_broker(self, reachable: bool, now: float) -> None:
        """Called after every poll; raises once the broker was away for the timeout."""
        if reachable:
            if self.state == "broker-unreachable" and self.unreachable_since is not None:
                log.log(self.report_level, "%s stage: broker at %s is reachable again after "
                        "%.0f s", self.role, self.bootstrap_servers, now - self.unreachable_since)
                self.state = "running" if self.partitions is not None else "joining"
            self.unreachable_since = None
            return
        if self.unreachable_since is None:
            self.unreachable_since = now
            return  # one poll without a connection is a reconnect, not an outage
        away = now - self.unreachable_since
        if self.state != "broker-unreachable" and away >= 1.0:
            self.state = "broker-unreachable"
            log.log(self.report_level, "%s stage: broker at %s is unreachable; retrying for "
                    "%.0f s", self.role, self.bootstrap_servers, self.broker_timeout_s)
        if away >= self.broker_timeout_s:
            raise BrokerUnavailableError(
                f"no Kafka broker answered at {self.bootstrap_servers} for "
                f"{self.broker_timeout_s:g} s (--broker-timeout-s); exiting so it can be "
                "restarted once the broker is back"
            )

    def observe_join(self, joined: bool, now: float) -> None:
        """Report a slow consumer-group join, and give up after `join_timeout_s`."""
        if joined or self.unreachable_since is not None:
            return
        waited = now - self.started_at
        if waited >= self.join_timeout_s:
            raise RolloutlakeError(
                f"could not join consumer group {self.group_id} within {self.join_timeout_s:g} s "
                "(--join-timeout-s): is another member of it stuck, or the broker overloaded?"
            )
        if waited >= JOIN_REPORT_S and (self.last_report is None
                                        or now - self.last_report >= REPORT_EVERY_S):
            self.last_report = now
            log.info("%s stage: waiting to join consumer group %s (%.0f s so far)", self.role,
                     self.group_id, waited)

    def joined(self, partitions: list[int]) -> None:
        self.partitions = partitions
        if self.state == "joining":
            log.info("%s stage: joined consumer group %s, partitions %s", self.role,
                     self.group_id, partitions or "none")
            self.state = "running"

    def as_json(self) -> dict[str, Any]:
        return {
            "role": self.role, "state": self.state, "consumer_group": self.group_id,
            "partitions": self.partitions, "last_commit_at": self.last_commit_at,
            "lag": self.lag, "error": self.error, "session_timeout_ms": self.session_timeout_ms,
            "broker_unreachable_for_s": None if self.unreachable_since is None
            else round(time.monotonic() - self.unreachable_since, 1),
        }


def write_status(folder: str, health: StageHealth) -> None:
    """`folder/<role>.json`, replaced atomically so a reader never sees half a file."""
    path = Path(folder) / f"{health.role}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    body = {**health.as_json(), "pid": os.getpid(), "updated_at": time.time()}
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
