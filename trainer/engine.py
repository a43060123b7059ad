"""DeepSpeed training of sealed steps: one optimizer update per step, with exact resume.

Order of a step, chosen so a kill at any point neither repeats nor skips an update:
train -> DeepSpeed checkpoint (its client state holds the step's `trainer_steps` row) ->
`trainer_steps` row -> weights. A restart loads the latest checkpoint, replays the
idempotent outputs of that step (a kill may have landed between checkpoint and row) and
continues at the next step. A step killed before its checkpoint left nothing durable and
is trained from the previous checkpoint, i.e. once.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM, PreTrainedModel

from ingest.io.lake import Lake
from schemas.errors import ConfigError
from trainer.batches import (
    StepBatch,
    StepFollower,
    StepPrefetcher,
    StepRow,
    plan_micro_batches,
)
from trainer.config import TrainerConfig
from trainer.losses import LossSettings, micro_batch_loss, token_log_probs
from trainer.outputs import StepSink, weights_path
from trainer.reducers import StepReduction, load_pg_loss_reducer
from trainer.tiny import tiny_model

log = logging.getLogger(__name__)

TINY_VOCAB_SIZE = 512


def build_model(spec: str, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A local HF causal LM, or `tiny`: the tiny policy's architecture (`trainer.tiny`)
    with a vocabulary wide enough for synthetic token ids; needs no download."""
    torch.manual_seed(seed)
    if spec == "tiny":
        return tiny_model(TINY_VOCAB_SIZE, seed, dtype)
    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)


def model_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """Load weights in the precision DeepSpeed will train in, not float32 first: an 8B
    model would otherwise need 32 GB of host memory before DeepSpeed casts it."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def init_distributed(backend: str | None) -> None:
    """Join (or, for a plain `python -m trainer.main`, form) the process group.

    Launchers (deepspeed, torchrun) set RANK/WORLD_SIZE/MASTER_*; a single process gets
    a free loopback port so two trainers on one machine do not collide.
    """
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if backend is None:
        accelerator = get_accelerator()
        # The CPU accelerator defaults to oneCCL, which is not installed with torch.
        backend = (
            "gloo"
            if accelerator.device_name() == "cpu"
            else accelerator.communication_backend_name()
        )
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def gathered_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Full-size CPU copies of the weights; a collective under ZeRO-3 (call on all ranks)."""
    params = list(engine.module.parameters())
    stage3 = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage3):
        return {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}


