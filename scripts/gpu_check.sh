#!/usr/bin/env bash
# The CUDA check as one command on a GPU machine (no weights carried: scripts/gpu_check.py builds a
# random tiny Llama and random heads). Installs what the machine lacks, then runs the check; the
# JSON lands in $OUT (or runs/gpu-check). Under 5 minutes on one GPU.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import transformers, sys; sys.exit(0 if transformers.__version__ >= '5.24' else 1)" 2>/dev/null \
  || pip install -q "transformers==5.24.0" accelerate safetensors networkx plotly pandas gguf filelock 2>&1 | tail -2
pip install -q --no-deps -e . 2>&1 | tail -1 || true
exec python scripts/gpu_check.py "$@"
