#!/usr/bin/env bash
# The CUDA check as one call on a GPU machine that cannot download anything. No weights travel:
# scripts/gpu_check.py builds a random tiny Llama and random heads. The JSON lands in $OUT (or
# runs/gpu-check). Under 5 minutes on one GPU.
#
#   bash scripts/gpu_check.sh stage     # here, with network: the wheels the GPU machine lacks -> .gpu/whl
#   bash scripts/gpu_check.sh           # there, with .gpu/whl carried along: install them offline, run
#
# The working tree with the heads in their int8 storage is ~40 MB, the wheels ~12 MB, so one call
# carries both (its limit is 64 MiB). Where the machine already has transformers 5.24, nothing is
# installed and no wheels are needed.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${GPU_WHEELS:-.gpu/whl}
# transformers' own floor for regex may be above the image's, so regex travels too (a cp312 wheel)
WHEELS=(transformers==5.24.0 regex==2026.11.19)
PY=${GPU_PYTHON:-python3}   # a GPU image's python3 holds its CUDA torch

die() { echo "gpu_check: $*" >&2; exit 1; }

stage() {
  local py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  rm -rf "$WHL" && mkdir -p "$WHL"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$WHL" "${WHEELS[@]}" \
    || die "could not download ${WHEELS[*]}"
  echo "staged $(ls "$WHL" | wc -l) wheels ($(du -sh "$WHL" | cut -f1)) in $WHL; the device call:"
  echo "  run(command=\"bash scripts/gpu_check.sh\", carry=[\"$WHL\"], timeout_s=420)"
}

check() {
  if ! "$PY" -c "import transformers, sys; v = tuple(int(x) for x in transformers.__version__.split('.')[:2]); sys.exit(0 if v >= (5, 24) else 1)" 2>/dev/null; then
    ls "$WHL"/*.whl > /dev/null 2>&1 || die "transformers 5.24 is not installed and no wheels are in $WHL (bash scripts/gpu_check.sh stage, then carry $WHL)"
    local site=/tmp/entmtp-site
    rm -rf "$site" && mkdir -p "$site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHL"/*.whl \
      || die "the carried wheels do not install"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 ENTMTP_CACHE=${ENTMTP_CACHE:-/tmp/entmtp-cache}
  exec "$PY" scripts/gpu_check.py "$@"
}

case "${1:-}" in
  stage) stage ;;
  -h|--help) sed -n 2,11p "$0" ;;
  *) check "$@" ;;
esac
