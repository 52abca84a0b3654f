"""Tree verification through an unmodified transformers causal LM.

One forward over all n+1 tree tokens: a 4D *additive* float mask ``(1, 1, n+1, past+n+1)``
in the model dtype (every node sees the whole prefix, its ancestors and itself) and
``position_ids = past + depth``. The KV cache is a stock ``DynamicCache``; after acceptance
only the accepted nodes' keys/values are kept.
"""

from __future__ import annotations

from typing import Optional

import torch


class UnsupportedModelError(RuntimeError):
    """The model cannot verify a tree exactly (sliding-window attention, flex attention, ...)."""


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def check_tree_support(model) -> None:
    """Raise UnsupportedModelError when a custom 4D mask with full attention is not exact."""
    cfg = text_config(model)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; entmtp needs a decoder-only causal LM")
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        odd = sorted({t for t in layer_types if t != "full_attention"})
        raise UnsupportedModelError(f"{name} has {', '.join(odd)} layers; tree verification needs full attention in every layer")
    sw = getattr(cfg, "sliding_window", None)
    if sw and getattr(cfg, "use_sliding_window", True) is not False:
        raise UnsupportedModelError(f"{name} uses sliding-window attention (window {sw}); tree verification needs full attention")
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if "flex" in impl:
        raise UnsupportedModelError(f"attention implementation {impl!r} is not supported; load the model with attn_implementation='sdpa' or 'eager'")


def max_context(model) -> int:
    cfg = text_config(model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 30


def tree_mask(bias: torch.Tensor, past: int) -> torch.Tensor:
    """bias [n+1, n+1] additive tree mask -> [1, 1, n+1, past+n+1] (prefix fully visible)."""
    n1 = bias.shape[0]
    mask = torch.zeros(1, 1, n1, past + n1, dtype=bias.dtype, device=bias.device)
    mask[0, 0, :, past:] = bias
    return mask


def keep_cache_entries(cache, past: int, path: list[int], n_tree: int) -> None:
    """Keep cache positions [0, past) and past + path; drop the other tree entries.

    path: accepted node indices in increasing order (ancestors come first in canonical
    order). When the path is a prefix of the tree tokens, a crop is enough.
    """
    a = len(path)
    if path == list(range(a)):
        if n_tree > a:
            cache.crop(-(n_tree - a))  # transformers 5: a negative count removes positions
        return
    sel = torch.tensor(path, dtype=torch.long)
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        s = sel.to(keys.device) + past
        # index_select copies first, so writing into the same storage is safe.
        keys[:, :, past: past + a] = keys.index_select(-2, s)
        layer.values[:, :, past: past + a] = layer.values.index_select(-2, s)
        layer.keys = keys[:, :, : past + a]
        layer.values = layer.values[:, :, : past + a]


def forward(model, input_ids: torch.Tensor, cache, *, mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.Tensor] = None, hidden: bool = False, logits_to_keep: int = 0):
    """One model forward with our cache. input_ids [1, q]. Returns (logits [q', V], hidden [q, h] or None)."""
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                use_cache=True, output_hidden_states=hidden, logits_to_keep=logits_to_keep)
    h = out.hidden_states[-1][0] if hidden else None
    return out.logits[0], h
