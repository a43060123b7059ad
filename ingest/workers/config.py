"""Typed configs of `rolloutlake engine` and `rolloutlake worker`, and flags made from them.

Every field maps to the flag `--<field-name>` (underscores become dashes); its attribute
docstring is the `--help` text and a validation error names the flag to fix.
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.errors import ConfigError

Model = typing.TypeVar("Model", bound=BaseModel)


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, config: type[BaseModel]) -> None:
    """One flag per field; unset flags stay None so the model's defaults apply."""
    for name, field in config.model_fields.items():
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": field.description}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(field.annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(field.annotation))
        if field.is_required():
            kwargs["required"] = True
        parser.add_argument(flag(name), **kwargs)


def config_from_args(config: type[Model], args: argparse.Namespace) -> Model:
    """Validate the flags given; the first error becomes a one-line `ConfigError`."""
    values = {name: getattr(args, name) for name in config.model_fields
              if getattr(args, name, None) is not None}
    try:
        return config(**values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0]) if err["loc"] else "config"
        raise ConfigError(f"{flag(field)}: {err['msg'].removeprefix('Value error, ')}") from None


class EngineServerConfig(BaseModel):
    """One vLLM CPU engine on loopback."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: str = "tiny"
    """Local Hugging Face model folder, or `tiny`: the tiny policy, written to `--tiny-dir`
    on first use."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Loopback port of the engine's HTTP API."""
    tiny_dir: Path = Path("artifacts/tiny-policy")
    """Where `--model tiny` keeps the tiny policy (weights and tokenizer); an existing one
    is reused, so the trainer can load the same folder."""
    venv: Path = Path(".venv-engine")
    """The engine's own virtual environment (`make engine` installs it)."""
    max_model_len: int = Field(default=512, ge=16)
    """Longest prompt + response, in tokens."""
    kv_cache_gib: int = Field(default=1, ge=1)
    """KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`)."""
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
