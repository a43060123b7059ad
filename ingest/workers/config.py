"""Typed configs of `rolloutlake engine` and `rolloutlake worker`.

Their flags and one-line errors come from the fields (`schemas/config.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ingest.io.kafka import KafkaSettings
from ingest.workers.engines import EngineKind
from schemas.config import ExistingFile
from schemas.dotted import DottedPath
from schemas.errors import ConfigError
from schemas.events import RunId

GATEWAY_TOKEN_ENV = "ROLLOUTLAKE_GATEWAY_TOKEN"


class EngineServerConfig(BaseModel):
    """One inference engine on loopback: vLLM's CPU build, or SGLang on a CUDA GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: EngineKind = "vllm"
    """The engine: `vllm` (its CPU build, from `--venv`) or `sglang` (CUDA only, from
    `--sglang-venv`)."""
    model: str = "tiny"
    """Local Hugging Face model folder, or `tiny`: the tiny policy, written to `--tiny-dir`
    on first use."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Loopback port of the engine's HTTP API."""
    tiny_dir: Path = Path("artifacts/tiny-policy")
    """Where `--model tiny` keeps the tiny policy (weights and tokenizer); an existing one
    is reused, so the trainer can load the same folder."""
    venv: Path = Path(".venv-engine")
    """vLLM's own virtual environment (`make engine` installs it)."""
    sglang_venv: Path = Path(".venv-sglang")
    """SGLang's own virtual environment (`deploy/engine/install-sglang.sh` installs it)."""
    max_model_len: int = Field(default=512, ge=16)
    """Longest prompt + response, in tokens."""
    kv_cache_gib: int = Field(default=1, ge=1)
    """vLLM's KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`)."""
    mem_fraction_static: float = Field(default=0.2, gt=0, lt=1)
    """SGLang's share of the GPU's memory for weights and KV cache
    (`--mem-fraction-static`); small, so the GPU stays usable beside it."""
    ready_timeout_s: float = Field(default=600.0, gt=0)
    """Give up when `/health` does not answer within this many seconds."""
    log_file: Path | None = None
    """Write the engine's own output here; unset passes it through."""

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str) -> str:
        if value != "tiny" and not (Path(value) / "config.json").is_file():
            raise ValueError(f"{value!r} is neither 'tiny' nor a model folder with config.json")
        return value


