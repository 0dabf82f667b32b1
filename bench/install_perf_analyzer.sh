#!/usr/bin/env bash
# bench/install_perf_analyzer.sh [VENV]  (default: .bench-venv)
#
# Installs Triton's perf_analyzer as VENV/bin/perf_analyzer on Debian 12 / x86_64.
# Why this way:
#  - the PyPI package `perf-analyzer` is an empty placeholder; the binary ships inside
#    tritonclient's manylinux wheels, and 2.51.0 is the newest that runs on glibc 2.36;
#  - it links libb64.so.0d (Debian package libb64-0d, unpacked into VENV, not installed
#    system-wide) and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12; loads without a GPU);
#  - a small wrapper sets LD_LIBRARY_PATH. Only VENV and a temporary folder are written.
set -euo pipefail
VENV=${1:-.bench-venv}
TRITONCLIENT_VERSION=2.51.0

if [[ -x $VENV/bin/perf_analyzer ]] && "$VENV/bin/perf_analyzer" --version >/dev/null 2>&1; then
  exit 0
fi
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip_install install nvidia-cuda-runtime-cu12

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip_install download --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$work" "tritonclient==$TRITONCLIENT_VERSION"
python3 -m zipfile -e "$work"/tritonclient-*manylinux*.whl "$work/wheel"

command -v apt-get >/dev/null || { echo "install_perf_analyzer: needs apt-get for libb64-0d" >&2; exit 1; }
(cd "$work" && { apt-get download libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get download libb64-0d; }; })
dpkg -x "$work"/libb64-0d_*.deb "$work/libb64"

mkdir -p "$VENV/opt/perf_analyzer/lib"
install -m 755 "$work/wheel/tritonclient-$TRITONCLIENT_VERSION.data/data/bin/perf_analyzer" \
  "$VENV/opt/perf_analyzer/perf_analyzer.bin"
cp "$work"/libb64/usr/lib/*/libb64.so.0d "$VENV/opt/perf_analyzer/lib/"
cat >"$VENV/bin/perf_analyzer" <<'WRAPPER'
#!/bin/sh
root="$(cd "$(dirname "$0")/.." && pwd)"
cudart="$(ls -d "$root"/lib/python3*/site-packages/nvidia/cuda_runtime/lib 2>/dev/null | head -n 1)"
export LD_LIBRARY_PATH="$root/opt/perf_analyzer/lib:$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$root/opt/perf_analyzer/perf_analyzer.bin" "$@"
WRAPPER
chmod +x "$VENV/bin/perf_analyzer"
"$VENV/bin/perf_analyzer" --version | head -n 1
