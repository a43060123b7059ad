"""The inference engine and the rollout worker, for real.

The engine is vLLM's CPU build, or SGLang with `ROLLOUTLAKE_TEST_ENGINE=sglang`
(`make test-gpu`). One `rolloutlake engine` on the tiny policy serves this module: the
adapter's tokens and log-probs are checked against the same weights run by Hugging Face
in torch, a weight reload must change what the engine computes, and the worker's samples
must reach `training_batches` through the real broker, processor and Delta (scored one
sample at a time, or a group at once with `--group-rm`). The last
test kills the engine command with SIGKILL in the middle of a worker run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ingest.io.broker import EmbeddedBroker, free_port
from ingest.io.lake import Lake
from ingest.workers.engines import Generation, Sampling, make_engine
from schemas.control import WeightsUpdated
from schemas.events import parse_event
from tests.integration.pipeline import by_group, rows, run_processor
from tests.support.engine_server import (
    CLI,
    ROOT,
    published,
    running_engine,
    write_dataset,
)
from tests.support.engine_server import worker_command as engine_worker_command
from tests.support.engine_under_test import engine_under_test
from tests.support.gateway_support import (
    GatewayProcess,
    RunningGateway,
    gateway_config,
    unique_run,
)
from tests.support.suite_kafka import SUITE_BROKER_START_S, suite_kafka

pytestmark = [pytest.mark.slow,
              pytest.mark.one_broker("the engine and the worker; their broker path is the SDK's")]

VOCAB = 64
PROMPT = "12+34="
REWARD_PATH = "tests.support.user_rewards.digit_share_or_raise"
ENGINE = engine_under_test()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(engine):
    return AutoTokenizer.from_pretrained(engine.tiny_dir)


def generate(url: str, prompt: list[int], sampling: Sampling, request_id: str) -> Generation:
    async def once() -> Generation:
        client = make_engine(ENGINE, url)
        try:
            return await client.generate(prompt, sampling, request_id)
        finally:
            await client.aclose()
    return asyncio.run(once())


def reload(url: str, path: Path, version: int) -> None:
    async def once() -> None:
        client = make_engine(ENGINE, url)
        try:
            await client.reload_weights(str(path), version)
        finally:
            await client.aclose()
    asyncio.run(once())


def torch_log_probs(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """Log-probs of `response` after `prompt` under the folder's weights, in plain torch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt, response = list(map(int, prompt)), list(map(int, response))  # also numpy arrays
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    picked = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(response)[:, None])
    return picked[:, 0].tolist()


def test_generation_returns_the_policys_tokens_and_log_probs(engine, tokenizer):
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out = generate(engine.url, prompt, Sampling(temperature=1.0, max_new_tokens=12), "gen-1")
    assert 1 <= len(out.tokens) <= 12
    assert out.status in ("completed", "truncated")
    assert (out.status == "truncated") == (len(out.tokens) == 12)
    assert all(0 <= t < VOCAB for t in out.tokens)
    assert out.log_probs == pytest.approx(
        torch_log_probs(engine.tiny_dir, prompt, out.tokens), abs=2e-3)


def test_reload_of_changed_weights_changes_the_log_probs(engine, tokenizer, tmp_path):
    zeroed = AutoModelForCausalLM.from_pretrained(engine.tiny_dir)
    with torch.no_grad():
        zeroed.lm_head.weight.zero_()  # every logit 0: a uniform policy over the vocabulary
    zeroed.save_pretrained(tmp_path / "zeroed")
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=1.0, max_new_tokens=6)
    reload(engine.url, tmp_path / "zeroed", 1)
    try:
        uniform = generate(engine.url, prompt, sampling, "after-zero")
        assert uniform.log_probs == pytest.approx([-math.log(VOCAB)] * len(uniform.tokens),
                                                  abs=1e-4)
    finally:
        reload(engine.url, engine.tiny_dir, 2)  # the other tests expect the tiny policy
    restored = generate(engine.url, prompt, sampling, "after-restore")
    assert restored.log_probs == pytest.approx(
        torch_log_probs(engine.tiny_dir, prompt, restored.tokens), abs=2e-3)
    assert restored.log_probs != pytest.approx([-math.log(VOCAB)] * len(restored.tokens),
                                               abs=1e-3)


