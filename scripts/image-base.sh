#!/usr/bin/env bash
# The Dockerfile's base image made locally, for machines that reach a Debian mirror but no
# container registry: a minimal Debian bookworm with Python 3.11 (mmdebstrap), imported into
# podman (or docker) as localhost/dynabatch-base:bookworm (BASE_IMAGE: another name). The
# Dockerfile's default base is the official image pinned by digest, which a local image can
# never match, so the build is told to use this one by name:
#
#   scripts/image-base.sh [ENGINE]      ENGINE: podman (default when installed) or docker
#   PYTHON_IMAGE=localhost/dynabatch-base:bookworm make image
#
# Where a registry is reachable, do not use this: the build pulls the pinned official base.
#
# Needs root and: apt-get install -y mmdebstrap (podman: podman buildah uidmap fuse-overlayfs; runc
# where CONTAINERS_CONF=scripts/containers-sandbox.conf is needed: a sandbox in which podman's default
# runtime, crun, cannot start a container). docs/operators.md, "The image without a registry", gives
# every step in order; this script ends by starting a container of the base, so a missing step shows here.
# The result is Debian's python3 (3.11.2 in bookworm) under /usr/bin, which is what the
# Dockerfile's two stages share; both stages use the same base, so the copied virtual
# environment's interpreter links resolve.
set -euo pipefail
source "$(dirname "$0")/container-engine.sh"
ENGINE="${1:-$(default_engine)}"
TAG="${BASE_IMAGE:-localhost/dynabatch-base:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if ! command -v mmdebstrap >/dev/null; then
    echo "image-base: mmdebstrap is not installed (apt-get install -y mmdebstrap)" >&2
    exit 1
fi
engine_ready image-base "$ENGINE"
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
engine_ready image-base "$ENGINE" "$TAG"
echo "image-base: build with it: PYTHON_IMAGE=$TAG make image"
