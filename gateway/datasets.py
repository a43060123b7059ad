"""Prompt datasets with Miles data-source semantics (MILES_SEMANTICS.md section 3), stored
as one Delta table per dataset under `<lake>/datasets/<name>`; each upload is a version.

Differences from Miles, on purpose:
- bad lines (not JSON, not UTF-8, missing keys, too long) are reported, not skipped silently;
- `@[start:end]` accepts negative bounds (Python slice semantics over the valid rows);
- uploads are parsed in two streaming passes through a spool file, so memory stays bounded
  (about one 8192-row batch) whatever the file size;
- `max_prompt_len` also measures chat-message prompts: the contents joined by newlines.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError
from pydantic import BaseModel

from ingest.core.dataset_rows import BadRow, DatasetOptions, convert_row, jsonl_objects
from ingest.io.lake_location import lake_storage_options
from schemas.errors import InvalidInputError, NotFoundError, UnsupportedFormatError
from schemas.tables import DATASET_ROWS

DATASET_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"
SLICE = re.compile(r"^@?\[(-?\d*):(-?\d*)\]$")
BATCH_ROWS = 8192
MAX_BAD_LINES_REPORTED = 1000
Format = Literal["jsonl", "parquet"]
FORMATS: dict[str, Format] = {".jsonl": "jsonl", ".parquet": "parquet"}

_SPOOL_SCHEMA = pa.schema([
    pa.field("source_line", pa.int64()), pa.field("prompt", pa.string()),
    pa.field("label", pa.string()), pa.field("metadata", pa.string()),
    pa.field("text", pa.string()),
])


class DatasetError(InvalidInputError):
    """The upload cannot become a dataset version; its details report the bad lines."""

    def __init__(self, message: str, bad_lines: list[dict[str, Any]] | None = None,
                 bad_line_count: int = 0):
        super().__init__(message, bad_line_count=bad_line_count, bad_lines=bad_lines or [])


class UnsupportedFileType(DatasetError, UnsupportedFormatError):
    """The upload is neither JSONL nor Parquet."""


def parse_slice(text: str | None) -> tuple[int | None, int | None]:
    """`@[start:end]` or `[start:end]`; either bound may be empty or negative."""
    if not text:
        return None, None
    match = SLICE.match(text.strip())
    if match is None:
        raise DatasetError(f"slice {text!r} is not of the form @[start:end] (no step)")
    start, end = (int(b) if b not in ("", "-") else None for b in match.groups())
    return start, end


def format_of(filename: str | None) -> Format:
    suffix = Path(filename or "").suffix.lower()
    if suffix not in FORMATS:
        raise UnsupportedFileType(
            f"unsupported file type {suffix or '(none)'!r} of {filename!r}: upload .jsonl or "
            ".parquet (or pass ?format=jsonl|parquet)"
        )
    return FORMATS[suffix]


class BadLine(BaseModel):
    line: int
    """1-based line (JSONL) or row (Parquet) number in the upload."""
    reason: str


class DatasetUploaded(BaseModel):
    name: str
    version: int
    """The Delta table version this upload became (time travel: `?version=`)."""
    valid_rows: int
    rows_kept: int
    rows_sliced_out: int
    rows_filtered: int
    """Rows dropped by `max_prompt_len`."""
    length_unit: str
    bad_line_count: int
    bad_lines: list[BadLine]
    """The first 1000 bad lines."""



def _parquet_objects(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        source = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"not a readable Parquet file: {err}") from None
    row = 0
    for batch in source.iter_batches(batch_size=BATCH_ROWS):
        for obj in batch.to_pylist():
            row += 1
            yield row, obj


class DatasetStore:
    """Uploads, versions and (cached) reads of datasets under one lake root."""

    def __init__(self, lake_root: str, spool_dir: Path, *, tokenizers: dict[str, Path],
                 line_limit: int):
        self.root = f"{lake_root.rstrip('/')}/datasets"
        # The lake's options (AWS_* environment, conditional put on S3): two gateways may
        # upload the same dataset at once.
        self.storage_options = lake_storage_options(lake_root) or None
        self.spool_dir = spool_dir
        self.tokenizer_paths = tokenizers
        self.line_limit = line_limit
        self._tokenizers: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def table(self, name: str, version: int | None = None) -> DeltaTable | None:
        """The dataset's Delta table at `version` (latest if None); None if either is unknown."""
        try:
            dt = DeltaTable(self.uri(name), storage_options=self.storage_options)
        except TableNotFoundError:
            return None
        if version is not None:
            if version > dt.version():
                return None
            dt.load_as_version(version)
        return dt

    def ingest(self, name: str, upload: Path, fmt: Format, opts: DatasetOptions) -> DatasetUploaded:
        """Parse, slice, filter and store `upload` as the next version of `name`."""
        measure = self._measure(opts)
        spool = upload.with_suffix(".spool.parquet")
        try:
            valid, bad, bad_count = self._spool(upload, fmt, opts, spool)
            if valid == 0:
                raise DatasetError("the upload holds no valid rows", bad, bad_count)
            lo, hi, _ = slice(opts.start, opts.end).indices(valid)
            kept = 0
            filtered = 0

            def rows() -> Iterator[pa.RecordBatch]:
                nonlocal kept, filtered
                seen = 0
                for batch in pq.ParquetFile(spool).iter_batches(batch_size=BATCH_ROWS):
                    first, seen = seen, seen + batch.num_rows
                    begin = max(lo - first, 0)
                    batch = batch.slice(begin, max(min(hi - first, batch.num_rows) - begin, 0))
                    if batch.num_rows == 0:
                        continue
                    lengths = pa.array(measure(batch.column("text").to_pylist()), pa.int64())
                    if opts.max_prompt_len is not None:
                        keep = pc.less_equal(lengths, opts.max_prompt_len)
                        filtered += batch.num_rows - pc.sum(keep).as_py()
                        batch, lengths = batch.filter(keep), lengths.filter(keep)
                    n = batch.num_rows
                    if n == 0:
                        continue
                    yield pa.RecordBatch.from_arrays(
                        [pa.array(range(kept, kept + n), pa.int64()), batch.column("source_line"),
                         batch.column("prompt"), batch.column("label"),
                         batch.column("metadata"), lengths],
                        schema=DATASET_ROWS.schema,
                    )
                    kept += n

            batches = rows()
            first = next(batches, None)
            if first is None:  # checked before writing, so no empty version is committed
                raise DatasetError(
                    f"no rows left after slicing {valid} valid rows to [{lo}:{hi}] and "
                    f"filtering by max_prompt_len={opts.max_prompt_len}", bad, bad_count)
            version = self._write(name, itertools.chain([first], batches), opts)
        finally:
            spool.unlink(missing_ok=True)
        return DatasetUploaded(
            name=name, version=version, valid_rows=valid, rows_kept=kept,
            rows_sliced_out=valid - max(hi - lo, 0), rows_filtered=filtered,
            length_unit="tokens" if opts.tokenizer else "characters",
            bad_line_count=bad_count, bad_lines=[BadLine(**line) for line in bad],
        )

    def rows(self, name: str, version: int) -> pa.Table:
        """The whole dataset version in memory, for prompt serving (few versions cached)."""
        key = (name, version)
        with self._guard:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        dt = self.table(name, version)
        if dt is None:
            raise NotFoundError(f"dataset {name!r} version {version} does not exist")
        table = dt.to_pyarrow_table(columns=["row", "prompt", "label", "metadata"]).sort_by("row")
        with self._guard:
            self._cache[key] = table
            while len(self._cache) > 4:
                self._cache.popitem(last=False)
        return table

    def _spool(self, upload: Path, fmt: Format, opts: DatasetOptions,
               spool: Path) -> tuple[int, list[dict[str, Any]], int]:
        objects = jsonl_objects(upload, self.line_limit) if fmt == "jsonl" else _parquet_objects(upload)
        bad: list[dict[str, Any]] = []
        bad_count = valid = 0
        columns: list[list[Any]] = [[] for _ in _SPOOL_SCHEMA]
        with pq.ParquetWriter(spool, _SPOOL_SCHEMA) as writer:
            for line_no, obj in objects:
                try:
                    if isinstance(obj, BadRow):
                        raise obj
                    converted = convert_row(obj, opts)
                except BadRow as err:
                    bad_count += 1
                    if len(bad) < MAX_BAD_LINES_REPORTED:
                        bad.append({"line": line_no, "reason": str(err)})
                    continue
                for column, value in zip(columns, (line_no, *converted), strict=True):
                    column.append(value)
                valid += 1
                if len(columns[0]) >= BATCH_ROWS:
                    writer.write_batch(pa.record_batch(columns, schema=_SPOOL_SCHEMA))
                    columns = [[] for _ in _SPOOL_SCHEMA]
            if columns[0]:
                writer.write_batch(pa.record_batch(columns, schema=_SPOOL_SCHEMA))
        return valid, bad, bad_count

    def _measure(self, opts: DatasetOptions):
        if opts.tokenizer is None:
            return lambda texts: [len(t) for t in texts]
        tokenizer = self._tokenizer(opts.tokenizer)
        return lambda texts: [
            len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]

    def _tokenizer(self, name: str) -> Any:
        if name not in self.tokenizer_paths:
            known = ", ".join(sorted(self.tokenizer_paths)) or "none configured"
            raise DatasetError(f"unknown tokenizer {name!r} (known: {known})")
        with self._guard:
            if name not in self._tokenizers:
                from transformers import AutoTokenizer  # heavy: imported on first use only

                self._tokenizers[name] = AutoTokenizer.from_pretrained(
                    str(self.tokenizer_paths[name]), local_files_only=True
                )
            return self._tokenizers[name]

    def _write(self, name: str, batches: Iterator[pa.RecordBatch], opts: DatasetOptions) -> int:
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        # One upload per dataset at a time: concurrent overwrites would conflict in Delta.
        with lock:
            reader = pa.RecordBatchReader.from_batches(DATASET_ROWS.schema, batches)
            meta = {"rolloutlake.dataset_options": orjson.dumps(opts.__dict__).decode()}
            write_deltalake(self.uri(name), reader, mode="overwrite",
                            commit_properties=CommitProperties(custom_metadata=meta),
                            storage_options=self.storage_options)
            return DeltaTable(self.uri(name), storage_options=self.storage_options).version()
