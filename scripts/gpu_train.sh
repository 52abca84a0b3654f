#!/usr/bin/env bash
# Train the embedded model's draft heads on a GPU machine without network access: the same staged
# payload as scripts/gpu_bench.sh (GGUF + wheels, one device call per part), then one call that
# self-distils a large prompt file on the GPU and fine-tunes the shipped heads on the answers.
#
#   python scripts/build_train_prompts.py --out runs/train_prompts.jsonl --n 3000 --seed 0
#   python scripts/build_train_prompts.py --out runs/calib_prompts.jsonl --n 400 --seed 1 --exclude runs/train_prompts.jsonl
#   python scripts/build_chat_prompts.py train --out runs/train_chat24k.jsonl --n 24000 --seed 0 --exclude runs/calib_prompts.jsonl
#   bash scripts/gpu_bench.sh stage          # prints the receive calls; the last call is instead:
#   run(command="bash scripts/gpu_train.sh train", carry=[".gpu/part-NN", "runs/train_chat24k.jsonl"], timeout_s=590)
#
# `train` answers the prompts greedily (bf16, up to 160 new tokens; GPU_GEN_MIN minutes at most),
# then trains Hydra and Hydra++ together (one process) and Medusa (a second process on the same
# GPU, started once the answers exist), each from the shipped heads in assets/heads, until
# GPU_TRAIN_MIN minutes after the start. What comes back under $OUT (at most 8 files of 16 MiB):
# the two training logs, answers.tgz.part-* (the self-distilled answers, which `entmtp train
# --work-dir` reuses here) and heads.tgz.part-* (the heads, int8 storage, with their reports).
# Join and unpack here with `cat heads.tgz.part-* | tar -xzf -`.
#
# Locally, `GPU_PYTHON=.venv/bin/python GPU_TRAIN_N=64 GPU_TRAIN_MIN=3 bash scripts/gpu_train.sh
# train --device cpu` runs the same path on a few prompts (after `bash scripts/gpu_bench.sh stage`).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_bench.sh
source scripts/gpu_bench.sh
die() { echo "gpu_train: $*" >&2; exit 1; }

DATA=${GPU_TRAIN_DATA:-runs/train_chat24k.jsonl}
TRAIN_MIN=${GPU_TRAIN_MIN:-7.3}   # whole training, both processes, from the start of `train`
GEN_MIN=${GPU_GEN_MIN:-2.5}       # self-distillation at most
GEN_BATCH=${GPU_GEN_BATCH:-512}
BATCH=${GPU_TRAIN_BATCH:-32}
LR=${GPU_TRAIN_LR:-5e-4}
HELD_OUT=${GPU_HELD_OUT:-0.02}  # share of the prompts held out for the final evaluation
N_PROMPTS=${GPU_TRAIN_N:-0}       # 0 = all of DATA

train() {
  local device=cuda
  [ "${1:-}" = "--device" ] && device=${2:?}
  local out=${OUT:-runs/gpu-train} work=${GPU_TRAIN_WORK:-/tmp/entmtp-gpu-train}
  [ -f "$DATA" ] || die "no prompt file $DATA (build it here and carry it)"
  mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
  local t0 end_s
  t0=$(date +%s)
  end_s=$(py_float "$t0 + $TRAIN_MIN * 60")
  unpack "$device"
  local cpu=()
  [ "$device" = cpu ] && cpu=(--cpu --threads 1)
  local common=(--model default --self-distill --num-heads 5 --dtype bfloat16 --mixed-precision bf16
    --gen-max-new-tokens 160 --gen-batch-size "$GEN_BATCH" --held-out "$HELD_OUT" --max-len 512 --max-prompts "$N_PROMPTS"
    --epochs 4 --batch-size "$BATCH" --warmup 50 --final-lr-mult 0.1 --teacher-loss-weight 1.0
    --lm-loss-weight 0.1 --teacher-topk 16 --save-every 0 --eval-every 400 --no-cache-features --seed 0
    --name smollm2-135m --save-dtype int8 --data "$DATA" --init-from assets/heads --lr "$LR" "${cpu[@]}")
  # Hydra + Hydra++: answers the prompts, then trains until the deadline
  "$PY" -m entmtp train "${common[@]}" --heads hydra,hydra++ --num-layers 1 --work-dir "$work/a" \
    --gen-time-budget-min "$GEN_MIN" --time-budget-min "$(minutes_left "$end_s")" --out "$work/heads/hydra-run" \
    > "$out/train-hydra.log" 2>&1 &
  local pid_a=$!
  # Medusa (two blocks per head): starts on the same answers once they are written
  until grep -q -E "^training:|self-distillation: (answered|all)" "$out/train-hydra.log" 2>/dev/null; do
    kill -0 "$pid_a" 2>/dev/null || { tail -5 "$out/train-hydra.log"; die "the Hydra run ended before training (log above)"; }
    sleep 2
  done
  echo "answers written after $(( $(date +%s) - t0 )) s"
  mkdir -p "$work/b" && cp -r "$work/a/selfdistill" "$work/b/"
  (cd "$work/a" && tar -czf - selfdistill) | split -b 15MB -d - "$out/answers.tgz.part-"
  local rc_b=0
  "$PY" -m entmtp train "${common[@]}" --heads medusa --num-layers 2 --work-dir "$work/b" \
    --gen-time-budget-min 0.000001 --time-budget-min "$(minutes_left "$end_s")" --out "$work/heads/medusa-run" \
    > "$out/train-medusa.log" 2>&1 || rc_b=$?
  local rc_a=0
  wait "$pid_a" || rc_a=$?
  echo "hydra run: exit $rc_a; medusa run: exit $rc_b; $(( $(date +%s) - t0 )) s in all"
  tail -n 3 "$out/train-hydra.log" "$out/train-medusa.log"
  [ -d "$work/heads" ] || die "no heads were written"
  (cd "$work" && tar -czf - heads) | split -b 15MB -d - "$out/heads.tgz.part-"
  ls -l "$out"
  [ "$rc_a" = 0 ] && [ "$rc_b" = 0 ] || die "a training run failed (logs above)"
}

py_float() { "$PY" -c "print($1)"; }
minutes_left() { "$PY" -c "import time; print(f'{max(0.2, ($1 - time.time()) / 60):.3f}')"; }

case "${1:-}" in
  train) shift; train "$@" ;;
  *) die "usage: bash scripts/gpu_train.sh train [--device cpu|cuda]  (stage and receive: scripts/gpu_bench.sh)" ;;
esac
