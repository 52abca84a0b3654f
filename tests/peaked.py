"""Tiny causal LMs whose attention is sharp and depends on positions: models on which a
decoding bug in positions, masks or cached keys changes the emitted tokens.

A randomly initialised tiny model attends almost uniformly (query and key projections of std
0.02 give attention logits near 0), so its next token hardly depends on which keys a query
sees or where they sit: tree verification with position ids `past + index` instead of
`past + depth`, a plain causal mask instead of the tree mask, or the first rows of the tree
kept in the cache instead of the accepted ones all still emit the tokens of plain decoding.
Scaling the query and key projections by `scale` multiplies the attention logits by
`scale**2`: at 20 the largest weight of a row is about 0.75 (uniform over 20 keys: 0.05), each
query picks a few keys by content and (rotary) relative position, and in Llama and Qwen2 each
of those three bugs changes the tokens of every oracle run over a tree with branches.
GPT-2 has learned absolute positions instead of rotary ones; with its position embeddings
scaled too, wrong position ids change its tokens as well (its wrong masks and cache rows
mostly do not: its sharp attention goes by absolute position, mostly into the prompt).
"""

from __future__ import annotations

import torch
from torch import nn

from conftest import tiny_model

SCALE = 20.0  # query/key scale: attention entropy 0.7-0.8 nats over 20 keys (a random tiny model: 2.7 of 3.0)
POSITIONS = 4.0  # GPT-2's position embeddings


def sharpen_attention(model: nn.Module, scale: float = SCALE, positions: float = POSITIONS) -> nn.Module:
    """Scale `model`'s query and key projections by `scale` (and GPT-2's position embeddings by
    `positions`), in place. Returns the model."""
    with torch.no_grad():
        for mod in model.modules():
            for name in ("q_proj", "k_proj"):  # llama, qwen2, mistral, ...: rotary positions
                lin = getattr(mod, name, None)
                if isinstance(lin, nn.Linear):
                    lin.weight.mul_(scale)
                    if lin.bias is not None:
                        lin.bias.mul_(scale)
            if type(mod).__name__ == "GPT2Attention":  # c_attn: [hidden, 3 * hidden] (Conv1D), q | k | v
                h = mod.embed_dim
                mod.c_attn.weight[:, : 2 * h].mul_(scale)
                mod.c_attn.bias[: 2 * h].mul_(scale)
        wpe = getattr(getattr(model, "transformer", None), "wpe", None)
        if wpe is not None:
            wpe.weight.mul_(positions)
    return model


def peaked_model(family: str = "llama", vocab: int = 24, seed: int = 3, scale: float = SCALE, **kw) -> nn.Module:
    """`conftest.tiny_model` with sharp, position-dependent attention (see the module docstring)."""
    return sharpen_attention(tiny_model(family, vocab=vocab, seed=seed, **kw), scale)


def attention_entropy(model: nn.Module, ids: list[int], skip: int = 10) -> float:
    """Mean entropy (nats) of the attention rows of every layer and head over `ids`, leaving out
    the first `skip` rows (few keys to choose from). Runs eager attention (sdpa returns no weights)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            atts = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, H, q, q]
    finally:
        model.set_attn_implementation(impl)
    att = torch.stack([a[0, :, skip:].float() for a in atts])
    return float(-(att * att.clamp_min(1e-30).log()).sum(-1).mean())
