"""The `rolloutlake` command: one subcommand per service, each module owning its flags.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their subcommand runs, so `rolloutlake broker` does not load torch.
Errors a user can cause end as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

from schemas.errors import RolloutlakeError, refused_resource

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("ingest.io.broker", "run an embedded broker on loopback (Tansu, or Apache Kafka)"),
    "schemas": ("schemas.export", "export JSON Schemas of events, print Delta table schemas"),
    "process": ("ingest.processor.command", "run the stream processor (events -> Delta batches)"),
    "simulate": ("ingest.commands.simulate", "publish simulated rollout runs (load generator)"),
    "demo": ("ingest.commands.demo", "the whole RL loop: a tiny policy learns a task (--simulate: the simulated pipeline)"),
    "replay": ("ingest.commands.replay", "re-derive a run's decisions and batches from the events archive"),
    "audit": ("ingest.commands.audit", "lineage of a group, batch row or trainer step: events to trainer update"),
    "lake": ("ingest.commands.lake", "optimize or vacuum the lake, keeping what runs under retention need"),
    "gateway": ("gateway.main", "run the REST gateway (FastAPI)"),
    "up": ("gateway.up", "run the whole local stack: broker, processor, gateway"),
    "trainer": ("trainer.main", "train on sealed batches with DeepSpeed"),
    "wandb-sync": ("ingest.commands.wandb_sync", "log a run's step metrics to Weights & Biases"),
    "watch": ("ingest.commands.watch", "live terminal table of a run's steps"),
    "engine": ("ingest.workers.engine_server", "run an inference engine on loopback: vLLM's CPU build or SGLang (CUDA)"),
    "worker": ("ingest.workers.main", "generate rollouts on engines, score them and publish events"),
}
# name -> module whose `prestart(argv)` starts helper processes before the flags are parsed
# (the parse imports the command's heavy modules; a helper imports them alongside).
PRESTART: dict[str, str] = {"process": "ingest.processor.launch"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `rolloutlake process: error: ...`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="rolloutlake", description=(
        "rolloutlake: durable, replayable trajectory data for RL post-training "
        "(rollout events in Kafka, sealed training batches in Delta Lake)"))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            _load(module_name).add_arguments(command)
        command.set_defaults(_module=module_name)
    return parser


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RolloutlakeError(f"{module_name} is not available: {err}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    try:
        if command in PRESTART:
            _load(PRESTART[command]).prestart(argv)
        args = build_parser(only=command).parse_args(argv)
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        logging.getLogger("kafka").setLevel(logging.WARNING)
        return int(_load(args._module).run(args) or 0)
    except RolloutlakeError as err:
        print(f"rolloutlake {command or ''}: {err}".replace("  ", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        refused = _acl_refusal(err)
        if refused is None:
            raise
        print(f"rolloutlake {command or ''}: {refused}".replace("  ", " "), file=sys.stderr)
        return 2


def _acl_refusal(err: Exception) -> str | None:
    """A refusal by the broker's ACLs that a command let through, in words (None for any
    other error). kafka-python is loaded by then if it raised it: this module does not
    import it, so that commands without Kafka start without it."""
    kafka_errors = sys.modules.get("kafka.errors")
    if kafka_errors is None or not isinstance(err, kafka_errors.AuthorizationError):
        return None
    return (f"the Kafka broker refuses access to {refused_resource(err)} (the ACLs each "
            "service needs: docs/kafka-security.md, \"ACLs\")")


if __name__ == "__main__":
    sys.exit(main())
