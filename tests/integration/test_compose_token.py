"""docker-compose's first-start token: the `gateway-token` service's script, run as
compose runs it, gives a token the gateway then accepts over real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.gateway_support import RunningGateway, gateway_config

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _token_script() -> str:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["gateway-token"]
    assert service["entrypoint"] == ["sh", "-c"]
    # Compose turns `$$` into `$`; the script uses no other interpolation.
    return service["command"][0].replace("$$", "$")


def _run_script(tokens_dir: Path) -> str:
    bin_dir = str(Path(sys.executable).parent)  # `python` and `rolloutlake` of this venv
    result = subprocess.run(
        ["sh", "-c", _token_script()], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TOKENS_DIR": str(tokens_dir),
             "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_first_start_token_opens_the_gateway(kafka, tmp_path):
    tokens_dir = tmp_path / "tokens"
    tokens_dir.mkdir()
    printed = _run_script(tokens_dir)
    token = printed.strip().rsplit(" ", 1)[-1]
    assert len(token) >= 40 and token not in (tokens_dir / "tokens.json").read_text()
    # A restart keeps the first token instead of replacing it.
    assert "kept" in _run_script(tokens_dir) and token not in _run_script(tokens_dir)
    config = gateway_config(kafka, str(tmp_path / "lake"), tmp_path / "state", tokens=[],
                            tokens_file=str(tokens_dir / "tokens.json"))
    with RunningGateway(config) as gateway:
        with gateway.client(token) as client:
            assert client.get("/v1/dashboard/runs").status_code == 200
        with gateway.client(None) as client:
            assert client.get("/v1/dashboard/runs").status_code == 401
        with gateway.client("not-the-token") as client:
            assert client.get("/v1/dashboard/runs").status_code == 401
