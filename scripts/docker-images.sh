#!/usr/bin/env bash
# Build the stack's images: kvroute-router:local (no torch), kvroute-engine:local (CPU torch),
# kvroute-redis:local (Debian's redis-server). Base: the public python:3.11-slim when it can
# be pulled, else a debootstrap'ed Debian bookworm imported into Docker. Python packages come
# from a wheelhouse prepared here (containers need no package index), keyed by content under
# $KVR_CACHE so repeated builds reuse it; Docker's build cache does the rest.
set -euo pipefail
. "$(dirname "$0")/docker-lib.sh"
cd "$KVR_REPO"

MIRROR=${KVROUTE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
TORCH_SPEC=${KVROUTE_TORCH_SPEC:-torch==2.13.0}
ROOTFS_RECIPE=1  # bump when the rootfs trimming below changes
mkdir -p "$KVR_CACHE/rootfs" "$KVR_CACHE/wheels" "$KVR_CACHE/logs"

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# ---- base images ------------------------------------------------------------------------
rootfs_tar() {  # $1 name, $2 packages: a trimmed debootstrap root as a cached tarball
  local tar="$KVR_CACHE/rootfs/$1-$(kvr_key "$SUITE" minbase "$2" "$MIRROR" "$ROOTFS_RECIPE").tar"
  if [ ! -f "$tar" ]; then
    local dir
    dir=$(mktemp -d "$KVR_CACHE/rootfs/tmp.XXXXXX")
    kvr_log "debootstrap $SUITE ($2) -> $tar"
    if ! debootstrap --variant=minbase --include="$2" "$SUITE" "$dir/root" "$MIRROR" \
      >"$KVR_CACHE/logs/debootstrap-$1.log" 2>&1; then
      tail -20 "$KVR_CACHE/logs/debootstrap-$1.log" >&2
      rm -rf "$dir"
      kvr_die "debootstrap $1 failed (log: $KVR_CACHE/logs/debootstrap-$1.log)"
    fi
    rm -rf "$dir"/root/var/cache/apt/archives/*.deb "$dir"/root/var/lib/apt/lists/* \
      "$dir"/root/usr/share/{doc,man,info,locale}/* "$dir"/root/var/log/*
    tar -C "$dir/root" -c . >"$tar.part" && mv "$tar.part" "$tar"
    rm -rf "$dir"
  fi
  echo "$tar"
}

import_rootfs() {  # $1 tarball -> image named after it, with the PATH a shell expects
  local image
  image="kvroute-base-$(basename "$1" .tar | sed 's/-\([0-9a-f]*\)$/:\1/')-p"
  have_image "$image" || "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$1" "$image" >/dev/null
  echo "$image"
}

if [ -n "${KVROUTE_BASE_IMAGE:-}" ]; then
  PY_BASE=$KVROUTE_BASE_IMAGE REDIS_BASE=${KVROUTE_REDIS_BASE_IMAGE:-$KVROUTE_BASE_IMAGE}
  NET=host
elif have_image python:3.11-slim || timeout 120 "$DOCKER" pull -q python:3.11-slim >/dev/null 2>&1; then
  PY_BASE=python:3.11-slim REDIS_BASE=debian:bookworm-slim NET=host
else
  kvr_log "python:3.11-slim cannot be pulled: building Debian $SUITE bases with debootstrap"
  command -v debootstrap >/dev/null || kvr_die "debootstrap missing (scripts/docker-daemon.sh installs it)"
  py_pkgs=python3,python3-venv redis_pkgs=redis-server
  # Both roots at once (about a minute each, mostly downloads), unless already cached.
  rootfs_tar python "$py_pkgs" >/dev/null & py_job=$!
  rootfs_tar redis "$redis_pkgs" >/dev/null & redis_job=$!
  wait "$py_job" && wait "$redis_job" || kvr_die "a debootstrap root failed"
  PY_BASE=$(import_rootfs "$(rootfs_tar python "$py_pkgs")")
  REDIS_BASE=$(import_rootfs "$(rootfs_tar redis "$redis_pkgs")")
  NET=none  # everything the builds need is in the bases and the wheelhouse
fi

# ---- wheelhouse ---------------------------------------------------------------------------
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
# One requirement per line: a requirement may hold spaces (an environment marker).
reqs() {
  "$PY" -c 'import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = p["dependencies"] if sys.argv[1] == "base" else p["optional-dependencies"][sys.argv[1]]
print("\n".join(deps))' "$1"
}
mapfile -t BASE_REQS < <(reqs base)
mapfile -t ENGINE_REQS < <(reqs engine)
REQS=("${BASE_REQS[@]}" "${ENGINE_REQS[@]}")
WHEELS="$KVR_CACHE/wheels/$(kvr_key "${REQS[@]}" "$TORCH_SPEC" cp311 "$(uname -m)")"
if [ ! -f "$WHEELS/.complete" ]; then
  kvr_log "preparing the wheelhouse $WHEELS"
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # The images run CPython 3.11 on glibc 2.36 (bookworm), like this machine: pip picks the
  # wheels this Python would install. torch comes from where `pip install torch==2.13.0`
  # takes it here (pip's find-links / indexes: the CPU build); checked below, never CUDA.
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null \
    || kvr_die "$PY is not Python 3.11: the wheelhouse must match the images' Python"
  dl=("$PY" -m pip download -q --only-binary=:all:)
  # pip evaluates requirement markers with this Python (3.11.x here): what bookworm's 3.11.2
  # needs beyond that is added by hand (redis: async-timeout; python_full_version < 3.11.3).
  ok=1
  { "${dl[@]}" -d "$WHEELS/base" "${BASE_REQS[@]}" "setuptools>=77" "async-timeout>=4.0.3" \
      && "${dl[@]}" -d "$WHEELS/engine" "$TORCH_SPEC" "${ENGINE_REQS[@]}"; } \
    >"$KVR_CACHE/logs/wheels.log" 2>&1 || ok=0
  [ "$ok" = 1 ] || { tail -20 "$KVR_CACHE/logs/wheels.log" >&2; kvr_die "pip download failed"; }
  ls "$WHEELS/engine" | grep -q '^torch-.*+cpu' \
    || kvr_die "no CPU build of torch in the wheelhouse: $(ls "$WHEELS/engine" | grep '^torch-')"
  if ls "$WHEELS/engine" | grep -q '^nvidia'; then kvr_die "CUDA wheels in the wheelhouse"; fi
  touch "$WHEELS/.complete"
fi
# Into the build context (hard links: no copy when the cache is on the same file system).
rm -rf docker/wheelhouse/base docker/wheelhouse/engine
cp -al "$WHEELS/base" "$WHEELS/engine" docker/wheelhouse/ 2>/dev/null \
  || cp -a "$WHEELS/base" "$WHEELS/engine" docker/wheelhouse/

# The kvroute wheel, built here where a C compiler and OpenSSL's headers are (offline
# builds cannot install a compiler in the build stage): the images carry the C extensions.
rm -f docker/dist/kvroute-*.whl
if ! "$PY" -m pip wheel -q --no-deps -w docker/dist . >"$KVR_CACHE/logs/kvroute-wheel.log" 2>&1; then
  rm -f docker/dist/kvroute-*.whl
  kvr_log "could not build the kvroute wheel here (log: $KVR_CACHE/logs/kvroute-wheel.log);" \
    "the images build their own (their build stage installs a compiler: needs the network)"
fi

# ---- images -------------------------------------------------------------------------------
build() {  # $1 tag, then docker build arguments
  local tag=$1 log="$KVR_CACHE/logs/build-${1%%:*}.log"
  shift
  kvr_log "building $tag"
  if ! "$DOCKER" build --progress=plain --network "$NET" -t "$tag" "$@" >"$log" 2>&1; then
    tail -30 "$log" >&2
    kvr_die "building $tag failed (log: $log)"
  fi
}
build kvroute-router:local -f docker/Dockerfile --target router --build-arg "BASE_IMAGE=$PY_BASE" .
build kvroute-engine:local -f docker/Dockerfile --target engine --build-arg "BASE_IMAGE=$PY_BASE" .
build kvroute-redis:local --build-arg "BASE_IMAGE=$REDIS_BASE" docker/redis
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^kvroute-(router|engine|redis):local ' >&2