def worker_command(engine, kafka, run_id: str, dataset: Path, *extra: str) -> list[str]:
    return engine_worker_command(engine, kafka, run_id, dataset, REWARD_PATH, *extra)


def test_worker_samples_reach_training_batches_as_the_engine_made_them(
        engine, tokenizer, kafka, lake_root, tmp_path):
    run_id = "worker-e2e"
    dataset = write_dataset(tmp_path / "prompts.jsonl", [
        {"input": "1+1=", "label": "2"}, {"input": "2+3=", "label": "5"},
        {"input": "7-4=", "label": "boom"}, {"input": "9+0=", "label": "9"}])
    done = subprocess.run(
        worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", "2",
                       "--rollout-batch-size", "3", "--over-sampling-batch-size", "4",
                       "--max-new-tokens", "8", "--weight-version", "3"),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker done: 4 groups, 8 samples finished, 0 aborted, 0 cancelled" in done.stdout
    assert "reward function raised RuntimeError: the scorer crashed" in done.stderr

    finished = {(e.group_index, e.rollout_id): e for e in published(kafka, run_id)
                if e.type == "sample_finished"}
    assert len(finished) == 8
    run_processor(kafka, lake_root, idle_s=3.0)

    groups = by_group(lake_root, run_id)
    assert {g: groups[g]["decision"] for g in groups} == {
        0: "kept", 1: "kept", 2: "dropped", 3: "kept"}
    assert groups[2]["reason"] == "group_has_missing_reward"
    assert [s["reward"] for s in rows(lake_root, "samples", run_id)
            if s["group_index"] == 2] == [None, None]

    batch = rows(lake_root, "training_batches", run_id)
    assert sorted((r["group_index"], r["rollout_id"]) for r in batch) == [
        (g, r) for g in (0, 1, 3) for r in (0, 1)]
    prompts = ["1+1=", "2+3=", "7-4=", "9+0="]
    for row in batch:
        event = finished[(row["group_index"], row["rollout_id"])]
        prompt = tokenizer(prompts[row["group_index"]], add_special_tokens=False)["input_ids"]
        # Events decode token arrays as numpy arrays (typed binary arrays on the wire).
        assert row["prompt_tokens"] == event.prompt_tokens.tolist() == prompt
        assert row["response_tokens"] == event.response_tokens.tolist()
        assert row["rollout_log_probs"] == pytest.approx(event.rollout_log_probs.tolist(),
                                                         abs=1e-6)
        assert row["rollout_log_probs"] == pytest.approx(
            torch_log_probs(engine.tiny_dir, prompt, row["response_tokens"]), abs=2e-3)
        assert row["loss_mask"] == [1] * len(row["response_tokens"])
        assert row["weight_version"] == 3
        response = tokenizer.decode(row["response_tokens"], skip_special_tokens=True)
        digits = sum(ch.isdigit() for ch in response) / max(len(response), 1)
        assert row["reward"] == pytest.approx(digits)


def wait_for_event(kafka, run_id: str, event_type: str, worker: subprocess.Popen[str]) -> None:
    """Return as soon as the run's first `event_type` is on the broker (the worker may
    still be publishing: this does not wait for the stream to go quiet)."""
    consumer = kafka.consumer(consumer_timeout_ms=1000)
    consumer.subscribe([kafka.topics.events])
    deadline = time.monotonic() + 300
    try:
        while True:
            for record in consumer:
                event = parse_event(json.loads(record.value))
                if event.run_id == run_id and event.type == event_type:
                    return
            assert worker.poll() is None, worker.stderr.read()[-2000:]
            assert time.monotonic() < deadline, f"no {event_type} of {run_id} within 300 s"
    finally:
        consumer.close()


