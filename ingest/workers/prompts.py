"""Prompt groups for the rollout loop: a local JSONL dataset, or the gateway's prompt API.

Dataset: rows map to prompts as in Miles (`--input-key`, `--label-key`, `--metadata-key`);
unlike Miles, a bad line is an error naming its line, not skipped silently. Group `g`
takes row `g mod rows`: epochs in file order, so a worker restarted at a later step picks
up the same prompts for the same group indexes.

Gateway (`--prompts-from URL`): `POST /v1/runs/{run}/prompts?count=N&step=S` hands out
the next N groups of the run's dataset with the same Miles semantics (seeded shuffle per
epoch, recycled groups first, a cursor that survives restarts); the gateway numbers the
groups and publishes their `group_started` itself. With partial rollout the worker
recycles cancelled groups there (`POST .../prompts/recycle`) with what their samples had
generated, and a recycled group comes back with those samples (`PartialSample`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from ingest.core.dataset_rows import BadRow, DatasetOptions, convert_row, jsonl_objects
from ingest.io.kafka import MAX_EVENT_BYTES
from schemas.errors import ConfigError, RolloutlakeError

log = logging.getLogger(__name__)

RECYCLE_ATTEMPTS = 5
RECYCLE_RETRY_S = 2.0


@dataclass(frozen=True)
class Prompt:
    text: str
    label: Any
    metadata: dict[str, Any]
    tokens: list[int]


def load_prompts(path: Path, options: DatasetOptions, tokenizer: Any) -> list[Prompt]:
    """Every row of the file, tokenized without special tokens (as the trainer sees them)."""
    rows: list[tuple[str, Any, dict[str, Any]]] = []
    for line_no, obj in jsonl_objects(path, MAX_EVENT_BYTES):
        try:
            if isinstance(obj, BadRow):
                raise obj
            prompt, label, metadata, _ = convert_row(obj, options)
        except BadRow as err:
            raise ConfigError(f"--prompt-data: {path} line {line_no}: {err}") from None
        text = orjson.loads(prompt)
        if not isinstance(text, str):
            raise ConfigError(f"--prompt-data: {path} line {line_no}: the worker takes string "
                              f"prompts; {options.input_key!r} holds chat messages")
        rows.append((text, None if label is None else orjson.loads(label), orjson.loads(metadata)))
    if not rows:
        raise ConfigError(f"--prompt-data: {path} holds no prompts")
    encoded = tokenizer([text for text, _, _ in rows], add_special_tokens=False)["input_ids"]
    return [Prompt(text, label, metadata, list(tokens))
            for (text, label, metadata), tokens in zip(rows, encoded, strict=True)]


@dataclass(frozen=True)
class PartialSample:
    """What one sample has generated so far, over one or more steps (partial rollout)."""

    status: str  # completed, truncated, or aborted (to be continued)
    tokens: list[int]
    log_probs: list[float]
    segments: list[tuple[int, int]]  # (tokens, weight version that generated them), in order
    start_rollout_id: int  # the step that first generated it

    def to_api(self, group_index: int, rollout_id: int) -> dict[str, Any]:
        """The gateway's `RecycledSample`."""
        return {"group_index": group_index, "rollout_id": rollout_id, "status": self.status,
                "response_tokens": self.tokens, "rollout_log_probs": self.log_probs,
                "loss_mask": [1] * len(self.tokens),
                "segments": [{"tokens": n, "weight_version": v} for n, v in self.segments],
                "start_rollout_id": self.start_rollout_id}

    @classmethod
    def from_api(cls, sample: dict[str, Any]) -> PartialSample:
        return cls(sample["status"], sample["response_tokens"], sample["rollout_log_probs"],
                   [(s["tokens"], s["weight_version"]) for s in sample["segments"]],
                   sample["start_rollout_id"])


@dataclass(frozen=True)
class IssuedGroup:
    group_index: int
    prompt: Prompt
    started: bool  # its group_started is already published (by the gateway)
    recycled_from: int | None = None
    resumed: dict[int, PartialSample] = field(default_factory=dict)  # rollout id -> sample


class DatasetPrompts:
    """Group `g` takes row `g mod rows` of the dataset file."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts = prompts

    async def take(self, step: int, group_indexes: list[int]) -> list[IssuedGroup]:
        return [IssuedGroup(g, self.prompts[g % len(self.prompts)], started=False)
                for g in group_indexes]

    async def aclose(self) -> None:
        pass


class GatewayPrompts:
    """The run's next prompt groups from `POST /v1/runs/{run}/prompts`: as many as
    `group_indexes` asks for, numbered by the gateway (its cursor serves every worker of
    the run)."""

    def __init__(self, url: str, run: str, token: str | None, tokenizer: Any,
                 n_samples: int, timeout_s: float = 60.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                        timeout=timeout_s)
        self.run = run
        self.tokenizer = tokenizer
        self.n_samples = n_samples

    async def take(self, step: int, group_indexes: list[int]) -> list[IssuedGroup]:
        path = f"/v1/runs/{self.run}/prompts"
        try:
            answer = await self.client.post(path, params={"count": len(group_indexes),
                                                          "step": step})
        except httpx.HTTPError as err:
            raise RolloutlakeError(f"--prompts-from: no answer from {self.client.base_url}: "
                                   f"{err}") from None
        if answer.status_code != 200:
            raise RolloutlakeError(f"--prompts-from: POST {path} answered "
                                   f"{answer.status_code}: {answer.text[:300]}")
        groups = answer.json()["groups"]
        for group in groups:
            if not isinstance(group["prompt"], str):
                raise RolloutlakeError(f"--prompts-from: group {group['group_index']} holds "
                                       "chat messages; the worker takes string prompts")
            if group["n_samples"] != self.n_samples:
                raise RolloutlakeError(
                    f"--prompts-from: the run serves {group['n_samples']} samples per prompt,"
                    f" the worker was given --n-samples-per-prompt {self.n_samples}")
        encoded = self.tokenizer([g["prompt"] for g in groups],
                                 add_special_tokens=False)["input_ids"] if groups else []
        return [IssuedGroup(g["group_index"],
                            Prompt(g["prompt"], g["label"], g["metadata"], list(tokens)),
                            started=True, recycled_from=g.get("recycled_from"),
                            resumed={s["rollout_id"]: PartialSample.from_api(s)
                                     for s in g.get("samples", [])})
                for g, tokens in zip(groups, encoded, strict=True)]

    async def recycle(self, group_index: int, samples: dict[int, PartialSample]) -> bool:
        """Queue the group to be served again with its samples; durable at the gateway
        when it returns True. Retried while the gateway is unreachable or restarting."""
        path = f"/v1/runs/{self.run}/prompts/recycle"
        body = {"group_indices": [group_index],
                "samples": [s.to_api(group_index, r) for r, s in sorted(samples.items())]}
        for attempt in range(1, RECYCLE_ATTEMPTS + 1):
            try:
                answer = await self.client.post(path, json=body)
            except httpx.HTTPError as err:
                problem = f"no answer ({err})"
            else:
                if answer.status_code == 200:
                    return True
                problem = f"answered {answer.status_code}: {answer.text[:300]}"
                if answer.status_code < 500:
                    break  # refused: asking again gets the same answer
            if attempt < RECYCLE_ATTEMPTS:
                await asyncio.sleep(RECYCLE_RETRY_S)
        log.warning("could not recycle group %d at %s: POST %s %s; its partial samples are "
                    "dropped", group_index, self.client.base_url, path, problem)
        return False

    async def aclose(self) -> None:
        await self.client.aclose()


PromptSource = DatasetPrompts | GatewayPrompts
