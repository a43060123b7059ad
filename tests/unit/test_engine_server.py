"""The command line `rolloutlake engine` starts each engine with, and its refusals before
an engine starts (no engine runs here)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ingest.io.broker import free_port
from ingest.workers.config import EngineServerConfig
from ingest.workers.engine_server import GUARD, EngineServer
from ingest.workers.engines import EngineError

PYTHON = Path("/venv/bin/python")
MODEL = Path("/models/tiny")


def test_sglang_is_launched_with_token_ids_float32_and_the_configured_memory_share():
    config = EngineServerConfig(backend="sglang", port=30123, max_model_len=256,
                                mem_fraction_static=0.15)
    assert EngineServer(config).command(PYTHON, MODEL) == [
        "/venv/bin/python", str(GUARD), "--", "/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/tiny", "--skip-tokenizer-init", "--dtype", "float32",
        "--context-length", "256", "--mem-fraction-static", "0.15",
        "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
        "--disable-cuda-graph", "--host", "127.0.0.1", "--port", "30123"]


def test_vllm_stays_the_default_backend_with_its_cpu_flags():
    assert EngineServer(EngineServerConfig(port=8123)).command(PYTHON, MODEL) == [
        "/venv/bin/python", str(GUARD), "--", "/venv/bin/python", "-m",
        "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
        "--max-model-len", "512", "--host", "127.0.0.1", "--port", "8123"]


def test_sglang_without_its_venv_names_the_install_script(tmp_path):
    missing = tmp_path / "no-sglang"
    # The vLLM venv is there: only the SGLang one may be looked for.
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").touch()
    config = EngineServerConfig(backend="sglang", venv=tmp_path / "vllm", sglang_venv=missing)
    with pytest.raises(EngineError) as refused:
        EngineServer(config).start()
    assert str(refused.value) == (
        f"no SGLang venv at {missing}: install it on a CUDA machine with "
        f"`sh deploy/engine/install-sglang.sh {missing}` (or `make test-gpu`)")


@pytest.mark.parametrize(("field", "value"), [("mem_fraction_static", 0.0),
                                              ("mem_fraction_static", 1.0),
                                              ("backend", "tgi")])
def test_bad_sglang_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EngineServerConfig(**{field: value})


def fake_sglang_venv(tmp_path: Path, exit_code: int) -> Path:
    """A venv whose python exits at once with `exit_code`, as an SGLang that cannot start."""
    venv = tmp_path / "sglang-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    python.chmod(0o755)
    return venv


def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_sglang_on_a_taken_port_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineServerConfig(backend="sglang", port=port, model=str(model_dir(tmp_path)),
                                    sglang_venv=fake_sglang_venv(tmp_path, 0))
        with pytest.raises(EngineError) as refused:
            EngineServer(config).start()
    assert str(refused.value) == (f"port {port} on 127.0.0.1 is already in use; "
                                  "pick another with --port")


def test_sglang_that_dies_at_start_is_one_error_naming_its_log(tmp_path):
    log_file = tmp_path / "engine.log"
    config = EngineServerConfig(backend="sglang", port=free_port(),
                                model=str(model_dir(tmp_path)), log_file=log_file,
                                sglang_venv=fake_sglang_venv(tmp_path, 3))
    with pytest.raises(EngineError) as refused:
        EngineServer(config).start()
    assert str(refused.value) == f"the engine exited with code 3 while starting (see {log_file})"