def _processor(kafka, lake_root: str) -> subprocess.Popen[str]:
    """A processor started before the worker, so it follows the stream when the worker
    starts. Without --until-idle, which counts from its start too and so would have to
    outlast a loaded machine's worker start: the test stops it."""
    return subprocess.Popen(
        [*CLI, "process", "--lake", lake_root, "--bootstrap-servers", kafka.bootstrap_servers,
         "--topic-prefix", kafka.topic_prefix],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


# Runs of the partial-rollout test's first step until its seal cuts a request mid-generation.
SEAL_MID_GENERATION_TRIES = 6


def _read_until_step_waits(worker: subprocess.Popen[str], step: int) -> list[str]:
    """Read the worker's log until step `step` waits for weight version `step` (the steps
    before it done): the lines read. Fails if the worker exits first."""
    assert worker.stderr is not None
    lines = []
    for line in worker.stderr:
        lines.append(line)
        if f"step {step} waits for weight version {step}" in line:
            return lines
    pytest.fail(f"worker exited with {worker.wait()} before step {step}")


def _kill_once_step_1_waits(command: list[str], env: dict[str, str]) -> list[str]:
    """Run the worker `command` until its step 0 is done (recycles included) and step 1
    waits for weights that never come, then kill -9 it: its log up to then."""
    worker = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = _read_until_step_waits(worker, 1)
        time.sleep(1.0)  # its last sample_aborted events leave the producer
    finally:
        worker.kill()
        worker.wait()
    return lines


def _joined_processor(kafka, lake_root: str) -> subprocess.Popen[str]:
    """`_processor`, returned once both its stages joined their consumer groups (their log
    lines), the rest of its log drained in the background: a worker started then has its
    first step sealed one decision's latency after the step's group completes, not after
    the processor's start-up and joins, which on a loaded machine outlast many
    generations."""
    processor = _processor(kafka, lake_root)
    assert processor.stderr is not None
    joined: set[str] = set()
    for line in processor.stderr:
        joined |= {role for role in ("groups", "batches")
                   if f"{role} stage: joined consumer group" in line}
        if len(joined) == 2:
            break
    else:
        pytest.fail(f"the processor exited with {processor.wait()} before its stages joined")
    threading.Thread(target=processor.stderr.read, daemon=True).start()
    return processor


def _stop_once_every_group_is_decided(processor: subprocess.Popen[str], kafka, lake_root: str,
                                      run_id: str, timeout_s: float = 300) -> list:
    """Stop the processor (SIGTERM) once the lake holds a decision for every group the
    run's workers, which have exited, started; the run's events."""
    events = published(kafka, run_id)
    started = {e.group_index for e in events if e.type == "group_started"}
    deadline = time.monotonic() + timeout_s
    while not started <= set(by_group(lake_root, run_id)):
        assert processor.poll() is None, processor.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "groups left undecided"
        time.sleep(0.5)
    processor.send_signal(signal.SIGTERM)
    _, err = processor.communicate(timeout=120)
    assert processor.returncode == 0, err[-2000:]
    return events


def test_step_sealed_cancels_the_steps_requests_which_never_become_training_rows(
        engine, kafka, lake_root, tmp_path):
    """32 groups issued for a step of 2, 4 requests at a time: the processor seals the step
    while most groups still wait or generate, and the worker stops generating for it.
    `--ignore-eos` makes every request run its 480 tokens, so requests are mid-generation
    when the seal arrives (the random policy's end token would end most within 0.1 s)."""
    run_id = "seal-cancels"
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}*{i}=", "label": str(i * i)} for i in range(8)])
    processor = _processor(kafka, lake_root)
    worker = subprocess.Popen(
        worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", "4",
                       "--rollout-batch-size", "2", "--over-sampling-batch-size", "32",
                       "--max-new-tokens", "480", "--ignore-eos", "--max-in-flight", "4"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
        assert "worker done: 32 groups" in out
        events = _stop_once_every_group_is_decided(processor, kafka, lake_root, run_id)
    finally:
        for process in (worker, processor):
            if process.poll() is None:
                process.kill()
    cancelled = [e for e in events if e.type == "sample_aborted"]
    assert cancelled and all(e.reason == "cancelled" for e in cancelled)
    assert len(cancelled) + sum(e.type == "sample_finished" for e in events) == 32 * 4
    # Requests in flight at the seal were aborted on the engine, not only the unsent ones
    # dropped (whether an aborted request answers with its partial tokens is the engine's
    # timing: vLLM answers some with them, some without).
    aborted_in_flight = [int(m) for m in re.findall(r"sealed: aborting (\d+) requests in flight", err)]
    assert aborted_in_flight and aborted_in_flight[0] > 0, err[-2000:]
    assert any(e.response_tokens is None for e in cancelled)
    [step] = rows(lake_root, "steps", run_id)
    sealed_at = step["sealed_at"].timestamp()
    assert all(e.ts >= sealed_at for e in cancelled)
    print(f"first cancel {min(e.ts for e in cancelled) - sealed_at:.2f} s after the seal")

    groups = by_group(lake_root, run_id)
    cancelled_groups = {e.group_index for e in cancelled}
    assert {groups[g]["reason"] for g in cancelled_groups} == {"cancelled_at_seal"}
    kept = {g for g, row in groups.items() if row["decision"] == "kept"}
    assert len(kept) == 2 and not kept & cancelled_groups
    batch = rows(lake_root, "training_batches", run_id)
    assert {r["group_index"] for r in batch} == kept and len(batch) == 2 * 4


def test_weights_updated_reloads_the_engine_and_stamps_the_new_version(
        engine, kafka, tmp_path):
    run_id = "reloads"
    zeroed = AutoModelForCausalLM.from_pretrained(engine.tiny_dir)
    with torch.no_grad():
        zeroed.lm_head.weight.zero_()
    zeroed.save_pretrained(tmp_path / "zeroed")
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}-1=", "label": str(i - 1)} for i in range(1, 5)])
    # Step 4 runs under version 4; with max_staleness 0, step 5 waits for version 5,
    # which the announcement brings. (Announcements that land mid-request:
    # test_weight_reload_stamping.py.)
    worker = subprocess.Popen(
        worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", "2",
                       "--rollout-batch-size", "2", "--first-step", "4", "--num-steps", "2",
                       "--max-staleness", "0", "--max-new-tokens", "16",
                       "--weight-version", "4", "--seal-wait-s", "0"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _read_until_step_waits(worker, 5)
        producer = kafka.producer()
        announcement = WeightsUpdated(run_id=run_id, step=4, path=str(tmp_path / "zeroed"),
                                      version=5)
        producer.send(kafka.topics.control, key=run_id.encode(),
                      value=announcement.model_dump_json().encode()).get(timeout=30)
        producer.close()
        out, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
        assert "engines serve weight version 5" in err
    finally:
        if worker.poll() is None:
            worker.kill()
        reload(engine.url, engine.tiny_dir, 6)  # the tiny policy again for the next test

    finished = [e for e in published(kafka, run_id) if e.type == "sample_finished"]
    assert len(finished) == 2 * 2 * 2
    by_version = {v: [e for e in finished if e.weight_version == v] for v in (4, 5)}
    # Steps 4 and 5 are groups 8-9 and 10-11.
    assert {e.group_index for e in by_version[4]} == {8, 9} and len(by_version[4]) == 4
    assert {e.group_index for e in by_version[5]} == {10, 11} and len(by_version[5]) == 4
    uniform = -math.log(VOCAB)
    for event in by_version[5]:
        assert event.rollout_log_probs == pytest.approx([uniform] * len(event.response_tokens),
                                                        abs=1e-4)
    for event in by_version[4]:  # generated by the tiny policy, before the reload
        assert event.rollout_log_probs == pytest.approx(
            torch_log_probs(engine.tiny_dir, event.prompt_tokens, event.response_tokens),
            abs=2e-3)


def _eight_sums_and_a_processor(kafka, lake_root: str, tmp_path: Path
                                ) -> tuple[Path, subprocess.Popen[str]]:
    """A dataset of 8 sums, and a processor for `_stop_once_every_group_is_decided`."""
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(8)])
    return dataset, _processor(kafka, lake_root)


