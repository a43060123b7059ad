"""A stand-in for Miles' `miles/utils/types.py` `Sample`: its attributes, not its code."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)


def miles_sample(group_index: int, index: int, *, prompt_tokens: list[int],
                 response_tokens: list[int], status: Any = Sample.Status.COMPLETED,
                 **fields: Any) -> Sample:
    """A generated sample: `tokens` is prompt + response, as Miles keeps them."""
    fields.setdefault("rollout_log_probs", [-0.25] * len(response_tokens))
    return Sample(group_index=group_index, index=index,
                  tokens=[*prompt_tokens, *response_tokens],
                  response_length=len(response_tokens), status=status, **fields)
