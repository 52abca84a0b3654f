"""Float32 attention for bf16 models on CPUs without bf16 matrix units: the exact attention of
the bf16 inputs, selected on the decoding twin only (never on the model `generate` runs), for
the Hydra++ prefix layer too, and off where it is not wanted."""

import math

import pytest
import torch

from conftest import assert_lossless_and_near_stock, random_heads, tiny_model
from entmtp import attention, kernels
from entmtp.decoding import Engine
from entmtp.heads import PrefixState
from entmtp.trees import resolve_tree


def exact_attention(q, k, v, mask=None, causal=False):
    """float64 reference: q [B, H, T, d], k/v [B, Hkv, S, d], additive or bool mask [.., T, S]."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v


needs_panels = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["panels"] is not None,
                                  reason="entmtp's panel kernels cannot run here (no AVX2 or no compiler)")


@pytest.mark.parametrize("rows,keys,masked", [(1, 1, False), (1, 37, False), (5, 41, True), (9, 9, True)])
def test_fp32_sdpa_is_the_exact_attention_of_the_bf16_inputs(rows, keys, masked):
    g = torch.Generator().manual_seed(rows * 100 + keys)
    q = torch.randn(1, 6, rows, 16, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, keys, 16, generator=g).bfloat16() for _ in range(2))
    mask = None
    if masked:  # a tree-style additive mask: every row sees the prefix, some rows hide a few keys
        mask = torch.zeros(1, 1, rows, keys, dtype=torch.bfloat16)
        mask[0, 0, 1:, -2] = torch.finfo(torch.bfloat16).min
    out = attention.fp32_sdpa(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 6, rows, 16)
    ref = exact_attention(q, k, v, None if mask is None else mask.float())
    # one bf16 rounding of the exact result (2^-8 relative) plus float32 summation
    assert ((out.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5).all()
    # no worse than torch's own bf16 kernel
    stock = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (out.double() - ref).abs().max() <= (stock.double() - ref).abs().max() + 1e-6


def test_prefix_causal_and_bool_masks():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 7, 8, generator=g).bfloat16()
    k, v = (torch.randn(1, 4, 7, 8, generator=g).bfloat16() for _ in range(2))
    ref = exact_attention(q, k, v, causal=True)
    assert ((attention.fp32_sdpa(q, k, v, is_causal=True).double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5).all()
    allow = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(attention.fp32_sdpa(q, k, v, allow), attention.fp32_sdpa(q, k, v, is_causal=True))


@needs_panels
def test_decode_twin_attends_in_float32_and_leaves_the_model_alone():
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    m, label, why = kernels.decode_model(model, "panels")
    assert m is not model and label == "panels" and "attention in float32" in why
    assert model.config._attn_implementation == "sdpa"  # transformers' generate keeps its attention
    assert m.config._attn_implementation == attention.FP32_SDPA
    impls = {mod.config._attn_implementation for mod in m.modules() if "config" in mod.__dict__}
    assert impls == {attention.FP32_SDPA}
    assert {p.data_ptr() for p in m.parameters()} == {p.data_ptr() for p in model.parameters()}
    # the twin's logits are the float32-attention ones: closer to a float32 forward of the same
    # bf16 weights than (or as close as) the stock bf16 model's
    ids = torch.randint(2, 96, (1, 21))
    exact = tiny_model("llama", vocab=96)  # float32, given the bf16 weights
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.inference_mode():
        ref = exact(ids).logits.double()
        stock, twin = model(ids).logits.double(), m(ids).logits.double()
    assert (twin - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (twin - ref).abs().max() <= (stock - ref).abs().max() * 1.5


def test_fp32_attention_only_in_the_panels_set_of_an_sdpa_model(monkeypatch):
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    assert kernels.decode_model(model, "stock")[0] is model
    fp32 = tiny_model("llama", vocab=96)
    assert kernels.decode_model(fp32, "auto")[0].config._attn_implementation == "sdpa"
    if kernels.kernel_options(torch.bfloat16)["onednn"] is None:  # oneDNN's set keeps torch's attention
        m, label, why = kernels.decode_model(model, "onednn")
        assert label == "onednn" and m.config._attn_implementation == "sdpa" and "attention" not in why
    if kernels.kernel_options(torch.bfloat16)["panels"] is None:
        eager = tiny_model("llama", vocab=96, dtype=torch.bfloat16, attn="eager")
        m, _, _ = kernels.decode_model(eager, "panels")
        assert m.config._attn_implementation == "eager"  # an eager model keeps its attention


@needs_panels
def test_engine_with_float32_attention_decodes_like_the_stock_engine():
    """Trees (explicit masks), one-row steps and the prompt (causal, no mask) all run through the
    float32 attention, the Hydra++ prefix layer too; speculation emits exactly the engine's own
    greedy tokens, and those are the stock engine's up to the first bf16 near-tie."""
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # margins far above bf16 rounding
    heads = {"hydra++": random_heads(model, "hydra", num_heads=4, prefix=True)}
    fast, stock = Engine(model, None, heads, kernels="panels"), Engine(model, None, heads, kernels="stock")
    assert fast.decode_model.config._attn_implementation == attention.FP32_SDPA
    assert fast.runners["hydra++"].prefix_dtype == torch.float32 and stock.runners["hydra++"].prefix_dtype is None
    # every model attention is a fused one (its own float32 attention op) where the panels are, else
    # transformers' attention module running the float32 attention function; count their row counts
    attns = [layer.self_attn for layer in fast.decode_model.model.layers]
    fused = True
    assert all(isinstance(a, kernels.FusedAttention) for a in attns)
    calls = []
    hooks = [a.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["hidden_states"].shape[1]), with_kwargs=True)
             for a in attns]
    real = attention.fp32_sdpa_attention
    from transformers import AttentionInterface
    used = []
    AttentionInterface.register(attention.FP32_SDPA, lambda *a, **k: used.append(1) or real(*a, **k))
    try:
        tree = resolve_tree("mc_sim_7b_63").truncated(4)
        assert_lossless_and_near_stock(fast, stock, model, "hydra++", tree)
    finally:
        AttentionInterface.register(attention.FP32_SDPA, real)
        for h in hooks:
            h.remove()
    assert bool(used) != fused
    assert {1, 5, 23, tree.size} <= set(calls)  # one-row steps, the two prompts' prefills, whole trees


def test_prefix_layer_in_float32_matches_its_whole_sequence_forward():
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    layer = random_heads(model, "hydra", num_heads=2, prefix=True).bfloat16().prefix
    x = torch.randn(1, 12, 32).bfloat16()
    with torch.no_grad():
        whole = layer(x)
        state = PrefixState(dtype=torch.float32)
        parts = [layer(x[:, :5], state), layer(x[:, 5:6], state), layer(x[:, 6:], state)]
    assert state.keys.dtype == torch.float32 and state.length == 12
    got = torch.cat(parts, 1)
    assert got.dtype == torch.bfloat16
    assert (got.float() - whole.float()).abs().max() <= 0.02 * whole.float().abs().max()
