#!/usr/bin/env bash
# Debian packages dynabatch's job and tests use: Fashion-MNIST (the main job's data),
# Prometheus (the monitoring tests), iproute2's ip and tc (the multi-host tests' network
# namespaces and shaped links), and python3-venv where $PYTHON (the Makefile's
# interpreter, python3 by default) cannot make a virtual environment with pip in it
# (Debian's python3 without that package). Installs only what is missing.
set -euo pipefail
need=()
"${PYTHON:-python3}" -c "import ensurepip" 2>/dev/null || need+=(python3-venv)
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need+=(dataset-fashion-mnist)
if [ "${1:-}" = "--test" ]; then
  command -v prometheus >/dev/null || need+=(prometheus)
  { command -v ip && command -v tc; } >/dev/null || need+=(iproute2)
fi
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "dynabatch needs Debian packages: ${need[*]}; run as root: apt-get install -y ${need[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y "${need[@]}" || { $sudo apt-get update && $sudo apt-get install -y "${need[@]}"; }
