"""What every head-checkpoint format shares: file names, the one-line error, strict loading of
a state dict into `DraftHeads`."""

from __future__ import annotations

import torch

from .heads import DraftHeads

WEIGHTS_FILE = "heads.safetensors"  # our format's weights
CONFIG_FILE = "config.json"  # ours and the published formats'


class CheckpointError(ValueError):
    """A head checkpoint that cannot be loaded (one-line message naming the problem)."""


def load_state_strict(heads: DraftHeads, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `heads`, failing with one line that names bad keys."""
    own = heads.state_dict()
    # Tensors shared inside `heads` appear under several names; any one of them suffices.
    alias: dict[int, list[str]] = {}
    for k, v in own.items():
        alias.setdefault(v.data_ptr() if v.numel() else id(v), []).append(k)
    unknown = sorted(set(state) - set(own))
    missing = sorted(k for names in alias.values() if not any(n in state for n in names) for k in names[:1])
    if unknown:
        raise CheckpointError(f"{source}: unknown keys {name_list(unknown)}")
    if missing:
        raise CheckpointError(f"{source}: missing keys {name_list(missing)}")
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in state if tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        raise CheckpointError(f"{source}: mis-shaped keys {name_list(bad)} (heads built for another model size?)")
    with torch.no_grad():
        for names in alias.values():
            src = next(state[n] for n in names if n in state)
            own[names[0]].copy_(src)


def name_list(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


__all__ = ["WEIGHTS_FILE", "CONFIG_FILE", "CheckpointError", "load_state_strict", "name_list"]
