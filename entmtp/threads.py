"""OpenMP waiting and torch's CPU threads, set before torch is imported.

OpenMP's default is to spin-wait between parallel regions. Decoding a small model is thousands
of short regions a second, so when another process holds one of the cores a spinning thread
steals the time the other thread needs: on a 2-core CPU with one busy neighbour, plain decoding
of SmolLM2-135M fell from ~100 to ~30-40 tok/s with 2 spinning threads, while one thread made
~71 idle and busy alike (`python scripts/busy_neighbour.py`). entmtp therefore asks for passive
waiting (`OMP_WAIT_POLICY=PASSIVE`) unless the environment says otherwise, and the thread count
is measured per machine (`entmtp.tuning`: one thread where it decodes as fast as all of them).
"""

from __future__ import annotations

import contextlib
import os
import sys

DEFAULT_WAIT_POLICY = "PASSIVE"
# the policy the environment asked for before entmtp set its default (None: OpenMP's own), for
# processes that should wait as a plain transformers program does (`entmtp.stock_process`)
USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")


def configure_wait_policy() -> str | None:
    """Set OMP_WAIT_POLICY (unless set) before torch loads OpenMP. Returns the policy in force,
    or None when torch was imported first (the policy is then whatever it started with)."""
    if "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        return None
    return os.environ.setdefault("OMP_WAIT_POLICY", DEFAULT_WAIT_POLICY)


def threads_override() -> int | None:
    """ENTMTP_THREADS (a positive int) when set: the thread count, not measured. ValueError otherwise."""
    v = os.environ.get("ENTMTP_THREADS", "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"ENTMTP_THREADS={v!r} must be a positive integer")
    return int(v)


def default_threads() -> int:
    """The thread count torch starts with here (OMP_NUM_THREADS, else the cores)."""
    v = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else (os.cpu_count() or 1)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with torch's CPU thread count at `n` (None: as it is), then restore it."""
    import torch

    old = torch.get_num_threads()
    if n and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


__all__ = ["DEFAULT_WAIT_POLICY", "USER_WAIT_POLICY", "configure_wait_policy", "threads_override", "default_threads", "torch_threads"]
