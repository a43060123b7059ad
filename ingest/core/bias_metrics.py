"""Bias-aware step metrics: what the filtered reward curves leave out.

With dynamic sampling, a step seals as soon as it holds `rollout_batch_size` kept groups
and the workers cancel the rest. The cancelled requests are the slowest ones, with the
longest answers, which mostly score 0, so every reward counted over decided groups
(`rollout/raw_reward_unfiltered` included) leans high. These keys make that visible:

- `rollout/cancelled/groups`, `rollout/cancelled/samples`,
  `rollout/cancelled/mean_partial_response_length`: groups decided `cancelled_at_seal`,
  their cancelled (aborted) fragments, and how long those fragments had grown.
- `rollout/completion_bias`: (issued - finished) / issued, the share of the step's issued
  prompt groups that never finished on their own (cancelled at seal, timed out, or still
  undecided when the step was reported). 0 means the step's rewards saw every prompt.
- `rollout/response_len_kept/mean`, `rollout/response_len_dropped/mean`: per-fragment
  response length of kept groups vs groups the filter chain dropped (cancelled groups are
  counted apart above, surplus groups are in neither: they passed the filter).

A key with nothing to average is absent rather than 0, like the Miles keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ingest.core.reasons import CANCELLED_AT_SEAL, GROUP_TIMEOUT

# A group decided by timeout never finished either; it counts against completion.
UNFINISHED_REASONS = frozenset({CANCELLED_AT_SEAL, GROUP_TIMEOUT})


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One group decided into a step, as the bias metrics read it.

    `response_lengths` and `statuses` have one entry per fragment row of the group (the
    `samples` table: an aborted rollout contributes its partial fragment, status
    `aborted`).
    """

    decision: str  # kept / dropped / surplus
    reason: str | None
    response_lengths: Sequence[int]
    statuses: Sequence[str]
    cancelled_at_seal: bool = False

    @property
    def finished(self) -> bool:
        return not self.cancelled_at_seal and self.reason not in UNFINISHED_REASONS


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def bias_metrics(groups: Iterable[GroupSummary], *, groups_issued: int) -> dict[str, float]:
    """Extra `step_metrics` for the groups decided into one step.

    `groups_issued` is the step's `rollout/prompts_issued`: prompt groups sent to the
    workers for this step, finished or not.
    """
    groups = list(groups)
    cancelled = [g for g in groups if g.cancelled_at_seal]
    partial = [
        length
        for g in cancelled
        for length, status in zip(g.response_lengths, g.statuses, strict=True)
        if status == "aborted"
    ]
    kept = [n for g in groups if g.decision == "kept" for n in g.response_lengths]
    dropped = [
        n
        for g in groups
        if g.decision == "dropped" and not g.cancelled_at_seal
        for n in g.response_lengths
    ]
    out = {
        "rollout/cancelled/groups": float(len(cancelled)),
        "rollout/cancelled/samples": float(len(partial)),
    }
    optional = {
        "rollout/cancelled/mean_partial_response_length": _mean(partial),
        "rollout/response_len_kept/mean": _mean(kept),
        "rollout/response_len_dropped/mean": _mean(dropped),
    }
    if groups_issued > 0:
        finished = sum(g.finished for g in groups)
        # Not clamped: a negative value means more groups were decided into the step than
        # were issued for it, an accounting error worth seeing on the dashboard.
        optional["rollout/completion_bias"] = (groups_issued - finished) / groups_issued
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
