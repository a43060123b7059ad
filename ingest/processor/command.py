"""`rolloutlake process`: its flags, and the order of its start.

Most of a start-up is the consumer groups' joins (Tansu holds a JoinGroup for half the
session timeout), and a join needs only kafka-python and the parsed settings. So once the
topics exist the stages' members start joining, and the processor's heavy modules
(deltalake, pyarrow, the stages: `ingest.processor.main`) are imported while the broker
holds the joins. The batch-stage child, started before the flags were parsed
(`launch.py`), starts its own join as soon as it has the configuration.
"""

from __future__ import annotations

import argparse
import logging
import signal

from ingest.processor.config import ProcessorConfig
from ingest.processor.launch import BatchChild, take_prestarted
from ingest.processor.membership import STAGE_ROLES, start_members
from schemas.config import add_config_flags, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, ProcessorConfig)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(ProcessorConfig, args)
    if not getattr(args, "verbose", False):
        # kafka-python logs every reconnect attempt; the stages say it once (health.py)
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    child = take_prestarted()
    split = config.stages == "all" and not config.single_process
    if child is not None and not split:
        child.cancel()
    config.kafka.ensure_topics()
    if not split:
        members = start_members(config, STAGE_ROLES[config.stages])
        from ingest.processor.main import Processor

        processor = Processor(config, members=members)
        signal.signal(signal.SIGTERM, processor.stop)
        signal.signal(signal.SIGINT, processor.stop)
        return processor.run()
    child = child or BatchChild()
    child.configure(config, logging.getLogger("kafka").getEffectiveLevel())
    try:
        members = start_members(config, ("groups",))
    except BaseException:
        child.cancel()
        raise
    from ingest.processor.main import run_split

    return run_split(config, child, members)
