"""JSON Schema export of the wire contract (`rolloutlake schemas --json-schema DIR`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from schemas.control import CONTROL_MODELS
from schemas.events import EVENT_MODELS
from schemas.tables import TABLES


def write_json_schemas(directory: Path) -> list[Path]:
    """Write one `<type>.schema.json` per event and control message; return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in {**EVENT_MODELS, **CONTROL_MODELS}.items():
        path = directory / f"{name}.schema.json"
        schema = model.model_json_schema()
        schema["$id"] = f"https://rolloutlake.dev/schemas/v1/{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json-schema", type=Path, metavar="DIR", help="write JSON Schemas to DIR")
    parser.add_argument("--tables", action="store_true", help="print the Delta table schemas")


def run(args: argparse.Namespace) -> int:
    if args.json_schema is None and not args.tables:
        args.tables = True
    if args.json_schema is not None:
        for path in write_json_schemas(args.json_schema):
            print(path)
    if args.tables:
        for spec in TABLES.values():
            print(f"# {spec.name}  key=({', '.join(spec.key)})")
            print(spec.schema.to_string(show_schema_metadata=False))
            print()
    return 0
