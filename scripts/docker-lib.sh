# Sourced by scripts/docker-*.sh: paths, the Docker and Compose commands, logging.
# shellcheck shell=bash
KVR_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Content-keyed artefacts (debootstrap root file systems, wheelhouses) outside the repo.
KVR_CACHE=${KVROUTE_DOCKER_CACHE:-$HOME/.cache/kvroute/docker}
KVR_PROJECT=${KVROUTE_COMPOSE_PROJECT:-kvroute-local}
KVR_COMPOSE_FILE="$KVR_REPO/docker/compose.local.yaml"
KVR_DOCKERD_LOG=${KVROUTE_DOCKERD_LOG:-/var/log/kvroute-dockerd.log}

# Debian's docker CLI (20.10) has BuildKit built in; a newer CLI found first on PATH without
# the buildx plugin only has the legacy builder (which ignores Dockerfile.dockerignore).
kvr_pick_docker() {
  if [ -n "${KVROUTE_DOCKER:-}" ]; then DOCKER=$KVROUTE_DOCKER
  elif [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker
  else DOCKER=docker
  fi
}
kvr_pick_docker
export DOCKER_BUILDKIT=1

kvr_log() { echo "[kvroute docker] $*" >&2; }
kvr_die() { kvr_log "error: $*"; exit 1; }

# docker-compose (v1, Debian's package) or the `docker compose` plugin, on our stack.
kvr_compose() {
  if command -v docker-compose >/dev/null 2>&1; then
    docker-compose -p "$KVR_PROJECT" -f "$KVR_COMPOSE_FILE" "$@"
  else
    "$DOCKER" compose -p "$KVR_PROJECT" -f "$KVR_COMPOSE_FILE" "$@"
  fi
}

# sha256 of its arguments and of the files named by @path arguments, 16 hex digits.
kvr_key() {
  local a
  for a in "$@"; do
    case "$a" in @*) cat "${a#@}" ;; *) printf '%s\n' "$a" ;; esac
  done | sha256sum | cut -c1-16
}
