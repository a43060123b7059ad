"""Prompts from a local JSONL dataset, read with the gateway's Miles row semantics.

Rows map to prompts as in Miles (`--input-key`, `--label-key`, `--metadata-key`); unlike
Miles, a bad line is an error naming its line, not skipped silently. Group `g` takes row
`g mod rows`: epochs in file order, so a worker restarted at a later step picks up the
same prompts for the same group indexes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ingest.core.dataset_rows import BadRow, DatasetOptions, convert_row, jsonl_objects
from ingest.io.kafka import MAX_EVENT_BYTES
from schemas.errors import ConfigError


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
