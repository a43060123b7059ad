"""The worker on a real vLLM engine with `--partial-rollout`: groups cancelled at a seal
survive kill -9 of the worker, between steps and while continuing them, on the compacted
partial topic, and continue exactly once, from their tokens, in a worker started later."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from ingest.workers.partial import PartialStore
from tests.integration.pipeline import by_group, rows
from tests.support.engine_server import (
    CLI,
    ROOT,
    published,
    running_engine,
    wait_for_event,
    worker_command,
    write_dataset,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.one_broker("the engine and the worker; their broker path is the SDK's")]

REWARD = "tests.support.user_rewards.digit_share_or_raise"
JOINED = "stage: joined consumer group"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


def _wait_for_line(process: subprocess.Popen[str], text: str, timeout_s: float = 300) -> str:
    """The worker's log up to the first line holding `text`."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    pytest.fail(f"no {text!r} from the worker: {''.join(seen)[-2000:]}")


def _wait_until_following(processor: subprocess.Popen[str], log: Path,
                          timeout_s: float = 300) -> None:
    """Both processor stages joined their consumer groups: from here a decision is made,
    and a step sealed, within a poll of the events that decide it."""
    deadline = time.monotonic() + timeout_s
    while log.read_text().count(JOINED) < 2:
        assert processor.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, f"processor not following: {log.read_text()[-2000:]}"
        time.sleep(0.2)


