"""`rolloutlake process`: run the group and batch stages until stopped (or idle).

By default the batch stage runs in a child process, so the two stages use two cores
instead of sharing one interpreter lock. The child dies with its parent (a kill -9 of the
processor kills both); on a normal stop or idle exit the parent tells the child to drain
the decisions still in flight, close its steps and exit.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kafka.errors import AuthorizationError

from ingest.io.allocator import reuse_large_buffers
from ingest.io.kafka import not_authorized
from ingest.io.lake import Lake
from ingest.io.spool import DecisionSpool
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from ingest.processor.health import FreezeWatch, write_status
from ingest.processor.launch import CHILD_REPORTED, BatchChild
from ingest.processor.membership import STAGE_ROLES, GroupMember, Role, start_members
from ingest.processor.wandb_sink import follow_all_runs
from schemas.errors import RolloutlakeError

log = logging.getLogger(__name__)

DRAIN_IDLE_S = 1.0  # a draining stage stops after this long without new messages
DRAIN_LIMIT_S = 30.0
STATUS_EVERY_S = 1.0
# In split mode the group stage (the parent) reports a lost broker or a join that does not
# finish; the batch stage gives up on its own only when the parent could not.
CHILD_GRACE_S = 15.0
CLOSE_TIMEOUT_S = 5.0


def idle_for(stages: Sequence[GroupStage | BatchStage], read_since: float = 0.0) -> float:
    """Seconds since the last activity of any of `stages`, or 0 while one is not idle.

    `--until-idle` samples this: a stage busy for a moment (a watermark on its way out)
    does not start the count again, only new activity, such as records or a take-over, does.
    Idle also needs every stage to have read its topics to end offsets measured after that
    activity and after `read_since`: a batch stage whose last check came before the group
    stage sent its last decisions counts as read to the end without them (a processor
    once stopped with two steps of a backlog unsealed).
    """
    if not all(stage.idle for stage in stages):
        return 0.0
    last = max([stage.last_activity for stage in stages], default=0.0)
    if any(stage.caught_up_as_of < max(last, read_since) for stage in stages):
        return 0.0
    return time.monotonic() - last


class Processor:
    """Both stages, each polled by its own thread; `run` returns when stopped or idle."""

    def __init__(self, config: ProcessorConfig,
                 tables_ready: Callable[[], None] | None = None,
                 spool: DecisionSpool | None = None,
                 members: Mapping[Role, GroupMember] | None = None):
        """`tables_ready` is called once every table and topic exists, before the stages
        are built. `spool` is the instance's spool where another process made it (a
        split processor); running both stages, the processor makes its own. `members`
        are the stages' consumer-group members where the caller started them already
        (the CLI, before it imported this module); otherwise they start here, once the
        topics exist, and join while the tables are made and the stages built."""
        reuse_large_buffers()  # both processes handle megabyte buffers by the thousand
        self.config = config
        if members is None:
            config.kafka.ensure_topics()
            members = start_members(config, STAGE_ROLES[config.stages])
        waiting = dict(members)
        self.stages: list[GroupStage | BatchStage] = []
        self.own_spool = spool is None and config.spool and config.stages == "all"
        try:
            self.lake = Lake(config.lake)
            for table in ("events", "groups", "samples", "training_batches", "steps",
                          "step_metrics", "dead_letters", "runs", "batch_state"):
                self.lake.ensure(table)
            if tables_ready is not None:
                tables_ready()
            if self.own_spool:
                spool = DecisionSpool.create(config.spool_dir)
            self.spool = spool
            if "groups" in waiting:
                self.stages.append(GroupStage(config, Lake(config.lake), spool,
                                              waiting.pop("groups")))
            if "batches" in waiting:
                self.stages.append(BatchStage(config, Lake(config.lake), spool,
                                              waiting.pop("batches")))
        except BaseException:
            for member in waiting.values():
                member.close()
            for stage in self.stages:
                stage.close(timeout_s=CLOSE_TIMEOUT_S)
            if self.own_spool and spool is not None:
                spool.remove()
            raise
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.drain_asked_at: float | None = None
        self.wandb_stop = threading.Event()

    def _loop(self, stage: GroupStage | BatchStage) -> None:
        try:
            while not self.stop_event.is_set():
                stage.poll_once()
        except BaseException as err:  # a stage that dies stops the processor
            if isinstance(err, AuthorizationError):  # the broker's ACLs: the user's to fix
                err = not_authorized(self.config.kafka, err, "processor")
            if not isinstance(err, RolloutlakeError):  # ours are one line, printed by the CLI
                log.exception("%s failed", type(stage).__name__)
            stage.health.state, stage.health.error = "failed", str(err)
            self.errors.append(err)
            self.stop_event.set()

    def run(self) -> int:
        threads = [threading.Thread(target=self._loop, args=(s,), name=type(s).__name__, daemon=True)
                   for s in self.stages]
        syncer = None
        if self.config.wandb and self.stages:
            runs = self.stages[0].runs  # read by the stage thread; the syncer only lists keys
            syncer = threading.Thread(
                target=follow_all_runs, name="wandb",
                args=(self.lake, lambda: list(runs.configs), self.wandb_stop),
                kwargs={"wandb_dir": self.config.wandb_dir})
            syncer.start()
        for thread in threads:
            thread.start()
        idle_s = self.config.until_idle_s
        status_at = 0.0
        checked_at = running_since = time.monotonic()
        while not self.stop_event.is_set():
            time.sleep(0.1)
            now = time.monotonic()
            if now - checked_at > FreezeWatch.FREEZE_S:
                # Frozen meanwhile: what arrived then is not read yet, so idleness counts
                # again from now (the stages, frozen too, did not look).
                running_since = now
            checked_at = now
            if now - status_at >= STATUS_EVERY_S:
                status_at = now
                self._write_status()
            # A drain reads first what was sent before it was asked for.
            idle = min(idle_for(self.stages, read_since=self.drain_asked_at or 0.0),
                       now - running_since)
            if idle_s is not None and idle >= idle_s:
                log.info("idle for %.1f s: finishing", idle_s)
                self.stop_event.set()
            if self.drain_asked_at is not None and (
                idle >= DRAIN_IDLE_S or now > self.drain_asked_at + DRAIN_LIMIT_S
            ):
                self.stop_event.set()
        for thread in threads:
            thread.join()
        if not self.errors:
            for stage in self.stages:
                if isinstance(stage, BatchStage):
                    stage.flush()
        if syncer is not None:  # stopped after the flush, so the last steps are synced too
            self.wandb_stop.set()
            syncer.join()
        for stage in self.stages:
            stage.close(timeout_s=CLOSE_TIMEOUT_S if self.errors else None)
            if stage.health.state != "failed":
                stage.health.state = "stopped"
        if self.own_spool and self.spool is not None:
            self.spool.remove()
        self._write_status()
        if self.errors:
            raise self.errors[0]
        return 0

    def _write_status(self) -> None:
        if self.config.status_dir is not None:
            for stage in self.stages:
                write_status(self.config.status_dir, stage.health)

    def stop(self, *_: object) -> None:
        self.stop_event.set()

    def drain(self, *_: object) -> None:
        """Finish what has arrived (until idle for a moment), then stop."""
        if self.drain_asked_at is None:
            self.drain_asked_at = time.monotonic()


def run_batch_stage(config: ProcessorConfig, spool_folder: Path | None, member: GroupMember,
                    drain_asked: threading.Event) -> int:
    """The batch stage of `config`, run by the child process (`launch.BatchChild`) with the
    parent's spool folder and the member it started joining; `drain_asked` is set when the
    parent asked it to drain before the stage existed. Returns the exit code."""
    processor = Processor(config.model_copy(update={
        "stages": "batches", "until_idle_s": None,
        "broker_timeout_s": config.broker_timeout_s + CHILD_GRACE_S,
        "join_timeout_s": config.join_timeout_s + CHILD_GRACE_S}),
        spool=None if spool_folder is None else DecisionSpool(spool_folder),
        members={"batches": member})
    for stage in processor.stages:  # the parent says it to the user
        stage.health.report_level = logging.INFO
    signal.signal(signal.SIGTERM, processor.drain)
    if drain_asked.is_set():
        processor.drain()
    return processor.run()


def run_split(config: ProcessorConfig, child: BatchChild,
              members: Mapping[Role, GroupMember]) -> int:
    """Group stage here, batch stage in `child`, configured already (its join started);
    `members` holds the group stage's member, joining already. Returns the exit code."""
    spool = DecisionSpool.create(config.spool_dir) if config.spool else None
    try:
        # The child writes the metrics and closes the last steps, so it runs the W&B sink.
        # It builds its stage once the tables exist (two processes creating one Delta
        # table would race), while this one builds its own.
        groups = Processor(
            config.model_copy(update={"stages": "groups", "wandb": False}),
            tables_ready=lambda: child.tables_ready(None if spool is None else spool.folder),
            spool=spool, members=members)
    except BaseException:
        child.cancel()
        if spool is not None:
            spool.remove()
        raise
    process = child.process

    def watch_child() -> None:
        process.join()
        if not groups.stop_event.is_set():
            if process.exitcode != CHILD_REPORTED:
                log.error("the batch stage exited with code %s; stopping", process.exitcode)
            groups.stop()

    threading.Thread(target=watch_child, daemon=True).start()
    signal.signal(signal.SIGTERM, groups.stop)
    signal.signal(signal.SIGINT, groups.stop)
    try:
        code = groups.run()
    except BaseException:
        # The lake resumes exactly from its transaction marks: no drain is needed, and a
        # broker that is gone would only make the child wait for it.
        process.kill()
        raise
    finally:
        if process.is_alive():
            process.terminate()  # SIGTERM: drain, close steps, exit
            process.join(DRAIN_LIMIT_S + 30)
        if process.is_alive():
            process.kill()
        process.join()
        if spool is not None:
            spool.remove()
    reported = child.reported_error()
    if reported is not None:
        raise RolloutlakeError(reported)
    if process.exitcode:
        raise RolloutlakeError(f"the batch stage exited with code {process.exitcode}")
    return code
