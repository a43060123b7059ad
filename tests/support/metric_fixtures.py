"""A simulated DAPO-filtered run written as contract rows (CONTRACT section 4), via Lake.

Stands in for the stream processor in the dashboard, stream and W&B tests and in
`bench/dashboard.py`: each step has kept groups, groups dropped as `zero_std_1.0` /
`zero_std_0.0`, and groups cancelled at seal whose partial answers are the longest, so the
charts show the bias the seeds describe. Rows are written the way the processor commits
them: a step's groups, samples and metrics, then its `steps` row, which seals it.
"""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa

from ingest.core.bias_metrics import GroupSummary, bias_metrics
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from schemas.tables import TABLES
from tests.support.gateway_support import RunningGateway, gateway_config

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def contract_table(name: str, rows: list[dict]) -> pa.Table:
    schema = TABLES[name].schema
    return pa.Table.from_pylist([{f: r.get(f) for f in schema.names} for r in rows], schema=schema)


def simulate_step(run_id: str, step: int, *, batch_size: int = 8, n_samples: int = 4,
                  seed: int = 0) -> dict[str, list[dict]]:
    """Rows of every table for one sealed step; deterministic in (run_id, step, seed)."""
    rng = random.Random(f"{run_id}:{step}:{seed}")
    skill = min(0.85, 0.35 + step / 400)  # the simulated policy improves slowly
    base_index = step * 10_000
    sealed_at = EPOCH + timedelta(seconds=60 * step + 55)
    groups, samples, kept_rewards = [], [], []
    decided: list[GroupSummary] = []
    offered_rewards: list[float] = []
    issued = 0
    while sum(g["decision"] == "kept" for g in groups) < batch_size:
        issued += 1
        rewards = [float(rng.random() < skill) for _ in range(n_samples)]
        lengths = [rng.randint(80, 900) if r else rng.randint(400, 2000) for r in rewards]
        reason = None if len(set(rewards)) > 1 else f"zero_std_{rewards[0]}"
        groups.append({"rewards": rewards, "lengths": lengths, "reason": reason,
                       "decision": "dropped" if reason else "kept"})
        offered_rewards.extend(rewards)
    # The step seals: in-flight groups (the slowest, longest, mostly wrong) are cancelled.
    for _ in range(rng.randint(1, 4)):
        issued += 1
        lengths = [rng.randint(1500, 4000) for _ in range(n_samples)]
        groups.append({"rewards": [None] * n_samples, "lengths": lengths,
                       "reason": "cancelled_at_seal", "decision": "dropped"})
    group_rows = []
    for i, g in enumerate(groups):
        gi = base_index + i
        cancelled = g["reason"] == "cancelled_at_seal"
        statuses = ["aborted" if cancelled else "completed"] * n_samples
        numeric = [r for r in g["rewards"] if r is not None]
        group_rows.append({
            "run_id": run_id, "group_index": gi, "step": step, "n_samples": n_samples,
            "decision": g["decision"], "reason": g["reason"],
            "batch_step": step if g["decision"] == "kept" else None,
            "decided_at": sealed_at - timedelta(seconds=len(groups) - i),
            "mean_reward": sum(numeric) / len(numeric) if numeric else None,
            "first_event_at": sealed_at - timedelta(seconds=55), "n_fragments": n_samples,
        })
        for rid, (reward, length) in enumerate(zip(g["rewards"], g["lengths"], strict=True)):
            samples.append({
                "run_id": run_id, "group_index": gi, "rollout_id": rid, "fragment_index": 0,
                "status": statuses[rid], "reward": reward, "response_length": length,
                "decision": g["decision"], "reason": g["reason"], "step": step,
                "sample_index": gi * n_samples + rid,
                "abort_reason": "cancelled" if cancelled else None,
            })
        if g["decision"] == "kept":
            kept_rewards.extend(g["rewards"])
        decided.append(GroupSummary(g["decision"], g["reason"], g["lengths"], statuses,
                                    cancelled_at_seal=cancelled))
    drops = Counter(g["reason"] for g in groups
                    if g["decision"] == "dropped" and g["reason"] != "cancelled_at_seal")
    kept_lengths = [n for g in groups if g["decision"] == "kept" for n in g["lengths"]]
    metrics = {
        **{f"rollout/dynamic_filter/drop_{r}": float(n) for r, n in drops.items()},
        "rollout/raw_reward": sum(kept_rewards) / len(kept_rewards),
        "rollout/episode_raw_reward": sum(kept_rewards) / len(kept_rewards),
        "rollout/raw_reward_unfiltered": sum(offered_rewards) / len(offered_rewards),
        "rollout/num_training_samples": float(len(kept_rewards)),
        "rollout/response_len/mean": sum(kept_lengths) / len(kept_lengths),
        "rollout/zero_std/all_zero_percentage": 0.0,
        "rollout/zero_std/all_one_percentage": 0.0,
        "rollout/groups_offered": float(sum(g["reason"] != "cancelled_at_seal" for g in groups)),
        "rollout/groups_kept": float(batch_size),
        "rollout/groups_surplus": 0.0,
        "rollout/groups_cancelled": float(sum(g["reason"] == "cancelled_at_seal" for g in groups)),
        "rollout/prompts_issued": float(issued),
        "perf/rollout_time": 20.0 + 2.5 * issued + rng.random() * 5,
        **bias_metrics(decided, groups_issued=issued),
    }
    return {
        "groups": group_rows,
        "samples": samples,
        "step_metrics": [{"run_id": run_id, "step": step, "key": k, "value": v}
                         for k, v in metrics.items()],
        "steps": [{"run_id": run_id, "step": step, "n_groups": batch_size,
                   "n_samples": batch_size * n_samples, "sealed_at": sealed_at,
                   "batch_version": step, "content_sha256": f"{step:064x}",
                   "n_rollouts": batch_size * n_samples, "n_tokens": sum(kept_lengths)}],
    }


def write_steps(lake: Lake, run_id: str, steps: range, **kwargs) -> None:
    """Seal `steps` with one commit per table (the `steps` rows last, as the processor)."""
    rows: dict[str, list[dict]] = {"groups": [], "samples": [], "step_metrics": [], "steps": []}
    for step in steps:
        for table, table_rows in simulate_step(run_id, step, **kwargs).items():
            rows[table].extend(table_rows)
    for table in ("groups", "samples", "step_metrics", "steps"):
        lake.append(table, contract_table(table, rows[table]))


def step_metric_keys(run_id: str, step: int, **kwargs) -> set[str]:
    """The metric keys the fixture writes for a step (what sinks must carry over)."""
    return {r["key"] for r in simulate_step(run_id, step, **kwargs)["step_metrics"]}



READER_TOKEN = "reader-token"  # read scope on every run (gateway_support.TOKENS)


def gateway(kafka: KafkaSettings, lake_root: str, state_dir: Path) -> RunningGateway:
    """The real gateway (`create_app`) over `lake_root` on a fresh port; each call is a
    new process-like instance with no memory of earlier ones (a restart)."""
    return RunningGateway(gateway_config(kafka, lake_root, state_dir))
