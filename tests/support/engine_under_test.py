"""The inference engine the engine tests run on: `ROLLOUTLAKE_TEST_ENGINE`.

Unset (as in `make test`) they run on vLLM's CPU build from `.venv-engine`;
`make test-gpu` sets `sglang`, so they run on SGLang from `.venv-sglang` (CUDA only).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args

import pytest

from ingest.workers.engines import EngineKind

ROOT = Path(__file__).resolve().parents[2]


def engine_under_test() -> EngineKind:
    wanted = os.environ.get("ROLLOUTLAKE_TEST_ENGINE", "vllm")
    if wanted not in get_args(EngineKind):
        raise pytest.UsageError(
            f"ROLLOUTLAKE_TEST_ENGINE={wanted!r}: engines are {get_args(EngineKind)}")
    return wanted  # type: ignore[return-value]


def engine_flags(kind: EngineKind) -> list[str]:
    """`rolloutlake engine` flags that start `kind` from this checkout's venv of it."""
    if kind == "sglang":
        return ["--backend", "sglang", "--sglang-venv", str(ROOT / ".venv-sglang")]
    return ["--backend", "vllm", "--venv", str(ROOT / ".venv-engine")]
