"""`rolloutlake gateway`: serve the REST gateway with uvicorn.

Configuration: an optional JSON file of `GatewayConfig` fields (`--config`), overridden by
flags; tokens also come from `--tokens-file` and ROLLOUTLAKE_GATEWAY_TOKENS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig, hash_token, load_config
from ingest.io.broker import port_is_free
from schemas.config import add_config_flags, flag_values
from schemas.errors import ConfigError

GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON file of gateway config fields; "
                        "flags override it")
    parser.add_argument("--hash-token", metavar="TOKEN",
                        help="print the sha256 to put in a tokens file, then exit")
    add_config_flags(parser, GatewayConfig)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        try:
            values = json.loads(args.config.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"--config {args.config}: {err}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"--config {args.config}: must hold a JSON object")
    for name, value in flag_values(GatewayConfig, args).items():
        nested = values.get(name)
        values[name] = {**nested, **value} if isinstance(nested, dict) else value
    return load_config(values)


def serve(config: GatewayConfig) -> None:
    """Run uvicorn until SIGINT/SIGTERM; shutdown drains requests, then flushes Kafka."""
    if not port_is_free(config.host, config.port):
        raise ConfigError(f"port: {config.port} on {config.host} is already in use")
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), host=config.host, port=config.port, access_log=False,
        log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    ))
    server.run()


def run(args: argparse.Namespace) -> int:
    if args.hash_token:
        print(hash_token(args.hash_token))
        return 0
    serve(config_from_args(args))
    return 0
