"""`rolloutlake process`: run the group and batch stages until stopped (or idle)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

from pydantic import ValidationError

from ingest.kafka_io import KafkaSettings
from ingest.lake import Lake
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from schemas.errors import ConfigError

log = logging.getLogger(__name__)


class Processor:
    """Both stages, each polled by its own thread; `run` returns when stopped or idle."""

    def __init__(self, config: ProcessorConfig):
        self.config = config
        self.lake = Lake(config.lake)
        for table in ("events", "groups", "samples", "training_batches", "steps",
                      "step_metrics", "dead_letters"):
            self.lake.ensure(table)
        config.kafka.ensure_topics()
        self.stop_event = threading.Event()
        self.stages: list[GroupStage | BatchStage] = []
        if config.stages in ("all", "groups"):
            self.stages.append(GroupStage(config, Lake(config.lake)))
        if config.stages in ("all", "batches"):
            self.stages.append(BatchStage(config, Lake(config.lake)))
        self.errors: list[BaseException] = []

    def _loop(self, stage: GroupStage | BatchStage) -> None:
        try:
            while not self.stop_event.is_set():
                stage.poll_once()
        except BaseException as err:  # a stage that dies stops the processor
            log.exception("%s failed", type(stage).__name__)
            self.errors.append(err)
            self.stop_event.set()

    def run(self) -> int:
        threads = [threading.Thread(target=self._loop, args=(s,), name=type(s).__name__, daemon=True)
                   for s in self.stages]
        for thread in threads:
            thread.start()
        idle_s = self.config.until_idle_s
        while not self.stop_event.is_set():
            time.sleep(0.1)
            if idle_s is not None and self._idle_for() >= idle_s:
                log.info("idle for %.1f s: finishing", idle_s)
                self.stop_event.set()
        for thread in threads:
            thread.join()
        if not self.errors:
            for stage in self.stages:
                if isinstance(stage, BatchStage):
                    stage.flush()
        for stage in self.stages:
            stage.close()
        if self.errors:
            raise self.errors[0]
        return 0

    def _idle_for(self) -> float:
        if not all(stage.idle for stage in self.stages):
            return 0.0
        return time.monotonic() - max(stage.last_activity for stage in self.stages)

    def stop(self, *_: object) -> None:
        self.stop_event.set()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="Kafka brokers")
    parser.add_argument("--lake", required=True, help="lake root (folder or s3://...)")
    parser.add_argument("--until-idle", type=float, metavar="S",
                        help="exit 0 after S seconds without new events")
    parser.add_argument("--topic-prefix", default="", help="prefix of every topic name")
    parser.add_argument("--stages", choices=["all", "groups", "batches"], default="all")
    parser.add_argument("--event-partitions", type=int, default=4,
                        help="partitions of rollout.events when creating it")
    parser.add_argument("--consumer-group", default="rolloutlake")


def config_from_args(args: argparse.Namespace) -> ProcessorConfig:
    try:
        return ProcessorConfig(
            kafka=KafkaSettings(bootstrap_servers=args.bootstrap_servers,
                                topic_prefix=args.topic_prefix,
                                event_partitions=args.event_partitions),
            lake=args.lake,
            until_idle_s=args.until_idle,
            stages=args.stages,
            consumer_group=args.consumer_group,
        )
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid processor setting {field}: {first['msg']}") from None


def run(args: argparse.Namespace) -> int:
    processor = Processor(config_from_args(args))
    signal.signal(signal.SIGTERM, processor.stop)
    signal.signal(signal.SIGINT, processor.stop)
    return processor.run()
