"""The rollout loop: prompt groups -> one engine request per sample -> reward -> events.

Per step the worker issues a round of `groups_per_step` groups; each group is a
`group_started` and `n_samples_per_prompt` engine requests, each with its own request id.
It is Miles' dynamic-sampling controller: when the processor's `demand` for a step says
that kept plus in-flight groups cannot reach `rollout_batch_size` (counting the groups
this worker issued that the processor has not seen yet), it issues another round for that
step, at any time until the step seals, also while later steps run. A finished sample
is scored by the Miles reward function and published as one `sample_finished` carrying
the engine's tokens and log-probs; a sample the engine could not finish is a
`sample_aborted(reason="engine_error")`, so its group is dropped, never stuck.

When the processor seals a step (`step_sealed` on `rollout.control`), that step's
requests in flight are aborted on every engine and its samples not yet sent are not
sent: both become `sample_aborted(reason="cancelled")`, which the processor counts as
`cancelled_at_seal`, and the worker moves on to the next step.

With `--partial-rollout` a group cancelled at a seal is kept, with its tokens, on the
compacted `rollout.partial` topic (`ingest/workers/partial.py`), and the next rounds
continue it first, from those tokens with the remaining `max_new_tokens`, also in a
worker started later.

On `weights_updated` every engine reloads the new weights (in place, requests in flight
finishing under the old ones); requests wait meanwhile, and each sample carries the
weight version its request was sent under. With `max_staleness` k, step s is issued only
once the engines serve version s - k or newer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ingest.core.filters import FilterArgs, SampleStatus
from ingest.sdk.publisher import RolloutPublisher
from ingest.workers.config import WorkerConfig
from ingest.workers.engines import Engine, EngineError, FinishStatus, Generation, Sampling
from ingest.workers.partial import (
    PartialStore,
    continuation_event_id,
    loss_mask,
    plan_round,
    prompt_of,
    stored_prompt,
)
from ingest.workers.prompts import IssuedGroup, Prompt, PromptSource
from ingest.workers.rewards import RewardSample, score, score_group
from schemas.control import Demand, StepSealed, WeightsUpdated
from schemas.errors import ConfigError
from schemas.partial import PartialGroup, PartialSample

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5
# Groups of step s's extra rounds are numbered from EXTRA_GROUPS * (s + 1): above the first
# rounds' `s * groups_per_step` of any step, and apart from every other step's extras.
EXTRA_GROUPS = 2**32

EventIds = Callable[..., str | None]


def _random_ids(kind: str, rollout_id: int | None = None) -> None:
    """Event ids of a fresh group: the SDK draws random ones."""
    return None


@dataclass
class Progress:
    """Counters of one worker run, and the terminal line drawn from them."""

    groups_issued: int = 0
    samples_finished: int = 0
    samples_aborted: int = 0
    samples_cancelled: int = 0
    in_flight: int = 0
    response_tokens: int = 0
    engine_errors: int = 0
    last_engine_error: str | None = None
    extra_rounds: int = 0  # rounds issued on a `demand`, beyond each step's first
    rounds_past_cap: int = 0  # of those, rounds beyond --max-over-sampling-rounds
    kept: dict[int, int] = field(default_factory=dict)  # step -> kept groups, last heard
    decided_not_kept: dict[int, int] = field(default_factory=dict)  # step -> last heard
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / max(time.monotonic() - self.started, 1e-9)

    def line(self, step: int) -> str:
        return (f"step {step} | groups {self.groups_issued} issued, "
                f"{sum(self.kept.values())} kept, {sum(self.decided_not_kept.values())} "
                f"dropped, {self.extra_rounds} extra rounds | requests {self.in_flight} in "
                f"flight | samples {self.samples_finished} finished, {self.samples_aborted} "
                f"aborted, {self.samples_cancelled} cancelled at seal | "
                f"{self.tokens_per_s:,.0f} tokens/s")


class RolloutWorker:
    """Generates, scores and publishes the configured steps of one run."""

    def __init__(self, config: WorkerConfig, *, publisher: RolloutPublisher,
                 engines: list[Engine], tokenizer: Any, reward_fn: Callable[..., Any],
                 prompts: PromptSource, terminal: TextIO | None = None,
                 partial: PartialStore | None = None):
        self.config = config
        self.publisher = publisher
        self.engines = engines
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.prompts = prompts
        self.partial = partial  # set with --partial-rollout
        self._recycled: list[PartialGroup] = []  # waiting for a round, oldest first
        self.terminal = terminal if terminal is not None and terminal.isatty() else None
        self.sampling = Sampling(temperature=config.temperature, top_p=config.top_p,
                                 max_new_tokens=config.max_new_tokens,
                                 ignore_eos=config.ignore_eos)
        self.reward_args = FilterArgs(**{**config.model_dump(mode="json"),
                                        **config.run_config()})
        self.progress = Progress()
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._step = config.first_step
        self._in_flight: dict[int, set[str]] = defaultdict(set)  # step -> request ids
        self._sealed: set[int] = set()
        self._cancelled: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.weight_version = config.weight_version
        self._serving = asyncio.Event()  # cleared while the engines load new weights
        self._serving.set()
        self._reloads = asyncio.Lock()
        self._new_weights = asyncio.Condition()  # notified when weight_version rises
        self._issued: dict[int, int] = {}  # step -> groups issued
        self._rounds: dict[int, int] = {}  # step -> rounds issued
        self._groups: dict[int, set[asyncio.Task[None]]] = defaultdict(set)  # step -> running
        self._last_heard = time.monotonic()  # last control message or finished round
        self._news = asyncio.Event()  # set on each of those

    def on_control(self, message: StepSealed | Demand | WeightsUpdated) -> None:
        """A `rollout.control` message of this run (call on the loop)."""
        self._heard()
        if isinstance(message, StepSealed):
            self.step_sealed(message.step)
        elif isinstance(message, Demand):
            self.demand(message)
        else:
            self._in_background(self._reload(message))

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        self._news.set()

    def demand(self, message: Demand) -> None:
        """The processor's need for groups of a step: issue another round while kept plus
        in-flight groups, those it has not seen yet included, cannot fill the batch."""
        step = message.step
        if step in self._sealed or step not in self._issued:
            return  # sealed, or a step of another worker run
        self.progress.kept[step] = message.kept
        if message.in_flight is not None and message.issued is not None:
            self.progress.decided_not_kept[step] = (message.issued - message.kept
                                                    - message.in_flight)
        seen = self._issued[step] if message.issued is None else message.issued
        unseen = max(0, self._issued[step] - seen)
        if message.groups_needed - unseen > 0:
            self._issue_round(step)

    def _issue_round(self, step: int) -> None:
        """Issue `groups_per_step` groups for `step` (Miles' over-sampling round)."""
        per_step = self.config.groups_per_step
        rounds = self._rounds[step] = self._rounds.get(step, 0) + 1
        if rounds == 1:
            first = step * per_step
        else:
            first = EXTRA_GROUPS * (step + 1) + (rounds - 2) * per_step
            self.progress.extra_rounds += 1
            cap = self.config.max_over_sampling_rounds
            if rounds > cap:
                self.progress.rounds_past_cap += 1
                log.warning("step %d: over-sampling round %d, past --max-over-sampling-rounds "
                            "%d; the filter keeps few groups (still issuing until it seals)",
                            step, rounds, cap)
        self._issued[step] = self._issued.get(step, 0) + per_step
        task = asyncio.create_task(self._run_round(step, first, per_step))
        self._groups[step].add(task)
        task.add_done_callback(self._groups[step].discard)
        task.add_done_callback(lambda _task: self._heard())

    async def _run_round(self, step: int, first: int, count: int) -> None:
        """The round's groups: recycled ones first (`plan_round`), fresh prompts on the
        indexes they leave."""
        continuing, self._recycled = plan_round(self._recycled, step,
                                                list(range(first, first + count)))
        taken = {index for index, _, _ in continuing}
        fresh = [group for group in await self.prompts.take(step, first, count)
                 if group.group_index not in taken]
        await asyncio.gather(
            *(self._run_group(as_step, IssuedGroup(index, prompt_of(recycled), started=False),
                              recycled)
              for index, as_step, recycled in continuing),
            *(self._run_group(step, group) for group in fresh))

    def _in_background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reload(self, message: WeightsUpdated) -> None:
        async with self._reloads:
            if message.version <= self.weight_version:
                return  # announced again, or older than what the engines serve
            self._serving.clear()
            try:
                results = await asyncio.gather(
                    *(e.reload_weights(message.path, message.version) for e in self.engines),
                    return_exceptions=True)
            finally:
                self._serving.set()
            failed = [(e.url, r) for e, r in zip(self.engines, results, strict=True)
                      if isinstance(r, Exception)]
            if failed:
                log.error("weights %d from %s did not load on %s; samples keep version %d",
                          message.version, message.path, failed, self.weight_version)
                return
            async with self._new_weights:
                self.weight_version = message.version
                self._new_weights.notify_all()
            log.info("engines serve weight version %d (%s)", message.version, message.path)

    def step_sealed(self, step: int) -> None:
        """The step's batch is complete: stop generating for it (call on the loop)."""
        if step in self._sealed:
            return
        self._sealed.add(step)
        if step in self._issued:
            self.progress.kept[step] = self.config.rollout_batch_size
        request_ids = sorted(self._in_flight.get(step, ()))
        self._cancelled.update(request_ids)
        log.info("step %d sealed: aborting %d requests in flight", step, len(request_ids))
        if request_ids:
            self._in_background(self._abort_everywhere(request_ids))

    async def _abort_everywhere(self, request_ids: list[str]) -> None:
        # A router may have sent a request to any engine and forwards no aborts.
        results = await asyncio.gather(*(e.abort(request_ids) for e in self.engines),
                                       return_exceptions=True)
        for engine, result in zip(self.engines, results, strict=True):
            if isinstance(result, Exception):
                log.warning("could not abort requests on %s: %s", engine.url, result)

    async def run(self) -> Progress:
        if self.partial is not None:
            self._recycled = self.partial.load()
            n = self.config.n_samples_per_prompt
            for group in self._recycled:
                if len(group.samples) != n:
                    raise ConfigError(f"--n-samples-per-prompt {n}: recycled group "
                                      f"{group.group_index} of run {self.config.run} has "
                                      f"{len(group.samples)} samples")
            log.info("%d recycled groups to continue", len(self._recycled))
        await self._check_engines()
        self.progress = Progress()  # tokens/s counts from the first request
        # With --prompts-from, the run's `run_started` is the gateway's, with its dataset.
        if self.config.publish_run_started and self.config.prompts_from is None:
            self.publisher.run_started(self.config.run, self.config.run_config(),
                                       dataset=str(self.config.prompt_data))
        drawing = asyncio.create_task(self._draw()) if self.terminal else None
        try:
            for step in range(self.config.first_step,
                              self.config.first_step + self.config.num_steps):
                self._step = step
                await self._wait_for_weights(step)
                await self._run_step(step)
                log.info("%s", self.progress.line(step))
            await self._wait_for_seals()
        finally:
            if drawing is not None:
                drawing.cancel()
                await asyncio.gather(drawing, return_exceptions=True)  # leaves the last line
            self.publisher.flush()
        return self.progress

    async def _check_engines(self) -> None:
        for engine in self.engines:
            if not await engine.health():
                raise EngineError(f"no engine answers at {engine.url}/health; start one with "
                                  "`rolloutlake engine` or fix --engine-url")

    async def _wait_for_weights(self, step: int) -> None:
        """Hold step `step` back until the engines serve weights at most `max_staleness`
        versions behind it."""
        if self.config.max_staleness is None:
            return
        needed = step - self.config.max_staleness
        if self.weight_version < needed:
            log.info("step %d waits for weight version %d (engines serve %d)", step, needed,
                     self.weight_version)
        async with self._new_weights:
            await self._new_weights.wait_for(lambda: self.weight_version >= needed)

    async def _run_step(self, step: int) -> None:
        """Issue the step's first round and wait for its groups, and for those of any
        round a `demand` adds meanwhile."""
        self._issue_round(step)
        await self._groups_done(step)

    async def _groups_done(self, step: int) -> None:
        while running := set(self._groups[step]):
            done, _ = await asyncio.wait(running)
            for task in done:
                task.result()  # a group that failed fails the worker, as before

    async def _wait_for_seals(self) -> None:
        """Follow the demand of the steps not sealed yet, until all are or the processor
        has been quiet for --seal-wait-s."""
        while True:
            for step in list(self._groups):
                await self._groups_done(step)
            open_steps = sorted(set(self._issued) - self._sealed)
            quiet = time.monotonic() - self._last_heard
            if not open_steps or quiet >= self.config.seal_wait_s:
                if open_steps:
                    log.info("steps %s not sealed after %.0f s without news from the "
                             "processor; exiting", open_steps, quiet)
                return
            self._news.clear()
            try:
                await asyncio.wait_for(self._news.wait(), self.config.seal_wait_s - quiet)
            except TimeoutError:
                pass

    async def _run_group(self, step: int, group: IssuedGroup,
                         recycled: PartialGroup | None = None) -> None:
        """Run one group: fresh, or continuing the cancelled group `recycled`."""
        group_index, prompt = group.group_index, group.prompt
        n = self.config.n_samples_per_prompt
        metadata = prompt.metadata
        priors: list[PartialSample | None] = [None] * n
        ids: EventIds = _random_ids
        if recycled is not None:
            assert self.partial is not None
            if recycled.state == "pending":  # durable before anything of the group is sent
                recycled = self.partial.claim(recycled, group_index, step)
            origin = recycled.group_index
            metadata = {**metadata, "recycled_from": origin}
            for sample in recycled.samples:
                priors[sample.rollout_id] = sample
            ids = functools.partial(continuation_event_id, self.config.run, origin,
                                    group_index)
        if not group.started:
            self.publisher.group_started(
                self.config.run, group_index=group_index, step=step, n_samples=n,
                prompt=prompt.text, label=prompt.label, metadata=metadata or None,
                event_id=ids("group_started"))
        self.progress.groups_issued += 1
        outcomes = await asyncio.gather(*(
            self._run_sample(step, group_index, r, prompt, priors[r], ids) for r in range(n)))
        if self.config.group_rm:
            await self._publish_group_rewards([s for s, _ in outcomes if s is not None], ids)
        if self.partial is not None:
            self._keep_partial(step, group_index, prompt, [p for _, p in outcomes], recycled)

    def _keep_partial(self, step: int, group_index: int, prompt: Prompt,
                      samples: list[PartialSample | None], recycled: PartialGroup | None
                      ) -> None:
        """`--partial-rollout`: a group the seal cancelled (every sample finished or
        cancelled, none failed) is recorded for a later round; the group it continued is
        written done once this group's events are acknowledged."""
        assert self.partial is not None
        kept = [s for s in samples if s is not None]
        if len(kept) == len(samples) and any(s.status in ("cancelled", "unsent") for s in kept):
            group = PartialGroup(run_id=self.config.run, group_index=group_index, step=step,
                                 prompt=stored_prompt(prompt), samples=kept)
            self.partial.put(group)
            self._recycled.append(group)
        if recycled is not None:
            self.publisher.flush()
            self.partial.done(recycled.group_index)

    async def _publish_group_rewards(self, samples: list[RewardSample], ids: EventIds) -> None:
        """`--group-rm`: the group's finished samples went out without rewards; score them
        at once and send one `reward` each."""
        rewards = await score_group(self.reward_fn, self.reward_args, samples)
        for sample, reward in zip(samples, rewards, strict=True):
            self.publisher.reward(self.config.run, group_index=sample.group_index,
                                  rollout_id=sample.rollout_id, reward=reward,
                                  event_id=ids("reward", sample.rollout_id))

    async def _run_sample(self, step: int, group_index: int, rollout_id: int, prompt: Prompt,
                          prior: PartialSample | None, ids: EventIds
                          ) -> tuple[RewardSample | None, PartialSample | None]:
        """Generate (or, for a recycled rollout, continue) and publish one sample: the
        finished sample (None when it was not), and where it stands for partial rollout
        (None when it failed)."""
        sample_index = group_index * self.config.n_samples_per_prompt + rollout_id
        before = prior or PartialSample(rollout_id=rollout_id, status="unsent")
        # A rollout that needs no request finished under the weights of its last token.
        finished_under = max(before.versions, default=self.weight_version)
        if before.status in ("completed", "truncated"):  # finished before it was cancelled
            return await self._publish_finished(group_index, rollout_id, sample_index, prompt,
                                                before, before.status, finished_under, ids)
        budget = self.config.max_new_tokens - len(before.tokens)
        if budget <= 0:  # Miles: no budget left is truncated, without a request
            return await self._publish_finished(group_index, rollout_id, sample_index, prompt,
                                                before, "truncated", finished_under, ids)
        engine = self.engines[sample_index % len(self.engines)]
        request_id = f"{self.config.run}-g{group_index}-r{rollout_id}-{uuid.uuid4().hex[:8]}"
        generation: Generation | None = None
        async with self._slots:
            await self._serving.wait()
            weight_version = self.weight_version
            if step in self._sealed:
                self._cancelled.add(request_id)  # sealed before it was sent: never send it
            else:
                self._in_flight[step].add(request_id)
                self.progress.in_flight += 1
                try:
                    generation = await engine.generate(
                        [*prompt.tokens, *before.tokens],
                        dataclasses.replace(self._sampling_for(sample_index),
                                            max_new_tokens=budget),
                        request_id)
                except EngineError as err:
                    if request_id not in self._cancelled:
                        self._engine_failed(str(err))
                finally:
                    self.progress.in_flight -= 1
                    self._in_flight[step].discard(request_id)
        now = before if generation is None else PartialSample(
            rollout_id=rollout_id, status="cancelled",
            tokens=[*before.tokens, *generation.tokens],
            log_probs=[*before.log_probs, *generation.log_probs],
            versions=[*before.versions, *[weight_version] * len(generation.tokens)])
        if request_id in self._cancelled and (generation is None
                                              or generation.status == "aborted"):
            self.publisher.sample_aborted(
                self.config.run, group_index=group_index, rollout_id=rollout_id,
                reason="cancelled", response_tokens=now.tokens or None,
                recyclable=self.partial is not None, event_id=ids("aborted", rollout_id))
            self.progress.samples_cancelled += 1
            return None, now.model_copy(
                update={"status": "cancelled" if now.tokens else "unsent"})
        if generation is None or generation.status == "aborted":
            if generation is not None:
                self._engine_failed(f"{engine.name} at {engine.url} aborted {request_id}")
            self.publisher.sample_aborted(
                self.config.run, group_index=group_index, rollout_id=rollout_id,
                reason="engine_error", response_tokens=now.tokens or None,
                event_id=ids("aborted", rollout_id))
            self.progress.samples_aborted += 1
            return None, None
        return await self._publish_finished(group_index, rollout_id, sample_index, prompt, now,
                                            generation.status, weight_version, ids)

    def _sampling_for(self, sample_index: int) -> Sampling:
        if self.config.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.config.seed * 2**32 + sample_index)

    def _engine_failed(self, message: str) -> None:
        self.progress.engine_errors += 1
        self.progress.last_engine_error = message
        log.warning("engine error: %s", message)

    async def _publish_finished(self, group_index: int, rollout_id: int, sample_index: int,
                                prompt: Prompt, response: PartialSample, status: FinishStatus,
                                weight_version: int, ids: EventIds
                                ) -> tuple[RewardSample, PartialSample]:
        """Score and publish a finished sample. `response` holds all its response tokens;
        with --mask-offpolicy-in-partial-rollout those of weights older than
        `weight_version` (a continued rollout's) get loss mask 0."""
        tokens, log_probs, versions = response.tokens, response.log_probs, response.versions
        mask = loss_mask(versions, weight_version,
                         mask_offpolicy=self.config.mask_offpolicy_in_partial_rollout)
        oldest = min(versions, default=weight_version)  # Miles' oldest_weight_version
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        sample = RewardSample(
            group_index=group_index, index=sample_index, rollout_id=rollout_id,
            status=SampleStatus(status), prompt=prompt.text, label=prompt.label,
            tokens=[*prompt.tokens, *tokens], response_length=len(tokens), loss_mask=mask,
            rollout_log_probs=list(log_probs),
            weight_versions=sorted(set(versions)) or [weight_version],
            metadata=dict(prompt.metadata), response=text)
        # With --group-rm the reward follows in a `reward` event once the group is scored.
        scored = {} if self.config.group_rm else {
            "reward": await score(self.reward_fn, self.reward_args, sample)}
        self.publisher.sample_finished(
            self.config.run, group_index=group_index, rollout_id=rollout_id,
            status=status, prompt_tokens=prompt.tokens, response_tokens=tokens,
            loss_mask=mask, rollout_log_probs=log_probs, **scored, sample_index=sample_index,
            weight_version=oldest, response_text=text, event_id=ids("finished", rollout_id))
        self.progress.samples_finished += 1
        self.progress.response_tokens += len(tokens)
        return sample, response.model_copy(update={"status": status})

    async def _draw(self) -> None:
        """Redraw the progress line on the terminal, cut to its width."""
        console = Console(file=self.terminal)
        with Live(self._progress_text(), console=console,
                  auto_refresh=False, redirect_stdout=False) as live:
            while True:
                live.update(self._progress_text(), refresh=True)
                try:
                    await asyncio.sleep(PROGRESS_INTERVAL_S)
                except asyncio.CancelledError:
                    live.update(self._progress_text(), refresh=True)
                    raise

    def _progress_text(self) -> Text:
        return Text(self.progress.line(self._step), no_wrap=True, overflow="ellipsis")
