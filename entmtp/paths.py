"""Where entmtp keeps what it computes once per machine (converted models, built kernels,
tuning profiles, latency models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ENTMTP_CACHE`` if set, else ``$XDG_CACHE_HOME/entmtp``, else ``~/.cache/entmtp``."""
    env = os.environ.get("ENTMTP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "entmtp"
    return Path.home() / ".cache" / "entmtp"


__all__ = ["cache_dir"]
