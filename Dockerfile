# syntax=docker/dockerfile:1
#
# One image for every rlbus service; the command picks the service:
#
#   docker build -t rlbus:cpu .                       # CPU image (default target)
#   docker build --target vllm -t rlbus:vllm .        # GPU image with vLLM (inference-gpu)
#   docker run --rm rlbus:cpu run inference           # = `rlbus run inference`
#
# Torch: PyPI's Linux torch wheel is the CUDA build (several GB with its nvidia-* wheels).
# The CPU image only needs the CPU build (~200 MB): docker-compose.yml passes
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Left empty (the default), torch comes from PyPI like every other dependency.

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error

# Non-root user. The /data folders are created here, owned by that user, because Docker
# initialises an empty named volume from the image folder it is mounted on (contents and
# ownership): volumes mounted at these paths are then writable without running as root.
# bubblewrap: the reward tier's code sandbox (python_tests) runs each program in its own
# namespaces with a read-only minimal root; without it the sandbox refuses to run anything.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin rlbus \
    && mkdir -p /data/model /data/weights /data/learner \
    && chown -R rlbus:rlbus /data

# A scaled compose service (`--scale rollout=4`) gives every replica the same environment,
# so nothing in it can tell them apart; their hostnames (container ids) differ. Unless
# RLBUS_INSTANCE is set, it defaults to the hostname, so each replica gets its own member
# name: a rollout instance derives its reply partition from it (a hash), a reward instance
# its Kafka transactional id (replicas sharing one would fence each other). A restarted
# container keeps its hostname, hence its transactional id, which is what fencing needs.
RUN printf '%s\n' \
      '#!/bin/sh' \
      ': "${RLBUS_INSTANCE:=${HOSTNAME:-$(cat /etc/hostname)}}"' \
      'export RLBUS_INSTANCE' \
      'exec rlbus "$@"' \
      > /usr/local/bin/rlbus-entrypoint \
    && chmod 0755 /usr/local/bin/rlbus-entrypoint

WORKDIR /app

# The project's dependencies as a requirements file, so that they are an image layer of
# their own: editing the source does not reinstall torch.
COPY pyproject.toml ./
RUN python - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
open("/tmp/requirements.txt", "w").write("\n".join(project["dependencies"]) + "\n")
open("/tmp/requirements-vllm.txt", "w").write(
    "\n".join(project["optional-dependencies"]["vllm"]) + "\n")
EOF

# ---------------------------------------------------------------------------------------------
# GPU image: vLLM pins its own CUDA torch, so torch comes from PyPI together with vLLM.
# Triton (under vLLM) compiles a small C helper on first use: it needs a C compiler.
FROM base AS vllm

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install -r /tmp/requirements.txt -r /tmp/requirements-vllm.txt
COPY . .
RUN pip install --no-deps . && rm -rf build *.egg-info

USER rlbus
ENTRYPOINT ["rlbus-entrypoint"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------
# CPU image (the default target: the last stage).
FROM base AS cpu

ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install torch --index-url "$TORCH_INDEX_URL"; \
    fi \
    && pip install -r /tmp/requirements.txt
COPY . .
RUN pip install --no-deps . && rm -rf build *.egg-info

USER rlbus
# `rlbus-entrypoint` is `rlbus` with RLBUS_INSTANCE defaulted (see above).
ENTRYPOINT ["rlbus-entrypoint"]
CMD ["--help"]