class Trainer:
    """Trains a run's sealed steps in order, one DeepSpeed update per step."""

    def __init__(self, config: TrainerConfig):
        self.config = config
        ds_config = config.deepspeed_config()
        # Loaded before DeepSpeed starts, so a bad path fails in a second, not after init.
        self.pg_reducer = (
            load_pg_loss_reducer(config.custom_pg_loss_reducer_function_path)
            if config.custom_pg_loss_reducer_function_path
            else None
        )
        init_distributed(config.dist_backend)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dtype = model_dtype(ds_config)
        model = build_model(config.model, config.seed, self.dtype)
        # Batch sizes in the JSON are nominal: a sealed step is one update whatever its
        # size. They only have to satisfy DeepSpeed's own consistency check.
        ds_config.setdefault("train_micro_batch_size_per_gpu", 1)
        ds_config.setdefault("gradient_accumulation_steps", 1)
        ds_config.setdefault(
            "train_batch_size",
            ds_config["train_micro_batch_size_per_gpu"]
            * ds_config["gradient_accumulation_steps"]
            * self.world_size,
        )
        optimizer = None
        if "optimizer" not in ds_config:
            # A torch optimizer: DeepSpeed's named ones JIT-compile ops (tens of seconds on CPU).
            optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=config.lr,
                betas=(config.adam_beta1, config.adam_beta2),
                weight_decay=config.weight_decay,
            )
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=None if optimizer else model.parameters(),
            config=ds_config,
        )
        self.vocab_size = model.config.vocab_size
        self.ref_model = self._reference_model() if config.use_kl_loss else None
        self.settings = LossSettings(
            eps_clip=config.eps_clip,
            eps_clip_high=config.eps_clip_high,
            eps_clip_c=config.eps_clip_c,
            kl_loss_coef=config.kl_loss_coef if config.use_kl_loss else 0.0,
            kl_loss_type=config.kl_loss_type,
            entropy_coef=config.entropy_coef,
            use_rollout_log_probs=config.use_rollout_log_probs,
        )
        self.lake = Lake(config.lake)
        self.follower = StepFollower(
            self.lake, config.run_id, poll_interval_s=config.poll_interval_s
        )
        self.sink = StepSink(config, self.lake) if self.rank == 0 else None
        self.trained_steps = 0
        self.next_step = self._resume()

    def _reference_model(self) -> PreTrainedModel:
        ref = build_model(self.config.ref_model or self.config.model, self.config.seed, self.dtype)
        ref.to(self.engine.device).eval().requires_grad_(False)
        return ref

    def _resume(self) -> int | None:
        """The next step to train: after the latest checkpoint, else `first_step` (None:
        the lowest sealed step)."""
        if not (self.config.checkpoint_dir / "latest").exists():
            return self.config.first_step
        path, client = self.engine.load_checkpoint(str(self.config.checkpoint_dir))
        if path is None:
            raise ConfigError(
                f"--output-dir: cannot load the checkpoint in {self.config.checkpoint_dir}"
            )
        row = client["trainer_row"]
        if row["run_id"] != self.config.run_id:
            raise ConfigError(
                f"--output-dir: {self.config.checkpoint_dir} holds run {row['run_id']!r}, "
                f"not {self.config.run_id!r}"
            )
        self.trained_steps = client["trained_steps"]
        log.info(
            "resumed from %s: step %d trained, %d updates", path, row["step"], self.trained_steps
        )
        self._finish_step(row)
        return row["step"] + 1

    def run(self) -> int:
        """Train until `steps` updates exist or the run goes idle; returns steps trained now."""
        trained_now = 0
        with StepPrefetcher(self.follower, self.next_step) as prefetched:
            while self.config.steps is None or self.trained_steps < self.config.steps:
                started = time.monotonic()
                loaded = prefetched.next(idle_timeout_s=self.config.until_idle_s)
                if loaded is None:
                    log.info("no sealed step after %ss; stopping", self.config.until_idle_s)
                    break
                sealed, batch = loaded
                log.info(
                    "step %d: training %d rows, %d rollouts (batch version %d, waited %.2fs "
                    "for its tensors)",
                    sealed.step,
                    batch.num_rows,
                    batch.n_rollouts,
                    sealed.batch_version,
                    time.monotonic() - started,
                )
                self._train_sealed(sealed, batch)
                trained_now += 1
        if self.sink is not None:
            self.sink.close()
        return trained_now

    def _train_sealed(self, sealed: StepRow, batch: StepBatch) -> None:
        """Train one step, checkpoint it, then record its outputs (the order resume needs)."""
        started = time.monotonic()
        stats = self.train_step(batch)
        self.trained_steps += 1
        row = {
            "run_id": self.config.run_id,
            "step": sealed.step,
            "batch_version": sealed.batch_version,
            "content_sha256": sealed.content_sha256,
            **stats,
            "tokens": int(batch.total_lengths.sum()),
            "loss_tokens": int(batch.loss_mask.sum()),
            "seconds": time.monotonic() - started,
            "update": self.trained_steps,
            "trained_at": time.time(),
        }
        self.engine.save_checkpoint(
            str(self.config.checkpoint_dir),
            tag=f"step_{sealed.step:09d}",
            client_state={"trainer_row": row, "trained_steps": self.trained_steps},
        )
        self._finish_step(row)
        log.info("step %d: loss %.6f, grad norm %.4f", sealed.step, row["loss"], row["grad_norm"])

    def _finish_step(self, row: dict[str, Any]) -> None:
        """Outputs of a checkpointed step; safe to repeat after a restart."""
        if self.sink is not None:  # rank 0
            self._prune_checkpoints()
            self.sink.record(row)
        every = self.config.save_weights_every
        if every and row["step"] % every == 0:
            path = weights_path(self.config, row["step"])
            if not path.exists():  # a shared filesystem, as for DeepSpeed checkpoints
                state = gathered_state_dict(self.engine)
                if self.sink is not None:
                    self.sink.save_weights(self.engine.module, state, row["step"])
            if self.sink is not None:
                self.sink.publish_weights(row["step"], path, row["update"])

    def _prune_checkpoints(self) -> None:
        tags = sorted(self.config.checkpoint_dir.glob("step_*"))
        for old in tags[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer update over the whole step, accumulated over micro-batches."""
        max_token = int(batch.tokens.max())
        if max_token >= self.vocab_size:
            raise ConfigError(
                f"--model: step {batch.step} has token id {max_token}, "
                f"but the model's vocabulary has {self.vocab_size} entries"
            )
        reduction = StepReduction.for_step(
            batch.loss_mask,
            batch.n_rollouts,
            calculate_per_token_loss=self.config.calculate_per_token_loss,
        )
        parts = plan_micro_batches(
            batch.total_lengths.numpy(),
            world_size=self.world_size,
            rank=self.rank,
            max_tokens=self.config.max_tokens_per_micro_batch,
        )
        device = self.engine.device
        totals: dict[str, torch.Tensor] = {}
        self.engine.train()
        for index, part in enumerate(parts):
            micro = batch.rows(part)
            tokens = micro.tokens.to(device, torch.long)
            attention_mask = micro.attention_mask.to(device)
            self.engine.set_gradient_accumulation_boundary(index == len(parts) - 1)
            logits = self.engine(
                input_ids=tokens, attention_mask=attention_mask, use_cache=False
            ).logits
            log_probs, entropy = token_log_probs(
                logits, tokens, with_entropy_grad=self.settings.entropy_coef > 0
            )
            ref_log_probs = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(
                        input_ids=tokens, attention_mask=attention_mask, use_cache=False
                    ).logits
                    ref_log_probs, _ = token_log_probs(ref_logits, tokens, with_entropy_grad=False)
            loss, metrics = micro_batch_loss(
                self.settings,
                micro,
                log_probs,
                entropy,
                reduction,
                ref_log_probs=ref_log_probs,
                pg_reducer_factory=self.pg_reducer,
            )
            # Shares of the step loss add up over micro-batches and ranks; DeepSpeed
            # averages gradients over ranks, hence the factor, and must not divide by its
            # nominal accumulation count.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0) + value
        own_norm = self._local_grad_norm() if self.engine.zero_optimization_stage() == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = own_norm
        keys = sorted(totals)
        summed = torch.stack([totals[k].float() for k in keys])
        dist.all_reduce(summed)
        stats = dict(zip(keys, summed.tolist(), strict=True))
        return {
            "loss": stats["loss"],
            "pg_loss": stats["pg_loss"],
            "pg_clipfrac": stats["pg_clipfrac"],
            "pg_clipfrac_low": stats["pg_clipfrac_low"],
            "pg_clipfrac_high": stats["pg_clipfrac_high"],
            "ppo_kl": stats["ppo_kl"],
            "log_ratio_clamped_tokens": int(stats["log_ratio_clamped_tokens"]),
            "kl": stats.get("kl_loss"),
            "entropy": stats["entropy_loss"],
            "grad_norm": float(grad_norm),
            "lr": float(self.engine.get_lr()[0]),
        }

    def _local_grad_norm(self) -> float:
        """ZeRO-0 keeps whole (already all-reduced) gradients, but DeepSpeed reports no
        norm for it without gradient clipping."""
        grads = [
            p.grad.float().norm() for p in self.engine.module.parameters() if p.grad is not None
        ]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0
