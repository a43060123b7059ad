"""What a trained step leaves behind (rank 0 only): its `trainer_steps` row, its W&B
metrics, and every k steps Hugging Face weights plus a `weights_updated` message.

Each output is idempotent, so the restart path can replay them for the last checkpointed
step without duplicating anything: the Delta row carries `TxnMark("trainer-<run>", step)`,
weights are written to a per-step folder by rename, and a repeated `weights_updated` names
the same folder and version.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
from kafka.errors import KafkaError

from ingest.io.kafka import acl_refusal, close_producer, not_authorized
from ingest.io.lake import Lake, TxnMark
from schemas.control import WeightsUpdated
from schemas.errors import BrokerUnavailableError
from schemas.tables import TRAINER_STEPS
from trainer.config import TrainerConfig

log = logging.getLogger(__name__)

WEIGHTS_ACK_TIMEOUT_S = 30
"""How long a `weights_updated` publish waits for the broker's acknowledgement."""

# Miles names for the metrics it has (MILES_SEMANTICS 8.5 / Miles log_utils), so dashboards
# carry over; the clip-bound split and token counts are rolloutlake additions.
WANDB_KEYS = {
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "pg_clipfrac": "train/pg_clipfrac",
    "pg_clipfrac_low": "train/pg_clipfrac_low",
    "pg_clipfrac_high": "train/pg_clipfrac_high",
    "ppo_kl": "train/ppo_kl",
    "log_ratio_clamped_tokens": "train/log_ratio_clamped_tokens",
    "kl": "train/kl_loss",
    "entropy": "train/entropy_loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr-pg_0",
    "tokens": "train/tokens",
    "loss_tokens": "train/loss_tokens",
    "seconds": "perf/train_time",
}


def wandb_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The W&B record of one `trainer_steps` row, keyed by `train/step`."""
    metrics = {key: row[name] for name, key in WANDB_KEYS.items() if row.get(name) is not None}
    metrics["train/step"] = row["step"]
    return metrics


def weights_path(config: TrainerConfig, step: int) -> Path:
    return config.weights_dir / f"step_{step:09d}"


class StepSink:
    """Rank 0's writer of per-step outputs. W&B and Kafka are opened on first use."""

    def __init__(self, config: TrainerConfig, lake: Lake):
        self.config = config
        self.lake = lake
        self.app_id = f"trainer-{config.run_id}"
        self._wandb_run: Any = None
        self._producer: Any = None

    def record(self, row: dict[str, Any]) -> bool:
        """Append the step's `trainer_steps` row exactly once; log W&B when it was new."""
        values = dict(row, trained_at=dt.datetime.fromtimestamp(row["trained_at"], dt.UTC))
        table = pa.Table.from_pylist([values], schema=TRAINER_STEPS.schema)
        version = self.lake.append(
            TRAINER_STEPS.name, table, marks=[TxnMark(self.app_id, row["step"])]
        )
        if version is None:
            return False
        self._log_wandb(row)
        return True

    def _log_wandb(self, row: dict[str, Any]) -> None:
        if self.config.wandb_mode == "disabled":
            return
        if self._wandb_run is None:
            import wandb

            self.config.run_dir.mkdir(parents=True, exist_ok=True)
            self._wandb_run = wandb.init(
                project=self.config.wandb_project,
                name=f"{self.config.run_id}-trainer",
                id=f"{self.config.run_id}-trainer",
                resume="allow",
                dir=str(self.config.run_dir),
                mode=self.config.wandb_mode,
                config=self.config.model_dump(mode="json"),
            )
            self._wandb_run.define_metric("train/step")
            self._wandb_run.define_metric("train/*", step_metric="train/step")
            self._wandb_run.define_metric("perf/*", step_metric="train/step")
        self._wandb_run.log(wandb_metrics(row))

    def save_weights(self, model: Any, state_dict: dict[str, Any], step: int) -> Path:
        """Write HF weights for `step` to a temporary folder, then rename it into place,
        so a rollout engine never loads a half-written folder."""
        final = weights_path(self.config, step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tmp.rename(final)
        return final

    def publish_weights(self, step: int, path: Path, version: int) -> None:
        """Send `weights_updated` keyed by run_id, when Kafka is configured (acks=all,
        idempotent; an unreachable broker raises `BrokerUnavailableError`, a refusal by its
        ACLs `AccessRefusedError`)."""
        kafka = self.config.kafka
        if kafka is None:
            return
        message = WeightsUpdated(
            run_id=self.config.run_id, step=step, path=str(path.resolve()), version=version
        )
        if self._producer is None:
            self._producer = kafka.producer()
        try:
            self._producer.send(
                kafka.topics.control,
                key=self.config.run_id.encode(),
                value=message.model_dump_json().encode(),
            ).get(timeout=WEIGHTS_ACK_TIMEOUT_S)
        except KafkaError as err:
            refusal = acl_refusal(err)
            if refusal is not None:  # the user's to fix; the producer is sound
                raise not_authorized(kafka, refusal, "trainer") from None
            # Dropped: kafka-python's exit handler printed tracebacks closing a producer
            # that still held the record, and an idempotent one whose request timed out
            # can send nothing more (docs/producers.md).
            close_producer(self._producer, timeout_s=0)
            self._producer = None
            raise BrokerUnavailableError(
                f"weights_updated for step {step} was not acknowledged by "
                f"{kafka.bootstrap_servers} within {WEIGHTS_ACK_TIMEOUT_S} s "
                f"({type(err).__name__}); the step is checkpointed, and a restart publishes "
                "it again"
            ) from None
        log.info("published weights_updated step=%d version=%d path=%s", step, version, path)

    def close(self) -> None:
        if self._producer is not None:
            # Every publish waited for its acknowledgement: nothing is left to send.
            close_producer(self._producer, timeout_s=0)
        if self._wandb_run is not None:
            self._wandb_run.finish()
