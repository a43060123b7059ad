"""The gateway's one typed configuration, validated at start with errors naming the field.

Built by the entry point (`rolloutlake gateway`, `rolloutlake up`, tests) and passed to
`create_app`; nothing here runs at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ingest.io.kafka import KafkaSettings
from ingest.io.lake_location import LakePath
from schemas.config import build_config, setting_name
from schemas.errors import ConfigError

TOKENS_ENV = "ROLLOUTLAKE_GATEWAY_TOKENS"
MiB = 1024 * 1024

Scope = Literal["read", "write"]


def hash_token(token: str) -> str:
    """The at-rest form of a bearer token: hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenSpec(BaseModel):
    """One bearer token, stored as its sha256; `write` includes `read`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1)]
    """Who holds the token; logged instead of the token."""
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """Hex sha256 of the token (`rolloutlake gateway --hash-token TOKEN` prints it)."""
    scopes: Annotated[list[Scope], Field(min_length=1)]
    runs: list[str] | None = None
    """Run ids the token may touch; None (or `["*"]`) means every run, datasets included."""

    @property
    def is_global(self) -> bool:
        return self.runs is None or "*" in self.runs


class GatewayConfig(BaseModel):
    """Everything `rolloutlake gateway` needs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    lake: LakePath = "./lake"
    """Delta lake root (local folder or s3:// URI); datasets live under `datasets/`."""
    state_dir: Path = Path("./gateway-state")
    """Local folder for the accepted-event-id log and dataset upload spool files."""
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    tokens: list[TokenSpec] = []
    """Bearer tokens (hashed). Merged with `tokens_file` and the env variable."""
    tokens_file: Path | None = None
    """JSON file holding a list of `TokenSpec` objects (more come from $ROLLOUTLAKE_GATEWAY_TOKENS)."""
    allow_anonymous: bool = False
    """Serve without auth when no token is configured (local `rolloutlake up` only)."""
    body_limit_bytes: Annotated[int, Field(ge=1024)] = 64 * MiB
    """Largest request body outside dataset uploads; larger -> 413."""
    dataset_limit_bytes: Annotated[int, Field(ge=1024)] = 20 * 1024 * MiB
    """Largest dataset upload; uploads stream to disk, so this bounds disk, not memory."""
    dataset_line_limit_bytes: Annotated[int, Field(ge=1024)] = 16 * MiB
    """A JSONL line longer than this is reported as a bad line without being read whole."""
    tokenizers: dict[str, Path] = {}
    """Tokenizer name -> local folder for `max_prompt_len` in tokens (never the hub)."""
    dedup_window: Annotated[int, Field(ge=1)] = 200_000
    """How many recently accepted event ids are remembered (and persisted) for duplicates."""
    publish_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """How long a request waits for broker acks before answering 503."""
    retry_after_s: Annotated[int, Field(ge=1)] = 5
    """`Retry-After` of a 503."""
    max_prompts_per_request: Annotated[int, Field(ge=1)] = 4096
    prompt_checkpoint_groups: Annotated[int, Field(ge=1)] = 1000
    """Checkpoint a run's prompt cursor to Delta after this many served groups..."""
    prompt_checkpoint_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """...or this many seconds after the last checkpoint (off the request path)."""

    @model_validator(mode="after")
    def _auth_is_configured(self) -> GatewayConfig:
        if not self.tokens and not self.allow_anonymous:
            raise ValueError(
                "tokens: no bearer token is configured; set tokens_file or "
                f"{TOKENS_ENV}, or allow_anonymous=true for a local stack"
            )
        return self

    @property
    def upload_dir(self) -> Path:
        return self.state_dir / "uploads"


def _read_tokens(text: str, source: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"tokens: {source} is not valid JSON ({err})") from None
    if not isinstance(data, list):
        raise ConfigError(f"tokens: {source} must hold a JSON list of token objects")
    return data


def load_config(values: dict[str, Any], env: dict[str, str] | None = None) -> GatewayConfig:
    """Validate `values`, merging tokens from `tokens_file` and the environment.

    Raises `ConfigError` with one line naming the offending field (by its flag).
    """
    env = dict(os.environ) if env is None else env
    values = dict(values)
    tokens = list(values.get("tokens") or [])
    tokens_file = values.get("tokens_file")
    if tokens_file is not None:
        path = Path(tokens_file)
        try:
            tokens += _read_tokens(path.read_text(), str(path))
        except OSError as err:
            raise ConfigError(f"{setting_name(GatewayConfig, ['tokens_file'])}: cannot read "
                              f"{path}: {err.strerror}") from None
    if env.get(TOKENS_ENV):
        tokens += _read_tokens(env[TOKENS_ENV], TOKENS_ENV)
    values["tokens"] = tokens
    return build_config(GatewayConfig, values)
