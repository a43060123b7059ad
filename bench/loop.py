"""The whole RL loop under three settings, same task and seed: what a Miles user compares.

    .venv/bin/python bench/loop.py [--steps 30] [--engine-url URL] [--out DIR]

- `grpo`: no filter, every issued group kept; `sum_of_sample_mean`, std-normalised advantages.
- `dapo filter`: the DAPO filter (`reward_nonzero_std`) with 3x over-sampling; the step
  seals at `groups` kept groups and the worker cancels the rest.
- `dr.grpo`: no filter; Dr.GRPO's reducer (constant divisor) and no std normalisation.

One broker and one engine serve all three (each run loads the initial policy into the
engine and uses its own topics). Prints one table and writes `<out>/loop_bench.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.commands.loop import LoopConfig, LoopError, StepRow, run_loop  # noqa: E402
from ingest.io.broker import EmbeddedBroker, free_port  # noqa: E402
from ingest.io.plots import Curve, Panel, save_panels  # noqa: E402
from ingest.workers.config import EngineServerConfig  # noqa: E402
from ingest.workers.engine_server import EngineServer  # noqa: E402

VARIANTS: dict[str, dict] = {
    "grpo": {},
    "dapo filter": {"dynamic_sampling_filter_path": "ingest.core.filters.reward_nonzero_std",
                    "over_sampling_factor": 3},
    "dr.grpo": {"pg_loss_reducer": "trainer.reducers.get_dr_grpo_reducer",
                "std_normalization": False},
}


def first_step_at(rows: list[StepRow], level: float) -> str:
    return next((str(r.step) for r in rows if r.episode_reward >= level), "-")


def summary(name: str, rows: list[StepRow], minutes: float) -> str:
    tail = rows[-5:]
    per_kept = sum(r.prompts_issued for r in rows) / max(sum(r.kept for r in rows), 1)
    return (f"{name:<12} {rows[0].episode_reward:>6.3f} "
            f"{statistics.mean(r.episode_reward for r in tail):>9.3f} "
            f"{first_step_at(rows, 0.5):>6} "
            f"{statistics.mean(r.dropped for r in rows):>8.2f} {per_kept:>9.2f} "
            f"{statistics.mean(r.rollout_seconds for r in rows):>9.2f} "
            f"{statistics.mean(r.reward_unfiltered for r in rows):>9.3f} "
            f"{statistics.mean(r.reward for r in rows):>9.3f} {minutes:>6.1f}")


HEADER = (f"{'variant':<12} {'start':>6} {'end(5)':>9} {'0.5 at':>6} {'drop/st':>8} "
          f"{'issued/k':>9} {'rollout s':>9} {'r before':>9} {'r after':>9} {'min':>6}")


def plot(curves: dict[str, list[StepRow]], path: Path) -> None:
    lines = []
    for i, (name, rows) in enumerate(curves.items()):
        steps = [r.step for r in rows]
        lines.append(Curve(f"{name}: episode reward", steps, [r.episode_reward for r in rows],
                           color=f"C{i}"))
        if any(r.dropped for r in rows):
            lines.append(Curve(f"{name}: reward before the filter", steps,
                               [r.reward_unfiltered for r in rows], linestyle="--",
                               color=f"C{i}"))
    save_panels(path, [Panel("repeat the digit: tiny policy, same seed", "reward", lines,
                             ylim=(0, 1.05), legend_loc="lower right")])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-url", default=None, help="a running vLLM engine")
    parser.add_argument("--out", type=Path, default=Path("lake") / time.strftime("bench-loop-%H%M%S"))
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[StepRow]] = {}
    lines: list[str] = []
    with EmbeddedBroker(free_port()) as broker:
        engine = None
        url = args.engine_url
        if url is None:
            engine = EngineServer(EngineServerConfig(port=free_port(),
                                                     tiny_dir=args.out / "engine-tiny",
                                                     log_file=args.out / "engine.log")).start()
            url = engine.url
        try:
            for index, name in enumerate(args.only):
                settings = dict(VARIANTS[name])
                factor = settings.pop("over_sampling_factor", None)
                config = LoopConfig(
                    steps=args.steps, groups=args.groups, seed=args.seed, engine_url=url,
                    bootstrap_servers=broker.bootstrap_servers, topic_prefix=f"b{index}.",
                    out=args.out / name.replace(" ", "-"), step_timeout_s=180,
                    over_sampling=factor * args.groups if factor else None, **settings)
                began = time.monotonic()
                print(f"{name}: {args.steps} steps ...", flush=True)
                try:
                    rows = run_loop(config).rows
                except LoopError as err:
                    print(f"{name}: {err}", flush=True)
                    continue
                curves[name] = rows
                lines.append(summary(name, rows, (time.monotonic() - began) / 60))
        finally:
            if engine is not None:
                engine.stop()
    print(HEADER)
    print("\n".join(lines))
    if curves:
        plot(curves, args.out / "loop_bench.png")
        print(f"plot: {args.out / 'loop_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
