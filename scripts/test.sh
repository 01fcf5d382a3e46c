#!/usr/bin/env bash
# The test command: set up, lint, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the packages in [tool.mypy] files, zero errors
# Where the native hasher can build (a C compiler, Python's and OpenSSL's headers), the
# suite must run on it: tests/events/test_native_hashing.py fails if it was not built.
inc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if command -v cc >/dev/null 2>&1 && [ -f "$inc/Python.h" ] && [ -f /usr/include/openssl/sha.h ]; then
  export KVROUTE_REQUIRE_NATIVE=${KVROUTE_REQUIRE_NATIVE:-1}
fi
.venv/bin/python -m pytest -q "$@"
