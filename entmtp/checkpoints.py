"""Head checkpoints: our format (safetensors + config.json) and the published formats.

Our format, a directory:
* ``config.json``  -- `HeadsConfig` fields (``"format": "entmtp-heads/1"``) plus ``meta``
  (training recipe, metrics, provenance).
* ``heads.safetensors`` -- the heads' own weights only. A shared base ``lm_head`` and the
  base embedding are never stored. Weights are float32, bfloat16, or (``save_heads(dtype="int8")``)
  large matrices as int8 with one float scale per output row (``<name>`` + ``<name>.row_scale``):
  half the bytes of bfloat16, dequantized when loaded.

Loading is strict: unknown, missing or mis-shaped keys raise `CheckpointError`, whose
one-line message names them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from . import published  # the published formats live apart from ours
from .heads import DraftHeads, HeadsConfig
from .heads_io import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_state_strict, name_list

def _unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with each shared tensor stored once (safetensors refuses aliases)."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in module.state_dict(keep_vars=False).items():
        ptr = v.data_ptr() if v.numel() else id(v)
        if ptr in seen:
            continue
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


ROW_SCALE = ".row_scale"  # suffix of an int8 matrix's per-row scales
INT8_MIN_NUMEL = 1 << 16  # smaller tensors (norms, biases, small matrices) stay bfloat16


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] float -> (q [rows, cols] int8, scale [rows] float32), w ~= q * scale[:, None]
    (symmetric, round to nearest)."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo `quantize_rows` for every ``<name>`` that has a ``<name>.row_scale``."""
    out = {}
    for k, v in state.items():
        if k.endswith(ROW_SCALE):
            continue
        scale = state.get(k + ROW_SCALE)
        out[k] = v.float() * scale.float()[:, None] if scale is not None else v
    return out


def compact_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The int8 storage: matrices of >= INT8_MIN_NUMEL elements per-row int8, the rest bfloat16."""
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() == 2 and v.numel() >= INT8_MIN_NUMEL:
            out[k], out[k + ROW_SCALE] = quantize_rows(v)
        else:
            out[k] = v.to(torch.bfloat16) if v.is_floating_point() else v
    return out


def save_heads(heads: DraftHeads, directory: str | Path, meta: Optional[dict[str, Any]] = None,
               dtype: Optional[torch.dtype | str] = None) -> Path:
    """Write `heads` in our format; returns the directory. dtype: None (as they are), a float
    dtype, or "int8" (large matrices per-row int8, see `compact_state`)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = _unique_state(heads)
    if dtype == "int8":
        state = compact_state(state)
    elif dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    tmp = d / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "entmtp-heads/1"})
    tmp.replace(d / WEIGHTS_FILE)
    cfg = heads.config.to_dict()
    cfg["meta"] = meta or {}
    (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=1, default=str) + "\n")
    return d


def read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return data
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def load_heads(path: str | Path, base_config=None) -> DraftHeads:
    """Load heads from a directory in our format or a published Medusa / Hydra format.

    `base_config` (the base model's transformers config) lets the loader check that the
    heads fit the base (hidden size, vocabulary); published Hydra++ checkpoints need it for
    the prefix layer's shape (else it is looked up from their `base_model_name_or_path`).
    """
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"head checkpoint not found: {d}")
    if d.is_file():
        d = d.parent
    raw = read_config(d / CONFIG_FILE)
    if (d / WEIGHTS_FILE).is_file() and str(raw.get("format", "")).startswith("entmtp-heads"):
        heads = _load_ours(d, raw)
        published.check_base(heads.config, base_config, str(d))
        return heads
    return published.load_published(d, raw, base_config=base_config)


def _load_ours(d: Path, raw: dict) -> DraftHeads:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fields = {k: v for k, v in raw.items() if k in HeadsConfig.__dataclass_fields__}
    unknown = sorted(set(raw) - set(HeadsConfig.__dataclass_fields__) - {"meta"})
    if unknown:
        raise CheckpointError(f"{d / CONFIG_FILE}: unknown config fields {name_list(unknown)}")
    try:
        cfg = HeadsConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d / CONFIG_FILE}: {e}") from None
    try:
        state = load_file(str(d / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{d / WEIGHTS_FILE}: unreadable safetensors file ({e})") from None
    orphans = [k for k in state if k.endswith(ROW_SCALE) and k[:-len(ROW_SCALE)] not in state]
    if orphans:
        raise CheckpointError(f"{d / WEIGHTS_FILE}: row scales without their matrix: {name_list(orphans)}")
    state = dequantize_rows(state)
    heads = DraftHeads(cfg)
    load_state_strict(heads, state, str(d / WEIGHTS_FILE))
    heads.meta = raw.get("meta", {})
    heads.source_dir = d  # where shipped acceptance statistics (ACCEPTANCE_FILE) are looked up
    return heads.eval()


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "CheckpointError", "save_heads", "load_heads", "read_config", "quantize_rows",
           "dequantize_rows", "compact_state"]
