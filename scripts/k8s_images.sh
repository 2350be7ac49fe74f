#!/usr/bin/env bash
# The images the test cluster of `make k8s-test` runs, built locally with Docker (nothing can
# be pulled here), then imported into the cluster's containerd by tests/k8s/cluster.py:
#
#   rlbus:k8s-test       this checkout's Dockerfile (target cpu) on rlbus-local/python:3.11,
#                        the base image scripts/compose_env.sh builds (it also starts dockerd)
#   rlbus-local/pause:1  the pod sandbox: a static Go binary that waits for SIGTERM
#
# and what the cluster runs on the host from Debian: containerd and runc (a containerd of the
# cluster's own, not Docker's) and the CNI plugins (bridge, host-local).
#
# Docker's layer cache makes a rebuild quick when only the code changed (the torch and
# requirements layers stay). Needs root. Prints nothing on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2
start=$(date +%s)
say() { echo "[k8s-images +$(($(date +%s) - start))s] $*"; }

missing=()
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
if ((${#missing[@]})); then
  say "installing ${missing[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

bash scripts/compose_env.sh >/dev/null  # dockerd, and the base images compose uses offline

say "building rlbus:k8s-test (classic builder; cached layers unless requirements changed)"
DOCKER_BUILDKIT=0 docker build -q --target cpu --build-arg BASE_IMAGE=rlbus-local/python:3.11 \
  --build-arg TORCH_INDEX_URL= -t rlbus:k8s-test . >/dev/null

if ! docker image inspect rlbus-local/pause:1 >/dev/null 2>&1; then
  say "building rlbus-local/pause:1"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp tests/k8s/pause/main.go tests/k8s/pause/Dockerfile "$tmp/"
  (cd "$tmp" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o pause main.go)
  DOCKER_BUILDKIT=0 docker build -q -t rlbus-local/pause:1 "$tmp" >/dev/null
fi
say "images ready"
