#!/usr/bin/env bash
# The Dockerfile's base image made locally, for machines that reach a Debian mirror but no
# container registry: a minimal Debian bookworm with Python 3.11 (mmdebstrap), imported into
# podman (or docker) under the name the Dockerfile's FROM uses, so `make image` finds it
# without pulling. Where a registry is reachable, do not use this: pull the real
# python:3.11-slim-bookworm and pin it by digest (BASE_IMAGE=python:3.11-slim-bookworm@sha256:...).
#
#   scripts/image-base.sh [ENGINE]      ENGINE: podman (default when installed) or docker
#
# Needs root and: apt-get install -y mmdebstrap (podman: podman buildah uidmap fuse-overlayfs).
# The result is Debian's python3 (3.11.2 in bookworm) under /usr/bin, which is what the
# Dockerfile's two stages share; both stages use the same base, so the copied virtual
# environment's interpreter links resolve.
set -euo pipefail
ENGINE="${1:-$(command -v podman >/dev/null && echo podman || echo docker)}"
TAG="${BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if ! command -v mmdebstrap >/dev/null; then
    echo "image-base: mmdebstrap is not installed (apt-get install -y mmdebstrap)" >&2
    exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# --variant=minbase: essential packages and apt only; then Python with venv and pip, and CA certificates.
mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$work/rootfs.tar" "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
    "deb ${MIRROR%/debian}/debian-security $SUITE-security main"
"$ENGINE" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$work/rootfs.tar" "$TAG"
"$ENGINE" image inspect --format '{{.Id}}' "$TAG" | sed "s|^|image-base: $TAG is |"
