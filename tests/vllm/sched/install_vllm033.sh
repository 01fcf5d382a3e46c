#!/usr/bin/env bash
# Idempotent: vLLM 0.33's Python sources, for driving its scheduler in-process on CPU.
# Why: GPU users run 0.33, but its wheel is a CUDA build that cannot serve here. Its
# scheduler and KV cache manager are plain Python, so the 0.32 CPU venv's interpreter and
# dependencies run them with the 0.33 wheel's .py files first on PYTHONPATH (the shared
# 0.32 venv is not touched). docs/vllm-0.32-vs-0.33.md says why this works.
# Prints the directory to put on PYTHONPATH on the last line of stdout; logs to stderr.
set -euo pipefail

DEST=${KVROUTE_VLLM033_SRC:-$HOME/.cache/kvroute/vllm-0.33.0-py}
PY=${PYTHON:-python3}
STAMP="$DEST/.kvroute-vllm033"

log() { echo "vllm-0.33-src: $*" >&2; }

if [ -f "$STAMP" ]; then
  echo "$DEST"
  exit 0
fi
mkdir -p "$(dirname "$DEST")"
exec 9>"$DEST.lock"
flock 9
if [ -f "$STAMP" ]; then
  echo "$DEST"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
log "downloading vllm==0.33.0 (wheel only, no dependencies; ~340 MB)"
"$PY" -m pip download -q --no-deps vllm==0.33.0 -d "$TMP" >&2
rm -rf "$DEST.part" && mkdir -p "$DEST.part"
# The Python files only: the CUDA extensions are neither loadable nor needed here.
"$PY" - "$TMP" "$DEST.part" <<'PYEOF' >&2
import sys, zipfile, pathlib
src, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = src.glob("vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
    z.extractall(dest, names)
print(f"extracted {len(names)} files from {wheel.name}")
PYEOF
rm -rf "$DEST" && mv "$DEST.part" "$DEST"
touch "$STAMP"
echo "$DEST"
