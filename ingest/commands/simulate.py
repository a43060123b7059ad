"""`rolloutlake simulate`: a seeded load generator that publishes realistic rollout runs.

Groups look like DAPO math rollouts: about half are all-right or all-wrong (zero std),
response lengths are log-normal and long answers are more often wrong, some rollouts
compact into 2-4 fragments, abort, or lose their reward; deliveries can be duplicated and
reordered. Two drivers:

- closed loop (default) drives each step the way Miles' rollout loop does: it issues
  `over_sampling_batch_size` groups, issues more while kept plus in-flight groups cannot
  reach `rollout_batch_size` (following `rollout.decisions`), finishes groups in order of
  their generation time, and at the step's `step_sealed` cancels what is still in flight;
- open loop publishes a fixed, fully reproducible stream (no feedback): per step, groups
  until the DAPO filter will keep `rollout_batch_size + surplus` of them.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from ingest.io.kafka import KafkaSettings, PartitionReader
from ingest.processor.decisions import UnreadableRecord, decision_header
from ingest.sdk.publisher import RolloutPublisher
from schemas.config import add_config_flags, config_from_args
from schemas.errors import RolloutlakeError
from schemas.events import DAPO_FILTER_PATH, SCHEMA_VERSION, RunId, event_group_key
from schemas.token_arrays import TOKEN_FIELDS, encode_token_array

log = logging.getLogger(__name__)

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class SimulationConfig(BaseModel):
    """One simulated run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run_id: RunId = "sim"
    steps: Annotated[int, Field(ge=1)] = 5
    rollout_batch_size: Annotated[int, Field(ge=1)] = 32
    """Kept groups per step."""
    over_sampling_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Groups issued per refill; default 2 x rollout_batch_size."""
    n_samples: Annotated[int, Field(ge=1)] = 8
    response_len_mean: Annotated[float, Field(gt=0)] = 512.0
    response_len_sigma: Annotated[float, Field(ge=0)] = 0.6
    max_response_len: Annotated[int, Field(ge=1)] | None = None
    """Responses reaching this are `truncated`; default 4 x the mean."""
    prompt_len: Annotated[int, Field(ge=1)] = 128
    vocab_size: Annotated[int, Field(ge=2)] = 32000
    log_probs: bool = True
    compact_arrays: bool = True
    """Per-token arrays in the compact typed form, as the SDK sends them (else JSON lists)."""
    abort_rate: Fraction = 0.01
    missing_reward_rate: Fraction = 0.01
    compaction_rate: Fraction = 0.05
    zero_std_share: Fraction = 0.5
    """Share of groups whose samples are all right or all wrong (DAPO runs: about half)."""
    separate_reward_rate: Fraction = 0.3
    """Share of rollouts whose reward comes in its own `reward` event."""
    duplicate_rate: Fraction = 0.02
    out_of_order: bool = True
    filter_path: str | None = DAPO_FILTER_PATH
    seed: int = 0
    tokens_per_s: Annotated[float, Field(gt=0)] = 2_000_000.0
    """Simulated generation speed: a group finishes after its longest response."""
    mode: Literal["closed", "open"] = "closed"
    surplus_per_step: Annotated[int, Field(ge=0)] = 2
    """Open loop: kept groups per step beyond the batch (they become `surplus`)."""

    @property
    def over_sampling(self) -> int:
        return self.over_sampling_batch_size or 2 * self.rollout_batch_size

    @property
    def truncation_len(self) -> int:
        return self.max_response_len or int(4 * self.response_len_mean)

    def run_config(self) -> dict[str, Any]:
        return {
            "n_samples_per_prompt": self.n_samples,
            "rollout_batch_size": self.rollout_batch_size,
            "over_sampling_batch_size": max(self.over_sampling, self.rollout_batch_size),
            "dynamic_sampling_filter_path": self.filter_path,
        }


@dataclass
class SimGroup:
    """One generated group: its events in publish order and what the filter will say."""

    group_index: int
    step: int
    events: list[dict[str, Any]]
    finish_s: float  # generation time of its longest response
    will_keep: bool
    cancel_events: list[dict[str, Any]] = field(default_factory=list)


def _event(cfg: SimulationConfig, kind: str, event_id: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": event_id, "type": kind, "schema_version": SCHEMA_VERSION,
            "run_id": cfg.run_id, "producer": "simulate", **fields}


def _token_array(cfg: SimulationConfig, name: str, values: np.ndarray) -> Any:
    return encode_token_array(TOKEN_FIELDS[name], values) if cfg.compact_arrays else values.tolist()


def generate_group(cfg: SimulationConfig, group_index: int, step: int) -> SimGroup:
    """The events of one group; a pure function of (config, group_index): reproducible."""
    rng = np.random.default_rng([cfg.seed, group_index])
    n = cfg.n_samples
    kind = rng.random()
    lengths = np.clip(
        rng.lognormal(math.log(cfg.response_len_mean) - cfg.response_len_sigma**2 / 2,
                      cfg.response_len_sigma, n).astype(int), 1, cfg.truncation_len)
    if kind < cfg.zero_std_share / 2:
        rewards = np.ones(n)
    elif kind < cfg.zero_std_share:
        rewards = np.zeros(n)
    else:  # mixed: long answers are more often wrong
        p_right = np.clip(0.8 - 0.6 * lengths / cfg.truncation_len, 0.05, 0.95)
        rewards = (rng.random(n) < p_right).astype(float)
    gid = f"{cfg.run_id}-g{group_index}"
    events = [_event(cfg, "group_started", f"{gid}-start", group_index=group_index, step=step,
                     n_samples=n, prompt=f"problem {group_index}", label=str(group_index))]
    cancel = []
    aborted = missing = False
    for rid in range(n):
        length = int(lengths[rid])
        rid_base = f"{gid}-r{rid}"
        cancel.append(_event(cfg, "sample_aborted", f"{rid_base}-cancel", group_index=group_index,
                             rollout_id=rid, reason="cancelled",
                             response_tokens=_token_array(cfg, "response_tokens", rng.integers(
                                 0, cfg.vocab_size, length // 3))))
        if rng.random() < cfg.abort_rate:
            aborted = True
            events.append(_event(cfg, "sample_aborted", f"{rid_base}-abort", group_index=group_index,
                                 rollout_id=rid, reason="engine_error",
                                 response_tokens=_token_array(cfg, "response_tokens", rng.integers(
                                     0, cfg.vocab_size, length // 2))))
            continue
        reward: float | None = float(rewards[rid])
        if rng.random() < cfg.missing_reward_rate:
            reward, missing = None, True
        n_frag = int(rng.integers(2, 5)) if rng.random() < cfg.compaction_rate else 1
        bounds = np.linspace(0, length, n_frag + 1).astype(int)
        prompt = _token_array(cfg, "prompt_tokens", rng.integers(0, cfg.vocab_size, cfg.prompt_len))
        tokens = rng.integers(0, cfg.vocab_size, length)
        logp = (-rng.exponential(0.5, length)).astype(np.float32) if cfg.log_probs else None
        for f in range(n_frag):
            lo, hi = bounds[f], max(bounds[f + 1], bounds[f] + 1)
            body: dict[str, Any] = dict(
                group_index=group_index, rollout_id=rid, prompt_tokens=prompt,
                response_tokens=_token_array(cfg, "response_tokens", tokens[lo:hi]),
            )
            if logp is not None:
                body["rollout_log_probs"] = _token_array(cfg, "rollout_log_probs", logp[lo:hi])
            if f < n_frag - 1:
                events.append(_event(cfg, "compaction_fragment", f"{rid_base}-f{f}",
                                     fragment_index=f, **body))
                continue
            body.update(status="truncated" if length >= cfg.truncation_len else "completed",
                        sample_index=group_index * n + rid, fragment_count=n_frag,
                        weight_version=step)
            separate = rng.random() < cfg.separate_reward_rate
            if not separate:
                body["reward"] = reward
            events.append(_event(cfg, "sample_finished", f"{rid_base}-done", **body))
            if separate:
                events.append(_event(cfg, "reward", f"{rid_base}-reward", group_index=group_index,
                                     rollout_id=rid, reward=reward))
    if cfg.out_of_order:
        order = rng.permutation(len(events))
        events = [events[i] for i in order]
    if cfg.duplicate_rate:
        dup = [e for e in events if rng.random() < cfg.duplicate_rate]
        events.extend(dup)
    zero_std = bool(np.all(rewards == rewards[0])) or n == 1
    keep_by_filter = not zero_std if cfg.filter_path else True
    return SimGroup(
        group_index=group_index, step=step, events=events,
        finish_s=float(lengths.max()) / cfg.tokens_per_s,
        will_keep=not aborted and not missing and keep_by_filter,
        cancel_events=cancel,
    )


def open_loop_groups(cfg: SimulationConfig) -> Iterator[SimGroup]:
    """Per step, groups until `rollout_batch_size + surplus_per_step` will be kept."""
    group_index = 0
    for step in range(cfg.steps):
        kept = 0
        while kept < cfg.rollout_batch_size + cfg.surplus_per_step:
            group = generate_group(cfg, group_index, step)
            kept += group.will_keep
            group_index += 1
            yield group


class _Follower:
    """Reads `rollout.decisions` headers and `step_sealed` messages of one run."""

    def __init__(self, settings: KafkaSettings, run_id: str):
        self.run_id = run_id
        topics = settings.topics
        # A stalled fetch would leave a run waiting for a seal it missed.
        self.reader = PartitionReader(settings, [topics.decisions, topics.control],
                                      what="simulation")
        self.control_topic = topics.control
        self.sealed: set[int] = set()
        self.decided: dict[int, str] = {}  # group_index -> decision

    def poll(self, timeout_ms: int) -> None:
        for tp, records in self.reader.poll(timeout_ms=timeout_ms).items():
            for record in records:
                if tp.topic == self.control_topic:
                    message = orjson.loads(record.value)
                    if message.get("run_id") == self.run_id and message.get("type") == "step_sealed":
                        self.sealed.add(message["step"])
                    continue
                try:
                    header = decision_header(record)
                except UnreadableRecord:  # not a group stage's: the processor dead-letters it
                    continue
                if header is not None and header.run_id == self.run_id:
                    self.decided[header.group_index] = header.decision

    def close(self) -> None:
        self.reader.close()


def _send(pub: RolloutPublisher, cfg: SimulationConfig, events: list[dict[str, Any]]) -> None:
    for body in events:
        key = event_group_key(cfg.run_id, body["group_index"])
        pub.send_raw(pub.topics.events, key, orjson.dumps(body))


def run_simulation(settings: KafkaSettings, cfg: SimulationConfig, *,
                   progress: Any = None, step_timeout_s: float = 120.0) -> dict[str, int]:
    """Publish one run; returns counts of groups issued and events sent."""
    stats = {"groups": 0, "events": 0, "cancelled_groups": 0}
    with RolloutPublisher(settings) as pub:
        pub.run_started(cfg.run_id, cfg.run_config(), event_id=f"{cfg.run_id}-run")
        pub.flush()
        if cfg.mode == "open":
            for group in open_loop_groups(cfg):
                _send(pub, cfg, group.events)
                stats["groups"] += 1
                stats["events"] += len(group.events)
                if progress:
                    progress(group.step, stats)
            return stats
        follower = _Follower(settings, cfg.run_id)
        try:
            _closed_loop(pub, follower, cfg, stats, progress, step_timeout_s)
        finally:
            follower.close()
    return stats


class _StepDriver:
    """Miles' rollout loop for one step: refill, collect decisions, cancel at the seal."""

    def __init__(self, pub: RolloutPublisher, cfg: SimulationConfig, step: int,
                 first_group: int, stats: dict[str, int]):
        self.pub, self.cfg, self.step, self.stats = pub, cfg, step, stats
        self.next_group = first_group
        self.in_flight: dict[int, tuple[float, SimGroup]] = {}  # group -> (finish time, group)
        self.published: set[int] = set()
        self.kept = 0

    def issue(self) -> None:
        issued_at = time.monotonic()
        for _ in range(self.cfg.over_sampling):
            group = generate_group(self.cfg, self.next_group, self.step)
            self.in_flight[self.next_group] = (issued_at + group.finish_s, group)
            # group_started goes out at issue time, like a data source handing out prompts.
            _send(self.pub, self.cfg, [e for e in group.events if e["type"] == "group_started"][:1])
            group.events = [e for e in group.events if e["type"] != "group_started"]
            self.next_group += 1
            self.stats["groups"] += 1

    def publish_finished(self) -> None:
        now = time.monotonic()
        for gi, (finish, group) in sorted(self.in_flight.items(), key=lambda kv: kv[1][0]):
            if finish <= now and gi not in self.published:
                _send(self.pub, self.cfg, group.events)
                self.stats["events"] += len(group.events) + 1
                self.published.add(gi)
        self.pub.flush()

    def collect(self, decided: dict[int, str]) -> None:
        for gi in [g for g in self.in_flight if g in decided]:
            self.kept += decided[gi] == "kept"
            del self.in_flight[gi]
        if self.kept + len(self.in_flight) < self.cfg.rollout_batch_size:
            self.issue()

    def cancel_in_flight(self) -> None:
        cancelled_at = time.time()
        for gi, (_, group) in self.in_flight.items():
            if gi not in self.published:
                # `ts` tells the processor the abort came after the seal.
                _send(self.pub, self.cfg, [{**e, "ts": cancelled_at} for e in group.cancel_events])
                self.stats["cancelled_groups"] += 1
        self.pub.flush()


