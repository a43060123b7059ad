"""The group filter chain (CONTRACT section 3) and the Miles-compatible filter interface.

Owns: `FilterOutput`, the `MilesSample` / `FilterArgs` objects user filters receive,
loading a filter from its dotted path, the built-in DAPO filter `reward_nonzero_std`,
and `apply_filter_chain`, which decides keep/drop for one complete group. Pure: no
Kafka, Delta or HTTP; the caller dead-letters a group whose user filter raises.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from ingest.core.model import FilterVerdict, Fragment, Group, Rollout
from ingest.core.reasons import GROUP_HAS_ABORTED, GROUP_HAS_MISSING_REWARD, ZERO_STD_PREFIX
from ingest.core.rewards import is_missing_reward, reward_value
from schemas.dotted import load_callable
from schemas.events import DAPO_FILTER_PATH, RunConfig, resolve_filter_path

# float64 unbiased std at or below this is "zero" (Miles apply_reward_nonzero_std_filter).
ZERO_STD_EPS = 1e-8


@dataclass(slots=True)
class FilterOutput:
    """What a dynamic sampling filter returns (Miles `FilterOutput`)."""

    keep: bool
    reason: str | None = None


DynamicFilterOutput = FilterOutput


class SampleStatus(StrEnum):
    """Miles `Sample.Status`; a str, so `s.status == "aborted"` holds as well."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(slots=True)
class MilesSample:
    """One training sample as Miles user filters see it (a subset of `miles.utils.types.Sample`).

    Built fresh for every filter call from copies, so a filter that mutates it cannot
    change the processor's state.
    """

    Status = SampleStatus

    group_index: int
    index: int | None
    rollout_id: int
    status: SampleStatus
    reward: Any = None
    prompt: Any = ""
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response: str = ""  # the `response_text` of the rollout's sample_finished
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    remove_sample: bool = False

    @property
    def effective_response_length(self) -> int:
        return self.response_length if self.loss_mask is None else sum(self.loss_mask)

    def get_reward_value(self, args: Any) -> Any:
        """`reward`, or `reward[args.reward_key]` (KeyError when the dict lacks it)."""
        return reward_value(self.reward, getattr(args, "reward_key", None))


class FilterArgs:
    """The `args` namespace user filters get: every run config field plus its unknown keys."""

    def __init__(self, **values: Any):
        self.__dict__.update(values)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FilterArgs:
        values: dict[str, Any] = dict(cfg.extra_args)
        values.update({name: getattr(cfg, name) for name in type(cfg).model_fields})
        # Miles resolves the default after parsing, so filters see a number, never None.
        values["over_sampling_batch_size"] = cfg.effective_over_sampling_batch_size
        return cls(**values)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in sorted(self.__dict__.items()))
        return f"FilterArgs({body})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FilterArgs) and self.__dict__ == other.__dict__


# ---------------------------------------------------------------- Miles sample views


def _as_list(values: Any) -> list[Any] | None:
    return None if values is None else np.asarray(values).tolist()


def _sample(group: Group, rollout: Rollout, status: SampleStatus, fragment: Fragment | None,
            tokens_too: bool = True) -> MilesSample:
    metadata = {**group.metadata, **rollout.metadata}
    tokens: list[int] = []
    loss_mask = log_probs = None
    if fragment is not None:
        metadata.update(fragment.metadata)
        if tokens_too:
            # Miles samples hold Python lists; the fragment's arrays are read-only numpy.
            tokens = np.concatenate([np.asarray(fragment.prompt_tokens, np.int64),
                                     np.asarray(fragment.response_tokens, np.int64)]).tolist()
            loss_mask = _as_list(fragment.loss_mask)
            log_probs = _as_list(fragment.rollout_log_probs)
    return MilesSample(
        group_index=group.group_index,
        index=rollout.sample_index,
        rollout_id=rollout.rollout_id,
        status=status,
        reward=copy.deepcopy(rollout.reward),
        prompt=copy.deepcopy(group.prompt) if group.prompt is not None else "",
        label=copy.deepcopy(group.label),
        tokens=tokens,
        response="" if fragment is None else fragment.response_text or "",
        response_length=0 if fragment is None else fragment.response_length,
        loss_mask=loss_mask,
        rollout_log_probs=log_probs,
        weight_versions=[] if rollout.weight_version is None else [rollout.weight_version],
        metadata=copy.deepcopy(metadata),
    )


def miles_group(group: Group, *, tokens_too: bool = True) -> list[MilesSample | list[MilesSample]]:
    """The group in Miles nesting: one element per rollout, a list for compacted rollouts.

    Every fragment carries its rollout's reward and status. A rollout with no fragment (an
    abort before any output) is one empty sample. Raises ValueError for an unfinished
    rollout: only decided-complete groups reach the filter chain. `tokens_too=False`
    leaves `tokens`, `loss_mask` and `rollout_log_probs` empty, for a filter that reads
    rewards only: they are Python lists, a Python object per token.
    """
    out: list[MilesSample | list[MilesSample]] = []
    for rollout in group.ordered_rollouts():
        if rollout.status is None:
            raise ValueError(
                f"group {group.group_index}: rollout {rollout.rollout_id} is not finished"
            )
        status = SampleStatus(rollout.status)
        fragments = rollout.ordered_fragments()
        if len(fragments) <= 1:
            out.append(_sample(group, rollout, status, fragments[0] if fragments else None,
                               tokens_too))
        else:
            out.append([_sample(group, rollout, status, f, tokens_too) for f in fragments])
    return out


