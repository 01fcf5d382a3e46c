#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: venv, the package with dev extras, redis-server,
# browser test dependencies (scripts/browser-deps.sh, when present).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvroute-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ events/_native.c -nt "$stamp" ] || [ router/_refcounts.c -nt "$stamp" ] || [ router/index/_memindex.c -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build of torch first, so the engine extra's torch requirement never pulls CUDA wheels.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # dev = the engine (torch) and bench (matplotlib, peer routers) extras + test tools.
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
# Browser tests (selenium) need a browser and its driver: another script's job, when present.
if [ -f scripts/browser-deps.sh ]; then
  bash scripts/browser-deps.sh
fi
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing redis-server with apt-get" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "warning: redis-server not found and cannot install it (need root + apt-get)" >&2
  fi
fi
