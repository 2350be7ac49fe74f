#!/usr/bin/env bash
# Helm, built from its Go module into a version-keyed cache outside the repo, only when missing:
#
#   scripts/helm.sh lint deploy/helm/rlbus     # = helm lint ..., building helm first if needed
#   scripts/helm.sh --path                     # prints the binary's path (builds it if needed)
#
# No prebuilt binary can be downloaded here, so `go install` builds it (about 2 min of CPU,
# once; a warm Go build cache makes it seconds). The -X flag gives `helm version` its full
# version: without it Helm reports "v4.3", and charts with a kubeVersion are checked against that.
# Env: HELM_VERSION (default v4.3.2), RLBUS_CACHE (default ~/.cache/rlbus).
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v4.3.2}
CACHE=${RLBUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlbus}
HELM=$CACHE/bin/helm-$HELM_VERSION

if [[ ! -x $HELM ]]; then
  command -v go >/dev/null || { echo "helm.sh: building Helm needs Go on PATH" >&2; exit 1; }
  echo "helm.sh: building Helm $HELM_VERSION from the Go module proxy (about 2 min, once)" >&2
  mkdir -p "$CACHE/bin"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  GOBIN=$tmp go install \
    -ldflags "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" >&2
  mv "$tmp/helm" "$HELM"
fi

if [[ ${1:-} == --path ]]; then
  echo "$HELM"
else
  exec "$HELM" "$@"
fi
