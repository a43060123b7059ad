"""One dataset row with Miles data-source semantics (MILES_SEMANTICS.md section 3): the
keys that pick prompt, label, metadata and tools, and the JSONL reader that reports bad
lines instead of skipping them. Shared by the gateway's dataset store and the worker's
local dataset file, so both read a row the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True)
class DatasetOptions:
    """Miles `--input-key`, `--label-key`, `--metadata-key`, `--tool-key`, slice, max length."""

    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str = "metadata"
    tool_key: str | None = "tools"
    start: int | None = None
    end: int | None = None
    max_prompt_len: int | None = None
    tokenizer: str | None = None


class BadRow(ValueError):
    """One dataset row that cannot become a prompt; the message says why."""


def dump_json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError as err:
        raise BadRow(f"value is not JSON-serializable: {err}") from None


def convert_row(obj: Any, opts: DatasetOptions) -> tuple[str, str | None, str, str]:
    """One source row -> (prompt, label, metadata) as JSON, and the text to measure."""
    if not isinstance(obj, dict):
        raise BadRow(f"row is a JSON {type(obj).__name__}, not an object")
    if opts.input_key not in obj:
        raise BadRow(f"missing input key {opts.input_key!r}")
    prompt = obj[opts.input_key]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        text = "\n".join(m["content"] for m in prompt if isinstance(m.get("content"), str))
    else:
        raise BadRow(f"input key {opts.input_key!r} must be a string or a list of chat messages")
    label = None
    if opts.label_key is not None:
        if opts.label_key not in obj:
            raise BadRow(f"missing label key {opts.label_key!r}")
        label = dump_json(obj[opts.label_key])
    metadata = obj.get(opts.metadata_key) or {}
    if not isinstance(metadata, dict):
        raise BadRow(f"metadata key {opts.metadata_key!r} must be an object")
    if opts.tool_key is not None and obj.get(opts.tool_key) is not None:
        tools = obj[opts.tool_key]
        if isinstance(tools, str):
            try:
                tools = orjson.loads(tools)
            except orjson.JSONDecodeError:
                raise BadRow(f"tool key {opts.tool_key!r} is a string but not JSON") from None
        if not isinstance(tools, list):
            raise BadRow(f"tool key {opts.tool_key!r} must be a list (or a JSON string of one)")
        metadata = {**metadata, "tools": tools}
    return dump_json(prompt), label, dump_json(metadata), text


def jsonl_objects(path: Path, line_limit: int) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object or BadRow) per non-blank line, reading at most
    `line_limit` bytes of any line into memory."""
    with path.open("rb") as f:
        line_no = 0
        while True:
            line = f.readline(line_limit + 1)
            if not line:
                return
            line_no += 1
            if len(line) > line_limit and not line.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass  # drain the rest of the overlong line without keeping it
                yield line_no, BadRow(f"line is longer than {line_limit} bytes")
                continue
            stripped = line.strip()
            if not stripped:
                continue
            try:
                stripped.decode("utf-8")
            except UnicodeDecodeError as err:
                yield line_no, BadRow(f"not valid UTF-8 (byte {err.start})")
                continue
            try:
                yield line_no, orjson.loads(stripped)
            except orjson.JSONDecodeError as err:
                yield line_no, BadRow(f"not valid JSON: {err}")