def test_a_filter_that_drops_most_groups_gets_more_rounds_until_every_step_seals(
        engine, kafka, lake_root, tmp_path):
    """Two groups per round for a batch of two, and the DAPO filter keeps only groups
    whose index divides by 3: step 0's first round (groups 0, 1) keeps one, its second
    (2**32 + 0, 1) none, so it seals only after a third round, past a cap of 2; step 1
    (groups 2, 3, then 2 * 2**32 + 0, 1) keeps one in each of its first two. The worker issues them on the
    processor's `demand`."""
    run_id = "dynamic-sampling"
    dataset, processor = _eight_sums_and_a_processor(kafka, lake_root, tmp_path)
    command = worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", "2",
                             "--rollout-batch-size", "2", "--over-sampling-batch-size", "2",
                             "--num-steps", "2", "--max-new-tokens", "4",
                             "--max-over-sampling-rounds", "2", "--seal-wait-s", "120",
                             "--dynamic-sampling-filter-path",
                             "ingest.core.filters.reward_nonzero_std")
    command[command.index(REWARD_PATH)] = "tests.support.user_rewards.spread_only_every_third_group"
    worker = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
        _stop_once_every_group_is_decided(processor, kafka, lake_root, run_id)
    finally:
        for process in (worker, processor):
            if process.poll() is None:
                process.kill()
    assert "past --max-over-sampling-rounds 2" in err
    extra, past_cap = (int(n) for n in re.search(
        r"(\d+) extra over-sampling rounds \((\d+) past the cap\)", out).groups())
    assert extra >= 3 and past_cap >= 1

    assert sorted(s["step"] for s in rows(lake_root, "steps", run_id)) == [0, 1]
    groups = by_group(lake_root, run_id)
    kept = sorted(g for g, row in groups.items() if row["decision"] == "kept")
    assert all(g % 3 == 0 for g in kept) and len(kept) == 4
    assert {g: groups[g]["batch_step"] for g in kept} == {0: 0, 3: 1, 2**32 + 2: 0,
                                                          2 * 2**32 + 1: 1}
    reasons = {groups[g]["reason"] for g in groups if g % 3}
    assert "zero_std_0.0" in reasons and reasons <= {"zero_std_0.0", "cancelled_at_seal"}


