"""Datasets: upload (JSONL or Parquet, raw body or multipart) and versioned reads."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import pyarrow.compute as pc
from deltalake import DeltaTable
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from gateway.datasets import (
    SLICE,
    DatasetStore,
    DatasetUploaded,
    format_of,
    parse_slice,
)
from gateway.deps import INT64_MAX, ConfigDep, DatasetNamePath, DatasetsDep, ReadGlobal, WriteGlobal
from gateway.errors import ApiError
from gateway.responses import AUTH, errors
from ingest.core.dataset_rows import DatasetOptions

router = APIRouter(tags=["datasets"])

CHUNK = 1024 * 1024


class DatasetVersion(BaseModel):
    version: int
    timestamp: int | None
    options: dict[str, Any] | None


class DatasetInfo(BaseModel):
    name: str
    version: int
    rows: int
    history: list[DatasetVersion]


class DatasetRows(BaseModel):
    name: str
    version: int
    rows: list[dict[str, Any]]


_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-ndjson": {"schema": {"type": "string"}},
            "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["file"],
                "properties": {"file": {"type": "string", "format": "binary"}},
            }},
        },
    }
}


async def _spool_upload(request: Request, target: Path, filename: str | None) -> str | None:
    """Stream the body (or its multipart `file` part) to `target`; returns the filename."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        async with request.form(max_files=1, max_fields=0) as form:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(422, "multipart upload needs a file part named 'file'")
            with target.open("wb") as out:
                while chunk := await upload.read(CHUNK):
                    out.write(chunk)
            return filename or upload.filename
    with target.open("wb") as out:
        async for chunk in request.stream():
            out.write(chunk)
    return filename


@router.post("/v1/datasets/{name}", status_code=201, openapi_extra=_UPLOAD_DOC,
             responses=errors(*AUTH, described={
                 413: "Upload over the configured dataset size limit.",
                 415: "Not a .jsonl or .parquet file.",
                 422: "No usable rows, bad options, or an unknown tokenizer.",
             }))
async def upload_dataset(
    name: DatasetNamePath, request: Request, _: WriteGlobal, config: ConfigDep,
    datasets: DatasetsDep,
    input_key: str = "input",
    label_key: str | None = None,
    metadata_key: str = "metadata",
    tool_key: str | None = "tools",
    slice: Annotated[str | None, Query(description="`@[start:end]`, negative bounds allowed.",
                                       json_schema_extra={"pattern": SLICE.pattern})] = None,
    max_prompt_len: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    tokenizer: Annotated[str | None, Query(description="Configured tokenizer name; "
                                           "without it max_prompt_len counts characters.")] = None,
    filename: Annotated[str | None, Query(description="Names the format of a raw body.")] = None,
    format: Literal["jsonl", "parquet"] | None = None,
) -> DatasetUploaded:
    """Upload a JSONL or Parquet file as the next version of dataset `name`.

    Miles data-source semantics: `input_key` holds a string prompt or a list of chat
    messages, `label_key` the label, `metadata_key` an object, `tool_key` a list (or JSON
    string of one) stored as `metadata.tools`. `slice` counts valid rows. Bad lines are
    reported with their line number and reason; the other rows are kept. Send the file as
    the raw body (with `?filename=x.jsonl` or `?format=`) or as multipart part `file`.
    """
    start, end = parse_slice(slice)
    if format is None and filename is not None:
        format_of(filename)  # fail before reading a large body of the wrong type
    opts = DatasetOptions(input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                          tool_key=tool_key, start=start, end=end,
                          max_prompt_len=max_prompt_len, tokenizer=tokenizer)
    config.upload_dir.mkdir(parents=True, exist_ok=True)
    target = config.upload_dir / f"{name}-{uuid.uuid4().hex}.upload"
    try:
        received_as = await _spool_upload(request, target, filename)
        fmt = format or format_of(received_as)
        report = await run_in_threadpool(datasets.ingest, name, target, fmt, opts)
    finally:
        target.unlink(missing_ok=True)
    return report


def _table_or_404(datasets: DatasetStore, name: str, version: int | None) -> DeltaTable:
    table = datasets.table(name, version)
    if table is None:
        at = f" at version {version}" if version is not None else ""
        raise ApiError(404, f"dataset {name!r} does not exist{at}")
    return table


@router.get("/v1/datasets/{name}",
            responses=errors(*AUTH, 422, described={404: "Unknown dataset/version."}))
def get_dataset(name: DatasetNamePath, _: ReadGlobal, datasets: DatasetsDep,
                version: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None) -> DatasetInfo:
    """A dataset's version (latest, or `version`), row count and upload history."""
    table = _table_or_404(datasets, name, version)
    history = []
    for entry in table.history():
        options = entry.get("rolloutlake.dataset_options")
        history.append(DatasetVersion(version=entry["version"], timestamp=entry.get("timestamp"),
                                      options=orjson.loads(options) if options else None))
    return DatasetInfo(name=name, version=table.version(),
                       rows=table.to_pyarrow_dataset().count_rows(), history=history)


@router.get("/v1/datasets/{name}/rows",
            responses=errors(*AUTH, 422, described={404: "Unknown dataset/version."}))
def get_dataset_rows(name: DatasetNamePath, _: ReadGlobal, datasets: DatasetsDep,
                     version: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
                     offset: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> DatasetRows:
    """Rows `offset`..`offset+limit` of a dataset version, prompts and labels decoded."""
    table = _table_or_404(datasets, name, version)
    data = table.to_pyarrow_dataset().to_table(
        filter=(pc.field("row") >= offset) & (pc.field("row") < offset + limit)).sort_by("row")
    rows = [
        {**row, "prompt": orjson.loads(row["prompt"]), "metadata": orjson.loads(row["metadata"]),
         "label": None if row["label"] is None else orjson.loads(row["label"])}
        for row in data.to_pylist()
    ]
    return DatasetRows(name=name, version=table.version(), rows=rows)
