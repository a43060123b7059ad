"""Configuration of the stream processor (`rolloutlake process`)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ingest.io.kafka import KafkaSettings
from ingest.io.lake_location import LakePath


class ProcessorConfig(BaseModel):
    """Everything `rolloutlake process` needs; validated once at start."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    # `--until-idle` is the spelling the processor had before every service said `-s`.
    cli_flags: ClassVar[dict[str, tuple[str, ...]]] = {
        "until_idle_s": ("--until-idle-s", "--until-idle")}

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    lake: LakePath
    """Lake root: a local folder or an object-store URI (s3://bucket/prefix)."""
    stages: Literal["all", "groups", "batches"] = "all"
    """Which stages this instance runs; `all` runs both (in two processes unless
    `single_process`)."""
    single_process: bool = False
    """Run both stages as threads of one process (one core) instead of a batch-stage child."""
    consumer_group: Annotated[str, Field(min_length=1)] | None = None
    """Consumer-group prefix; must be the same for all instances of one deployment. By
    default the topic prefix followed by `rolloutlake`: deployments that share a broker
    under different topic prefixes never share a group (a member of one would hold up,
    or take no partitions in, the other's rebalances)."""
    until_idle_s: Annotated[float, Field(gt=0)] | None = None
    """Exit 0 after this many seconds without new messages, once everything is committed."""
    poll_timeout_ms: Annotated[int, Field(ge=1, le=10_000)] = 100
    max_poll_records: Annotated[int, Field(ge=1)] = 2000
    session_timeout_ms: Annotated[int, Field(ge=1000)] | None = None
    """Consumer-group session timeout. By default 2000 where the broker accepts it (Tansu
    answers a first join after about half of it), else 6000 (Apache Kafka refuses less
    than its group.min.session.timeout.ms, 6000 by default)."""
    snapshot_every: Annotated[int, Field(ge=1)] = 500
    """`rollout.decisions` records (decisions, notices, watermarks) between two snapshots
    of the batch stage's state (per partition): a restart replays at most this many."""
    compact_every: Annotated[int, Field(ge=0)] = 100
    """Commits of a stage to a table it appends to every poll (the group stage: events;
    the batch stage: samples, groups, steps, step_metrics) between two compactions of that
    table's small files, in a background thread; 0 never. A Delta append costs time in
    proportion to the files a table holds, so without it a long run's commits, and with
    them its decisions, slow down."""
    broker_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """How long the processor retries a broker it lost before it exits non-zero."""
    join_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """How long a stage may wait to join its consumer group before it exits non-zero."""
    status_dir: str | None = None
    """Folder where each stage keeps `<stage>.json` current: state, partitions, last commit."""
    default_group_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Timeout of groups whose run has no `run_started` yet."""
    watermark_lag_s: Annotated[float, Field(ge=0)] = 1.0
    """How far behind the wall clock an idle events partition's event time follows. An
    event that arrives later than this behind its own time is ordered as if it came at
    the idle partition's time; a larger lag delays seals while a partition is idle."""
    spool: bool = True
    """Hand kept groups' token columns from the group stage to this instance's own batch
    stage through files on this host (`spool_dir`) instead of through Kafka a second time;
    decisions bound for another instance's batch stage still carry them."""
    spool_dir: str | None = None
    """Folder of the spool's files (default: rolloutlake-spool in the system's temp
    folder; a memory-backed folder such as /dev/shm spares the disk its writes)."""
    wandb: bool = False
    """Also log every run's step metrics to Weights & Biases (offline unless WANDB_MODE)."""
    wandb_dir: str | None = None
    """Where W&B keeps its run files (default: its own, ./wandb)."""

    @property
    def group_prefix(self) -> str:
        """What the stages' consumer groups are named after (`consumer_group`)."""
        return self.consumer_group or f"{self.kafka.topic_prefix}rolloutlake"
