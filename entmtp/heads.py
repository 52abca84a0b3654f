"""Draft heads: Medusa, Hydra and Hydra++ behind one drafting interface.

* Medusa head k (k = 0..K-1) reads only the base model's last hidden state h_t and predicts
  token x_{t+k+2}: ``L`` residual SiLU blocks, then an LM head.
* Hydra head k is *sequentially dependent*: it reads [h_t, E(x_{t+1}), ..., E(x_{t+k+1})],
  the hidden state plus the embeddings of the k+1 tokens on the drafted path (x_{t+1} is the
  root, the base model's own next token). Its first block maps (k+2)h -> h with a learned
  residual projection.
* Hydra++ adds one causal decoder layer (Llama-style: RMSNorm, RoPE attention, SwiGLU MLP)
  over the sequence of base hidden states; its output replaces h_t for every head.
* EAGLE (kind "eagle") is one such decoder layer applied autoregressively in feature space
  (EAGLE, Li et al. 2024): the row of position t reads fc[f_t, E(x_{t+1})] and outputs f'_t,
  the layer's guess of the base's next hidden state, whose LM-head scores draft x_{t+2}; the
  next depth reads fc[f'_t, E(x_{t+2})] with f'_t in place of the unknown f_{t+1}. Rows of
  accepted positions read the base's real features and stay in the layer's KV; a drafted row
  attends to them and to its own ancestors in the tree. `num_heads` is the draft depth.

The LM head of every head can be the frozen base ``lm_head`` (shared, not stored: a copy is
V*h parameters, 113 MB per head for a 49k vocabulary) or a per-head copy (published
checkpoints). A reduced *draft vocabulary* (a subset of token ids) makes drafting and
training several times cheaper on CPU; verification always uses the full vocabulary, so it
stays lossless.

Heads hold no generation state: `HeadRunner` binds heads to one base model (embedding and
LM-head weights), and per-request state (the Hydra++ layer's KV) lives in `PrefixState`.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import fp32_sdpa
from .kernels import (can_pack, int8_draft_layer, kernel_options, pack_panels, packed_twin, probe_ok,
                      quantize_rows, shared_linear, twin_of, within_scale)
from .trees import Tree
from .hardware import cpu_isa, fast_bf16_matmul, largest_cache_bytes

MAX_CACHED_TREES = 512  # dynamic tree shapes a caller's cache keeps before it starts again (each holds its buffers)


@dataclass
class HeadsConfig:
    """Everything needed to rebuild a set of draft heads (saved as `config.json`)."""

    kind: str  # "medusa", "hydra" or "eagle"
    num_heads: int
    hidden_size: int
    vocab_size: int
    num_layers: int = 1
    prefix_layer: bool = False  # Hydra++: one causal decoder layer over base hidden states
    shared_lm_head: bool = True  # use the frozen base lm_head (not stored)
    lm_head_bias: bool = False  # per-head LM heads only (Hydra's published heads have a bias)
    shared_block: bool = False  # published quirk: one block object applied L-1 times
    # Published Medusa quirk (`[ResBlock(h)] * L`): *all* L blocks are one object, the first
    # one included. Only for kind "medusa", whose first block is h -> h like the others.
    shared_all_blocks: bool = False
    draft_vocab_size: Optional[int] = None  # heads score only these token ids
    # EAGLE only (EAGLE-3's multi-layer features): the base layers whose outputs the draft layer
    # reads beside the last hidden state, as indices of transformers' `hidden_states` tuple
    # (0 = embeddings, i = decoder layer i's output); empty = the last hidden state alone
    feature_layers: list = field(default_factory=list)
    # Hydra++ decoder-layer shape (copied from the base config)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    base_model: str = ""
    format: str = "entmtp-heads/1"
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("medusa", "hydra", "eagle"):
            raise ValueError(f"heads kind must be 'medusa', 'hydra' or 'eagle', got {self.kind!r}")
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError("num_heads and num_layers must be >= 1")
        # prefix_layer with kind "medusa": Hydra's ungrounded "prefix-mlp" checkpoints.
        if self.shared_all_blocks and self.kind != "medusa":
            raise ValueError("shared_all_blocks needs kind='medusa' (a Hydra head's first block is wider)")
        if self.prefix_layer and not (self.num_attention_heads and self.intermediate_size):
            raise ValueError("the Hydra++ prefix layer needs num_attention_heads and intermediate_size")
        if self.kind == "eagle" and not (self.num_attention_heads and self.intermediate_size):
            raise ValueError("the EAGLE draft layer needs num_attention_heads and intermediate_size")
        self.feature_layers = [int(i) for i in self.feature_layers]
        if self.feature_layers and self.kind != "eagle":
            raise ValueError("feature_layers (multi-layer features) are for EAGLE heads only")
        if self.kind == "eagle" and (self.prefix_layer or not self.shared_lm_head):
            raise ValueError("EAGLE heads are one draft layer scored by the shared base lm_head (no prefix layer, no own lm_heads)")

    @property
    def label(self) -> str:
        return "hydra++" if self.prefix_layer else self.kind

    @property
    def feature_width(self) -> int:
        """Width of what the heads read from a base forward (`verify.base_features`)."""
        return (len(self.feature_layers) + 1) * self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def for_base(base_config, kind: str, num_heads: int = 4, **kw) -> "HeadsConfig":
        """A config sized for a transformers base config (Hydra++ layer shape included)."""
        txt = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
        n_heads = getattr(txt, "num_attention_heads", 0) or getattr(txt, "n_head", 0)
        return HeadsConfig(
            kind=kind, num_heads=num_heads, hidden_size=txt.hidden_size, vocab_size=txt.vocab_size,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(txt, "num_key_value_heads", None) or n_heads,
            intermediate_size=getattr(txt, "intermediate_size", None) or 4 * txt.hidden_size,
            rms_norm_eps=float(getattr(txt, "rms_norm_eps", 1e-5) or 1e-5),
            rope_theta=float(_rope_theta(txt)),
            base_model=str(getattr(base_config, "_name_or_path", "") or ""), **kw)


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta"):
        return rp["rope_theta"]
    return getattr(cfg, "rope_theta", 10000.0) or 10000.0


class ResBlock(nn.Module):
    """y = R x + SiLU(W x + b); R = identity when in == out, else a learned projection.

    W starts at zero so a fresh block is (close to) R x: heads start from the base state.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.res_connection = nn.Linear(in_features, out_features) if in_features != out_features else None
        nn.init.zeros_(self.linear.weight)
        if self.res_connection is not None:
            # Start as "take the h_t part": the head begins as a Medusa head on h_t.
            with torch.no_grad():
                self.res_connection.weight.zero_()
                self.res_connection.weight[:, :out_features] = torch.eye(out_features)
                self.res_connection.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = x if self.res_connection is None else self.res_connection(x)
        return res + F.silu(self.linear(x))


