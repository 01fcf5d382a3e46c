#!/usr/bin/env bash
# Make sure a Docker engine answers: install Debian's docker.io, docker-compose and debootstrap
# when missing (root + apt), then start dockerd when it is not running. The flags are what
# this kind of sandbox allows: no bridge, no iptables (containers use host networking).
# Storage: overlay2 when the kernel and file system take it, vfs otherwise.
set -euo pipefail
. "$(dirname "$0")/docker-lib.sh"

missing=()
command -v dockerd >/dev/null 2>&1 && [ -x /usr/bin/docker ] || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || "$DOCKER" compose version >/dev/null 2>&1 \
  || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    || kvr_die "need ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
  kvr_log "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  kvr_pick_docker
fi

if "$DOCKER" info >/dev/null 2>&1; then
  exit 0
fi
[ "$(id -u)" = 0 ] || kvr_die "no Docker engine answers and only root can start dockerd"

start_dockerd() {  # $1: storage driver; returns once it answers, or fails after 60 s
  kvr_log "starting dockerd (storage driver $1, log $KVR_DOCKERD_LOG)"
  mkdir -p "$(dirname "$KVR_DOCKERD_LOG")"
  setsid dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
    --storage-driver="$1" >>"$KVR_DOCKERD_LOG" 2>&1 </dev/null &
  local pid=$! i
  for i in $(seq 120); do
    "$DOCKER" info >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.5
  done
  kill "$pid" 2>/dev/null || true
  return 1
}

probe() {  # a container really runs on this storage driver (the static tini docker ships)
  local init dir
  init=$(command -v docker-init || command -v tini-static || true)
  [ -n "$init" ] || return 0
  dir=$(mktemp -d) && cp -L "$init" "$dir/probe"
  tar -C "$dir" -c probe | "$DOCKER" import - kvroute-probe:latest >/dev/null && rm -rf "$dir"
  "$DOCKER" run --rm --network none kvroute-probe:latest /probe --version >/dev/null 2>&1
}

# A dockerd left behind without its socket answering (crashed, stale pid file).
if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
  rm -f /var/run/docker.pid
fi
for driver in ${KVROUTE_DOCKER_STORAGE_DRIVER:-overlay2 vfs}; do
  if start_dockerd "$driver"; then
    # overlay2 may start and still fail to mount a layer: prove it with a real container.
    if [ "$driver" = vfs ] || probe; then
      exit 0
    fi
    kvr_log "overlay2 cannot run a container here; restarting dockerd with vfs"
    kill "$(cat /var/run/docker.pid)" && while [ -e /var/run/docker.pid ]; do sleep 0.5; done
  fi
done
tail -20 "$KVR_DOCKERD_LOG" >&2 || true
kvr_die "dockerd did not start (log: $KVR_DOCKERD_LOG)"