class WorkerConfig(BaseModel):
    """One rollout worker: prompts from a dataset file, samples from engines, events to Kafka."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run: RunId
    """The run whose rollouts this worker generates."""
    prompt_data: ExistingFile | None = None
    """JSONL dataset of prompts (Miles `--prompt-data`), one object per line; or give
    `--prompts-from`."""
    prompts_from: str | None = None
    """Gateway base URL: prompt groups come from its `POST /v1/runs/{run}/prompts` (the
    run and its dataset are registered there; the gateway publishes `run_started` and
    each `group_started`). The bearer token comes from `--gateway-token-file` or
    $ROLLOUTLAKE_GATEWAY_TOKEN."""
    gateway_token_file: Path | None = None
    """File holding the gateway bearer token (a write token of the run)."""
    tokenizer: Path
    """Hugging Face tokenizer folder of the engine's model (for `--model tiny`: its
    `--tiny-dir`); prompts are tokenized here, engines get token ids."""
    custom_rm_path: DottedPath
    """Reward function `module.fn` or `module:fn`, Miles signature
    `async def rm(args, sample) -> float | dict`; one that raises scores the sample null."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    engine: EngineKind = "vllm"
    """Engine API: `vllm` (OpenAI-compatible) or `sglang` (native)."""
    engine_url: str = "http://127.0.0.1:8000"
    """Engine base URL; several, comma-separated, share the requests round-robin."""
    input_key: str = "input"
    """Dataset key of the prompt (Miles `--input-key`); a string."""
    label_key: str | None = None
    """Dataset key of the label (Miles `--label-key`); a row without it is an error."""
    metadata_key: str = "metadata"
    """Dataset key of the row metadata (Miles `--metadata-key`)."""
    n_samples_per_prompt: int = Field(default=8, ge=1)
    """Samples per prompt; each is one engine request with its own request id."""
    rollout_batch_size: int = Field(default=4, ge=1)
    """Kept groups per step (the processor seals a step at this many)."""
    over_sampling_batch_size: int | None = Field(default=None, ge=1)
    """Groups issued per step; unset issues `rollout_batch_size`."""
    num_steps: int = Field(default=1, ge=1)
    """Steps to generate; the worker exits when they are done."""
    first_step: int = Field(default=0, ge=0)
    """Step of the first groups issued; group indexes start at `first_step` times the
    groups issued per step, so a worker resumed at a later step does not reuse them."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Most tokens generated per sample."""
    ignore_eos: bool = False
    """Generate `max_new_tokens` whatever the end-of-sequence token (both engines'
    `ignore_eos`): fixed-length rollouts for load tests and benchmarks."""
    group_rm: bool = False
    """Score each group at once (Miles `--group-rm`): `--custom-rm-path` is called as
    `rm(args, samples) -> list[float | dict]`, one reward per finished sample, sent as
    `reward` events once the group is done."""
    reward_key: str | None = None
    """Key of the reward in a dict reward (Miles `--reward-key`), sent in `run_started`."""
    dynamic_sampling_filter_path: str | None = None
    """The run's group filter, sent in `run_started` (e.g. `ingest.core.filters.reward_nonzero_std`)."""
    std_normalization: bool = True
    """Divide GRPO advantages by the group's reward std (sent in `run_started`); Dr.GRPO
    runs without it."""
    publish_run_started: bool = True
    """Publish `run_started` with this worker's batch settings before the first group."""
    weight_version: int = Field(default=0, ge=0)
    """Weight version the engines serve at the start; `weights_updated` raises it."""
    max_staleness: int | None = Field(default=None, ge=0)
    """The run's `max_staleness`, sent in `run_started`. When set, the groups of step `s`
    are issued only once the engines serve weight version `s - max_staleness` or newer
    (versions count trainer updates, as the trainer's `weights_updated` numbers them
    with `--save-weights-every 1`): 0 is Miles' synchronous loop, every sample generated
    by the weights trained on all earlier steps. Unset issues each step at once."""
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    """Seed of the engines' sampling: sample `i` of the run is drawn with seed
    `seed * 2**32 + i`, so the same weights give the same samples (vLLM only). Unset:
    the engine's own randomness."""
    num_workers: int = Field(default=1, ge=1)
    """Workers sharing this run (each with its own `--worker-index`): every round of
    `--over-sampling-batch-size` groups is split between them, so together they issue it
    once, also on the processor's `demand`, which each of them follows."""
    worker_index: int = Field(default=0, ge=0)
    """This worker's share of each round, from 0 to `--num-workers` - 1: the groups
    whose place in the round leaves this remainder divided by `--num-workers`."""
    max_over_sampling_rounds: int = Field(default=8, ge=1)
    """Soft cap on the rounds of `--over-sampling-batch-size` groups issued for one step:
    each round beyond it logs a warning and counts in `rounds past cap`; the worker keeps
    issuing until the step seals (a hard cap would leave the step unsealed)."""
    seal_wait_s: float = Field(default=10.0, ge=0)
    """After its last step's groups are done, the worker waits for its steps to seal,
    issuing more groups on the processor's `demand`; it exits once every step it issued
    is sealed, or when for this many seconds no control message of the run came and no
    round of its groups ended."""
    partial_rollout: bool = False
    """Miles `--partial-rollout`: at a seal, a group whose samples were cancelled is
    recycled at the gateway with what its samples had generated (durable before their
    `sample_aborted`), served again first, and each partial sample continues from its
    tokens with the rest of `--max-new-tokens`. Needs `--prompts-from`."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Miles `--mask-offpolicy-in-partial-rollout`: a continued sample's tokens generated
    under older weights than the ones that finish it get loss mask 0. Needs
    `--partial-rollout`."""
    broker_outage_s: float = Field(default=120.0, ge=0)
    """How long the worker rides out a Kafka outage (a broker restarted or failed over):
    the events the broker did not acknowledge are sent again by a new producer until it
    takes them. Past it the worker stops with exit code 2; 0 stops at the first step whose
    events were not acknowledged within 30 s."""
    max_in_flight: int = Field(default=64, ge=1)
    """Most engine requests open at once, over all engines."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds one engine request may take before it is an engine error."""

    @model_validator(mode="after")
    def _one_prompt_source(self) -> WorkerConfig:
        if (self.prompt_data is None) == (self.prompts_from is None):
            raise ValueError("give exactly one of --prompt-data and --prompts-from")
        return self

    @model_validator(mode="after")
    def _partial_rollout_needs_the_gateway(self) -> WorkerConfig:
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
        if self.partial_rollout and self.prompts_from is None:
            raise ValueError("--partial-rollout needs --prompts-from: the gateway keeps the "
                             "recycled samples durable")
        return self

    def gateway_token(self) -> str | None:
        """The gateway token: `--gateway-token-file`, else $ROLLOUTLAKE_GATEWAY_TOKEN."""
        if self.gateway_token_file is not None:
            try:
                return self.gateway_token_file.read_text().strip()
            except OSError as err:
                raise ConfigError(f"--gateway-token-file: {err}") from None
        return os.environ.get(GATEWAY_TOKEN_ENV) or None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: Path) -> Path:
        if not (value / "tokenizer.json").is_file() and not (value / "tokenizer_config.json").is_file():
            raise ValueError(f"{value} holds no Hugging Face tokenizer (tokenizer.json)")
        return value

    @field_validator("over_sampling_batch_size")
    @classmethod
    def _over_sampling_at_least_batch(cls, value: int | None, info: ValidationInfo) -> int | None:
        batch = info.data.get("rollout_batch_size")
        if value is not None and batch is not None and value < batch:
            raise ValueError(f"must be >= --rollout-batch-size ({batch}), got {value}")
        return value

    @model_validator(mode="after")
    def _a_share_of_every_round(self) -> WorkerConfig:
        if self.worker_index >= self.num_workers:
            raise ValueError(f"--worker-index {self.worker_index} is not below --num-workers "
                             f"{self.num_workers}")
        if self.num_workers > self.groups_per_step:
            raise ValueError(f"--num-workers {self.num_workers} is more than the groups of a "
                             f"round ({self.groups_per_step}, --over-sampling-batch-size): "
                             "a worker would never get one")
        return self

    @field_validator("seed")
    @classmethod
    def _seed_needs_vllm(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("engine") == "sglang":
            raise ValueError("the SGLang adapter sends no per-request seed; unset --seed")
        return value

    @property
    def groups_per_step(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @property
    def producer_id(self) -> str:
        """The `producer` of this worker's events: its run, and its index among several."""
        index = f"-{self.worker_index}" if self.num_workers > 1 else ""
        return f"worker-{self.run}{index}"

    def round_share(self, first_group: int) -> list[int]:
        """This worker's group indexes of the round that starts at `first_group`."""
        return list(range(first_group + self.worker_index, first_group + self.groups_per_step,
                          self.num_workers))

    @property
    def engine_urls(self) -> list[str]:
        return [url.strip() for url in self.engine_url.split(",") if url.strip()]

    def run_config(self) -> dict[str, Any]:
        """The `run_started` config (CONTRACT section 2) this worker's flags describe."""
        return {
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "rollout_batch_size": self.rollout_batch_size,
            "over_sampling_batch_size": self.groups_per_step,
            "dynamic_sampling_filter_path": self.dynamic_sampling_filter_path,
            "reward_key": self.reward_key,
            "std_normalization": self.std_normalization,
            "partial_rollout": self.partial_rollout,
            **({} if self.max_staleness is None else {"max_staleness": self.max_staleness}),
        }