def _int8_product(weight: torch.Tensor) -> nn.Module:
    """weight [out, in] -> a bias-free drafting product on the int8 panels (`kernels.int8_draft_layer`);
    ValueError where those do not run here."""
    product = int8_draft_layer(weight.detach())
    if product is None:
        raise ValueError("entmtp's int8 panels do not run here")
    return product


class Int8ResBlock(nn.Module):
    """A `ResBlock` for drafting on int8 panels (`kernels.Int8PanelLinear`): W and R stacked as one
    product, so x is read once and every weight is one byte instead of two; the SiLU and the sum in
    float32, one rounding to x's dtype at the end. A draft step reads each head's weights once per
    level, cold from memory after the base's forward, so their bytes are a large part of its time.
    Drafts only: this moves which tokens are proposed at near-ties, never what is emitted.
    forward(x [..., in]) -> [..., h] in x's dtype."""

    claim = "within bf16 rounding of the block with its int8 weights"

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        return isinstance(mod, ResBlock) and mod.linear.bias is not None

    def __init__(self, block: ResBlock):
        super().__init__()
        lin, res = block.linear, block.res_connection
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # a parameter, so that probes see the dtype
        self.product = _int8_product(lin.weight if res is None else torch.cat([lin.weight, res.weight]))
        biases = [lin.bias] + ([] if res is None else [res.bias if res.bias is not None else torch.zeros_like(lin.bias)])
        self.bias = torch.cat([b.detach().float() for b in biases])
        self.has_res = res is not None
        self.__dict__["_reference"] = block  # the replaced block, for `matches` (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out_features
        y = self.product(x) + self.bias  # [..., h or 2h] float32
        res = y[..., h:] if self.has_res else x.float()
        return (res + F.silu(y[..., :h])).to(x.dtype)

    def matches(self, x: torch.Tensor) -> bool:
        """x [r, in]: this within bf16 rounding of the replaced block computed exactly in float32
        with its weights rounded to int8 (`kernels.quantize_rows`)."""
        block = self._reference

        def exact(lin: nn.Module) -> torch.Tensor:
            q, scales = quantize_rows(lin.weight)
            return F.linear(x.float(), q.float() * scales[:, None], None if lin.bias is None else lin.bias.float())

        res = x.float() if block.res_connection is None else exact(block.res_connection)
        ref = res + F.silu(exact(block.linear))
        return within_scale(self(x).float(), ref, 2.0 ** -7)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Llama's half-split convention). x [B, H, T, d], pos [T], inv_freq [d/2] fp32."""
    d = x.shape[-1]
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
          is_causal: bool = False) -> torch.Tensor:
    """q [B, H, T, d], k/v [B, Hkv, S, d] -> [B, H, T, d] (grouped-query when Hkv < H)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class PrefixState:
    """Per-request KV of the Hydra++ layer: storage keys/values [1, kv_heads, capacity, head_dim]
    of which the first `length` positions are used. The storage grows by doubling, so a step
    copies only its new tokens' keys/values, not the whole history. `dtype` float32 keeps them
    (and the layer's attention) in float32 for bf16 heads on an AVX2 CPU (`entmtp.attention`); None keeps the layer's dtype."""

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    length: int = 0
    dtype: Optional[torch.dtype] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, kv_heads, T, d] -> every key/value so far, views [B, kv_heads, length + T, d]."""
        need = self.length + k.shape[-2]
        cap = 0 if self.keys is None else self.keys.shape[-2]
        if need > cap:
            cap = max(need, 2 * cap, 64)
            keys, values = k.new_empty(*k.shape[:2], cap, k.shape[-1]), v.new_empty(*v.shape[:2], cap, v.shape[-1])
            if self.length:
                keys[:, :, : self.length] = self.keys[:, :, : self.length]
                values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length: need] = k
        self.values[:, :, self.length: need] = v
        self.length = need
        return self.keys[:, :, :need], self.values[:, :, :need]


class DecoderLayerWeights(nn.Module):
    """The weights of one Llama-style decoder layer plus a final norm (Llama's parameter names, so
    that published `prefix_embeding_layer.*` weights load) and its RoPE frequencies; the Hydra++
    and EAGLE layers compute with them."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        kvh = cfg.num_key_value_heads or nh
        self.n_heads, self.n_kv, self.head_dim, self.theta = nh, kvh, h // nh, cfg.rope_theta
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, nh * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, kvh * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, kvh * self.head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # RoPE frequencies (not a parameter)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies [head_dim / 2], float32 whatever the weights' dtype, cached per device."""
        inv = self._inv_freq.get(device)
        if inv is None:
            d = self.head_dim
            inv = self._inv_freq[device] = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        return inv


class PrefixLayer(DecoderLayerWeights):
    """Hydra++: one causal Llama-style decoder layer (+ final norm) over base hidden states."""

    def forward(self, x: torch.Tensor, state: Optional[PrefixState] = None) -> torch.Tensor:
        """x [B, T, h] new hidden states (continuing `state` if given) -> [B, T, h].

        Causal over the sequence. With `state`, the new keys/values are appended to it.
        """
        B, T, _ = x.shape
        past = state.length if state is not None else 0
        pos = torch.arange(past, past + T, device=x.device)
        inv = self.inv_freq(x.device)
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q, pos, inv), _rope(k, pos, inv)
        attend = _sdpa
        if state is not None:
            if state.dtype is not None:
                k, v, attend = k.to(state.dtype), v.to(state.dtype), fp32_sdpa
            k, v = state.append(k, v)
        if past == 0:
            att = attend(q, k, v, is_causal=True)
        elif T == 1:  # one new token sees every key: no mask
            att = attend(q, k, v)
        else:
            # new token i (absolute past+i) sees keys 0..past+i
            allow = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            att = attend(q, k, v, allow)
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.norm(x)


