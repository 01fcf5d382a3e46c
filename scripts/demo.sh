#!/usr/bin/env bash
# The main job: set up, then run the local demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvroute up --policies cost,round_robin "$@"
