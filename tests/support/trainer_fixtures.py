"""Sealed steps written straight to Delta, standing in for the stream processor.

`seal_step` does what the processor's batch stage does at seal time: append the step's
`training_batches` rows, then a `steps` row naming the resulting table version and the
rows' `content_sha256`. Rows use the contract schemas, so the trainer reads them exactly
as it will read a processor's.
"""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pyarrow as pa

from ingest.io.lake import Lake
from schemas.tables import STEPS, TRAINING_BATCHES, content_sha256


def batch_rows(run_id: str, step: int, rows: list[dict]) -> pa.Table:
    """Contract-schema rows from dicts holding at least the per-row fields; positions
    follow list order."""
    full = [
        {
            "run_id": run_id,
            "step": step,
            "position": position,
            "sample_index": None,
            "fragment_index": 0,
            "rollout_log_probs": None,
            "reward": None,
            "status": "completed",
            "weight_version": None,
            **row,
        }
        for position, row in enumerate(rows)
    ]
    return pa.Table.from_pylist(full, schema=TRAINING_BATCHES.schema)


def seal_step(lake: Lake, rows: pa.Table, *, sha256: str | None = None) -> int:
    """Append a step's rows, then its `steps` row; returns the recorded batch version.

    `sha256` overrides the recorded hash, to simulate a batch changed after sealing.
    """
    run_id = rows.column("run_id")[0].as_py()
    step = rows.column("step")[0].as_py()
    version = lake.append(TRAINING_BATCHES.name, rows)
    keys = zip(
        rows.column("group_index").to_pylist(), rows.column("rollout_id").to_pylist(), strict=True
    )
    steps_row = {
        "run_id": run_id,
        "step": step,
        "n_groups": len(set(rows.column("group_index").to_pylist())),
        "n_samples": rows.num_rows,
        "sealed_at": dt.datetime.now(dt.UTC),
        "batch_version": version,
        "content_sha256": sha256 or content_sha256(rows.sort_by("position")),
        "n_rollouts": len(set(keys)),
        "n_tokens": sum(
            len(p) + len(r)
            for p, r in zip(
                rows.column("prompt_tokens").to_pylist(),
                rows.column("response_tokens").to_pylist(),
                strict=True,
            )
        ),
    }
    lake.append(STEPS.name, pa.Table.from_pylist([steps_row], schema=STEPS.schema))
    return version


def random_step(
    run_id: str,
    step: int,
    *,
    n_groups: int = 4,
    n_samples: int = 4,
    prompt_len: int = 8,
    response_len: int = 16,
    vocab: int = 256,
    seed: int = 0,
) -> pa.Table:
    """A plausible GRPO step: 0/1 rewards, group-normalised advantages, old log-probs near
    a uniform policy's, and rollout 0 of every group compacted into two sibling fragments."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for group in range(n_groups):
        rewards = rng.integers(0, 2, n_samples).astype(float)
        std = rewards.std(ddof=1)
        advantages = (rewards - rewards.mean()) / (std + 1e-6) if std > 0 else rewards * 0
        prompt = rng.integers(1, vocab, prompt_len).tolist()
        for rollout in range(n_samples):
            length = int(rng.integers(response_len // 2, response_len + 1))
            fragments = 2 if rollout == 0 else 1
            for fragment in range(fragments):
                rows.append(
                    {
                        "group_index": step * 1000 + group,
                        "rollout_id": rollout,
                        "sample_index": (step * 1000 + group) * n_samples + rollout,
                        "fragment_index": fragment,
                        "prompt_tokens": prompt,
                        "response_tokens": rng.integers(1, vocab, length).tolist(),
                        "loss_mask": (rng.random(length) > 0.1).astype(int).tolist(),
                        "rollout_log_probs": (
                            -math.log(vocab) + rng.normal(0, 0.1, length)
                        ).tolist(),
                        "reward": float(rewards[rollout]),
                        "advantage": float(advantages[rollout]),
                    }
                )
    return batch_rows(run_id, step, rows)
