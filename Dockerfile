# syntax=docker/dockerfile:1
#
# One image for every role: the command picks it (`dynabatch scheduler|ps|worker|run`).
#
#   CPU (default):  docker build -t dynabatch:0.1.0 .
#   GPU:            docker build --build-arg TORCH_INDEX_URL= -t dynabatch:0.1.0-gpu .
#
# The CPU build installs with constraints-cpu.txt, whose torch==2.13.0 resolves to
# the +cpu wheel from the PyTorch CPU index (a +cpu local version sorts above the
# plain one, so pip takes it). With TORCH_INDEX_URL empty the same pins resolve on
# PyPI alone, where torch==2.13.0 for Linux x86_64 is the CUDA build (its CUDA
# runtime comes as nvidia-* wheels; the node supplies only the driver, through the
# NVIDIA container toolkit), so no nvidia/cuda base image is needed.
#
# The base is pinned to bookworm: `python:3.11-slim` follows Debian's newest
# release, and both stages must share one Python for the copied virtualenv.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

# PyTorch's CPU wheel index; empty for the CUDA build from PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/dynabatch
ENV PATH=/opt/dynabatch/bin:$PATH
WORKDIR /src

# Dependencies first, in their own layer: torch is most of the image, and this
# layer changes only when pyproject.toml or the pins do.
COPY pyproject.toml constraints-cpu.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -c constraints-cpu.txt -r requirements.txt

# Then dynabatch itself (.dockerignore keeps tests, runs and keys out of the context).
COPY . .
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -c constraints-cpu.txt . \
 && dynabatch --version

# -------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE} AS runtime

# 1: include Fashion-MNIST (Debian bookworm main: dataset-fashion-mnist, about
# 30 MB, installs /usr/share/datasets/fashion-mnist, where the loader looks).
# 0: leave it out and mount the data instead (--data-dir / DYNABATCH_DATA_DIR).
ARG WITH_FASHION_MNIST=1

# libstdc++6: torch's wheels link against the system's (slim may not carry it).
# The user's fixed UID/GID 10001 is the one the Kubernetes manifests run as.
# Unpinned Debian versions: bookworm's point releases carry only security fixes.
# hadolint ignore=DL3008
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends libstdc++6; \
    if [ "$WITH_FASHION_MNIST" = "1" ]; then \
        apt-get install -y --no-install-recommends dataset-fashion-mnist; \
    fi; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --gid 10001 dynabatch; \
    useradd --uid 10001 --gid 10001 --home-dir /var/lib/dynabatch \
        --no-create-home --shell /usr/sbin/nologin dynabatch; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/dynabatch /var/lib/dynabatch/checkpoints

COPY --from=build /opt/dynabatch /opt/dynabatch

# HOME and MPLCONFIGDIR under /tmp: with a read-only root filesystem (as the
# Kubernetes manifests run it) /tmp is the only writable place (an emptyDir).
ENV PATH=/opt/dynabatch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib

LABEL org.opencontainers.image.title="dynabatch" \
      org.opencontainers.image.description="Distributed PyTorch training with speed-aware dynamic batch sizes (scheduler, parameter-server shards, workers)" \
      org.opencontainers.image.licenses="Apache-2.0"

WORKDIR /var/lib/dynabatch
# Numeric, so that Kubernetes' runAsNonRoot can check it without /etc/passwd.
USER 10001:10001

# Control (scheduler), data (ps) and metrics ports of the Kubernetes manifests.
EXPOSE 5555 5600 9100

# No HEALTHCHECK: the metrics port is chosen per process (0 = any free port unless
# DYNABATCH_METRICS_PORT is set), and Kubernetes ignores HEALTHCHECK; its probes
# call /healthz and /readyz on the metrics port instead.
ENTRYPOINT ["dynabatch"]
# `docker run --rm dynabatch:0.1.0` runs the whole demo job in one container.
CMD ["run"]
