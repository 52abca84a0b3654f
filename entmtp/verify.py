"""Tree verification through an unmodified transformers causal LM.

One forward over all n+1 tree tokens: a 4D *additive* float mask ``(1, 1, n+1, past+n+1)``
in the model dtype (every node sees the whole prefix, its ancestors and itself) and
``position_ids = past + depth``. The KV cache is transformers' ``DynamicCache`` (with
``kvcache.GrowingLayer`` layers in the decoding loop); after acceptance only the accepted nodes'
keys/values are kept.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .hardware import fast_bf16_matmul
from .kernels import move_rows, packed_layer
from .kvcache import GrowingLayer


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
    if "flex" in impl or "flash" in impl:
        # flash kernels take a 4D tree mask for a padding mask (wrong tokens); flex aborts on CPU
        raise UnsupportedModelError(f"attention implementation {impl!r} cannot take a tree mask; load the model with "
                                    "attn_implementation='sdpa' or 'eager'")


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
    j = next(i for i, p in enumerate(path) if p != i)  # the path's leading nodes are in place already
    layers = [layer for layer in cache.layers if layer.get_seq_length()]
    # a GrowingLayer's whole buffers: its keys and values are slices made when read
    stores = [t for layer in layers for t in (layer.buffers() if isinstance(layer, GrowingLayer) else (layer.keys, layer.values))]
    if not move_rows(stores, [past + p for p in path[j:]], past + j):
        sel = torch.tensor(path[j:], dtype=torch.long) + past
        on_device: dict = {}  # one host-to-device copy per device (layers may live on several GPUs), not per layer
        for layer in layers:
            s = on_device.get(layer.keys.device)
            if s is None:
                s = on_device[layer.keys.device] = sel.to(layer.keys.device)
            # index_select copies first, so writing into the same storage is safe.
            layer.keys[:, :, past + j: past + a] = layer.keys.index_select(-2, s)
            layer.values[:, :, past + j: past + a] = layer.values.index_select(-2, s)
    for layer in layers:
        # the layer's own crop (negative count): a GrowingLayer shortens its views, a DynamicLayer slices
        layer.crop(past + a - layer.get_seq_length())


def base_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int] = ()) -> torch.Tensor:
    """What draft heads read from a base forward. hidden_states: transformers' `hidden_states`
    tuple (embeddings, then each decoder layer's output; the last one post-norm), each [..., h].
    Returns the last hidden state [..., h], or with `layers` (EAGLE-3's multi-layer features)
    [..., (len(layers) + 1) h]: those entries' outputs, then the last hidden state."""
    last = hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers] + [last], -1) if layers else last


def missing_layers(layers: Sequence[int], model_config) -> tuple[list[int], Optional[int]]:
    """(the entries of `layers` that are not hidden-state indices of this base, its layer count
    or None when the config does not say): 0..num_hidden_layers are."""
    n = getattr(model_config.get_text_config(), "num_hidden_layers", None)
    return [i for i in layers if n is not None and not 0 <= i <= n], n


def forward(model, input_ids: torch.Tensor, cache, *, mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.Tensor] = None, hidden: bool = False, layers: Sequence[int] = (),
            logits_to_keep: int | torch.Tensor = 0):
    """One model forward with our cache. input_ids [1, q]. Returns (logits [q', V], the heads'
    features [q, F] (`base_features` of `layers`; F = h without) or None).
    logits_to_keep: 0 = every position, k = the last k, NO_LOGITS = none (hidden states only)."""
    q = input_ids.shape[-1]
    if isinstance(logits_to_keep, int) and 0 < logits_to_keep < q:
        logits_to_keep = last_positions(q, logits_to_keep, input_ids.device)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                use_cache=True, output_hidden_states=hidden, logits_to_keep=logits_to_keep)
    h = base_features(out.hidden_states, layers)[0] if hidden else None
    return out.logits[0], h


def last_positions(q: int, k: int, device=None) -> torch.Tensor:
    """logits_to_keep for the last k of q positions, as indices [k] rather than the int k.

    transformers slices ``hidden[:, -k:]`` for an int: a strided view for which torch's CPU
    matmul broadcasts and copies the whole lm_head weight (SmolLM2-135M bf16: +50 ms per
    prefill, about a one-token step). Indexing gives the same rows, contiguous."""
    return torch.arange(q - k, q, device=device)


def left_padded(seqs: Sequence[Sequence[int]], pad: int, device=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of token lists, right-aligned: ids [B, L] (`pad` before each sequence), attention
    mask [B, L] (1 on real tokens) and position ids [B, L] (each sequence counts from 0 at its first
    token), L the longest length. Right-aligned, every row's next token goes in the same column."""
    L = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, L - len(x):] = torch.tensor(x, dtype=torch.long)
        attn[i, L - len(x):] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0)


