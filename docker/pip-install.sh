#!/bin/sh
# Runs inside docker/Dockerfile's build stages, into the venv /opt/kvroute:
#   pip-install.sh deps [EXTRA]   the requirements pyproject.toml names (and the extra's)
#   pip-install.sh wheel DIR      the kvroute wheel into DIR: /build/dist's (built on the
#                                 host) if there is one, else built from /build
# Offline from /wheels/{base,engine} when they hold wheels, else from the indexes (torch
# from its CPU index, so the engine image never carries CUDA).
set -eu
cd /build
pip=/opt/kvroute/bin/pip
if ls /wheels/base/*.whl >/dev/null 2>&1; then
  set -- "$@" --no-index --find-links /wheels/base --find-links /wheels/engine
  offline=1
else
  offline=
fi
what=$1
shift
case "$what" in
  deps)
    extra=
    case "${1:-}" in --*) ;; *) extra=${1:-}; [ $# -gt 0 ] && shift ;; esac
    /opt/kvroute/bin/python - "$extra" >/build/requirements.txt <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = sys.argv[1]
print("\n".join(project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])))
PY
    if [ "$extra" = engine ]; then
      if [ -n "$offline" ]; then
        $pip install "torch==2.13.0" "$@"
      else
        $pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
      fi
    fi
    $pip install -r /build/requirements.txt "$@"
    ;;
  wheel)
    dest=$1
    shift
    if ls /build/dist/kvroute-*.whl >/dev/null 2>&1; then  # built on the host (docker/dist)
      mkdir -p "$dest" && cp /build/dist/kvroute-*.whl "$dest"/
      exit 0
    fi
    $pip install "setuptools>=77" "$@"
    $pip wheel --no-deps --no-build-isolation -w "$dest" /build
    ;;
  *) echo "usage: pip-install.sh deps [EXTRA] | wheel DIR" >&2; exit 2 ;;
esac
