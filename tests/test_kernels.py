"""Prepacked CPU linears: bit-identical to the stock kernels, a twin that leaves the model alone."""

import pytest
import torch
from torch import nn

from conftest import random_heads, tiny_model
from entmtp import kernels
from entmtp.decoding import DecodeConfig, Engine
from entmtp.trees import resolve_tree

bf16_model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
needs_pack = pytest.mark.skipif(kernels.can_pack(bf16_model) is not None,
                                reason=f"no packed kernels here: {kernels.can_pack(bf16_model)}")


fp32_model = tiny_model("llama", vocab=96)
needs_pack32 = pytest.mark.skipif(kernels.can_pack(fp32_model) is not None,
                                  reason=f"no packed float32 kernels here: {kernels.can_pack(fp32_model)}")


@needs_pack32
def test_float32_twin_is_within_rounding_and_decodes_like_generate():
    """fp32 packs with another summation order: outputs within rounding of the stock model, and
    greedy decoding (plain and with a tree) gives generate's tokens."""
    model = tiny_model("llama", vocab=96, seed=5)
    m, name, why = kernels.decode_model(model, "auto")
    assert name == "packed" and m is not model and "fp32" in why
    assert {p.data_ptr() for p in m.parameters()} == {p.data_ptr() for p in model.parameters()}
    ids = torch.randint(2, 96, (1, 13))
    with torch.inference_mode():
        a, b = model(ids).logits, m(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    eng = Engine(model, None, heads)
    assert (eng.kernels, eng.runners["hydra"].kernels) == ("packed", "packed")
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    cfg = DecodeConfig(max_new_tokens=40, eos_token_ids=())
    for prompt in ([5, 9, 11, 5, 9], [7] * 3 + list(range(20, 40))):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        want = want[0, len(prompt):].tolist()
        assert eng.run(prompt, config=cfg).tokens == want
        assert eng.run(prompt, heads="hydra", tree=tree, config=cfg).tokens == want


def test_a_float32_probe_outside_tolerance_refuses(monkeypatch):
    """A layer whose packed fp32 product strays beyond FP32_PROBE_RTOL is not used: auto falls back."""
    if kernels.can_pack(fp32_model) is not None:
        pytest.skip(kernels.can_pack(fp32_model))
    monkeypatch.setattr(kernels, "FP32_PROBE_RTOL", 0.0)
    exact_here = kernels._probe_ok(torch.ops.mkldnn._reorder_linear_weight(fp32_model.lm_head.weight.detach()),
                                   fp32_model.lm_head.weight.detach())
    m, name, why = kernels.decode_model(fp32_model, "auto")
    if exact_here:  # this CPU's oneDNN happens to sum like F.linear: nothing to refuse
        assert name == "packed"
    else:
        assert m is fp32_model and name == "stock" and "within 0 of F.linear" in why


@needs_pack
@pytest.mark.parametrize("shape", [(5,), (1, 5), (7, 5), (1, 9, 5), (2, 3, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_bitwise(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(5, 11, bias=bias).to(torch.bfloat16)
    packed = kernels.PackedLinear(lin)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        y = packed(x)
    assert y.shape == (*shape[:-1], 11)
    assert torch.equal(y, lin(x))
    assert packed.weight is lin.weight and packed.bias is lin.bias


@needs_pack
def test_twin_is_exact_shares_weights_and_leaves_the_model_alone():
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=3)
    twin = kernels.packed_twin(model)
    assert all(type(m) is not kernels.PackedLinear for m in model.modules())  # the model is stock
    n_lin = sum(type(m) is nn.Linear for m in model.modules())
    assert n_lin > 0 and sum(type(m) is kernels.PackedLinear for m in twin.modules()) == n_lin
    # every parameter is shared, none copied
    assert {p.data_ptr() for p in twin.parameters()} == {p.data_ptr() for p in model.parameters()}
    calls = []
    h = model.register_forward_pre_hook(lambda *_: calls.append(1))  # hooks on the model stay on the model
    ids = torch.randint(2, 96, (1, 13))
    with torch.inference_mode():
        a = model(ids, output_hidden_states=True)
        n_model = len(calls)
        b = twin(ids, output_hidden_states=True)
    h.remove()
    assert n_model == 1 and len(calls) == 1
    assert torch.equal(a.logits, b.logits)
    assert len(b.hidden_states) == len(a.hidden_states) and torch.equal(a.hidden_states[-1], b.hidden_states[-1])


def test_policies_and_refusals():
    fp16 = tiny_model("llama", dtype=torch.float16)
    m, name, why = kernels.decode_model(fp16, "auto")
    assert m is fp16 and name == "stock" and "bfloat16 and float32" in why
    with pytest.raises(ValueError, match="cannot use packed kernels: .*float16"):
        kernels.decode_model(fp16, "packed")
    fp32 = tiny_model("llama")
    assert kernels.decode_model(fp32, "stock")[:2] == (fp32, "stock")
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.decode_model(fp32, "fast")
    assert kernels.decode_model(bf16_model, "stock")[:2] == (bf16_model, "stock")


def test_a_cpu_without_bf16_reorder_falls_back_with_a_reason(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises RuntimeError when called: auto must fall
    back to the stock kernels and "packed" must refuse in one line, not crash mid-generation."""
    def no_bf16(w):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    kernels._packing_unavailable.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16)
    try:
        m, name, why = kernels.decode_model(bf16_model, "auto")
        assert m is bf16_model and name == "stock" and "AVX-512" in why
        with pytest.raises(ValueError, match="cannot use packed kernels: this CPU"):
            kernels.decode_model(bf16_model, "packed")
        assert kernels.packed_weight(bf16_model.lm_head.weight) is None
    finally:
        kernels._packing_unavailable.cache_clear()


@needs_pack
def test_auto_packs_small_bf16_models_and_respects_the_memory_cap(monkeypatch):
    m, name, _ = kernels.decode_model(bf16_model, "auto")
    assert name == "packed" and m is not bf16_model
    monkeypatch.setattr(kernels, "AUTO_MAX_BYTES", kernels.linear_bytes(bf16_model) - 1)
    m, name, why = kernels.decode_model(bf16_model, "auto")
    assert m is bf16_model and name == "stock" and "--kernels packed" in why
    assert kernels.decode_model(bf16_model, "packed")[1] == "packed"  # asked for: packs anyway


@needs_pack
@pytest.mark.parametrize("lookup", [0, 4])
def test_engine_decodes_the_same_tokens_with_either_kernels(lookup):
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    packed, stock = Engine(model, None, heads, kernels="packed"), Engine(model, None, heads, kernels="stock")
    assert (packed.kernels, stock.kernels) == ("packed", "stock") and stock.decode_model is model
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    cfg = DecodeConfig(max_new_tokens=40, lookup=lookup, eos_token_ids=())
    for prompt in ([5, 9, 11, 5, 9], [7] * 3 + list(range(20, 40))):
        a = packed.run(prompt, heads="hydra", tree=tree, config=cfg)
        b = stock.run(prompt, heads="hydra", tree=tree, config=cfg)
        assert a.tokens == b.tokens and len(a.tokens) == 40
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
        assert packed.run(prompt, config=cfg).tokens == stock.run(prompt, config=cfg).tokens


@needs_pack
@pytest.mark.parametrize("kind,prefix", [("hydra", True), ("hydra", False), ("medusa", False)])
def test_packed_heads_draft_the_same_tokens(kind, prefix):
    from entmtp.heads import HeadRunner

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=7)
    heads = random_heads(model, kind, num_heads=3, prefix=prefix)
    packed, stock = HeadRunner(heads, model, kernels="auto"), HeadRunner(heads, model, kernels="stock")
    assert (packed.kernels, stock.kernels) == ("packed", "stock")
    assert all(type(m) is not kernels.PackedLinear for m in heads.modules())  # the heads stay stock
    tree = resolve_tree("mc_sim_7b_63").truncated(3)
    hidden = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        (sa, fa), (sb, fb) = packed.start(hidden), stock.start(hidden)
        assert torch.equal(fa, fb)
        root = torch.tensor(17)
        da = packed.draft(tree, fa, root, with_stats=True)
        db = stock.draft(tree, fb, root, with_stats=True)
        assert torch.equal(da.tokens, db.tokens)
        torch.testing.assert_close(da.probs, db.probs, rtol=0, atol=0, equal_nan=True)  # the root's is nan
        assert torch.equal(packed.first_level(fa, root), stock.first_level(fb, root))
        if prefix:
            more = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
            assert torch.equal(packed.advance(sa, more, more[-1]), stock.advance(sb, more, more[-1]))


def test_packed_weight_only_where_exact_and_the_screen_uses_it():
    from entmtp.kernels import packed_linear, packed_weight
    from entmtp.verify import ScreenedGreedyHead

    w32 = torch.randn(40, 12)
    assert packed_weight(w32) is None  # only the bf16 screen of a float32 head packs (packed_weight is bf16 only)
    if kernels.can_pack(bf16_model) is not None:
        pytest.skip("no packed kernels here")
    w = w32.to(torch.bfloat16)
    p = packed_weight(w)
    assert p is not None
    x = torch.randn(3, 2, 12).to(torch.bfloat16)
    assert torch.equal(packed_linear(x, p, 40), x @ w.T)
    head = ScreenedGreedyHead(w32 * 3)
    assert head.packed_bf16 is not None
    h = torch.randn(5, 12)
    targets, _ = head.targets(h)
    assert targets == (h @ (w32 * 3).T).argmax(1).tolist()
