"""The batch stage's child process, started before the processor parses its flags.

`rolloutlake process` runs the batch stage in a spawned child (delta-rs must not be
forked), and a spawned interpreter imports pyarrow, deltalake, pydantic and kafka-python
again: 0.6-1.6 s by load. The CLI therefore calls `prestart` before it parses, and the
child goes through the same steps as the parent, side by side on two cores:

1. it imports what parsing the flags and joining a consumer group need (pydantic,
   kafka-python), and waits for its configuration, which the parent sends (`configure`)
   once it parsed its flags and the topics exist, or kills it, if the flags turn out to
   want no child;
2. it starts its consumer-group join (`membership.GroupMember`), then imports the
   processor's heavy modules while the broker holds the join;
3. it builds its stage once the parent says the tables exist (`tables_ready`: two
   processes creating one Delta table would race).

On a machine without a core to spare the child imports only once the configuration has
come, since its imports would slow the parent's, which come first on the way to the first
batch. This module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ingest.io.child_process import die_with_parent

if TYPE_CHECKING:
    from pathlib import Path

    from ingest.processor.config import ProcessorConfig

# Flags after which the processor runs no batch-stage child (or runs nothing at all).
_NO_CHILD_FLAGS = ("-h", "--help", "--single-process", "--stages")

CHILD_REPORTED = 2  # exit code of a batch-stage child that sent its one-line error to the parent

_prestarted: BatchChild | None = None


class BatchChild:
    """A spawned interpreter that imports what a join needs, then waits for its configuration
    (`configure`: it starts joining) and for the tables (`tables_ready`: it builds its stage)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        receive, self._send = context.Pipe(duplex=False)
        self._errors, report = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main, args=(receive, report, os.getpid()),
                                       name="rolloutlake-batches")
        self.process.start()
        receive.close()
        report.close()
        # Not configured by the time the parent exits (bad flags, --help): nothing to wait for.
        atexit.register(self.cancel)

    def configure(self, config: ProcessorConfig, kafka_log_level: int) -> None:
        """The child runs the batch stage of `config`: it starts its consumer-group join
        now, and builds the stage once `tables_ready` says the tables exist."""
        atexit.unregister(self.cancel)
        # The model itself, pickled: a JSON dump would mask its secrets (SASL password).
        self._send.send((config, kafka_log_level))

    def tables_ready(self, spool_folder: Path | None) -> None:
        """Every table exists: the child builds its stage, with the parent's spool."""
        self._send.send(spool_folder)
        self._send.close()

    def reported_error(self) -> str | None:
        """The one-line error the child stopped on, for the parent to say (once: the
        parent's own comes first); None when it reported none."""
        try:
            return self._errors.recv() if self._errors.poll() else None
        except EOFError:
            return None

    def cancel(self) -> None:
        """Stop the child: one never configured has only imported modules so far, and one
        configured before its parent's own stage failed to build has nothing to finish."""
        atexit.unregister(self.cancel)
        self._send.close()
        self.process.kill()
        self.process.join()


def prestart(argv: list[str]) -> None:
    """Start the batch-stage child now, unless `argv` shows that none will run."""
    global _prestarted
    if not any(arg.split("=")[0] in _NO_CHILD_FLAGS for arg in argv):
        _prestarted = BatchChild()


def take_prestarted() -> BatchChild | None:
    """The child `prestart` started, handed out once."""
    global _prestarted
    child, _prestarted = _prestarted, None
    return child


def _child_main(receive: Connection, report: Connection, parent_pid: int) -> None:
    die_with_parent(parent_pid)  # no orphan stage lives on
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C, even mid-import
    # The parent's SIGTERM means "drain, then exit"; one that comes before the stage exists
    # (an --until-idle parent that finished while this child still imported) is kept.
    drain_asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: drain_asked.set())
    if os.getloadavg()[0] >= (os.cpu_count() or 1):
        # No core to spare: importing now would slow the parent's imports, which come first
        # on the way to the first batch. Import once the configuration comes instead.
        receive.poll(None)
    from ingest.processor.membership import GroupMember
    from schemas.errors import RolloutlakeError

    try:
        config, kafka_log_level = receive.recv()
    except EOFError:  # the parent went away before it had a configuration
        return
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(kafka_log_level)  # as in the parent
    try:
        member = GroupMember(config, "batches")
        from ingest.processor.main import run_batch_stage  # while the broker holds the join

        try:
            spool_folder = receive.recv()
        except EOFError:  # the parent failed before its tables existed, and says why
            member.close()
            return
        code = run_batch_stage(config, spool_folder, member, drain_asked)
    except RolloutlakeError as err:
        # Said by the parent, unless it stops on an error of its own: flags the broker or
        # the lake refuses are refused to both stages at once, and the user reads it once.
        report.send(str(err))
        sys.exit(CHILD_REPORTED)
    sys.exit(code)
