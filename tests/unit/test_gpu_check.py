"""`make test-gpu` and `deploy/engine/install-sglang.sh` stop at once, with one line, on a
machine without a CUDA GPU: before a venv, a download or a test starts.

PATH is narrowed to a folder of this test's own, so the machine's own nvidia-smi (if
any) is out of sight and nothing but the check can run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "deploy" / "engine" / "install-sglang.sh"
NEEDS_GPU = "a CUDA GPU is needed: SGLang serves on CUDA only and nvidia-smi lists no GPU here"


def bin_dir(tmp_path: Path, *tools: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed")
        (folder / tool).symlink_to(found)
    return folder


def no_devices_nvidia_smi(folder: Path) -> None:
    """nvidia-smi as a driver without a GPU answers (exit code 6)."""
    fake = folder / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)


@pytest.mark.parametrize("driver", ["no nvidia-smi", "nvidia-smi without devices"])
def test_install_script_needs_a_cuda_gpu(tmp_path, driver):
    folder = bin_dir(tmp_path)
    if driver == "nvidia-smi without devices":
        no_devices_nvidia_smi(folder)
    done = subprocess.run(["/bin/sh", str(INSTALL), str(tmp_path / "venv")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": str(folder)})
    assert (done.returncode, done.stdout, done.stderr) == (1, "", NEEDS_GPU + "\n")
    assert not (tmp_path / "venv").exists()


def test_make_test_gpu_stops_at_the_gpu_check(tmp_path):
    folder = bin_dir(tmp_path, "make", "sh")
    done = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "test-gpu"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": str(folder)})
    assert done.returncode == 2
    assert done.stdout == ""
    first, *rest = done.stderr.splitlines()
    assert first == NEEDS_GPU
    # make's own "Error 1" only; `make[1]` when this suite itself runs under make
    assert [re.sub(r"\[\d+\]$", "", line.split(":")[0]) for line in rest] == ["make"]
