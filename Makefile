# rlbus: the two commands a new user needs are `make demo` and `make test`.
# Both install what they need: a virtualenv (.venv, reused), the package with its dev extras
# (pip's cache is reused, so torch downloads once), Java + Maven and bubblewrap if missing
# (apt), and the Kafka jars (resolved by Maven into ~/.cache/rlbus, reused). `make test` also
# builds vLLM's own virtualenv (.venv-vllm, reused) for the vllm engine's tests.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
PYTEST_ARGS ?=
# flags of `rlbus demo`, e.g. make demo DEMO_ARGS="--lora 8"
DEMO_ARGS ?=

.PHONY: demo test unit integration lint loadtest up down install jars java bwrap clean vllm-env \
        compose-test k8s-test

install: $(STAMP) bwrap

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

java:
	@command -v java >/dev/null && command -v mvn >/dev/null || { \
	  echo "installing Java 17 and Maven (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null; }

bwrap:
	@command -v bwrap >/dev/null || { \
	  echo "installing bubblewrap for the code sandbox (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; }

# vLLM pins its own torch, so RLBUS_ENGINE=vllm runs from a virtualenv of its own; on a machine
# without a GPU, vLLM's CPU backend. About 2-3 min and 6 GB the first time, ~10 s after.
vllm-env:
	VLLM_VENV=$(VLLM_VENV) PY=$(PY) bash scripts/vllm_env.sh

jars: install java
	$(BIN)/python -c "from rlbus.ops.broker import resolve_jars; print('kafka jars:', resolve_jars())"

# The tree is checked as it is: `rlbus` spans two source roots (shared/, services/) whose
# folder paths are import paths, so mypy follows every import from pyproject.toml's mypy_path,
# and lint-imports holds the layering contract of [tool.importlinter] (docs/architecture.md).
lint: install
	$(BIN)/ruff check shared services tests loadtest examples
	$(BIN)/mypy shared services
	$(BIN)/lint-imports

unit: install
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration: jars
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

test: lint jars vllm-env
	$(BIN)/pytest tests $(PYTEST_ARGS)

# `docker compose up` for real, offline: a Docker daemon, Compose and the local base and Kafka
# images (scripts/compose_env.sh; root), then tests/compose: the stack scaled, a rollout and
# an inference container killed mid-run, nothing lost or trained twice, nothing left after
# `down -v`. A target of its own, run by .ci/run after `make test` rather than inside it: it
# needs root and a Docker daemon, which `make test` never did, and it takes minutes on its own:
# 11.5 min measured on a fresh machine (Docker, Compose and a 6.4 GB image built: PyPI's torch
# is the CUDA build), 2-4 min warm. RLBUS_SKIP_DOCKER=1 skips it, saying so.
compose-test: jars
	@if [ "$$RLBUS_SKIP_DOCKER" = 1 ]; then \
	  echo "compose-test: RLBUS_SKIP_DOCKER=1, not installing Docker"; \
	  $(BIN)/pytest tests/compose -m docker $(PYTEST_ARGS); \
	else \
	  compose=$$(bash scripts/compose_env.sh) && \
	  COMPOSE_CMD=$$compose $(BIN)/pytest tests/compose -m docker -s $(PYTEST_ARGS); \
	fi

# The Helm chart (deploy/helm/rlbus) for real: helm lint/template over tests/k8s/values, every
# rendered object validated by a real API server with KEDA's CRDs, then a one-node cluster of
# host processes (etcd, apiserver, controller-manager, scheduler, containerd, kubelet, KEDA):
# `helm install`, training with rollout scaled to 2 and members killed, KEDA scaling on lag.
# Builds Helm, Kubernetes and KEDA from Go modules into ~/.cache/rlbus (about 20 min of CPU
# cold, seconds warm) and the images with Docker (scripts/compose_env.sh); needs root. Not
# part of `make test`. Measured times: docs/kubernetes.md.
k8s-test: jars
	helm=$$(bash scripts/helm.sh --path) && bin=$$(bash scripts/k8s_env.sh) && \
	  bash scripts/k8s_images.sh && \
	  RLBUS_HELM=$$helm RLBUS_K8S_BIN=$$bin RLBUS_K8S_REQUIRED=1 \
	  $(BIN)/pytest tests/k8s -m k8s -s $(PYTEST_ARGS)

demo: jars
	$(BIN)/rlbus demo $(DEMO_ARGS)

loadtest: jars
	$(BIN)/python -m loadtest

up:
	docker compose up --build

down:
	docker compose down -v

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache runs
