"""Time to turn one sealed step into trainer tensors: Delta vs Parquet vs JSONL.

    .venv/bin/python bench/trainer_io.py [--groups 256 --samples 8 --tokens 2048 --repeat 11]

All three paths end in the same `trainer.batches.tensorize`, so the ratios measure the
storage format and its reader:
- Delta: what the trainer does: find the step in `steps`, read its `training_batches`
  rows at the pinned version (the table also holds the neighbouring steps), verify
  row count, positions and `content_sha256`, tensorise.
- Parquet: the same rows alone in one file, `pyarrow.parquet.read_table`, tensorise (no
  verification: the format's limit).
- JSONL: the same rows as one JSON object per line (the dump users write today), parsed
  with orjson, `pa.Table.from_pylist`, tensorise.
- Delta, prefetched: what the training loop waits for per step with `StepPrefetcher`,
  which loads step s+1 (find + read + verify + tensorise) while step s trains; training is
  a `--train-ms` sleep, as when the accelerator does the work and the host cores are free.
Files are written first and read warm from the page cache; each path reports the median
and minimum of `--repeat` rounds, the paths interleaved within each round. The indented
rows break the Delta path down; "delta, hash skipped" shows what verification costs.
Targets: Delta within 1.3x of Parquet, >= 5x faster than JSONL; the prefetched wait within
1.1x of the Parquet read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.io.lake import Lake  # noqa: E402
from schemas.tables import TRAINING_BATCHES, content_sha256  # noqa: E402
from tests.support.trainer_fixtures import seal_step  # noqa: E402
from trainer.batches import (  # noqa: E402
    StepFollower,
    StepPrefetcher,
    load_step,
    read_sealed_rows,
    tensorize,
)

RUN = "bench"
DELTA = "delta (find + read + verify + tensorise)"
PREFETCHED = "delta, prefetched (wait per step)"
PARQUET = "parquet (read + tensorise)"
JSONL = "jsonl (parse + tensorise)"


def _list_array(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_.value_type))


def sealed_rows(step: int, groups: int, samples: int, tokens: int, seed: int) -> pa.Table:
    """One step: `groups` x `samples` rows of `tokens` tokens (1/8 prompt, 7/8 response)."""
    rng = np.random.default_rng([seed, step])
    n = groups * samples
    prompt_len = np.full(n, tokens // 8)
    resp_len = np.full(n, tokens - tokens // 8)
    n_resp = int(resp_len.sum())
    advantages = rng.standard_normal(n)
    columns = {
        "run_id": pa.array([RUN] * n),
        "step": pa.array(np.full(n, step)),
        "position": pa.array(np.arange(n, dtype=np.int32)),
        "group_index": pa.array(step * groups + np.arange(n) // samples),
        "rollout_id": pa.array(np.arange(n) % samples),
        "sample_index": pa.array(step * n + np.arange(n)),
        "fragment_index": pa.array(np.zeros(n, dtype=np.int32)),
        "prompt_tokens": _list_array(
            prompt_len, rng.integers(0, 150_000, int(prompt_len.sum())), pa.list_(pa.int32())
        ),
        "response_tokens": _list_array(
            resp_len, rng.integers(0, 150_000, n_resp), pa.list_(pa.int32())
        ),
        "loss_mask": _list_array(resp_len, rng.random(n_resp) > 0.05, pa.list_(pa.int8())),
        "rollout_log_probs": _list_array(
            resp_len, -rng.exponential(1.0, n_resp).astype(np.float32), pa.list_(pa.float32())
        ),
        "reward": pa.array(rng.integers(0, 2, n).astype(float)),
        "advantage": pa.array(advantages),
        "status": pa.array(["completed"] * n),
        "weight_version": pa.array(np.full(n, step)),
    }
    return pa.table(columns).cast(TRAINING_BATCHES.schema)


def interleaved_times(
    paths: dict[str, Callable[[], object]], repeat: int
) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per path. The paths run round-robin so that load from other
    processes on the machine falls on all of them alike; the minimum is the run least
    disturbed by it."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt + response per sample")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument(
        "--train-ms", type=float, default=300, help="simulated training time of one step"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trainer_io_") as tmp:
        root = Path(tmp)
        lake = Lake(root / "lake")
        target = 2
        for step in (1, 2, 3):  # the step read sits between two others in the table
            rows = sealed_rows(step, args.groups, args.samples, args.tokens, seed=0)
            seal_step(lake, rows)
            if step == target:
                step_rows = rows
        pq.write_table(step_rows, root / "step.parquet")
        with (root / "step.jsonl").open("wb") as out:
            for row in step_rows.to_pylist():
                out.write(orjson.dumps(row) + b"\n")

        follower = StepFollower(lake, RUN, poll_interval_s=1.0)

        def from_delta():
            return load_step(lake, follower.sealed(target))

        def from_parquet():
            return tensorize(pq.read_table(root / "step.parquet"), target)

        def from_jsonl():
            with (root / "step.jsonl").open("rb") as lines:
                parsed = [orjson.loads(line) for line in lines]
            return tensorize(pa.Table.from_pylist(parsed, schema=TRAINING_BATCHES.schema), target)

        def prefetched_wait() -> float:
            """Seconds the loop waited for steps 2 and 3 (step 1 has nothing to overlap)."""
            waited = 0.0
            with StepPrefetcher(follower, 1) as prefetched:
                for step in (1, 2, 3):
                    started = time.perf_counter()
                    sealed, _ = prefetched.next(idle_timeout_s=None)
                    if step > 1:
                        waited += time.perf_counter() - started
                    assert sealed.step == step
                    time.sleep(args.train_ms / 1000)
            return waited / 2

        batch = from_delta()  # warm-up, and a sanity check of the shapes
        assert batch.num_rows == args.groups * args.samples
        parquet_rows = pq.read_table(root / "step.parquet")
        sealed = follower.sealed(target)
        timings = interleaved_times(
            {
                DELTA: from_delta,
                PARQUET: from_parquet,
                JSONL: from_jsonl,
                "  delta, hash skipped": lambda: tensorize(
                    read_sealed_rows(lake, follower.sealed(target)), target
                ),
                "  delta: find the step": lambda: follower.sealed(target),
                "  delta: read + check rows": lambda: read_sealed_rows(lake, sealed),
                "  parquet: read": lambda: pq.read_table(root / "step.parquet"),
                "  tensorise": lambda: tensorize(parquet_rows, target),
                "  content_sha256": lambda: content_sha256(parquet_rows),
            },
            args.repeat,
        )
        waits = [prefetched_wait() for _ in range(args.repeat)]
        timings[PREFETCHED] = (statistics.median(waits), min(waits))

    n_tokens = int(batch.total_lengths.sum())
    print(
        f"one sealed step: {args.groups} groups x {args.samples} samples x {args.tokens} tokens "
        f"= {batch.num_rows} rows, {n_tokens / 1e6:.2f}M tokens; {args.repeat} rounds"
    )
    print(f"{'':42s} {'median':>9s}    {'min':>9s}")
    for name, (median, fastest) in timings.items():
        print(f"{name:42s} {median * 1000:9.1f} ms {fastest * 1000:9.1f} ms")
    for label, index in (("median", 0), ("min", 1)):
        delta, parquet, jsonl = (timings[k][index] for k in (DELTA, PARQUET, JSONL))
        print(
            f"{label:6s}: delta / parquet = {delta / parquet:.2f}x (target <= 1.3x), "
            f"jsonl / delta = {jsonl / delta:.1f}x (target >= 5x), "
            f"prefetched / parquet = {timings[PREFETCHED][index] / parquet:.2f}x "
            f"(target <= 1.1x, training {args.train_ms:.0f} ms a step)"
        )


if __name__ == "__main__":
    main()
