"""docker-compose.yml as the services will read it."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from ingest.cli import build_parser
from ingest.io.lake_location import lake_storage_options

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_lake_services_commit_safely_to_s3():
    for name in ("processor", "gateway"):
        service = _services()[name]
        command = service["command"]
        lake = command[command.index("--lake") + 1]
        assert lake.startswith("s3://")
        env = {k: str(v) for k, v in service["environment"].items()}
        assert "AWS_S3_ALLOW_UNSAFE_RENAME" not in env, name
        # What the service's Lake will use: accepted (no ConfigError), conditional put on.
        assert lake_storage_options(lake, environ=env)["AWS_CONDITIONAL_PUT"] == "etag"


def test_the_token_script_passes_a_token_that_starts_with_a_dash():
    """`secrets.token_urlsafe` starts with `-` once in 64 tokens; as a separate argument
    argparse would take it for a flag and the first start would fail."""
    script = _services()["gateway-token"]["command"][0].replace("$$", "$")
    [line] = [ln for ln in script.splitlines() if "--hash-token" in ln]
    call = line.split("$(", 1)[1].rsplit(")", 1)[0].replace("$token", "-leading-dash")
    argv = shlex.split(call)
    assert argv[:2] == ["rolloutlake", "gateway"]
    assert build_parser(only="gateway").parse_args(argv[1:]).hash_token == "-leading-dash"
