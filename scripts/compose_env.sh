#!/usr/bin/env bash
# Everything the compose end-to-end test (tests/compose) needs on a machine that cannot reach
# Docker Hub, installed or built here and reused on the next run:
#
#   1. a Docker daemon: Debian's docker.io (dockerd 20.10) if dockerd is missing; started in
#      the background (log: ~/.cache/rlbus/dockerd.log) unless one answers already;
#   2. Docker Compose $COMPOSE_VERSION, built from its Go module (the Go module proxy) into
#      ~/.cache/rlbus/bin: Debian's docker-compose 1.29 rejects docker-compose.yml (it
#      predates the top-level `name:`), and no other compose installs here;
#   3. the images docker-compose.yml takes from Docker Hub, built locally:
#      rlbus-local/debian:bookworm   a minbase rootfs from debootstrap, `docker import`ed
#      rlbus-local/python:3.11       + Debian's Python in a venv: the Dockerfile's BASE_IMAGE
#      rlbus-local/kafka:4.4.0       + Java 17 and the Maven jars `rlbus broker` runs
#      (tests/compose/offline.yml selects them). The rlbus image itself is built by compose.
#
# Needs root (apt-get, dockerd). Idempotent: docker.io, dockerd, Compose and the Debian
# rootfs are reused when present; the Python and Kafka images are rebuilt every run (Maven
# copies the jars again from its cache), which Docker's layer cache makes quick. Prints the Compose command
# and nothing else on stdout, for callers: `compose=$(bash scripts/compose_env.sh)`.
# Env: COMPOSE_VERSION, DEBIAN_MIRROR (default: the mirror apt on this machine uses).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2  # stdout is for the Compose command alone (fd 3); the tools' output goes to stderr

COMPOSE_VERSION=${COMPOSE_VERSION:-v5.6.0}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/rlbus
BUILD=build/compose
DEBIAN_IMAGE=rlbus-local/debian:bookworm
PYTHON_IMAGE=rlbus-local/python:3.11
start=$(date +%s)
say() { echo "[compose-env +$(($(date +%s) - start))s] $*"; }
die() { echo "compose-env: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root: it installs docker.io with apt-get and starts dockerd"
mkdir -p "$CACHE/bin" "$BUILD"

apt_install() {
  say "installing $* (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_daemon() {
  command -v dockerd >/dev/null || apt_install docker.io
  command -v docker >/dev/null || die "docker.io installed no docker CLI"
  if docker info >/dev/null 2>&1; then
    say "Docker daemon answers ($(docker version -f '{{.Server.Version}}'))"
    return
  fi
  say "starting dockerd (log: $CACHE/dockerd.log)"
  # Its own session: the daemon outlives this script and make; later runs reuse it. And
  # not our fd 3: a caller's $(...) would wait for the daemon to close it, forever.
  setsid nohup dockerd >>"$CACHE/dockerd.log" 2>&1 </dev/null 3>&- &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { say "dockerd is up"; return; }
    sleep 1
  done
  tail -20 "$CACHE/dockerd.log" >&2
  die "dockerd did not answer within 60 s (log above)"
}

# `go install module@version` refuses compose's go.mod (it has exclude directives), so the
# module is downloaded and built as the main module, where those directives apply.
ensure_compose() {
  COMPOSE=$CACHE/bin/docker-compose-$COMPOSE_VERSION
  [[ -x $COMPOSE ]] && return
  command -v go >/dev/null || die "building Docker Compose needs Go (>= 1.26) on PATH"
  say "building Docker Compose $COMPOSE_VERSION from the Go module proxy (about a minute)"
  local dir
  dir=$(go mod download -json "github.com/docker/compose/v5@$COMPOSE_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  (cd "$dir" && go build -trimpath -o "$COMPOSE.tmp" \
    -ldflags "-s -w -X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION" ./cmd)
  mv "$COMPOSE.tmp" "$COMPOSE"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# The mirror this machine's apt already reaches (deb822 sources or sources.list).
debian_mirror() {
  [[ -n ${DEBIAN_MIRROR:-} ]] && { echo "$DEBIAN_MIRROR"; return; }
  local sources=(/etc/apt/sources.list.d/*.sources /etc/apt/sources.list)
  grep -hoE '^(URIs:|deb) +https?://[^ ]+' "${sources[@]}" 2>/dev/null |
    awk '!/security/ {print $2; exit}' || true
}

ensure_debian_image() {
  have_image "$DEBIAN_IMAGE" && return
  command -v debootstrap >/dev/null || apt_install debootstrap
  local mirror rootfs=$BUILD/rootfs
  mirror=$(debian_mirror)
  [[ -n $mirror ]] || die "no Debian mirror in /etc/apt; set DEBIAN_MIRROR"
  say "debootstrap --variant=minbase bookworm from $mirror (about 30 s)"
  rm -rf "$rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$BUILD/debootstrap.log" 2>&1 ||
    { tail -20 "$BUILD/debootstrap.log" >&2; die "debootstrap failed"; }
  tar -C "$rootfs" -c . | docker import - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

# Built with the classic builder: it needs no Docker Hub image (BuildKit would fetch the
# Dockerfile frontend for the `# syntax=` line) and no buildx plugin.
build_image() {
  local tag=$1 context=$2 dockerfile=$3
  say "building $tag"
  DOCKER_BUILDKIT=0 docker build -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    -t "$tag" -f "$dockerfile" "$context" >/dev/null
}

ensure_images() {
  ensure_debian_image
  local py=$BUILD/python kafka=$BUILD/kafka lib version
  rm -rf "$py" "$kafka" && mkdir -p "$py" "$kafka/libs"
  cp /etc/ssl/certs/ca-certificates.crt "$py/"
  build_image "$PYTHON_IMAGE" "$py" tests/compose/python/Dockerfile

  lib=$(.venv/bin/python -c 'from rlbus.ops.broker import resolve_jars; print(resolve_jars())')
  cp "$lib"/*.jar "$kafka/libs/"
  mvn -q -B dependency:copy -Dartifact="org.apache.kafka:kafka-tools:$KAFKA_VERSION" \
    -DoutputDirectory="$kafka/libs" >"$BUILD/mvn.log" 2>&1 ||
    { cat "$BUILD/mvn.log"; die "Maven could not resolve kafka-tools $KAFKA_VERSION"; }
  cp tests/compose/kafka/* "$kafka/"
  build_image "$KAFKA_IMAGE" "$kafka" "$kafka/Dockerfile"
}

# The broker's Kafka version and jars, as `make jars` resolved them.
KAFKA_VERSION=$(.venv/bin/python -c 'from rlbus.ops.broker import KAFKA_VERSION as v; print(v)')
KAFKA_IMAGE=rlbus-local/kafka:$KAFKA_VERSION

ensure_daemon
ensure_compose
ensure_images
say "ready: $("$COMPOSE" version --short) with images $DEBIAN_IMAGE, $PYTHON_IMAGE, $KAFKA_IMAGE"
echo "$COMPOSE" >&3
