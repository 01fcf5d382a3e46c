#!/usr/bin/env bash
# System packages for the operator's-view tests: Debian's chromium and chromedriver (the
# dashboard's browser test) and prometheus (the Grafana queries evaluated by a real
# Prometheus). Idempotent: does nothing when all are on PATH; without root or apt it says
# so and exits 0 (those tests then fail, saying what is missing).
set -euo pipefail

have() { command -v chromium && command -v chromedriver && command -v prometheus; } >/dev/null 2>&1
if have; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "browser-deps: no apt-get; install chromium and chromedriver yourself" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "browser-deps: not root; skipping the chromium install" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver prometheus >/dev/null
have
