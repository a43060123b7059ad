"""The trainer's one typed configuration, built from the command line in `trainer.main`.

Flags and one-line errors come from the fields (`schemas/config.py`); `run_id` is `--run`,
as in the contract's CLI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ingest.io.kafka import KafkaSettings
from ingest.io.lake_location import LakePath
from schemas.config import ExistingFile
from schemas.dotted import DottedPath
from schemas.errors import ConfigError
from schemas.events import FieldValueError, RunId


def _wandb_mode_from_env() -> Any:
    """$WANDB_MODE, else offline; unchecked here, so the field's validation names a bad one."""
    return os.environ.get("WANDB_MODE", "offline")


class TrainerConfig(BaseModel):
    """Everything one trainer process needs; the DeepSpeed JSON stays a separate file."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    cli_flags: ClassVar[dict[str, tuple[str, ...]]] = {"run_id": ("--run",)}

    lake: LakePath
    """Root of the Delta lake (local folder or s3:// URI) the processor writes."""
    run_id: RunId
    """The run whose sealed steps are trained."""
    model: str = "tiny"
    """Local Hugging Face model folder, or `tiny` for a small random causal LM (no download)."""
    deepspeed: ExistingFile
    """DeepSpeed JSON config (ZeRO stage, precision, optional optimizer and scheduler)."""
    steps: int | None = Field(default=None, ge=1)
    """Exit once the run has this many trained steps in total (counted across restarts);
    unset follows the run until `until_idle_s`."""
    first_step: int | None = Field(default=None, ge=0)
    """Step to train first when no checkpoint exists; unset means the lowest sealed step."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between reads of the `steps` table while waiting for the next sealed step."""
    until_idle_s: float | None = Field(default=None, gt=0)
    """Exit 0 after waiting this long for the next sealed step; unset waits forever."""
    output_dir: Path = Path("artifacts/trainer")
    """Checkpoints go to `<output_dir>/<run_id>/checkpoints`, HF weights to `.../weights`."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """DeepSpeed checkpoints kept on disk; older tags are deleted after each save."""
    seed: int = 1234
    """Seed for model initialisation (`tiny`) and dropout."""

    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate (used when the DeepSpeed config has no `optimizer` section)."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay (Miles default)."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(default=0.98, ge=0, lt=1)
    """AdamW beta2 (Miles default)."""
    max_tokens_per_micro_batch: int = Field(default=16384, ge=1)
    """Token budget of one forward/backward per rank; a step is split into enough
    micro-batches to respect it, all accumulated into one optimizer update."""

    eps_clip: float = Field(default=0.2, ge=0)
    """PPO lower clip range: the ratio is clipped below at 1 - eps_clip."""
    eps_clip_high: float = Field(default=0.28, ge=0)
    """PPO upper clip range (DAPO clip-higher): the ratio is clipped above at 1 + eps_clip_high."""
    eps_clip_c: float | None = Field(default=None, gt=1)
    """Dual-clip constant for negative advantages; unset disables dual clip."""
    calculate_per_token_loss: bool = False
    """Token-level reduction (DAPO `token_mean`) instead of the per-rollout `sum_of_sample_mean`."""
    custom_pg_loss_reducer_function_path: DottedPath | None = None
    """`module.fn` or `module:fn` of a Miles reducer factory; replaces the pg-loss reducer only."""
    use_rollout_log_probs: bool = True
    """Use the engine's `rollout_log_probs` as the old policy; rows without them (or all rows
    when false) use the trainer's own log-probs, i.e. ratio 1 at the single update per step."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference model."""
    kl_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """KL estimator (MILES_SEMANTICS 10.2)."""
    ref_model: str | None = None
    """Reference model for the KL penalty; unset means the initial weights of `model`."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus weight (entropy is always logged)."""

    save_weights_every: int = Field(default=0, ge=0)
    """Save HF-format weights and publish `weights_updated` every k steps; 0 never."""
    kafka: KafkaSettings | None = None
    """Where `weights_updated` goes (`<topic_prefix>rollout.control`); set by any Kafka flag,
    unset publishes nothing."""
    wandb_project: str = "rolloutlake"
    """W&B project."""
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        default_factory=_wandb_mode_from_env, validate_default=True
    )
    """W&B mode; defaults to $WANDB_MODE, else offline."""
    dist_backend: str | None = None
    """torch.distributed backend; unset picks gloo on CPU and the accelerator's default elsewhere."""

    @field_validator("model", "ref_model")
    @classmethod
    def _model_exists(cls, value: str | None) -> str | None:
        if value is not None and value != "tiny" and not Path(value).is_dir():
            raise ValueError(f"{value!r} is neither 'tiny' nor a local model folder")
        return value

    @model_validator(mode="after")
    def _kl_needs_coef(self) -> TrainerConfig:
        if self.use_kl_loss and self.kl_loss_coef == 0:
            raise FieldValueError("kl_loss_coef", "must be > 0 when --use-kl-loss is set")
        return self

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_id

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def weights_dir(self) -> Path:
        return self.run_dir / "weights"

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed JSON, checked for the few keys the trainer relies on."""
        try:
            ds = json.loads(self.deepspeed.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--deepspeed: {self.deepspeed} is not JSON ({exc})") from None
        if not isinstance(ds, dict):
            raise ConfigError(f"--deepspeed: {self.deepspeed} must hold a JSON object")
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"--deepspeed: zero_optimization.stage must be 0-3, got {stage!r}")
        return ds
