"""Where entmtp's files live: the embedded heads it ships, and what it computes once per machine
(converted models, built kernels, tuning profiles, latency models)."""

from __future__ import annotations

import os
from pathlib import Path

# the embedded heads of the default model: kind -> directory under DEFAULT_HEADS_DIR
DEFAULT_HEADS_DIR = Path(__file__).resolve().parent.parent / "assets" / "heads"
HEAD_KINDS = {
    "medusa": "smollm2-135m-medusa",
    "hydra": "smollm2-135m-hydra",
    "hydra++": "smollm2-135m-hydrapp",
}


def cache_dir() -> Path:
    """``$ENTMTP_CACHE`` if set, else ``$XDG_CACHE_HOME/entmtp``, else ``~/.cache/entmtp``."""
    env = os.environ.get("ENTMTP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "entmtp"
    return Path.home() / ".cache" / "entmtp"


__all__ = ["DEFAULT_HEADS_DIR", "HEAD_KINDS", "cache_dir"]
