"""`rolloutlake trainer`: flags, config and the run, for the CLI registry and standalone use.

    python -m trainer.main --lake lake --run r1 --model tiny --deepspeed ds.json --steps 3

Flags are generated from `TrainerConfig` (`schemas/config.py`), so each field's docstring
is its `--help` text and every flag is validated by the same model.
"""

from __future__ import annotations

import argparse
import logging
import sys

from schemas.config import add_config_flags, config_from_args
from schemas.errors import RolloutlakeError
from trainer.config import TrainerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, TrainerConfig)


def run(args: argparse.Namespace) -> int:
    """Train the run's sealed steps; returns the exit code."""
    config = config_from_args(TrainerConfig, args)
    # Imported here so `--help` and flag errors do not pay for importing torch/DeepSpeed.
    from trainer.engine import Trainer

    logging.getLogger(__name__).info("trainer config %s", config.model_dump_json())
    trained = Trainer(config).run()
    logging.getLogger(__name__).info("trained %d steps", trained)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rolloutlake trainer",
        description="Train a run's sealed Delta steps with DeepSpeed.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(args)
    except RolloutlakeError as exc:
        print(f"rolloutlake trainer: {exc}", file=sys.stderr)
        return 2  # as `rolloutlake` does for user errors


if __name__ == "__main__":
    sys.exit(main())