class FusedPrefixLayer(nn.Module):
    """The Hydra++ layer on entmtp's AVX2 kernel library, for bf16 heads whose layer attends in
    float32 (`PrefixState(dtype=float32)`): RMSNorms as one op each, q|k|v and gate|up as one panel
    product each (fp32 sums), the rotary embedding with the head split in one op, the attention as
    one `attend` call (causal over the cached keys), about 12 op calls instead of some 60 -- the
    layer runs once per decoding step and cost ~2 ms in dispatch, more than its arithmetic.
    Within bf16 rounding of the exact layer (probed); drafts only, so never what is emitted.
    Weights are the replaced layer's (shared); forward(x [B, T, h] bf16, state) -> [B, T, h] bf16."""

    claim = "within bf16 rounding of the exact Hydra++ layer"
    probe_rows = (2, 7)  # a 1-row prompt + a 1-row continuation (a decoding step), and 4 + 3 rows

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        """A bf16 `PrefixLayer` whose head_dim `attend` takes (8-lane blocks); the probe checks the rest."""
        return isinstance(mod, PrefixLayer) and mod.q_proj.weight.dtype == torch.bfloat16 and mod.head_dim % 8 == 0

    def __init__(self, layer: PrefixLayer):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = layer.n_heads, layer.n_kv, layer.head_dim
        self.qkv_width = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.in_features = layer.q_proj.in_features
        self.inter = layer.gate_proj.out_features
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.norms = [(n.weight, float(n.eps)) for n in (layer.input_layernorm, layer.post_attention_layernorm, layer.norm)]
        self.weight = layer.q_proj.weight  # a parameter, so that probes see the dtype
        self._pack(layer)
        self.__dict__["_reference"] = layer  # the replaced layer, for `matches` (not a submodule)

    def _pack(self, layer: PrefixLayer) -> None:
        """The layer's weights for `_sums` and `_add`: q|k|v, o, gate|up and down as panels."""
        cat = lambda *ls: torch.cat([m.weight.detach() for m in ls])  # noqa: E731
        self.qkv = pack_panels(cat(layer.q_proj, layer.k_proj, layer.v_proj))
        self.o = pack_panels(layer.o_proj.weight, fp32_input=True)
        self.gate_up = pack_panels(cat(layer.gate_proj, layer.up_proj))
        self.down = pack_panels(layer.down_proj.weight, fp32_input=True)

    def _sums(self, x: torch.Tensor, which: str, n: int) -> torch.Tensor:
        """x [..., in] through the packed weight `which` -> the float32 sums [..., n]."""
        return torch.ops.entmtp_cpu.bf16_panels_linear(x, getattr(self, which), n, None, True)

    def _add(self, x: torch.Tensor, y: torch.Tensor, which: str) -> torch.Tensor:
        """x [..., h] bf16 + x' W_which.T, rounded to bf16 once."""
        return x + torch.ops.entmtp_cpu.bf16_panels_linear(y, getattr(self, which), x.shape[-1], None, False)

    def forward(self, x: torch.Tensor, state: Optional[PrefixState] = None) -> torch.Tensor:
        if state is None or state.dtype != torch.float32:
            return self._reference(x, state)
        ops = torch.ops.entmtp_cpu
        B, T, h = x.shape
        (w1, e1), (w2, e2), (w3, e3) = self.norms
        ang = torch.arange(state.length, state.length + T, dtype=torch.float32)[:, None] * self._reference.inv_freq(x.device)[None]
        ang = torch.cat([ang, ang], -1).expand(B, T, -1)  # [B, T, d], the half-split convention of `_rope`
        qkv = self._sums(ops.bf16_rms_norm(x, w1, e1), "qkv", self.qkv_width)
        q, k, v = ops.rope_split(qkv, ang.cos(), ang.sin(), self.n_heads, self.n_kv)
        k, v = state.append(k, v)
        att = ops.attend(q, k, v, None, True, self.scale)  # [B, T, H, d]; row i sees keys <= past + i
        x = self._add(x, att.reshape(B, T, -1), "o")
        gu = self._sums(ops.bf16_rms_norm(x, w2, e2), "gate_up", 2 * self.inter)
        x = self._add(x, ops.silu_mul(gu), "down")
        return ops.bf16_rms_norm(x, w3, e3)

    def _exact_copy(self) -> nn.Module:
        """The replaced layer in float32: what this computes up to its roundings."""
        return copy.deepcopy(self._reference).float()

    def matches(self, x: torch.Tensor) -> bool:
        """x [r, h]: all but the last 3 rows as a prompt, then the rest as one continuation, through
        this, the replaced layer and an exact float32 copy of it (each with its own float32 state):
        this within bf16 rounding of the copy, the layer within its own roundings of it."""
        split = max(1, x.shape[0] - 3)
        exact_layer = self._exact_copy()
        outs = []
        for mod, dtype in ((self, x.dtype), (self._reference, x.dtype), (exact_layer, torch.float32)):
            state = PrefixState(dtype=torch.float32)
            parts = [mod(x[None, lo:hi].to(dtype), state).float() for lo, hi in ((0, split), (split, x.shape[0])) if hi > lo]
            outs.append(torch.cat(parts, 1))
        ours, layer, exact = outs
        tol = 2.0 ** -8 * exact.abs().max().clamp_min(1e-30)
        return bool((ours - exact).abs().max() <= 4 * tol and (layer - exact).abs().max() <= 32 * tol)


class Int8PrefixLayer(FusedPrefixLayer):
    """`FusedPrefixLayer` with its four products on the int8 panels (`kernels.Int8PanelLinear`: one
    byte a weight, a float32 scale per output row): the layer's weights are read once a decoding
    step, cold after the base's forward, so their bytes are part of its time. Drafts only.
    Within bf16 rounding of the exact float32 layer whose weights are rounded to int8 (probed)."""

    claim = "within bf16 rounding of the exact Hydra++ layer with its weights in int8"

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        return isinstance(mod, FusedPrefixLayer) and not isinstance(mod, Int8PrefixLayer)

    def __init__(self, fused: FusedPrefixLayer):
        super().__init__(fused._reference)

    def _pack(self, layer: PrefixLayer) -> None:
        cat = lambda *ls: torch.cat([m.weight.detach() for m in ls])  # noqa: E731
        products = {"qkv": cat(layer.q_proj, layer.k_proj, layer.v_proj), "o": layer.o_proj.weight.detach(),
                    "gate_up": cat(layer.gate_proj, layer.up_proj), "down": layer.down_proj.weight.detach()}
        for name, w in products.items():
            setattr(self, name, _int8_product(w))

    def _sums(self, x: torch.Tensor, which: str, n: int) -> torch.Tensor:
        return getattr(self, which)(x)

    def _add(self, x: torch.Tensor, y: torch.Tensor, which: str) -> torch.Tensor:
        return (x.float() + getattr(self, which)(y)).to(x.dtype)

    def _exact_copy(self) -> nn.Module:
        exact = super()._exact_copy()
        with torch.no_grad():
            for lin in (exact.q_proj, exact.k_proj, exact.v_proj, exact.o_proj, exact.gate_proj, exact.up_proj, exact.down_proj):
                q, scales = quantize_rows(lin.weight)
                lin.weight.copy_(q.float() * scales[:, None])
        return exact


