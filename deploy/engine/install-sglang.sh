#!/bin/sh
# SGLang's own venv (default .venv-sglang) for `rolloutlake engine --backend sglang` and
# `make test-gpu`. SGLang serves on CUDA only, so on a machine without a CUDA GPU this stops
# at once, with one line, before it installs anything.
#
# As SGLang's install guide does it (docs.sglang.io/docs/get-started/install): uv, with
# --prerelease=allow, because some of SGLang's dependencies publish only pre-releases on
# PyPI (pip, or an older uv without the flag, does not resolve them), and the torch that
# this SGLang pins, a CUDA 13 build from PyPI (SGLang 0.5.19 was its last CUDA 12 release),
# so the driver must support CUDA 13 ("CUDA Version" in nvidia-smi). A venv of its own,
# as for vLLM: SGLang pins a torch and libraries of its own, which the gateway and the
# trainer must not inherit.
#
# Usage: deploy/engine/install-sglang.sh [VENV]. Idempotent: a stamp file records the
# SGLang requirement it installed; rerunning then only checks the GPU.
set -eu
# Shell built-ins only until the GPU is found, so the check also runs on a bare PATH.
gpus=$(nvidia-smi -L 2>/dev/null) || gpus=""
case "$gpus" in
    *"GPU "*) ;;
    *) echo "a CUDA GPU is needed: SGLang serves on CUDA only and nvidia-smi lists no GPU here" >&2
       exit 1 ;;
esac
VENV=${1:-.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG='sglang==0.5.23'
STAMP="$VENV/.sglang-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SGLANG" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip uv
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --prerelease=allow "$SGLANG"
"$VENV/bin/python" -c "import sglang, torch; assert torch.cuda.is_available(), \
'torch ' + torch.__version__ + ' in $VENV sees no CUDA device: is the driver new enough for CUDA ' + str(torch.version.cuda) + '?'"
echo "$SGLANG" > "$STAMP"
