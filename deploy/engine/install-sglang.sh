#!/bin/sh
# SGLang's own venv (default .venv-sglang) for `rolloutlake engine --backend sglang` and
# `make test-gpu`. SGLang serves on CUDA only, so on a machine without a CUDA GPU this stops
# at once, with one line, before it installs anything.
#
# pip resolves the torch that this SGLang pins; PyPI's Linux torch wheels are CUDA builds,
# so nothing else is needed for the GPU. A venv of its own, as for vLLM: SGLang pins its
# torch, transformers and fastapi, which the gateway and the trainer must not inherit.
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
SGLANG='sglang[all]==0.5.23'
STAMP="$VENV/.sglang-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SGLANG" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$SGLANG"
"$VENV/bin/python" -c "import sglang, torch; assert torch.cuda.is_available(), \
'torch ' + torch.__version__ + ' in $VENV sees no CUDA device'"
echo "$SGLANG" > "$STAMP"
