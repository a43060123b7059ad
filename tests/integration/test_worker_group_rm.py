"""The worker on a real vLLM engine: `--group-rm` scores each group at once."""

from __future__ import annotations

import subprocess

import pytest
from transformers import AutoTokenizer

from tests.integration.pipeline import by_group, rows, run_processor
from tests.support.engine_server import (
    ROOT,
    published,
    running_engine,
    worker_command,
    write_dataset,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.one_broker("the engine and the worker; their broker path is the SDK's")]

GROUP_RM = "tests.support.user_rewards.group_digit_share_or_fail"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


def test_group_rm_scores_each_group_at_once_and_a_failing_one_is_missing_rewards(
        engine, kafka, lake_root, tmp_path):
    run_id = "group-rm"
    dataset = write_dataset(tmp_path / "prompts.jsonl", [
        {"input": "1+1=", "label": "2"}, {"input": "7-4=", "label": "boom"},
        {"input": "2+2=", "label": "short"}, {"input": "9+0=", "label": "9"}])
    done = subprocess.run(
        worker_command(engine, kafka, run_id, dataset, GROUP_RM, "--group-rm",
                       "--n-samples-per-prompt", "3", "--rollout-batch-size", "2",
                       "--over-sampling-batch-size", "4", "--max-new-tokens", "8"),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker done: 4 groups, 12 samples finished" in done.stdout
    assert "group reward function raised RuntimeError: the group scorer crashed (group 1)" \
        in done.stderr
    assert "group reward function returned 2 rewards for 3 samples (group 2)" in done.stderr

    events = published(kafka, run_id)
    finished = {(e.group_index, e.rollout_id): e for e in events if e.type == "sample_finished"}
    assert len(finished) == 12 and not any(e.has_reward for e in finished.values())
    rewards = {(e.group_index, e.rollout_id): e.reward for e in events if e.type == "reward"}
    assert sorted(rewards) == sorted(finished)
    assert [rewards[(g, r)] for g in (1, 2) for r in range(3)] == [None] * 6
    tokenizer = AutoTokenizer.from_pretrained(engine.tiny_dir)
    for g in (0, 3):
        for r in range(3):
            text = tokenizer.decode(finished[(g, r)].response_tokens, skip_special_tokens=True)
            assert rewards[(g, r)] == pytest.approx(
                sum(ch.isdigit() for ch in text) / max(len(text), 1))

    run_processor(kafka, lake_root, idle_s=3.0)
    groups = by_group(lake_root, run_id)
    assert {g: (row["decision"], row["reason"]) for g, row in groups.items()} == {
        0: ("kept", None), 1: ("dropped", "group_has_missing_reward"),
        2: ("dropped", "group_has_missing_reward"), 3: ("kept", None)}
    batch = rows(lake_root, "training_batches", run_id)
    assert sorted((r["group_index"], r["rollout_id"]) for r in batch) == [
        (g, r) for g in (0, 3) for r in range(3)]
    assert all(r["reward"] == pytest.approx(rewards[(r["group_index"], r["rollout_id"])])
               for r in batch)
