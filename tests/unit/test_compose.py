"""docker-compose.yml as the services will read it."""

from __future__ import annotations

from pathlib import Path

import yaml

from ingest.io.lake import lake_storage_options

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