def test_two_workers_of_one_run_issue_each_round_once_between_them(
        engine, kafka, lake_root, tmp_path):
    """`--num-workers 2`: each worker issues its half of every round of 4 groups (the
    places 0, 2 and 1, 3) and both follow the processor's `demand`, so the run gets the
    rounds one worker would issue: step 0 (batch 3; the filter keeps groups whose index
    divides by 3) seals after 2 rounds, step 1 after 3, each group issued once. (Without
    the shares, both would issue the same group indexes.)"""
    run_id = "two-workers"
    dataset, processor = _eight_sums_and_a_processor(kafka, lake_root, tmp_path)
    workers = []
    for index in (0, 1):
        command = engine_worker_command(
            engine, kafka, run_id, dataset, "tests.support.user_rewards.spread_only_every_third_group",
            "--n-samples-per-prompt", "2", "--rollout-batch-size", "3",
            "--over-sampling-batch-size", "4", "--num-steps", "2", "--max-new-tokens", "4",
            "--seal-wait-s", "120", "--num-workers", "2", "--worker-index", str(index),
            "--dynamic-sampling-filter-path", "ingest.core.filters.reward_nonzero_std")
        workers.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    try:
        for worker in workers:
            _, err = worker.communicate(timeout=600)
            assert worker.returncode == 0, err[-2000:]
        events = _stop_once_every_group_is_decided(processor, kafka, lake_root, run_id)
    finally:
        for process in (*workers, processor):
            if process.poll() is None:
                process.kill()

    started = [e for e in events if e.type == "group_started"]
    assert all(e.producer == f"worker-{run_id}-{e.group_index % 2}" for e in started)
    issued = Counter(e.group_index for e in started)
    assert set(issued.values()) == {1}
    # Each step's rounds, by their first group: the first, then those of its demands.
    rounds = {0: [0, 2**32], 1: [4, 2 * 2**32, 2 * 2**32 + 4]}
    assert sorted(issued) == sorted(first + j for firsts in rounds.values()
                                    for first in firsts for j in range(4))
    assert sorted(s["step"] for s in rows(lake_root, "steps", run_id)) == [0, 1]
    groups = by_group(lake_root, run_id)
    kept = {g: row["batch_step"] for g, row in groups.items() if row["decision"] == "kept"}
    assert {g for g, step in kept.items() if step == 0} == {0, 3, 2**32 + 2}
    # Step 1's third round holds two groups the filter keeps, one of each worker's share:
    # the first decided fills the batch.
    step_1 = {g for g, step in kept.items() if step == 1}
    assert len(step_1) == 3 and {6, 2 * 2**32 + 1} < step_1
    assert step_1 - {6, 2 * 2**32 + 1} <= {2 * 2**32 + 4, 2 * 2**32 + 7}


