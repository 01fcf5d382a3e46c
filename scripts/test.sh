#!/usr/bin/env bash
# The test command: set up, lint, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the packages in [tool.mypy] files, zero errors
# Where the C extensions can build (a C compiler, Python's and OpenSSL's headers), the
# suite must run on them: the tests of each (events._native, router._refcounts,
# router.index._memindex; tests/test_native_loader.py lists them) fail if one was not built.
inc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if command -v cc >/dev/null 2>&1 && [ -f "$inc/Python.h" ] && [ -f /usr/include/openssl/sha.h ]; then
  export KVROUTE_REQUIRE_NATIVE=${KVROUTE_REQUIRE_NATIVE:-1}
fi
.venv/bin/python -m pytest -q "$@"
