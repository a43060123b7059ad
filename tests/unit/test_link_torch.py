"""deploy/engine/link_torch.py: the engine's venv takes the project venv's torch, with the
CUDA libraries torch asks for as extras, as hard links rather than a second copy."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import venv
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "engine" / "link_torch.py"


def link(python: str | Path, target: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), str(SCRIPT), str(target)], capture_output=True,
                          text=True, timeout=300)


def test_torch_and_every_library_it_needs_are_hard_linked(tmp_path):
    done = link(sys.executable, tmp_path)
    assert done.returncode == 0, done.stderr
    linked = {dist.metadata["Name"].lower().replace("_", "-"): dist.version
              for dist in metadata.distributions(path=[str(tmp_path)])}
    # the venv's CUDA libraries are all torch's, most of them through cuda-toolkit's extras
    cuda = {dist.metadata["Name"].lower().replace("_", "-") for dist in metadata.distributions()
            if dist.metadata["Name"].lower().startswith("nvidia")}
    assert cuda and cuda <= linked.keys(), cuda - linked.keys()
    assert linked["torch"] == metadata.version("torch")
    assert linked["triton"] == metadata.version("triton")
    source = Path(str(metadata.distribution("torch").locate_file("torch/__init__.py")))
    assert (tmp_path / "torch" / "__init__.py").samefile(source)
    assert not (tmp_path / "bin").exists()  # console scripts stay out of site-packages


def test_a_target_that_is_not_a_folder_is_named(tmp_path):
    done = link(sys.executable, tmp_path / "missing")
    assert done.returncode == 1
    assert done.stderr.strip() == (f"link_torch: {tmp_path / 'missing'} is not a "
                                   "site-packages folder")


def test_a_venv_without_torch_is_named(tmp_path):
    venv.create(tmp_path / "bare", with_pip=False)
    done = link(tmp_path / "bare" / "bin" / "python", tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == f"link_torch: torch is not installed in {tmp_path / 'bare'}"
