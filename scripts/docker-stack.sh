#!/usr/bin/env bash
# The Compose stack on this machine (docker/compose.local.yaml):
#   docker-stack.sh up     Docker engine, images, Redis + 3 engines + 2 routers, wait healthy
#   docker-stack.sh down   remove its containers and volume (images stay: the next up is fast)
#   docker-stack.sh status one line per container: name, state, health
set -euo pipefail
. "$(dirname "$0")/docker-lib.sh"
cd "$KVR_REPO"

ROUTERS=(http://127.0.0.1:8080 http://127.0.0.1:8081)
PORTS=(8080 8081 16379 18000 18001 18002 18010 18011 18012)
WAIT_S=${KVROUTE_STACK_WAIT_S:-180}

containers() {
  "$DOCKER" ps -a -q --filter "label=com.docker.compose.project=$KVR_PROJECT"
}

status() {
  local ids
  ids=$(containers)
  [ -n "$ids" ] || return 0
  # shellcheck disable=SC2086
  "$DOCKER" inspect -f \
    '{{index .Config.Labels "com.docker.compose.service"}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}}' \
    $ids | sort
}

busy_ports() {  # ports of ours that something outside the stack already listens on
  local listening p
  listening=$(ss -Hltn 2>/dev/null | awk '{print $4}' | sed 's/.*://' | sort -u)
  for p in "${PORTS[@]}"; do
    grep -qx "$p" <<<"$listening" && echo "$p"
  done
  return 0
}

up() {
  local t0=$SECONDS
  bash scripts/docker-daemon.sh
  kvr_pick_docker  # it may just have installed Debian's CLI
  kvr_log "Docker engine ready after $((SECONDS - t0)) s"
  bash scripts/docker-images.sh
  kvr_log "images ready after $((SECONDS - t0)) s"
  if [ -z "$(containers)" ]; then
    local busy
    busy=$(busy_ports)
    [ -z "$busy" ] || kvr_die "ports already in use on this machine: $(echo $busy) (see docker/compose.local.yaml)"
  fi
  kvr_log "starting the stack (project $KVR_PROJECT)"
  # Up waits for Redis and the engines to be healthy before it starts the routers.
  if ! kvr_compose up -d --no-build --remove-orphans >"$KVR_CACHE/logs/compose-up.log" 2>&1; then
    tail -20 "$KVR_CACHE/logs/compose-up.log" >&2
    kvr_compose logs --tail 30 >&2 || true
    kvr_die "docker-compose up failed (log: $KVR_CACHE/logs/compose-up.log)"
  fi
  local deadline=$((SECONDS + WAIT_S)) st
  while :; do
    st=$(status)
    if [ "$(grep -c ' running healthy$' <<<"$st")" = 6 ]; then break; fi
    if [ $SECONDS -ge $deadline ] || grep -qE ' (exited|dead) | unhealthy$' <<<"$st"; then
      echo "$st" >&2
      kvr_compose logs --tail 30 >&2 || true
      kvr_die "the stack did not become healthy"
    fi
    sleep 1
  done
  kvr_log "stack healthy in $((SECONDS - t0)) s:"
  status | sed 's/^/  /' >&2
  printf '%s\n' "${ROUTERS[@]}"
}

down() {
  if "$DOCKER" info >/dev/null 2>&1; then
    kvr_compose down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1 || true
    local left
    left=$(containers)
    # shellcheck disable=SC2086
    [ -z "$left" ] || "$DOCKER" rm -f -v $left >/dev/null
  fi
  kvr_log "stack removed"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
