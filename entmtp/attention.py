"""Float32 attention for bf16 models, part of entmtp's own kernel set (`kernels.decode_model("panels")`).

On a CPU without AVX-512 torch's bf16 `scaled_dot_product_attention` runs a slow path: one query over 300
cached keys of SmolLM2-135M's layer (9 heads, 3 key/value heads) took 409 us, against 108 us for
casting query, keys and values to float32, attending there (grouped-query, no repeated keys) and
casting the result back; 9 tree rows 346 vs 220 us; one query over 1000 keys 735 vs 152 us
(`python scripts/bench_attention.py`). Over 30 layers that is 4-17 ms of a ~50 ms step. The
result is the exact attention of the bf16 inputs rounded once to bf16 (torch's bf16 kernel, which
also accumulates in float32, is no closer to it).

Two users: the model's own layers, through a transformers attention function registered as
`FP32_SDPA` that `kernels.decode_model` selects on the decoding twin only (transformers'
`generate` on the model itself keeps its own attention), and the Hydra++ prefix layer of the
draft heads (`heads.PrefixLayer`), whose per-request keys/values are then kept in float32.
With entmtp's panel kernels, Llama-style attentions of the twin are replaced outright by
`kernels.FusedAttention` (its own float32 attention op, `attend`); `FP32_SDPA` serves the rest.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FP32_SDPA = "entmtp_fp32_sdpa"  # the attention implementation name registered with transformers


def _float32_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An additive float mask in float32 (bool masks and None as they are)."""
    return mask.float() if mask is not None and mask.is_floating_point() else mask


def fp32_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              *, scale: Optional[float] = None, is_causal: bool = False) -> torch.Tensor:
    """query [B, H, q, D], key/value [B, Hkv, kv, D] (H a multiple of Hkv), attn_mask additive
    float or bool, broadcastable to [B, H, q, kv] -> [B, H, q, D] in query's dtype, computed in
    float32 (inputs already float32 are not copied)."""
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=_float32_mask(attn_mask), scale=scale,
                                         is_causal=is_causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.to(query.dtype)


def fp32_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                        dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (`AttentionInterface`): `sdpa` computed in float32.

    query [B, H, q, D], key/value [B, Hkv, kv, D] -> ([B, q, H, D] in query's dtype, None).
    Decoding steps and draft trees (one query, or an explicit mask) take `fp32_sdpa`; the rest
    (causal prefill without a mask, position bias, softcap, dropout) goes through transformers'
    own `sdpa_attention_forward` on float32 inputs, so its causal-alignment rules and errors hold.
    """
    q_len = query.shape[2]
    plain = (attention_mask is not None or q_len == 1) and not dropout and \
        kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if plain:
        out = fp32_sdpa(query, key, value, attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), _float32_mask(attention_mask),
                                    dropout=dropout, scaling=scaling, **kwargs)
    return out.to(query.dtype), None


@functools.lru_cache(maxsize=None)
def register_fp32_sdpa() -> str:
    """Register `FP32_SDPA` with transformers (attention and mask functions; masks as for sdpa).
    Idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP32_SDPA, fp32_sdpa_attention)
    AttentionMaskInterface.register(FP32_SDPA, sdpa_mask)
    return FP32_SDPA


def _config_pairs(old, new, pairs: dict) -> dict:
    """id(config or sub-config of `old`) -> its counterpart in `new` (a deep copy of `old`)."""
    pairs[id(old)] = new
    for key in getattr(old, "sub_configs", None) or {}:
        o, n = getattr(old, key, None), getattr(new, key, None)
        if o is not None and n is not None:
            _config_pairs(o, n, pairs)
    return pairs


def use_fp32_attention(twin: nn.Module, config) -> None:
    """Point every module of `twin` that holds `config` (or one of its sub-configs) at a copy
    whose attention implementation is `FP32_SDPA`. `twin` must own its modules (a twin from
    `kernels.twin_of`): the model that `config` belongs to is left as it is."""
    new = copy.deepcopy(config)
    new._attn_implementation = register_fp32_sdpa()  # recursive over the copy's sub-configs
    pairs = _config_pairs(config, new, {})
    for mod in twin.modules():
        held = mod.__dict__.get("config")
        if held is not None and id(held) in pairs:
            mod.__dict__["config"] = pairs[id(held)]


__all__ = ["FP32_SDPA", "fp32_sdpa", "fp32_sdpa_attention", "register_fp32_sdpa",
           "use_fp32_attention"]
