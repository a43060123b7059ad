"""The rooms of the code and which way their imports point (docs/DESIGN.md, "Rooms").

The pure core must stay free of Kafka, Delta and HTTP so it can be replayed and unit
tested; I/O must not reach up into the services that use it; no service imports a command.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "ingest", "gateway", "trainer")
INGEST_ROOMS = ("core", "io", "sdk", "processor", "workers", "commands", "cli")

# room -> the rooms it may import from (besides itself)
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "ingest.core": {"schemas"},
    "ingest.io": {"schemas", "ingest.core"},
    "ingest.sdk": {"schemas", "ingest.core", "ingest.io"},
    "ingest.processor": {"schemas", "ingest.core", "ingest.io"},
    "trainer": {"schemas", "ingest.core", "ingest.io"},
    "gateway": {"schemas", "ingest.core", "ingest.io", "ingest.sdk"},
    "ingest.workers": {"schemas", "ingest.core", "ingest.io", "ingest.sdk", "trainer"},
    "ingest.commands": {"schemas", "ingest.core", "ingest.io", "ingest.sdk", "ingest.processor",
                        "ingest.workers", "trainer", "gateway"},
    "ingest.cli": {"schemas"},  # it loads the command modules by name
}
# The core imports no client of Kafka, Delta or HTTP.
CORE_FORBIDDEN = ("kafka", "deltalake", "fastapi", "httpx", "starlette", "uvicorn", "torch")


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "ingest" and len(parts) > 1 and parts[1] in INGEST_ROOMS:
        return f"ingest.{parts[1]}"
    return parts[0]


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path))
    return found


def test_every_module_lives_in_a_known_room():
    unknown = sorted({room_of(name) for name, _ in modules()} - set(ALLOWED) - {"ingest"})
    assert not unknown, f"rooms without import rules: {unknown}"


def test_imports_point_the_documented_way():
    wrong = []
    for name, path in modules():
        source = room_of(name)
        for imported in imports_of(path):
            if imported.split(".")[0] not in PACKAGES:
                continue
            target = room_of(imported)
            if target != source and target not in ALLOWED.get(source, set()):
                wrong.append(f"{name} imports {imported} ({source} -> {target})")
    assert not wrong, "\n".join(wrong)


def test_the_core_speaks_no_kafka_delta_or_http():
    wrong = [f"{name} imports {imported}"
             for name, path in modules() if room_of(name) == "ingest.core"
             for imported in imports_of(path) if imported.split(".")[0] in CORE_FORBIDDEN]
    assert not wrong, "\n".join(wrong)