def test_worker_takes_its_prompt_groups_from_the_gateway(
        engine, tokenizer, kafka, lake_root, tmp_path):
    """`--prompts-from`: the gateway numbers the groups, publishes their `group_started`
    and `run_started`; the worker generates and scores them, with the token from the
    environment."""
    inputs = ["1+1=", "2+3=", "7-4="]
    config = gateway_config(kafka, lake_root, tmp_path / "state")
    with RunningGateway(config) as gateway, gateway.client() as client:
        body = "".join(json.dumps({"input": i, "label": "x"}) + "\n" for i in inputs)
        client.post("/v1/datasets/sums", params={"filename": "s.jsonl", "label_key": "label"},
                    content=body).raise_for_status()
        run_id = unique_run()
        client.post("/v1/runs", json={"run_id": run_id, "dataset": "sums", "config": {
            "n_samples_per_prompt": 2, "rollout_batch_size": 2, "rollout_seed": 3,
        }}).raise_for_status()
        command = worker_command(engine, kafka, run_id, tmp_path / "unused.jsonl",
                                 "--n-samples-per-prompt", "2", "--rollout-batch-size", "2",
                                 "--num-steps", "2", "--max-new-tokens", "4",
                                 "--seal-wait-s", "0")
        at = command.index("--prompt-data")
        command[at:at + 2] = ["--prompts-from", gateway.url]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "ROLLOUTLAKE_GATEWAY_TOKEN": "run-a-writer"})
        assert done.returncode != 0 and "answered 403" in done.stderr.strip().splitlines()[-1]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "ROLLOUTLAKE_GATEWAY_TOKEN": "admin-token"})
        assert done.returncode == 0, done.stderr[-2000:]
        cursor = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
    assert "worker done: 4 groups, 8 samples finished" in done.stdout
    assert cursor["next_group_index"] == 4

    events = published(kafka, run_id)
    started = [e for e in events if e.type == "group_started"]
    assert sorted(e.group_index for e in started) == [0, 1, 2, 3]  # the gateway's, once each
    assert all(e.event_id == f"{run_id}/group_started/{e.group_index}" for e in started)
    finished = [e for e in events if e.type == "sample_finished"]
    assert sorted((e.group_index, e.rollout_id) for e in finished) == [
        (g, r) for g in range(4) for r in range(2)]
    prompt_of = {e.group_index: e.prompt for e in started}
    assert set(prompt_of.values()) <= set(inputs)
    for event in finished:
        assert event.prompt_tokens.tolist() == tokenizer(
            prompt_of[event.group_index], add_special_tokens=False)["input_ids"]


GROUP_RM = "tests.support.user_rewards.group_digit_share_or_fail"


