"""Hard-link torch and the distributions it needs from this venv into another one.

Run with the python of a venv that has torch installed; the argument is the other venv's
site-packages. torch==2.13.0 with its CUDA libraries and triton is 4.6 GB: the engine's venv
would hold a second, byte-identical copy of it, and on a machine short of disk that copy is
what made the install fail. pip then finds torch installed in the engine's venv and leaves it.

Only files under site-packages are linked (a distribution's console scripts are not needed by
the engine). Where a hard link is refused (another filesystem), the file is copied.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import sys
from pathlib import Path


def requirement_closure(root: str) -> list[metadata.Distribution]:
    """The installed distribution `root` and every one it requires here, with the extras
    those requirements ask for (torch's CUDA libraries are extras of `cuda-toolkit`)."""
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # a venv without packaging has pip's copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
        from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    todo, seen = [(canonicalize_name(root), "")], set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in installed:
            continue
        seen.add((name, extra))
        for line in installed[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                required = canonicalize_name(requirement.name)
                todo += [(required, wanted) for wanted in ("", *requirement.extras)]
    return [installed[name] for name in sorted({name for name, _ in seen})]


def link_distribution(dist: metadata.Distribution, target: Path) -> int:
    """Link the distribution's files that lie under site-packages; returns how many."""
    source_site = Path(str(dist.locate_file(""))).resolve()
    linked = 0
    for file in dist.files or []:
        source = (source_site / file).resolve()
        if not source.is_relative_to(source_site) or not source.is_file():
            continue
        destination = target / source.relative_to(source_site)
        destination.parent.mkdir(parents=True, exist_ok=True)
        if destination.exists():
            destination.unlink()
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)
        linked += 1
    return linked


def main() -> None:
    target = Path(sys.argv[1])
    if not target.is_dir():
        sys.exit(f"link_torch: {target} is not a site-packages folder")
    try:
        metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        sys.exit(f"link_torch: torch is not installed in {sys.prefix}")
    dists = requirement_closure("torch")
    files = sum(link_distribution(dist, target) for dist in dists)
    print(f"linked {len(dists)} distributions ({files} files) from {sys.prefix}")


if __name__ == "__main__":
    main()
