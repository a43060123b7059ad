"""Miles `Sample` objects as rolloutlake events: a Miles rollout function publishes its groups.

Duck-typed on the attributes of Miles' `miles/utils/types.py` `Sample` (`group_index`,
`index`, `rollout_id` when it has one, `prompt`, `label`, `tokens`, `response_length`,
`response`, `loss_mask`, `rollout_log_probs`, `reward`, `status`, `weight_versions`,
`remove_sample`, `metadata`), so Miles need not be importable here:

    from ingest.sdk.miles import miles_run_config, publish_miles_group

    publisher = RolloutPublisher("127.0.0.1:9092", producer_id="miles")
    publisher.run_started(run, miles_run_config(args))
    for group in groups:                   # list[list[Sample]], as a rollout function has them
        publish_miles_group(publisher, run, group, step=rollout_id)

A group is one `group_started` and, per sample, a `sample_finished` (status `completed` or
`truncated`, reward included, so a null reward is a failed scoring) or a `sample_aborted`
(status `aborted` or `failed`: Miles trains a failed sample, the contract has no such
status, so its group is dropped as `group_has_aborted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

from ingest.sdk.publisher import RolloutPublisher, build_event
from schemas.errors import EventValidationError
from schemas.events import AnyEvent

FINISHED = ("completed", "truncated")
ABORTED = ("aborted", "failed")
RUN_CONFIG_ARGS = ("n_samples_per_prompt", "rollout_batch_size", "over_sampling_batch_size",
                   "dynamic_sampling_filter_path", "reward_key", "advantage_estimator",
                   "partial_rollout")


def miles_run_config(args: Any) -> dict[str, Any]:
    """The `run_started` config of a Miles `args` namespace: the batch, filter and reward
    settings it has (unset ones take the contract's defaults)."""
    return {name: getattr(args, name) for name in RUN_CONFIG_ARGS
            if getattr(args, name, None) is not None}


def miles_group_events(run_id: str, samples: Sequence[Any], *, step: int,
                       producer_id: str | None = None) -> list[AnyEvent]:
    """The validated events of one Miles group, `group_started` first. Raises
    EventValidationError naming the sample and what is wrong with it."""
    if not samples:
        raise EventValidationError("a Miles group needs at least one sample", field="samples")
    group_index = samples[0].group_index
    first = samples[0]
    events = [build_event("group_started", run_id, producer_id=producer_id,
                          group_index=group_index, step=step, n_samples=len(samples),
                          prompt=first.prompt, label=first.label)]
    seen: set[int] = set()
    for position, sample in enumerate(samples):
        where = f"Miles sample {position} of group {group_index}"
        if sample.group_index != group_index:
            raise EventValidationError(f"{where}: group_index {sample.group_index} is not the "
                                       f"group's {group_index}", field="group_index")
        rollout_id = getattr(sample, "rollout_id", None)
        rollout_id = position if rollout_id is None else rollout_id
        if rollout_id in seen:
            raise EventValidationError(f"{where}: rollout_id {rollout_id} appears twice",
                                       field="rollout_id")
        seen.add(rollout_id)
        events.append(_sample_event(run_id, sample, group_index, rollout_id, where,
                                    producer_id))
    return events


def publish_miles_group(publisher: RolloutPublisher, run_id: str, samples: Sequence[Any], *,
                        step: int) -> list[AnyEvent]:
    """Validate the whole group, then publish it (nothing is sent when a sample is bad)."""
    events = miles_group_events(run_id, samples, step=step, producer_id=publisher.producer_id)
    for event in events:
        publisher.publish(event)
    return events


def _sample_event(run_id: str, sample: Any, group_index: int, rollout_id: int, where: str,
                  producer_id: str | None) -> AnyEvent:
    status = str(getattr(sample.status, "value", sample.status))
    tokens = list(sample.tokens)
    response_length = sample.response_length
    if not 0 <= response_length <= len(tokens):
        raise EventValidationError(f"{where}: response_length {response_length} is not within "
                                   f"its {len(tokens)} tokens", field="response_length")
    cut = len(tokens) - response_length
    prompt_tokens, response_tokens = tokens[:cut], tokens[cut:]
    common = {"group_index": group_index, "rollout_id": rollout_id}
    if status in ABORTED:
        return build_event("sample_aborted", run_id, producer_id=producer_id, **common,
                           reason=status, response_tokens=response_tokens or None)
    if status not in FINISHED:
        raise EventValidationError(f"{where}: status {status!r} was never generated; a rollout "
                                   f"publishes {', '.join(FINISHED + ABORTED)} samples",
                                   field="status")
    loss_mask = sample.loss_mask
    if getattr(sample, "remove_sample", False):  # Miles zeroes the mask of a removed sample
        loss_mask = [0] * response_length
    fields: dict[str, Any] = {
        **common, "status": status, "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens, "reward": _reward(sample.reward),
        "sample_index": sample.index, "response_text": sample.response or None,
        "loss_mask": loss_mask, "rollout_log_probs": sample.rollout_log_probs,
        "weight_version": _oldest_version(sample.weight_versions, where),
        "metadata": sample.metadata or None,
    }
    optional = ("sample_index", "response_text", "loss_mask", "rollout_log_probs",
                "weight_version", "metadata")
    try:
        return build_event("sample_finished", run_id, producer_id=producer_id,
                           **{k: v for k, v in fields.items()
                              if not (k in optional and v is None)})
    except EventValidationError as err:
        raise EventValidationError(f"{where}: {err}", field=err.field,
                                   event_type="sample_finished") from None


def _reward(value: Any) -> Any:
    """A numpy or torch scalar reward as the plain number the contract carries."""
    if isinstance(value, Real) and not isinstance(value, bool | int | float):
        return float(value)
    return value


def _oldest_version(versions: Sequence[Any], where: str) -> int | None:
    """Miles' `oldest_weight_version`: the staleness the processor checks is the oldest's."""
    try:
        return min((int(v) for v in versions), default=None)
    except (TypeError, ValueError):
        raise EventValidationError(f"{where}: weight_versions {list(versions)!r} are not all "
                                   "integers", field="weight_versions") from None
