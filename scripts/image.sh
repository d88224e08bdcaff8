#!/usr/bin/env bash
# Builds the dynabatch image (`make image`, `make image-gpu`) with docker or podman and
# fails loudly unless torch in it is the build asked for. Prints the build time and size.
#
#   scripts/image.sh cpu|cuda TAG
#
# Environment:
#   CONTAINER_ENGINE   docker or podman (default: podman if installed, else docker)
#   PYTHON_IMAGE       the base (default: the Dockerfile's, the official python:3.11-slim-bookworm
#                      pinned by digest); without a registry, scripts/image-base.sh makes a local
#                      one: PYTHON_IMAGE=localhost/dynabatch-base:bookworm
#   TORCH_INDEX_URL    torch's index (default: PyTorch's CPU index for cpu, PyPI for cuda)
#   TORCH_WHEELS       a folder holding the locked torch wheel (lock/VARIANT/torch.txt's version), served
#                      to the build as its torch index on 127.0.0.1, for a machine that cannot reach
#                      PyTorch's index
#   CONTAINERS_CONF    podman's settings; in a sandbox where podman's default runtime (crun) cannot start
#                      a container, scripts/containers-sandbox.conf (needs Debian's runc); relative or not
#
# Without a registry, docs/operators.md ("The image without a registry") gives the steps in order; each
# missing one stops this script with a line that names it (scripts/container-engine.sh).
#   PIP_INDEX_URL      the index of everything else (default: pip's configured index, else PyPI)
#   PIP_CERT           CA bundle pip must trust (a TLS-intercepting proxy's), passed as a build
#                      secret; default: pip's configured `cert`, if any
set -euo pipefail
source "$(dirname "$0")/container-engine.sh"  # before cd: it resolves a relative CONTAINERS_CONF
cd "$(dirname "$0")/.."
variant="${1:?usage: scripts/image.sh cpu|cuda TAG}"
tag="${2:?usage: scripts/image.sh cpu|cuda TAG}"
engine="${CONTAINER_ENGINE:-$(default_engine)}"
pip_config() { python3 -m pip config get "$1" 2>/dev/null || true; }
case "$variant" in
    cpu) torch_index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;;
    cuda) torch_index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;;
    *) echo "image: unknown variant $variant (cpu or cuda)" >&2; exit 2 ;;
esac
pip_index="${PIP_INDEX_URL:-$(pip_config global.index-url)}"
pip_index="${pip_index:-https://pypi.org/simple}"
cert="${PIP_CERT:-$(pip_config global.cert)}"
base="${PYTHON_IMAGE:-$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)}"
args=(--build-arg "TORCH_VARIANT=$variant" --build-arg "PIP_INDEX_URL=$pip_index" --build-arg "PYTHON_IMAGE=$base"
      --network host)
[ -n "$cert" ] && args+=(--secret "id=pip_cert,src=$cert")
if [ "$engine" = podman ]; then
    # podman builds from what is here, never pulling: the base is local or pulled before, by its digest.
    ready=0
    engine_ready image podman "$base" || ready=$?
    if [ "$ready" = 2 ]; then
        echo "image: the base $base is not here: podman pull $base; without a registry," \
             "scripts/image-base.sh, then PYTHON_IMAGE=localhost/dynabatch-base:bookworm make image" >&2
    fi
    [ "$ready" = 0 ] || exit 1
    args+=(--pull=never --format docker)
else
    engine_ready image "$engine"  # docker pulls the base itself
fi
server="" index=""
trap '[ -n "$server" ] && kill "$server"; [ -n "$index" ] && rm -rf "$index"' EXIT
if [ -n "${TORCH_WHEELS:-}" ]; then
    if ! compgen -G "$TORCH_WHEELS/torch-*.whl" >/dev/null; then
        echo "image: TORCH_WHEELS=$TORCH_WHEELS holds no torch-*.whl (the version lock/$variant/torch.txt names)" >&2
        exit 1
    fi
    # A PEP 503 index of the folder's torch wheels on a free loopback port (the build shares the network).
    index="$(mktemp -d)"; mkdir -p "$index/simple/torch"
    for wheel in "$TORCH_WHEELS"/torch-*.whl; do
        ln -s "$(realpath "$wheel")" "$index/simple/torch/"
        echo "<a href=\"$(basename "$wheel")#sha256=$(sha256sum "$wheel" | cut -d' ' -f1)\">$(basename "$wheel")</a>"
    done > "$index/simple/torch/index.html"
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" >/dev/null 2>&1 &
    server=$!
    torch_index="http://127.0.0.1:$port/simple"
fi
args+=(--build-arg "TORCH_INDEX_URL=$torch_index")
echo "image: $engine build $tag ($variant; torch from $torch_index, the rest from $pip_index)"
start=$(date +%s)
nice -n 10 "$engine" build "${args[@]}" -t "$tag" .
seconds=$(( $(date +%s) - start ))
# The build checked torch already; this checks what the image really runs.
want='import sys, torch; v = torch.__version__
ok = v.endswith("+cpu") if sys.argv[1] == "cpu" else not v.endswith("+cpu")
print(f"torch {v}"); sys.exit(0 if ok else f"image: torch {v} is not the {sys.argv[1]} build")'
"$engine" run --rm --network none --entrypoint python "$tag" -c "$want" "$variant"
size=$("$engine" image inspect --format '{{.Size}}' "$tag")
echo "image: $tag built in ${seconds}s, $(( size / 1000000 )) MB"
