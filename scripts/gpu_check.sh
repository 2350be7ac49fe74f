#!/usr/bin/env bash
# The vLLM checks on a machine with a CUDA GPU, in one go: builds .venv-vllm with the regular
# (CUDA) vllm wheel and the main .venv, runs tests/integration/test_vllm_engine.py (engine:
# generation, logprobs against the hf engine, in-place reload; the inference service over a
# local Kafka broker), and prints the figures the tests measure (start-up, first batch,
# reload, |Δ logprob|). Needs PyPI, and Java + Maven for the broker (`make jars` installs
# them with apt-get). Exits non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
VLLM_BACKEND=cuda bash scripts/vllm_env.sh
echo "gpu-check: vllm env in $(($(date +%s) - t0))s"
make jars
mkdir -p build
t1=$(date +%s)
# float32 throughout, as on the CPU; the full output stays in build/gpu_check.log
.venv/bin/pytest tests/integration/test_vllm_engine.py -s -q -p no:cacheprovider 2>&1 |
  tee build/gpu_check.log | grep -E "^vllm |Δ logprob|passed|failed|error"
echo "gpu-check: vllm tests in $(($(date +%s) - t1))s"