def _closed_loop(pub: RolloutPublisher, follower: _Follower, cfg: SimulationConfig,
                 stats: dict[str, int], progress: Any, step_timeout_s: float) -> None:
    next_group = 0
    for step in range(cfg.steps):
        driver = _StepDriver(pub, cfg, step, next_group, stats)
        deadline = time.monotonic() + step_timeout_s
        driver.issue()
        while step not in follower.sealed:
            if time.monotonic() > deadline:
                raise RolloutlakeError(
                    f"step {step} did not seal within {step_timeout_s:.0f} s: is "
                    "`rolloutlake process` running against the same broker?"
                )
            driver.publish_finished()
            follower.poll(timeout_ms=20)
            driver.collect(follower.decided)
            if progress:
                progress(step, stats)
        driver.cancel_in_flight()
        next_group = driver.next_group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser.add_argument_group("kafka settings"), KafkaSettings)
    add_config_flags(parser, SimulationConfig)


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    settings = config_from_args(KafkaSettings, args)
    cfg = config_from_args(SimulationConfig, args)
    with Progress() as bar:
        task = bar.add_task(f"run {cfg.run_id}", total=cfg.steps)

        def progress(step: int, stats: dict[str, int]) -> None:
            bar.update(task, completed=step, description=f"run {cfg.run_id}: step {step}, "
                       f"{stats['groups']} groups issued")

        stats = run_simulation(settings, cfg, progress=progress)
        bar.update(task, completed=cfg.steps)
    print(f"published run {cfg.run_id}: {stats['groups']} groups, {stats['events']} events, "
          f"{stats['cancelled_groups']} groups cancelled at seal")
    return 0
