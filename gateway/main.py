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
from gateway.config import TOKENS_ENV, GatewayConfig, hash_token, load_config
from ingest.io.broker import port_is_free
from schemas.errors import ConfigError

GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON file of gateway config fields")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--bootstrap-servers", help="Kafka brokers, host:port[,host:port]")
    parser.add_argument("--topic-prefix", help="prefix of every topic name")
    parser.add_argument("--lake", help="Delta lake root (default ./lake)")
    parser.add_argument("--state-dir", help="local state folder (default ./gateway-state)")
    parser.add_argument("--tokens-file", type=Path,
                        help=f"JSON list of hashed tokens (also read from ${TOKENS_ENV})")
    parser.add_argument("--allow-anonymous", action="store_true",
                        help="serve without tokens (local development only)")
    parser.add_argument("--hash-token", metavar="TOKEN",
                        help="print the sha256 to put in a tokens file, then exit")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        try:
            values = json.loads(args.config.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"--config {args.config}: {err}") from None
    kafka = dict(values.get("kafka") or {})
    if args.bootstrap_servers:
        kafka["bootstrap_servers"] = args.bootstrap_servers
    if args.topic_prefix is not None:
        kafka["topic_prefix"] = args.topic_prefix
    values["kafka"] = kafka
    for flag, key in (("host", "host"), ("port", "port"), ("lake", "lake_root"),
                      ("state_dir", "state_dir"), ("tokens_file", "tokens_file")):
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    if args.allow_anonymous:
        values["allow_anonymous"] = True
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