def test_partial_rollouts_survive_kill_9_and_each_continues_once_from_its_tokens(
        engine, kafka, lake_root, tmp_path):
    """Step 0 issues 48 groups for a batch of 1 and is cancelled at its seal, mid-generation;
    the worker then waits for weights that never come (`--max-staleness 0`) with the
    cancelled groups recycled, and is killed with SIGKILL. A second worker claims them for
    step 1 and is killed too once it published a continued rollout; a third continues the
    groups left claimed as the same groups with the same event ids. Every recycled group
    is continued once, from its tokens to the 480-token budget, each rollout trained as
    it first reached the processor, and with `--mask-offpolicy-in-partial-rollout` the
    tokens of the older weights are masked."""
    run_id = "partial-kill9"
    # Every request runs its 480 tokens (`--ignore-eos`), 4 at a time: step 0 is 24 waves
    # of requests, its first group ends with the first wave, and its seal (decision,
    # Delta commits, control message) was seen 1 to 5 waves later. With 16 groups 8 at
    # a time the step was 4 waves, and often over before its seal.
    budget, groups = 480, 48
    dataset = write_dataset(tmp_path / "prompts.jsonl",
                            [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(8)])
    common = ("--partial-rollout", "--n-samples-per-prompt", "2", "--max-new-tokens",
              str(budget), "--ignore-eos")
    processor_log = tmp_path / "processor.log"
    with processor_log.open("w") as log_file:
        # No --until-idle: worker restarts take a while on a loaded machine; it is
        # stopped once the last worker has seen step 1 sealed.
        processor = subprocess.Popen(
            [*CLI, "process", "--lake", lake_root, "--bootstrap-servers",
             kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    first = second = None
    try:
        # The seal must come while step 0 generates: start the worker only once the
        # processor follows the stream (started together, a slow processor start let
        # the whole step finish before its seal).
        _wait_until_following(processor, processor_log)
        first = subprocess.Popen(
            worker_command(engine, kafka, run_id, dataset, REWARD, *common,
                           "--max-in-flight", "4", "--rollout-batch-size", "1",
                           "--over-sampling-batch-size", str(groups), "--num-steps", "2",
                           "--max-staleness", "0"),
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first_log = _wait_for_line(first, "step 1 waits for weight version 1")
        recycled = {g.group_index: g for g in _load(kafka, run_id)}
        first.kill()
        first.wait(timeout=30)
        print(*(line for line in first_log.splitlines() if "step 0" in line), sep="\n")
        assert recycled, f"the seal cancelled no group: {first_log[-3000:]}"
        continue_step_1 = worker_command(
            engine, kafka, run_id, dataset, REWARD, *common, "--max-in-flight", "8",
            "--rollout-batch-size", str(groups), "--first-step", "1", "--weight-version", "1",
            "--mask-offpolicy-in-partial-rollout", "--seal-wait-s", "60")
        # Killed again while continuing: once a continued rollout is published, the
        # groups still generating stay claimed.
        second = subprocess.Popen(continue_step_1, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        wait_for_event(kafka, run_id, "sample_finished", second,
                       groups=range(groups, groups + len(recycled)))
        second.kill()
        second.wait(timeout=30)
        claimed = _load(kafka, run_id)
        assert claimed and all(g.state == "claimed" and g.as_step == 1 for g in claimed)
        assert {g.group_index for g in claimed} <= set(recycled)
        third = subprocess.run(continue_step_1, cwd=ROOT, capture_output=True, text=True,
                               timeout=600)
        assert third.returncode == 0, third.stderr[-2000:]
        assert f"{len(claimed)} recycled groups to continue" in third.stderr
        assert "not sealed" not in third.stderr, third.stderr[-2000:]
        processor.send_signal(signal.SIGTERM)
        processor.wait(timeout=300)
    finally:
        for process in (first, second, processor):
            if process is not None and process.poll() is None:
                process.kill()
    assert processor.returncode == 0, processor_log.read_text()[-2000:]

    events = published(kafka, run_id)
    cancelled = {(e.group_index, e.rollout_id): e for e in events
                 if e.type == "sample_aborted"}
    assert cancelled and all(e.reason == "cancelled" and e.recyclable
                             for e in cancelled.values())
    assert {g for g, _ in cancelled} == set(recycled)
    partial_tokens = {key: e.response_tokens.tolist() for key, e in cancelled.items()
                      if e.response_tokens is not None}
    assert partial_tokens, "no request was cut off mid-generation"
    continuing = [e for e in events if e.type == "group_started" and e.step == 1
                  and "recycled_from" in e.metadata]
    origin_of = {e.group_index: e.metadata["recycled_from"] for e in continuing}
    assert sorted(origin_of.values()) == sorted(recycled)  # every group once: none lost
    as_group = {origin: g for g, origin in origin_of.items()}

    batch = rows(lake_root, "training_batches", run_id)
    step_1 = {(r["group_index"], r["rollout_id"]): r for r in batch if r["step"] == 1}
    assert len(step_1) == groups * 2 and len(batch) == groups * 2 + 2
    for (origin, rollout), tokens in partial_tokens.items():
        row = step_1[(as_group[origin], rollout)]
        assert row["response_tokens"][:len(tokens)] == tokens  # continued from its tokens
        assert len(row["response_tokens"]) == budget and row["status"] == "truncated"
        assert row["loss_mask"] == [0] * len(tokens) + [1] * (budget - len(tokens))
        assert row["weight_version"] == 0  # the oldest weights it was generated with
    finished_before = {(e.group_index, e.rollout_id): e for e in events
                       if e.type == "sample_finished" and e.group_index in recycled}
    for (origin, rollout), event in finished_before.items():
        row = step_1[(as_group[origin], rollout)]
        assert row["response_tokens"] == event.response_tokens.tolist()  # not regenerated
        assert row["loss_mask"] == [1] * len(event.response_tokens)  # finished on-policy
    decided = by_group(lake_root, run_id)
    assert {decided[g]["reason"] for g in recycled} == {"cancelled_at_seal"}
    # Both lives sent the claimed groups' events under the same ids, which the processor
    # applies once: each continued rollout is trained as its first `sample_finished` on the
    # broker (a later one is a duplicate, or refused: the third worker also sends fresh
    # groups on the indexes of groups the second one finished).
    copies = Counter(e.event_id for e in events)
    assert {e.group_index for e in continuing if copies[e.event_id] == 2} == {
        g.as_group for g in claimed}
    first_finished = {}
    for event in events:
        if event.type == "sample_finished" and event.group_index in origin_of:
            first_finished.setdefault((event.group_index, event.rollout_id), event)
    assert first_finished.keys() == {key for key in step_1 if key[0] in origin_of}
    for key, event in first_finished.items():
        assert step_1[key]["response_tokens"] == event.response_tokens.tolist(), key
    assert _load(kafka, run_id) == []  # every continued group was written done


def _load(kafka, run_id: str) -> list:
    store = PartialStore(kafka, run_id)
    try:
        return store.load()
    finally:
        store.close()
