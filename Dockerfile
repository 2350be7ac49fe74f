# syntax=docker/dockerfile:1
#
# One image for every rlbus service; the command picks the service:
#
#   docker build --target cpu -t rlbus:cpu .          # CPU image (also the default target)
#   docker build --target vllm -t rlbus:vllm .        # GPU image with vLLM (inference-gpu)
#   docker run --rm rlbus:cpu run inference           # = `rlbus run inference`
#
# Torch: PyPI's Linux torch wheel is the CUDA build (several GB with its nvidia-* wheels).
# The CPU image only needs the CPU build (~200 MB): docker-compose.yml passes
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Left empty (the default), torch comes from PyPI like every other dependency.
#
# BASE_IMAGE: any Debian-based image with `python` and `pip` on PATH; the default is the
# official slim image. tests/compose/ builds one from a Debian rootfs for machines that
# cannot reach Docker Hub (see tests/compose/offline.yml).
#
# Written for the classic builder too (no heredocs, no RUN --mount; the syntax line above is
# then ignored), and it builds the stages up to --target in file order: so the vllm stage
# comes after cpu, and building cpu never installs vLLM.

ARG PYTHON_VERSION=3.11
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base

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

# ---------------------------------------------------------------------------------------------
# The project's dependencies as requirements files, read from pyproject.toml. The images
# copy these files, not pyproject.toml: the layers that install torch (GBs) and the rest are
# then rebuilt only when the requirements themselves change, not on every pyproject edit.
FROM base AS requirements

COPY pyproject.toml ./
# with the lora extra (peft, pure Python, under 1 MB with accelerate): the learner trains
# and the hf engine serves LoRA adapters in either image (RLBUS_LORA__RANK)
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print(*p["dependencies"], *p["optional-dependencies"]["lora"], sep="\n")' \
    > /tmp/requirements.txt \
    && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print(*p["optional-dependencies"]["vllm"], sep="\n")' > /tmp/requirements-vllm.txt \
    && grep -E '^torch($|[^a-zA-Z0-9._-])' /tmp/requirements.txt > /tmp/torch.txt

# ---------------------------------------------------------------------------------------------
# CPU image (compose's `target: cpu`, and the default target through the last stage below).
FROM base AS cpu

ARG TORCH_INDEX_URL=""
# torch alone first: its layer survives changes to every other requirement.
COPY --from=requirements /tmp/torch.txt /tmp/
RUN pip install -r /tmp/torch.txt ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY --from=requirements /tmp/requirements.txt /tmp/
RUN pip install -r /tmp/requirements.txt
COPY . .
RUN pip install --no-deps . && rm -rf build *.egg-info

USER rlbus
# `rlbus-entrypoint` is `rlbus` with RLBUS_INSTANCE defaulted (see above).
ENTRYPOINT ["rlbus-entrypoint"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------
# GPU image: vLLM pins its own CUDA torch, so torch comes from PyPI together with vLLM.
# Triton (under vLLM) compiles a small C helper on first use: it needs a C compiler.
FROM base AS vllm

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=requirements /tmp/requirements.txt /tmp/requirements-vllm.txt /tmp/
RUN pip install -r /tmp/requirements.txt -r /tmp/requirements-vllm.txt
COPY . .
RUN pip install --no-deps . && rm -rf build *.egg-info

USER rlbus
ENTRYPOINT ["rlbus-entrypoint"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------
# `docker build .` with no --target builds the last stage: the CPU image. (BuildKit builds
# only what that needs; the classic builder would build vllm too, hence `--target cpu`.)
FROM cpu AS default
