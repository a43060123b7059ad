"""The user-facing commands built on the processor and the lake: simulate, demo, replay,
audit, watch and wandb-sync. Each module exposes `add_arguments(parser)` and `run(args)`."""
