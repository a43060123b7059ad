"""User filters loaded by dotted path in the end-to-end tests (Miles signature)."""

from __future__ import annotations

from ingest.core.filters import FilterOutput


def explode_on_group_3(args, samples, **kwargs):
    """Keeps every group but raises on group 3, like a buggy user filter would."""
    first = samples[0][0] if isinstance(samples[0], list) else samples[0]
    if first.group_index == 3:
        raise ValueError("reward model returned garbage for group 3")
    return FilterOutput(keep=True)


def drop_long(args, samples, **kwargs):
    """Drops groups whose mean response length exceeds args.max_len (an extra run key)."""
    flat = [s for x in samples for s in (x if isinstance(x, list) else [x])]
    mean = sum(s.response_length for s in flat) / len(flat)
    return FilterOutput(keep=mean <= args.max_len, reason="too_long")


def reason_not_utf8(args, samples, **kwargs):
    """Drops every group with a reason no JSON encoder writes (a lone surrogate)."""
    return FilterOutput(keep=False, reason="bad\udc80reason")


def keep_boxed_answers(args, samples, **kwargs):
    """A Miles-style filter over the generated text: keep groups where some response has a
    boxed answer."""
    flat = [s for x in samples for s in (x if isinstance(x, list) else [x])]
    keep = any("\\boxed{" in s.response for s in flat)
    return FilterOutput(keep=keep, reason=None if keep else "no_answer")
