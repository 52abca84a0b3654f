#!/usr/bin/env bash
# Reproduce the embedded artefacts: the trained heads (assets/heads/), the calibrated trees and
# entropy banks (trees/), and the benchmark tables of README.md. CPU, about 1.5 h on 2 cores.
# Run inside the project environment (bash run.sh install; . .venv/bin/activate).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1

# 1. prompts: training (3000) and calibration (400, none of the training prompts); both exclude
#    the held-out benchmark set entmtp/prompts/bench.jsonl
python scripts/build_train_prompts.py --out runs/train_prompts.jsonl --n 3000 --seed 0
python scripts/build_train_prompts.py --out runs/calib_prompts.jsonl --n 400 --seed 1 --exclude runs/train_prompts.jsonl

# 2. heads: self-distillation (22 min), features, joint training of the three kinds (55 min in all)
python -m entmtp train \
  --model default --data runs/train_prompts.jsonl --self-distill \
  --heads medusa,hydra,hydra++ --num-heads 4 --num-layers 1 --draft-vocab 8192 \
  --dtype bfloat16 --mixed-precision bf16 --threads 1 \
  --gen-max-new-tokens 160 --gen-batch-size 32 --gen-time-budget-min 22 \
  --held-out 0.05 --max-len 512 --epochs 4 --batch-size 4 \
  --lr 1e-3 --warmup 30 --final-lr-mult 0.1 \
  --teacher-loss-weight 1.0 --lm-loss-weight 0.1 --teacher-topk 16 \
  --time-budget-min 55 --eval-every 300 --save-every 200 --seed 0 \
  --work-dir runs/train-work --out assets/heads --name smollm2-135m --save-dtype bfloat16

# 3. trees and entropy banks per head kind (bfloat16 latency model)
for heads in hydra medusa hydra++; do
  python -m entmtp search --model default --heads "$heads" --data runs/calib_prompts.jsonl \
    --budgets 4,8,16,32,64 --dtype bfloat16 --threads 1 --max-prompts 200 --max-new-tokens 64 \
    --out "runs/search-${heads/++/pp}" --save-trees-to trees/
done

# 4. benchmarks on the held-out bench set
python -m entmtp bench --model default --dtype bfloat16 --methods hf,pld,baseline,medusa,hydra,hydra++,entmtp,dynamic \
  --max-new-tokens 128 --per-category 2 --out runs/bench-bf16
python -m entmtp bench --model default --dtype float32 --methods hf,baseline,medusa,hydra,entmtp \
  --max-new-tokens 128 --per-category 2 --out runs/bench-fp32