NO_LOGITS = torch.empty(0, dtype=torch.long)  # logits_to_keep: run the body, skip the lm_head


class ScreenedGreedyHead:
    """Exact greedy targets of a float32 lm_head on CPU at a third of its cost.

    The lm_head of a small model is a large share of a step (SmolLM2-135M: 49152 x 576; in
    fp32 on 2 cores 12 ms for one row, 20 ms for a 9-node tree). A bf16 copy of the head runs
    on the CPU's bf16 units; each bf16 logit s_j is within a proven bound b_j of the fp32 logit
    l_j (inputs rounded to bf16: relative 2^-8 each, fp32 accumulation, bf16 output rounding):

        |s_j - l_j| <= (2u + u^2 + K 2^-24) ||x|| ||w_j|| + 2u |s_j|,   u = 2^-8, K = hidden size

    so the fp32 argmax is among {j : s_j + b_j >= max_k (s_k - b_k)} (typically 2-10 tokens),
    whose fp32 logits are then computed exactly. Only for greedy acceptance with summary traces;
    the bf16 logits are returned too, as the (approximate) distribution for scheduler signals.
    """

    U = 2.0 ** -8

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.weight = weight  # [V, h] float32 (shared with the model, not copied)
        self.bias = bias
        self.weight_bf16 = weight.detach().to(torch.bfloat16)
        self.packed_bf16 = packed_layer(self.weight_bf16)  # no per-call relayout (entmtp.kernels), within the bound
        self.row_norms = weight.detach().float().norm(dim=1)  # [V]
        h = weight.shape[1]
        self.rel = 1.01 * (2 * self.U + self.U ** 2 + (h + 8) * 2.0 ** -24)

    @staticmethod
    def for_model(model) -> Optional["ScreenedGreedyHead"]:
        """The screened head when it is exact for this model, else None: float32 weights on a
        CPU with bf16 matrix units, and logits that are exactly `last hidden state @ W.T + b`
        (checked on a probe: no logit scaling or soft-capping), with logits_to_keep support."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        w = getattr(head, "weight", None)
        p = next(model.parameters())
        if (w is None or w.dtype != torch.float32 or p.dtype != torch.float32 or w.device.type != "cpu"
                or not fast_bf16_matmul() or w.dim() != 2):
            return None
        bias = getattr(head, "bias", None)
        try:
            with torch.inference_mode():
                ids = torch.arange(3, 8, device=w.device)[None] % w.shape[0]
                out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
                hid = out.hidden_states[-1][0]
                ref = hid @ w.T + (bias if bias is not None else 0)
                if out.logits.shape[-2] != ids.shape[1] or not torch.allclose(out.logits[0], ref, rtol=1e-5, atol=1e-5):
                    return None
                none = model(input_ids=ids, use_cache=False, logits_to_keep=NO_LOGITS)
                if none.logits.shape[-2] != 0:
                    return None
        except Exception:  # noqa: BLE001 - any model that cannot do this keeps the plain head
            return None
        return ScreenedGreedyHead(w, bias)

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, h] fp32 -> (bf16 logits as fp32 [n, V], candidate mask [n, V])."""
        x = hidden.to(torch.bfloat16)
        if self.packed_bf16 is not None:
            s = self.packed_bf16(x).float()
        else:
            s = (x @ self.weight_bf16.T).float()
        if self.bias is not None:
            s += self.bias
        bound = (self.rel * hidden.norm(dim=1, keepdim=True)) * self.row_norms[None] + (2 * self.U) * s.abs() + 1e-6
        lo = (s - bound).max(dim=1, keepdim=True).values
        return s, (s + bound) >= lo

    def targets(self, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """hidden [n, h] -> (the fp32 lm_head's argmax per row, bf16 logits [n, V])."""
        s, cand = self.screen(hidden)
        rows, cols = cand.nonzero(as_tuple=True)
        exact = (self.weight[cols] * hidden[rows]).sum(-1)
        if self.bias is not None:
            exact += self.bias[cols]
        # per row, the argmax among its (few) candidates; nonzero() lists them row-major with ids
        # ascending, and argmax takes the first maximum, so ties go to the lowest id like argmax
        n = hidden.shape[0]
        counts = cand.sum(1)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(rows)) - starts[rows]
        table = torch.full((n, int(counts.max())), float("-inf"))
        table[rows, slot] = exact
        best = table.argmax(1)
        ids = torch.zeros_like(table, dtype=torch.long)
        ids[rows, slot] = cols
        return ids[torch.arange(n), best].tolist(), s