def flatten(samples: Iterable[MilesSample | list[MilesSample]]) -> list[MilesSample]:
    """Miles flattening: `[s0, [s1, s2], s3]` -> `[s0, s1, s2, s3]`."""
    flat: list[MilesSample] = []
    for item in samples:
        if isinstance(item, list):
            flat.extend(item)
        else:
            flat.append(item)
    return flat


# ---------------------------------------------------------------- built-in DAPO filter


def reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> FilterOutput:
    """DAPO dynamic sampling: keep iff the float64 unbiased std of all rewards is > 1e-8.

    Rewards are every flattened fragment's, in order. A drop's reason is
    `zero_std_{round(first_reward, 1)}`; Python `round` keeps the type, so int 0 gives
    `zero_std_0` and 0.0 gives `zero_std_0.0`. One fragment has NaN std and is dropped.
    """
    rewards = [s.get_reward_value(args) for s in flatten(samples)]
    if not rewards:
        raise ValueError("reward_nonzero_std got an empty group")
    values = np.asarray(rewards, dtype=np.float64)
    # ddof=1 on one value is NaN (with a numpy warning); NaN > eps is False: dropped.
    std = float(np.std(values, ddof=1)) if values.size > 1 else float("nan")
    if std > ZERO_STD_EPS:
        return FilterOutput(keep=True)
    return FilterOutput(keep=False, reason=f"{ZERO_STD_PREFIX}{round(rewards[0], 1)}")


# ---------------------------------------------------------------- loading user filters

_FILTER_CACHE: dict[str, Callable[..., Any]] = {}
_CACHE_LOCK = threading.Lock()


def load_filter(path: str | None) -> Callable[..., Any] | None:
    """The callable a `dynamic_sampling_filter_path` names; None for no filter.

    Dotted `module.func` (split at the last dot, as Miles does) or `module:func`. The Miles
    DAPO paths map to `reward_nonzero_std`. Raises FilterLoadError with one readable line.
    Successful loads are cached per path; failures are not, so a fixed module loads later.
    """
    if path is None:
        return None
    path = path.strip()
    if resolve_filter_path(path) == DAPO_FILTER_PATH:
        return reward_nonzero_std
    with _CACHE_LOCK:
        cached = _FILTER_CACHE.get(path)
    if cached is not None:
        return cached
    fn = load_callable(path, "filter")
    with _CACHE_LOCK:
        _FILTER_CACHE[path] = fn
    return fn


def clear_filter_cache() -> None:
    """Forget loaded filters (tests; a run whose filter module changed on disk)."""
    with _CACHE_LOCK:
        _FILTER_CACHE.clear()


# ---------------------------------------------------------------- the chain


def _user_verdict(result: Any, fn: Callable[..., Any]) -> FilterVerdict:
    if isinstance(result, bool | np.bool_):
        keep, reason = bool(result), None
    elif isinstance(result, FilterOutput) or (
        hasattr(result, "keep") and hasattr(result, "reason")
    ):
        # Duck-typed so a filter returning another FilterOutput class (Miles' own) works.
        keep, reason = bool(result.keep), result.reason
    else:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"dynamic sampling filter {name} returned {type(result).__name__}; "
            "expected bool or FilterOutput"
        )
    if reason is not None:
        reason = str(reason) or None  # an empty reason is no reason
    return FilterVerdict(keep, reason, counted=keep or reason is not None)


def apply_filter_chain(
    args: Any, group: Group, user_filter: Callable[..., Any] | None, **kwargs: Any
) -> FilterVerdict:
    """Decide one complete group; the first failing step decides (Miles apply_preput_filters).

    1. any aborted rollout -> `group_has_aborted` (the batch stage makes it
       `cancelled_at_seal` when the seal cut the group short: `ingest.core.decide`);
    2. any missing reward (null, object without `reward_key`, null value) ->
       `group_has_missing_reward`;
    3. `user_filter(args, miles_group(group), **kwargs)`, called exactly once; a bool or a
       FilterOutput. A drop without a reason is not counted in metrics. Its exceptions
       propagate: the caller dead-letters the group.
    """
    if any(r.aborted for r in group.rollouts.values()):
        return FilterVerdict(False, GROUP_HAS_ABORTED)
    reward_key = getattr(args, "reward_key", None)
    if any(is_missing_reward(r.reward, reward_key) for r in group.rollouts.values()):
        return FilterVerdict(False, GROUP_HAS_MISSING_REWARD)
    if user_filter is None:
        return FilterVerdict(True)
    # The built-in DAPO filter reads rewards only: its samples go without token lists.
    samples = miles_group(group, tokens_too=user_filter is not reward_nonzero_std)
    return _user_verdict(user_filter(args, samples, **kwargs), user_filter)
