#!/usr/bin/env bash
# The binaries of a one-node Kubernetes cluster with KEDA, built from Go modules into a
# version-keyed cache outside the repo, each only when missing; prints the bin folder (and
# nothing else on stdout), for callers: `bin=$(bash scripts/k8s_env.sh)`.
#
#   kube-apiserver kube-controller-manager kube-scheduler kubelet   k8s $K8S_VERSION
#   kubectl                                                           (Debian's may be missing or old)
#   etcd                                                              $ETCD_VERSION (what k8s pins)
#   keda keda-adapter                                                 KEDA $KEDA_VERSION
#   keda-crds/                                                        KEDA's CRDs (config/crd/bases)
#
# Neither k8s.io/kubernetes nor etcd's server builds with `go install module@version` (their
# go.mod has replace directives), and the module zip has no staging/ tree: a wrapper module
# requires each one and maps every staging module (k8s.io/api, client-go, ...) to its
# published v0.x release; KEDA's replaces are version pins, copied as they are. Cold: about
# 7.5 min (k8s + etcd) and 7 min (KEDA) on 2 idle cores, peak RSS ~3 GB, ~5 GB of Go caches;
# with a warm Go build cache, seconds. Helm is scripts/helm.sh. Env: K8S_VERSION, KEDA_VERSION,
# RLBUS_CACHE (default ~/.cache/rlbus).
set -euo pipefail
exec 3>&1 1>&2  # stdout is for the bin folder alone

K8S_VERSION=${K8S_VERSION:-1.34.4}
ETCD_VERSION=${ETCD_VERSION:-3.6.4}
KEDA_VERSION=${KEDA_VERSION:-2.20.2}
CACHE=${RLBUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlbus}
BIN=$CACHE/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-keda-$KEDA_VERSION
start=$(date +%s)
say() { echo "[k8s-env +$(($(date +%s) - start))s] $*"; }
command -v go >/dev/null || { echo "k8s_env.sh: needs Go on PATH" >&2; exit 1; }
export GOFLAGS=-mod=mod
mkdir -p "$BIN"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

moddir() { go mod download -json "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'; }

build_k8s() {
  local need=0 b
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl etcd; do
    [[ -x $BIN/$b ]] || need=1
  done
  ((need)) || return 0
  say "building Kubernetes v$K8S_VERSION and etcd v$ETCD_VERSION (cold: ~7.5 min)"
  local km minor=${K8S_VERSION#*.}
  minor=${minor%%.*}
  km=$(moddir "k8s.io/kubernetes@v$K8S_VERSION")
  mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
  { printf 'module rlbus/kbuild\n\ngo 1.24.0\n\ngodebug default=go1.24\n\nrequire (\n'
    printf '\tk8s.io/kubernetes v%s\n\tgo.etcd.io/etcd/server/v3 v%s\n)\n\nreplace (\n' "$K8S_VERSION" "$ETCD_VERSION"
    sed -n '/^replace (/,/^)/p' "$km/go.mod" | awk -v v="0.${K8S_VERSION#1.}" '/=>/{print "\t"$1" => "$1" v"v}'
    echo ')'; } >go.mod
  local ldf="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
  ldf+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION"
  # The version flags matter: without them the server says v0.0.0-master+$Format:%H$, which
  # kubectl cannot parse and which fails every chart's kubeVersion check.
  go build -ldflags "$ldf" -o "$WORK/out/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl
  go build -o "$WORK/out/etcd" go.etcd.io/etcd/server/v3
  mv "$WORK"/out/* "$BIN/"
  say "Kubernetes built"
}

build_keda() {
  [[ -x $BIN/keda && -x $BIN/keda-adapter && -d $BIN/keda-crds ]] && return 0
  say "building KEDA v$KEDA_VERSION (cold: ~7 min)"
  local km
  km=$(moddir "github.com/kedacore/keda/v2@v$KEDA_VERSION")
  mkdir -p "$WORK/keda" && cd "$WORK/keda"
  { printf 'module rlbus/kedabuild\n\ngo 1.26.0\n\nrequire github.com/kedacore/keda/v2 v%s\n\n' "$KEDA_VERSION"
    sed -n '/^replace (/,/^)/p' "$km/go.mod"; } >go.mod
  local ldf="-X=github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION -X=github.com/kedacore/keda/v2/version.GitCommit=local"
  go build -ldflags "$ldf" -o "$WORK/out/keda" github.com/kedacore/keda/v2/cmd/operator
  go build -ldflags "$ldf" -o "$WORK/out/keda-adapter" github.com/kedacore/keda/v2/cmd/adapter
  rm -rf "$WORK/out/keda-crds" && cp -r "$km/config/crd/bases" "$WORK/out/keda-crds" && chmod -R u+w "$WORK/out/keda-crds"
  mv "$WORK"/out/* "$BIN/"
  say "KEDA built"
}

case ${1:-all} in
  k8s) build_k8s ;;
  keda) build_keda ;;
  all) build_k8s; build_keda ;;
  *) echo "usage: k8s_env.sh [k8s|keda|all]" >&2; exit 2 ;;
esac
echo "$BIN" >&3