def test_group_rm_scores_each_group_at_once_and_a_failing_one_is_missing_rewards(
        engine, kafka, lake_root, tmp_path):
    run_id = "group-rm"
    dataset = write_dataset(tmp_path / "prompts.jsonl", [
        {"input": "1+1=", "label": "2"}, {"input": "7-4=", "label": "boom"},
        {"input": "2+2=", "label": "short"}, {"input": "9+0=", "label": "9"}])
    done = subprocess.run(
        engine_worker_command(engine, kafka, run_id, dataset, GROUP_RM, "--group-rm",
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


def process_tree(pid: int) -> set[int]:
    """`pid` and all its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        tree.add(current)
        todo.extend(children.get(current, []))
    return tree


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def doomed_engine(tmp_path_factory):
    """An engine of its own for the test that kills it: pytest (and pytest-xdist) may run
    the module's tests in any order, so the module's engine must outlive every test."""
    with running_engine(tmp_path_factory.mktemp("doomed-engine")) as running:
        yield running


def test_engine_killed_mid_request_aborts_samples_and_leaves_no_process(
        doomed_engine, kafka, lake_root, tmp_path):
    engine = doomed_engine
    run_id = "engine-dies"
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(8)])
    # Enough steps that the worker is still generating when the engine dies; the
    # requests of later steps then find no engine at all.
    steps, groups, samples = 30, 4, 4
    worker = subprocess.Popen(
        worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", str(samples),
                       "--rollout-batch-size", str(groups), "--num-steps", str(steps),
                       "--max-new-tokens", "480"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_event(kafka, run_id, "group_started", worker)
    engine_processes = process_tree(engine.process.pid)
    assert len(engine_processes) >= 4  # command, guard, API server, engine core
    os.kill(engine.process.pid, signal.SIGKILL)

    out, err = worker.communicate(timeout=600)
    assert worker.returncode == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("rolloutlake worker: ")
    assert "got no answer from the engine" in err.strip().splitlines()[-1]
    events = published(kafka, run_id)
    aborted = [e for e in events if e.type == "sample_aborted"]
    assert aborted and all(e.reason == "engine_error" for e in aborted)
    assert len(aborted) + sum(e.type == "sample_finished" for e in events) == (
        steps * groups * samples)

    run_processor(kafka, lake_root, idle_s=3.0)
    reasons = {g["reason"] for g in by_group(lake_root, run_id).values()}
    assert "group_has_aborted" in reasons

    deadline = time.monotonic() + 60
    while (left := {p for p in engine_processes if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"engine processes outlived kill -9 of their parent: {sorted(left)}"


def test_a_broker_killed_under_a_worker_stops_it_at_the_end_of_the_step(engine, tmp_path):
    """The worker checks each step's events acknowledged before it generates the next. It
    generated every step into its producer's buffer and waited --seal-wait-s without news
    before its last flush said that nothing was acknowledged."""
    run_id = "broker-dies"
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(4)])
    broker = EmbeddedBroker(free_port()).start(SUITE_BROKER_START_S)
    worker = None
    try:
        kafka = suite_kafka(broker.bootstrap_servers, topic_prefix="gone.")
        kafka.ensure_topics()
        worker = subprocess.Popen(
            worker_command(engine, kafka, run_id, dataset, "--n-samples-per-prompt", "2",
                           "--rollout-batch-size", "2", "--num-steps", "30",
                           "--seal-wait-s", "900", "--broker-outage-s", "5"),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_event(kafka, run_id, "group_started", worker)
        assert broker.process is not None
        os.kill(broker.process.pid, signal.SIGKILL)
        # the step's flush gives up after 30 s, a new producer 5 s later
        _, err = worker.communicate(timeout=300)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        broker.stop()
    assert worker.returncode == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last == ("rolloutlake worker: events not acknowledged by the broker within 30 s, "
                    "nor by a new producer within 5 s"), last


def _gateway_worker(engine, kafka, run_id: str, gateway_url: str, *extra: str) -> list[str]:
    command = worker_command(engine, kafka, run_id, Path("unused.jsonl"), *extra)
    at = command.index("--prompt-data")
    command[at:at + 2] = ["--prompts-from", gateway_url]
    return command


def test_partial_rollout_continues_each_cancelled_sample_once_across_kills(
        engine, kafka, lake_root, tmp_path):
    """`--partial-rollout`: step 0 seals while its other groups generate; each of those is
    recycled at the gateway with what its samples had made. Then the worker is killed -9
    (waiting for weights that never come) and the gateway too; a new gateway and a new
    worker serve each recycled group once more, the finished samples as they were and
    every cancelled one continued from its tokens to the 1536 tokens asked for, the old
    tokens masked as generated by older weights.

    The seal must cut a request mid-generation, which is timing. With 24 groups of
    448-token samples (about 2 s each), 2 or 4 requests at a time, a processor starved by
    the suite's load sealed after 18 of the groups, once after all of them (nothing to
    recycle), and an abort once reached the engine after the requests it meant had
    finished (every recycled sample empty). So samples take 1536 tokens here, over three
    times as long (12 groups, 2 requests at a time), the worker starts once the processor
    has joined, and up to `SEAL_MID_GENERATION_TRIES` runs are served, each its
    own, until a seal cuts a request; the rest of the test follows that run. (One
    clean-clone run, its test process frozen for 3 s at a time by the load, missed in all
    of four: two seals after every group, two aborts of requests not yet generating.)"""
    config = gateway_config(kafka, lake_root, tmp_path / "state")
    n, max_new = 2, 1536
    flags = ["--n-samples-per-prompt", str(n), "--rollout-batch-size", "1",
             "--over-sampling-batch-size", "12", "--max-new-tokens", str(max_new),
             "--ignore-eos", "--partial-rollout"]
    env = {**os.environ, "ROLLOUTLAKE_GATEWAY_TOKEN": "admin-token"}
    with GatewayProcess(config, tmp_path / "gw1.json") as gateway, gateway.client() as client:
        body = "".join(json.dumps({"input": f"{i}*{i}=", "label": str(i * i)}) + "\n"
                       for i in range(8))
        client.post("/v1/datasets/squares", params={"filename": "s.jsonl",
                                                    "label_key": "label"},
                    content=body).raise_for_status()
        processor = _joined_processor(kafka, lake_root)
        try:
            tries = []
            for _ in range(SEAL_MID_GENERATION_TRIES):
                run_id = unique_run()
                client.post("/v1/runs", json={"run_id": run_id, "dataset": "squares", "config": {
                    "n_samples_per_prompt": n, "rollout_batch_size": 1, "rollout_shuffle": False,
                }}).raise_for_status()
                log_lines = _kill_once_step_1_waits(_gateway_worker(
                    engine, kafka, run_id, gateway.url, *flags, "--num-steps", "2",
                    "--max-staleness", "0", "--max-in-flight", "2"), env)
                recycled = Lake(lake_root).read("recycled_samples",
                                                filter=pc.field("run_id") == run_id)
                partial = {(r["group_index"], r["rollout_id"]): r for r in recycled.to_pylist()}
                if any(0 < len(r["response_tokens"]) < max_new for r in partial.values()):
                    break
                # What the try did, for the failure: how many samples it recycled and of
                # what lengths, and when its worker saw the seal.
                tries.append(f"{run_id}: recycled lengths "
                             f"{sorted(len(r['response_tokens']) for r in partial.values())}; "
                             f"worker: {[line.strip() for line in log_lines if 'sealed' in line]}")
            else:
                pytest.fail(f"in {SEAL_MID_GENERATION_TRIES} runs no seal cut a request "
                            "mid-generation:\n" + "\n".join(tries))
            gateway.kill()
        finally:
            if processor.poll() is None:
                processor.kill()
    groups = {g for g, _ in partial}
    assert len(partial) == n * len(groups)
    for event in published(kafka, run_id):
        if event.type == "sample_aborted":
            assert event.reason == "cancelled" and event.recyclable
            assert event.group_index in groups
            stored = partial[(event.group_index, event.rollout_id)]["response_tokens"]
            assert (event.response_tokens.tolist() if event.response_tokens is not None
                    else []) == stored

    config = config.model_copy(update={"port": free_port()})
    with GatewayProcess(config, tmp_path / "gw2.json") as gateway:
        done = subprocess.run(
            _gateway_worker(engine, kafka, run_id, gateway.url, *flags, "--first-step", "1",
                            "--max-in-flight", "64",
                            "--weight-version", "1", "--seal-wait-s", "0",
                            "--mask-offpolicy-in-partial-rollout"),
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    continued = [e for e in published(kafka, run_id)
                 if e.type == "sample_finished" and e.metadata.get("recycled_from") is not None]
    origins = Counter(e.metadata["recycled_from"] for e in continued)
    assert origins == {g: n for g in groups}  # every recycled group served once, whole
    assert len({(e.group_index, e.rollout_id) for e in continued}) == len(continued)
    for event in continued:
        before = partial[(event.metadata["recycled_from"], event.rollout_id)]
        old = len(before["response_tokens"])
        tokens = event.response_tokens.tolist()
        assert tokens[:old] == before["response_tokens"]
        assert event.rollout_log_probs.tolist()[:old] == pytest.approx(
            before["rollout_log_probs"], abs=1e-6)
        assert len(tokens) == max_new and event.status == "truncated"
        assert event.metadata["start_rollout_id"] == 0
        if before["status"] == "aborted":  # continued under version 1: new tokens trained
            assert event.loss_mask.tolist() == [0] * old + [1] * (max_new - old)
            assert event.metadata["segment_versions"][-1] == 1
            assert sum(event.metadata["segment_tokens"]) == max_new
        else:  # finished before the seal: served as it was, all of it older weights
            assert tokens == before["response_tokens"]
            assert event.loss_mask.tolist() == [0] * max_new