def chain_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, allow: Optional[torch.Tensor],
                    chain_k: list[torch.Tensor], chain_v: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of draft rows over context keys plus each row's own chain of earlier draft rows.

    q [B, H, T, d]; k_ctx / v_ctx [B, Hkv, S, d]; allow [T, S] bool (None: every context key);
    chain_k / chain_v: lists of [B, Hkv, T, d] whose row i belongs to query row i's chain (its
    ancestors in the tree and itself). -> [B, H, T, d]; scores and softmax in float32.
    Grouped-query heads (H = Hkv * rep, query head h reads kv head h // rep) are folded into
    the rows, so the keys are never copied per query head.
    """
    B, H, T, d = q.shape
    G, S = k_ctx.shape[1], k_ctx.shape[-2]
    rep = H // G
    qg = q.float().reshape(B, G, rep, T, d)
    s = torch.matmul(qg.reshape(B, G, rep * T, d), k_ctx.float().transpose(-1, -2)).view(B, G, rep, T, S) * scale
    if allow is not None:
        s = s.masked_fill(~allow, float("-inf"))
    if chain_k:
        s = torch.cat([s, torch.stack([(qg * k.float()[:, :, None]).sum(-1) for k in chain_k], -1) * scale], -1)
    w = torch.softmax(s, -1)
    out = torch.matmul(w[..., :S].reshape(B, G, rep * T, S), v_ctx.float()).view(B, G, rep, T, d)
    for i, v in enumerate(chain_v):
        out = out + w[..., S + i, None] * v.float()[:, :, None]
    return out.reshape(B, H, T, d).to(q.dtype)


class EagleLayer(DecoderLayerWeights):
    """EAGLE's draft layer: fc[feature, embedding] (2h -> h), then one causal Llama-style decoder
    layer and a final norm. Its output at a row is the next row's feature and, scored by the
    base lm_head, the draft of the token after the row's token.

    Starts as "the feature, normed": fc takes the feature half, and the attention and MLP
    outputs start at zero, so training begins from the base's own next-token guess.
    """

    def __init__(self, cfg: HeadsConfig):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.fc = nn.Linear(2 * h, h)
        # multi-layer features (EAGLE-3): each listed layer's output normed (residual streams
        # differ in scale by orders of magnitude), then with the last hidden state projected
        # to h; it starts as "the last hidden state", so such heads begin where one-layer ones do
        n = len(cfg.feature_layers)
        self.feature_norms = nn.ModuleList([RMSNorm(h, cfg.rms_norm_eps) for _ in range(n)]) if n else None
        self.project = nn.Linear((n + 1) * h, h, bias=False) if n else None
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :h] = torch.eye(h)
            self.fc.bias.zero_()
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()
            if self.project is not None:
                self.project.weight.zero_()
                self.project.weight[:, n * h:] = torch.eye(h)

    def lift(self, feat: torch.Tensor) -> torch.Tensor:
        """Base features [..., (n+1) h] (n listed layers, then the last hidden state) -> the
        draft layer's feature [..., h]; the last hidden state itself when no layers are listed."""
        if self.project is None:
            return feat
        h = self.project.weight.shape[0]
        parts = [norm(feat[..., i * h:(i + 1) * h]) for i, norm in enumerate(self.feature_norms)]
        return self.project(torch.cat(parts + [feat[..., -h:]], -1))

    def rows(self, feat: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor):
        """feat, emb [B, T, h]; pos [T] positions -> (residual stream x [B, T, h], rotated
        q [B, H, T, d], k and v [B, Hkv, T, d])."""
        B, T, _ = feat.shape
        x = self.fc(torch.cat([feat, emb.to(feat.dtype)], -1))
        y = self.input_layernorm(x)
        inv = self.inv_freq(x.device)
        q = _rope(self.q_proj(y).view(B, T, self.n_heads, self.head_dim).transpose(1, 2), pos, inv)
        k = _rope(self.k_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2), pos, inv)
        v = self.v_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return x, q, k, v

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """x [B, T, h] residual stream, att [B, H, T, d] -> the rows' output features [B, T, h]."""
        B, T, _ = x.shape
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.norm(x)

    def unroll(self, hidden: torch.Tensor, emb: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Teacher-forced drafting along the true continuation, as it runs at decoding time.

        hidden [B, T, F] base features (`lift`); emb [B, T', h] embeddings of the tokens (token t+1
        follows hidden state t; T' >= T, zeros past the end). Returns `depth` tensors [B, T, h]:
        entry k at row t is the feature after drafting k levels from position t, whose lm_head
        scores predict x_{t+k+2}. Step 0's rows are the context rows (real features, causal);
        a step-k row reads step k-1's output and x_{t+k+1}, and attends to the context rows <= t
        and its own earlier steps (the chain a tree node's row sees).
        """
        hidden = self.lift(hidden)
        B, T, h = hidden.shape
        pad = emb.new_zeros(B, max(0, T + depth - emb.shape[1]), h)
        emb = torch.cat([emb, pad], 1) if pad.shape[1] else emb
        pos = torch.arange(T, device=hidden.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
        feat, outs, chain_k, chain_v = hidden, [], [], []
        k_ctx = v_ctx = None
        for k in range(depth):
            x, q, kk, vv = self.rows(feat, emb[:, k + 1: k + 1 + T], pos + k)
            if k == 0:
                k_ctx, v_ctx = kk, vv
            else:
                chain_k, chain_v = chain_k + [kk], chain_v + [vv]
            feat = self.finish(x, chain_attention(q, k_ctx, v_ctx, causal, chain_k, chain_v, self.scale))
            outs.append(feat)
        return outs

    def extend(self, state: PrefixState, feat: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Context rows at the next positions: feat, emb [n, h] -> their outputs [n, h]; their
        keys and values are appended to `state` (causal over every earlier row)."""
        past, n = state.length, feat.shape[0]
        pos = torch.arange(past, past + n, device=feat.device)
        x, q, k, v = self.rows(feat[None], emb[None], pos)
        keys, values = state.append(k.float(), v.float())  # float32: every later draft row reads them as such
        allow = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool, device=feat.device).tril(diagonal=past)
        return self.finish(x, chain_attention(q, keys, values, allow, [], [], self.scale))[0]


@dataclass
class EagleState:
    """A request's EAGLE context, the feature EAGLE heads read: the draft layer's keys/values of
    rows 0..kv.length-1, the base feature `hidden` [h] (`EagleLayer.lift`) at the last accepted position t =
    `position` and, once a step drafted from it, row t's root token and output feature [h]."""

    kv: PrefixState
    hidden: torch.Tensor
    position: int
    root: Optional[int] = None
    root_out: Optional[torch.Tensor] = None


class DraftHeads(nn.Module):
    """K Medusa or Hydra heads (optionally Hydra++). Weights only: no generation state."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        blocks = []
        for k in range(cfg.num_heads if cfg.kind != "eagle" else 0):
            first_in = (k + 2) * h if cfg.kind == "hydra" else h
            layers = [ResBlock(first_in, h)]
            if cfg.shared_all_blocks:
                layers = layers * cfg.num_layers  # one object applied L times
            elif cfg.num_layers > 1:
                if cfg.shared_block:
                    shared = ResBlock(h, h)
                    layers += [shared] * (cfg.num_layers - 1)
                else:
                    layers += [ResBlock(h, h) for _ in range(cfg.num_layers - 1)]
            blocks.append(nn.ModuleList(layers))
        self.blocks = nn.ModuleList(blocks)
        n_out = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_heads = None
        if not cfg.shared_lm_head:
            self.lm_heads = nn.ModuleList([nn.Linear(h, n_out, bias=cfg.lm_head_bias) for _ in range(cfg.num_heads)])
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab = None
        self.prefix = PrefixLayer(cfg) if cfg.prefix_layer else None
        self.eagle = EagleLayer(cfg) if cfg.kind == "eagle" else None

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def features(self, hidden: torch.Tensor, emb: Optional[torch.Tensor]):
        """What the heads read, teacher-forced over whole sequences: hidden [B, T, F] base features
        (`verify.base_features`: the last hidden states, F = h, except for multi-layer EAGLE heads), emb [B, T', h] embeddings of the tokens (T' >= T; EAGLE only). The Hydra++ layer's output
        [B, T, h]; for EAGLE a list, the draft layer's output after each of its `num_heads` steps
        (`EagleLayer.unroll`); else hidden itself."""
        if self.eagle is not None:
            return self.eagle.unroll(hidden, emb, self.num_heads)
        return self.prefix(hidden) if self.prefix is not None else hidden

    def head_hidden(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k's blocks. x [..., in_k] -> [..., h] (EAGLE: x is already the drafted feature)."""
        if self.eagle is not None:
            return x
        for block in self.blocks[k]:
            x = block(x)
        return x

    def head_logits(self, k: int, x: torch.Tensor, lm_weight: Optional[torch.Tensor]) -> torch.Tensor:
        """Head k on inputs x [..., in_k] -> draft logits [..., V_draft].

        lm_weight [V_draft, h] is the (draft-vocab rows of the) frozen base lm_head, used
        when the heads share it.
        """
        z = self.head_hidden(k, x)
        if self.lm_heads is not None:
            return self.lm_heads[k](z)
        return F.linear(z, lm_weight)

    def training_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module,
                        lm_weight: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """Teacher-forced logits for training and evaluation.

        hidden [B, T, F] base features (`features`); input_ids [B, T].
        Returns K tensors [B, T-k-1, V_draft]: head k at position t predicts x_{t+k+2}.
        (Positions whose target would fall beyond T are dropped.) EAGLE: "head k" is the
        draft layer's k-th step along the true continuation (`EagleLayer.unroll`).
        """
        emb = None  # [B, T, h] base embeddings of the tokens, for the kinds that read them
        if self.config.kind != "medusa":
            with torch.no_grad():
                emb = embed(input_ids).to(hidden.dtype)
        T = hidden.shape[1]
        if self.eagle is not None:
            outs = self.features(hidden, emb)
            return [self.head_logits(k, o[:, : T - k - 1], lm_weight) for k, o in enumerate(outs) if T - k - 1 > 0]
        hidden = self.features(hidden, emb)
        out = []
        if self.config.kind == "medusa":
            for k in range(self.num_heads):
                out.append(self.head_logits(k, hidden[:, : T - k - 1], lm_weight))
            return out
        feats = hidden
        for k in range(self.num_heads):
            n = T - k - 1  # positions t = 0..n-1 have x_{t+k+1} and a target x_{t+k+2}
            if n <= 0:
                break
            feats = torch.cat([feats[:, :n], emb[:, k + 1: k + 1 + n]], dim=-1)
            out.append(self.head_logits(k, feats, lm_weight))
        return out


@dataclass
class Draft:
    """One step's drafted tree. Index 0 is the root (the base model's own token).

    tokens [n+1] long; probs [n+1] draft probability of each node's token under the head
    that proposed it (root: nan); entropies [n+1] entropy (nats) of that head distribution.
    probs/entropies are None unless asked for.
    """

    tokens: torch.Tensor
    probs: Optional[torch.Tensor] = None
    entropies: Optional[torch.Tensor] = None


INT8_DRAFT_MIN_WEIGHTS = 1 << 20  # a smaller draft lm_head slice stays in the kernels' own dtype
_DRAFT_LM_TIMINGS: dict[tuple, tuple[float, float]] = {}


DRAFT_LM_TURNS = 12  # timed turns of each variant (after one untimed), the order alternated


def flush_caches(scratch: torch.Tensor) -> None:
    """Stream `scratch` (twice the largest CPU cache) through the caches, as a verification
    forward streams the base model's weights before each draft."""
    scratch.add_(1)


def draft_lm_timings(lm: nn.Module, int8: nn.Module, dtype: torch.dtype, kernels: str,
                     rows: tuple[int, ...] = (1, 4), flush: Optional[Callable[[], None]] = None) -> tuple[float, float]:
    """Seconds of a draft step's calls of the lm_head slice, on its kernel set and as int8 panels:
    an input of `rows[0]` rows right after the caches were flushed (the first draft level, which
    follows a verification forward that streamed the base's weights through them), then one of each
    further row count (the next levels, the slice now cached). Median over turns, the two variants
    in turns (a drift of the machine's speed hits both alike); once per shape, dtype and kernel set
    in a process. Timed hot, call after call, the kernels' own bf16 slice had looked twice as fast
    as int8 on a 2-core EPYC (0.20 against 0.39 ms), while Hydra's drafts in decoding were faster in
    int8 (0.96 against 1.10 ms a step: `python scripts/step_breakdown.py --draft-lm both`)."""
    key = (int8.out_features, int8.in_features, dtype, kernels, cpu_isa())
    if key not in _DRAFT_LM_TIMINGS:
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(r, int8.in_features, generator=g).to(dtype) for r in rows]
        if flush is None:
            scratch = torch.zeros(min(2 * largest_cache_bytes(), 256 << 20), dtype=torch.uint8)
            flush = functools.partial(flush_caches, scratch)
        times: tuple[list[float], list[float]] = ([], [])
        with torch.no_grad():
            for turn in range(DRAFT_LM_TURNS + 1):
                for i in ((0, 1) if turn % 2 == 0 else (1, 0)):
                    layer = (lm, int8)[i]
                    flush()
                    t0 = time.perf_counter()
                    for x in xs:
                        layer(x)
                    if turn:
                        times[i].append(time.perf_counter() - t0)
        _DRAFT_LM_TIMINGS[key] = (statistics.median(times[0]), statistics.median(times[1]))
    return _DRAFT_LM_TIMINGS[key]


def _int8_blocks(mod: nn.Module) -> Optional[nn.Module]:
    """`twin_of`'s replacement: a `ResBlock` or fused Hydra++ layer on the int8 panels where its
    probe passes, else kept."""
    for cls in (Int8ResBlock, Int8PrefixLayer):
        if cls.fits(mod):
            try:
                new = cls(mod)
            except ValueError:
                return None
            return new if probe_ok(new, getattr(new, "probe_rows", (1, 7))) else None
    return None


class HeadRunner:
    """Draft heads bound to one base model, for inference. Shared read-only across requests.

    It resolves the embedding and (draft-vocab rows of the) LM-head weights once.

    Drafting precision never affects what is emitted (the base model verifies every token), so
    for a float32 base on a CPU with bf16 matrix units the heads draft in bfloat16
    (`draft_dtype="auto"`): the same drafts up to near-ties, at a fraction of the cost.
    """

    def __init__(self, heads: DraftHeads, model: nn.Module, draft_dtype: str | torch.dtype = "auto",
                 kernels: str = "auto", lm_int8: Optional[bool] = None, int8_blocks: Optional[bool] = None):
        """kernels: "auto"/"packed" run the heads' linears prepacked on CPU where the probes pass
        (`entmtp.kernels`: bf16 drafts bit-identical to the stock ones, fp32 within rounding;
        drafts are verified either way), "stock" never.
        lm_int8: score drafts through the shared lm_head slice quantised to int8 (`Int8PanelLinear`):
        True where the panel kernels run, False never, None (ENTMTP_DRAFT_INT8=1/0 overrides) where
        it is measured faster here (`draft_lm_timings`, once per shape in a process) for a slice of
        at least INT8_DRAFT_MIN_WEIGHTS weights, with the heads on a packed kernel set.
        int8_blocks: the heads' residual blocks on the int8 panels too (`Int8ResBlock`); None: with
        the slice (the same trade of bytes for widening, measured once)."""
        self.heads = heads.eval()
        self.config = heads.config
        self.embed = model.get_input_embeddings()
        p = next(model.parameters())
        # with a device_map the heads live where the last hidden state and the lm_head do
        self.device = model.get_output_embeddings().weight.device
        if draft_dtype == "auto":
            fast = p.dtype == torch.float32 and p.device.type == "cpu" and fast_bf16_matmul()
            draft_dtype = torch.bfloat16 if fast else p.dtype
        self.dtype = draft_dtype  # the heads' compute dtype; features are cast to it
        self.heads.to(device=p.device, dtype=self.dtype)
        lm = model.get_output_embeddings().weight
        dv = heads.draft_vocab
        self.draft_vocab = None if dv is None else dv.to(self.device)
        self.lm_weight = None
        if heads.lm_heads is None:
            w = lm if dv is None else lm.index_select(0, self.draft_vocab).contiguous()
            self.lm_weight = w if w.dtype == self.dtype else w.detach().to(self.dtype)
        # what drafting runs: the heads and the shared lm_head, prepacked where the probes pass
        self.compute, self.kernels = self.heads, "stock"
        self.lm = None
        if self.lm_weight is not None:
            self.lm = shared_linear(self.lm_weight)
        # the heads run the engine's kernel set where it can run for their dtype (drafts only: never
        # what is emitted); with the panels the Hydra++ layer's per-request keys/values and attention
        # are float32 and the layer runs fused (`FusedPrefixLayer`, probed)
        opts = kernel_options(self.dtype, self.device)
        if kernels in ("auto", "packed"):
            kernels = next((k for k in ("panels", "onednn") if opts[k] is None), "stock")
        elif opts.get(kernels) is not None:
            kernels = "onednn" if kernels == "panels" and opts["onednn"] is None else "stock"
        self.prefix_dtype = torch.float32 if kernels == "panels" else None
        fused = (FusedPrefixLayer,) if kernels == "panels" else ()
        if kernels != "stock" and can_pack(self.heads) is None:
            try:
                self.compute = packed_twin(self.heads, method=kernels, fused_extra=fused)
                self.lm = packed_twin(self.lm, method=kernels) if self.lm is not None else None
                self.kernels = kernels
            except ValueError:
                self.compute, self.kernels, self.prefix_dtype = self.heads, "stock", None
        # the shared lm_head slice is most of a draft level's bytes: at one byte a weight where
        # that is measured faster (drafts only: what is emitted is the base model's)
        self.lm_int8, self.lm_seconds = False, None
        if lm_int8 is None and os.environ.get("ENTMTP_DRAFT_INT8", "") in ("0", "1"):
            lm_int8 = os.environ["ENTMTP_DRAFT_INT8"] == "1"
        if lm_int8 is None and self.lm_weight is not None and self.lm_weight.numel() < INT8_DRAFT_MIN_WEIGHTS:
            lm_int8 = False  # too small for the bytes to matter (or the timing to be more than noise)
        if lm_int8 is None and self.kernels == "stock":
            lm_int8 = False  # stock kernels asked for (or the only ones here): not entmtp's int8 panels
        if self.lm is not None and lm_int8 is not False:
            int8 = int8_draft_layer(self.lm_weight)
            if int8 is not None:
                if lm_int8 is None:
                    self.lm_seconds = draft_lm_timings(self.lm, int8, self.dtype, self.kernels)
                if lm_int8 or self.lm_seconds[1] < self.lm_seconds[0]:
                    self.lm, self.lm_int8 = int8, True
        if (self.lm_int8 if int8_blocks is None else int8_blocks) and self.kernels != "stock":
            # the heads' own blocks on the same int8 panels
            self.compute = twin_of(self.compute, _int8_blocks)

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def int8_blocks(self) -> int:
        """How many of the heads' residual blocks draft on the int8 panels (`Int8ResBlock`)."""
        return sum(isinstance(m, Int8ResBlock) for m in self.compute.modules())

    @property
    def int8_prefix(self) -> bool:
        """Whether the Hydra++ layer drafts on the int8 panels (`Int8PrefixLayer`)."""
        return isinstance(getattr(self.compute, "prefix", None), Int8PrefixLayer)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The base layers a forward must return besides the last hidden state (`verify.forward`)."""
        return tuple(self.config.feature_layers)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> the base's input embeddings [n, h] on the heads' device (with a device_map
        the embedding may live on another device than the lm_head)."""
        w = self.embed.weight
        return self.embed(ids.to(w.device)).to(self.device)

    def start(self, hidden: torch.Tensor, ids: Optional[torch.Tensor] = None):
        """Begin a request. hidden [T, F] base features of the prompt (`verify.base_features`);
        ids [T] its tokens (EAGLE heads only: their context rows read the token after each position).

        Returns (request state or None, the feature the heads read at the last position: h_t
        [h], or for EAGLE heads the `EagleState`, which is also the request state).
        """
        hidden = hidden.to(self.dtype)
        if self.compute.eagle is not None:
            if ids is None:
                raise ValueError("EAGLE heads need the prompt's token ids to start")
            ids = torch.as_tensor(ids, device=self.device).flatten()
            hidden = self.compute.eagle.lift(hidden)
            st = EagleState(PrefixState(), hidden[-1], hidden.shape[0] - 1)
            if hidden.shape[0] > 1:
                self.compute.eagle.extend(st.kv, hidden[:-1], self.embed_tokens(ids[1: hidden.shape[0]]).to(self.dtype))
            return st, st
        if self.compute.prefix is None:
            return None, hidden[-1]
        state = PrefixState(dtype=self.prefix_dtype)
        out = self.compute.prefix(hidden[None], state)
        return state, out[0, -1]

    def advance(self, state, hidden: torch.Tensor, last: torch.Tensor, tokens: Optional[torch.Tensor] = None):
        """Feed newly accepted base features [a, F] (tokens [a]: the accepted path's tokens,
        the root first; EAGLE heads only); returns the new head feature."""
        if isinstance(state, EagleState):
            if tokens is None:
                raise ValueError("EAGLE heads need the accepted tokens to advance")
            tokens, hidden = tokens.to(self.device).flatten(), self.compute.eagle.lift(hidden.to(self.dtype))
            feats, toks = [hidden[:-1]], [tokens[1:]]
            if state.kv.length == state.position:  # no draft from row t this step: add it now
                feats, toks = [state.hidden[None]] + feats, [tokens[:1]] + toks
            f = torch.cat(feats)
            if f.shape[0]:
                self.compute.eagle.extend(state.kv, f, self.embed_tokens(torch.cat(toks)).to(self.dtype))
            state.hidden, state.position = hidden[-1], state.position + hidden.shape[0]
            state.root = state.root_out = None
            return state
        if state is None:
            return last.to(self.dtype)
        return self.compute.prefix(hidden.to(self.dtype)[None], state)[0, -1]

    def head_logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k's draft logits. x [R, in_k] -> [R, V_draft] (`DraftHeads.head_logits`, on the
        packed kernels when the runner has them)."""
        z = self.compute.head_hidden(k, x)
        return self.compute.lm_heads[k](z) if self.lm is None else self.lm(z)

    def _eagle_root(self, st: EagleState, root: torch.Tensor) -> torch.Tensor:
        """The draft layer's output [h] at row t = (f_t, root), added to the context once per step."""
        r = int(root)
        if st.root != r:
            st.kv.length = st.position  # a row t of another root (never in decoding) is replaced
            emb = self.embed_tokens(root.view(1)).to(self.dtype)
            st.root_out, st.root = self.compute.eagle.extend(st.kv, st.hidden[None], emb)[0], r
        return st.root_out

    def _eagle_rows(self, st: EagleState, outs: torch.Tensor, chain: tuple[list, list], sel: torch.Tensor,
                    tok: torch.Tensor, depth: int) -> tuple[torch.Tensor, tuple[list, list]]:
        """The next level's draft rows: parents sel [R'] (rows of outs [R, h]) reading their drafted
        tokens tok [R'] at position t + depth; each attends to the context and its own chain
        (chain: per earlier level, keys and values [1, Hkv, R, d] aligned with outs).
        Returns (their output features [R', h], their chains)."""
        layer = self.compute.eagle
        pos = torch.full((1,), st.position + depth, device=self.device)
        x, q, k, v = layer.rows(outs[sel][None], self.embed_tokens(tok).to(outs.dtype)[None], pos)
        ck = [c.index_select(2, sel) for c in chain[0]] + [k]
        cv = [c.index_select(2, sel) for c in chain[1]] + [v]
        n = st.kv.length
        att = chain_attention(q, st.kv.keys[:, :, :n], st.kv.values[:, :, :n], None, ck, cv, layer.scale)
        return layer.finish(x, att)[0], (ck, cv)

    def _map(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.draft_vocab is None else self.draft_vocab[idx]

    @torch.no_grad()
    def draft(self, tree: Tree, feature: torch.Tensor, root: torch.Tensor, with_stats: bool = False,
              first_logits: Optional[torch.Tensor] = None) -> Draft:
        """Draft every node of `tree`.

        feature [h] the head feature at the last accepted position; root [] long, the base
        model's next token. Works for any valid tree (gaps in ranks, any widths): node tokens
        are gathered by their own rank under their own parent. first_logits [V_draft]: head 0's
        logits at the root when already computed this step (by a scheduler), reused as level 1.
        """
        buf = tree.buffers(self.device)
        n1 = tree.size
        tokens = torch.empty(n1, dtype=torch.long, device=self.device)
        tokens[0] = root
        probs = ents = None
        if with_stats:
            probs = torch.full((n1,), float("nan"), device=self.device)
            ents = torch.full((n1,), float("nan"), device=self.device)
        D = min(tree.depth, self.config.num_heads)
        if tree.depth > self.config.num_heads:
            raise ValueError(f"tree {tree.name!r} has depth {tree.depth} but the heads only draft {self.config.num_heads} levels")
        if self.config.kind == "medusa":
            x = feature[None]
            for d in range(1, D + 1):
                logits = first_logits if d == 1 and first_logits is not None else self.head_logits(d - 1, x)[0]
                top = torch.topk(logits, buf.level_topk[d])
                nodes, ranks = buf.level_nodes[d], buf.level_ranks[d]
                tokens[nodes] = self._map(top.indices[ranks])
                if with_stats:
                    lp = torch.log_softmax(logits.float(), -1)
                    probs[nodes] = lp[top.indices[ranks]].exp()
                    ents[nodes] = -(lp.exp() * lp).sum()
            return Draft(tokens, probs, ents)
        # Hydra: rows = expanded nodes of the previous level, features grow by one embedding;
        # EAGLE: rows = the draft layer's outputs at the expanded nodes of the previous level
        eagle = self.compute.eagle is not None
        if eagle:
            rows, chain = self._eagle_root(feature, root)[None], ([], [])  # [1, h]
        else:
            rows = torch.cat([feature, self.embed_tokens(root.view(1))[0].to(feature.dtype)])[None]  # [1, 2h]
        for d in range(1, D + 1):
            if d == 1 and first_logits is not None:
                logits = first_logits[None]
            else:
                logits = self.head_logits(d - 1, rows)  # [R, Vd]
            top = torch.topk(logits, buf.level_topk[d], dim=-1)
            nodes, prow, ranks = buf.level_nodes[d], buf.level_parent_row[d], buf.level_ranks[d]
            idx = top.indices[prow, ranks]  # [m_d]
            tok = self._map(idx)
            tokens[nodes] = tok
            if with_stats:
                lp = torch.log_softmax(logits.float(), -1)
                probs[nodes] = lp[prow, idx].exp()
                ents[nodes] = (-(lp.exp() * lp).sum(-1))[prow]
            exp = buf.level_expand[d]
            if d < D and exp.numel():
                if eagle:
                    rows, chain = self._eagle_rows(feature, rows, chain, prow[exp], tok[exp], d)
                else:
                    rows = torch.cat([rows[prow[exp]], self.embed_tokens(tok[exp]).to(rows.dtype)], dim=-1)
        return Draft(tokens, probs, ents)

    @torch.no_grad()
    def grow(self, feature: torch.Tensor, root: torch.Tensor, depth: int, topk: int, beam: int,
             budget: int, with_stats: bool = True, trees: Optional[dict] = None) -> tuple[Tree, Draft]:
        """EAGLE-2 style dynamic tree from this step's head outputs.

        Per depth, the `beam` best nodes by cumulative draft log-probability are expanded
        with their `topk` children; the `budget` best nodes overall form the tree (a child's
        cumulative log-probability never exceeds its parent's, so the choice is prefix-closed).
        For the same reason only nodes that rank above the `budget`-th best node drafted so far
        are expanded, and drafting stops at a level with none: no other node's descendants could
        enter the tree.
        Returns the tree and its draft (tokens and probabilities in canonical order; entropies
        of the heads' distributions only `with_stats`). trees: a cache of the trees grown so far
        by their node set (the caller's), so that a shape seen before keeps its verification
        buffers instead of building them again each step.
        """
        D = min(depth, self.config.num_heads)
        eagle = self.compute.eagle is not None
        per_node = self.config.kind == "hydra" or eagle  # a row per kept node (Medusa: one row)
        if eagle:
            rows, chain = self._eagle_root(feature, root)[None], ([], [])
        else:
            rows = torch.cat([feature, self.embed_tokens(root.view(1))[0].to(feature.dtype)])[None] if per_node else feature[None]
        parents: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
        cand: dict[tuple[int, ...], tuple[float, int, float, float]] = {}  # path -> (score, token, log-prob, entropy)
        nan = float("nan")
        for d in range(1, D + 1):
            logits = self.head_logits(d - 1, rows)  # [R, Vd] (R = 1 for Medusa)
            top = torch.topk(logits, topk, dim=-1)  # the order of the log-probabilities, one pass fewer
            high = top.values[:, :1].float()  # each row's maximum: log-sum-exp without a pass to find it
            shifted = logits.float() - high
            lse = high + shifted.exp().sum(-1, keepdim=True).log()  # [R, 1]
            vals, toks = (top.values.float() - lse).tolist(), self._map(top.indices).tolist()
            if with_stats:
                lp = shifted - (lse - high)
                ent = (-(lp.exp() * lp).sum(-1)).tolist()
            else:
                ent = [nan] * len(vals)
            level = []
            for i, (path, score) in enumerate(parents):
                r = i if per_node else 0
                for j in range(topk):
                    q = path + (j,)
                    cand[q] = (score + vals[r][j], toks[r][j], vals[r][j], ent[r])
                    level.append((q, score + vals[r][j], i, toks[r][j]))
            level.sort(key=lambda x: -x[1])
            # a child scores no more than its parent and ranks after it on a tie, so a node at or
            # below the `budget`-th best drafted so far has no descendant that could enter the
            # tree: only the nodes above it are expanded, and none is drafted past the level
            # where no node is
            bar = sorted(v[0] for v in cand.values())[-budget] if len(cand) >= budget else -math.inf
            keep = [x for x in level[:beam] if x[1] > bar]
            if not keep:
                break
            if d < D and per_node:
                sel = torch.tensor([x[2] for x in keep], device=rows.device)
                tok = torch.tensor([x[3] for x in keep], device=rows.device)
                if eagle:
                    rows, chain = self._eagle_rows(feature, rows, chain, sel, tok, d)
                else:
                    rows = torch.cat([rows[sel], self.embed_tokens(tok).to(rows.dtype)], dim=-1)
            parents = [(x[0], x[1]) for x in keep]
        ranked = sorted(cand, key=lambda q: (-cand[q][0], len(q), q))
        chosen: set[tuple[int, ...]] = set()
        for q in ranked:
            if len(chosen) >= budget:
                break
            if all(q[:k] in chosen for k in range(1, len(q))):
                chosen.add(q)
        key = frozenset(chosen)
        tree = trees.get(key) if trees is not None else None
        if tree is None:
            tree = Tree.from_paths([list(q) for q in chosen], f"dynamic-{len(chosen)}")
            if trees is not None:
                if len(trees) >= MAX_CACHED_TREES:
                    trees.clear()
                trees[key] = tree
        order = tree.paths
        tokens = torch.tensor([int(root)] + [cand[q][1] for q in order], device=self.device)
        probs = torch.tensor([nan] + [math.exp(cand[q][2]) for q in order], device=self.device)
        ents = torch.tensor([nan] + [cand[q][3] for q in order], device=self.device) if with_stats else None
        return tree, Draft(tokens, probs, ents)

    @torch.no_grad()
    def first_level(self, feature: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Head 0's draft logits at the root [V_draft] (a scheduler signal of this step)."""
        if self.compute.eagle is not None:
            return self.head_logits(0, self._eagle_root(feature, root)[None])[0]
        x = feature[None] if self.config.kind == "medusa" else torch.cat([feature, self.embed_tokens(root.view(1))[0].to(feature.dtype)])[None]
        return self.head_logits(0, x)[0]

    def to_full_vocab(self, idx: torch.Tensor) -> torch.Tensor:
        return self._map(idx)


def with_draft_vocab(heads: DraftHeads, vocab: Optional[torch.Tensor]) -> DraftHeads:
    """The same heads scoring another set of token ids (vocab [n] long; None: the whole vocabulary).

    Only for heads that share the base lm_head: their blocks output a hidden state, and the
    vocabulary is just the lm_head rows it is scored against, so the weights carry over unchanged.
    """
    if not heads.config.shared_lm_head:
        raise ValueError("only heads that share the base lm_head can change their draft vocabulary")
    cfg = copy.deepcopy(heads.config)
    cfg.draft_vocab_size = None if vocab is None else int(vocab.numel())
    out = DraftHeads(cfg)
    state = {k: v for k, v in heads.state_dict().items() if k != "draft_vocab"}
    missing, unexpected = out.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"draft_vocab"}:
        raise ValueError(f"heads state does not fit: missing {missing}, unexpected {unexpected}")
    if vocab is not None:
        out.draft_vocab.copy_(vocab)
    return out.to(next(heads.parameters()).dtype)


def count_parameters(heads: DraftHeads) -> int:
    return sum(p.numel() for p in {id(p): p for p in heads.parameters()}.values())


def approx_bytes(heads: DraftHeads) -> int:
    seen = {id(p): p for p in heads.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


__all__ = ["HeadsConfig", "DraftHeads", "HeadRunner", "Draft", "PrefixState", "ResBlock", "DecoderLayerWeights", "PrefixLayer",
           "EagleLayer", "EagleState", "chain_attention",
           "with_draft_vocab", "count_parameters", "approx_bytes"]
