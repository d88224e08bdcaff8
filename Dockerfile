# syntax=docker/dockerfile:1
#
# One image for every role: the command picks it (`dynabatch scheduler|ps|worker|run`).
#
#   CPU (default):  make image        (docker build -t localhost/dynabatch:0.1.0 .)
#   GPU:            make image-gpu    (docker build --build-arg TORCH_VARIANT=cuda
#                                       --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t localhost/dynabatch:0.1.0-gpu .)
#
# Every package comes from the lock files (lock/VARIANT/, made by scripts/lock-image.sh
# from pyproject.toml and constraints-cpu.txt): exact versions, transitive ones included,
# installed with --require-hashes. torch comes alone from TORCH_INDEX_URL (--index-url:
# that index and no other, so an unreachable CPU index fails the build instead of
# falling back to PyPI's CUDA build), the rest from PIP_INDEX_URL; then the build checks
# that torch is the build it asked for. The CUDA build's runtime comes as nvidia-*
# wheels and needs an NVIDIA driver >= 580 on the node (CUDA 13), nothing in the image.
#
# The base is the official python:3.11-slim-bookworm pinned by digest (its multi-arch
# index, so one pin serves amd64 and arm64): a rebuilt tag cannot change the image
# under the lock files. Both stages share it, so the copied virtualenv's interpreter
# links resolve. To move to a newer base, replace the digest (`docker buildx
# imagetools inspect python:3.11-slim-bookworm` prints the current one). Without a
# registry, scripts/image-base.sh makes a Debian bookworm base locally and the build
# uses it by name: PYTHON_IMAGE=localhost/dynabatch-base:bookworm make image.
#
# A TLS-intercepting proxy's CA certificate reaches pip as the build secret `pip_cert`
# (--secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt); it is not kept in a layer.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:528257d48c1da0dcecc2e725d1ae34498d60c965f1241e39cd6a85a8859bdf84

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

# cpu or cuda: which lock (lock/VARIANT/) and which torch the build must end with.
ARG TORCH_VARIANT=cpu
# PyTorch's CPU wheel index for cpu; PyPI for cuda.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/dynabatch
ENV PATH=/opt/dynabatch/bin:$PATH
WORKDIR /src

# Dependencies first, in their own layer: torch is most of the image, and this
# layer changes only when the lock files do.
COPY lock/ ./lock/
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && pip install --require-hashes --no-deps --index-url "$TORCH_INDEX_URL" -r "lock/$TORCH_VARIANT/torch.txt" \
 && pip install --require-hashes --no-deps --index-url "$PIP_INDEX_URL" -r "lock/$TORCH_VARIANT/rest.txt" \
 && pip check \
 && python -c "import sys, torch; v, want = torch.__version__, sys.argv[1]; \
ok = v.endswith('+cpu') if want == 'cpu' else (torch.version.cuda is not None and not v.endswith('+cpu')); \
print(f'torch {v} (CUDA {torch.version.cuda})'); \
sys.exit(0 if ok else f'torch {v} is not the {want} build this image asked for')" "$TORCH_VARIANT"

# Then dynabatch itself (.dockerignore keeps tests, runs and keys out of the context),
# with the locked setuptools: nothing unhashed is fetched.
COPY . .
RUN pip install --no-deps --no-index --no-build-isolation . \
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
# `docker run --rm localhost/dynabatch:0.1.0` runs the whole demo job in one container.
CMD ["run"]
