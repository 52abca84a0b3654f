"""Prepacked CPU linears: oneDNN's (bit-identical in bf16, within rounding in fp32) and entmtp's
AVX2 bf16 panels (within bf16 rounding of the exact product); a twin that leaves the model alone."""

import copy
import time

import pytest
import torch
from torch import nn

from conftest import assert_lossless_and_near_stock, random_heads, tiny_model
from entmtp import hardware, kernels
from entmtp.decoding import DecodeConfig, Engine
from entmtp.trees import resolve_tree

bf16_model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
# the bit-identity tests need oneDNN's bf16 kernels (AVX-512 / AMX CPUs)
needs_pack = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["onednn"] is not None,
                                reason=f"no oneDNN bf16 kernels here: {kernels.kernel_options(torch.bfloat16)['onednn']}")
needs_panels = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["panels"] is not None,
                                  reason=f"no bf16 panel kernels here: {kernels.kernel_options(torch.bfloat16)['panels']}")


fp32_model = tiny_model("llama", vocab=96)
needs_pack32 = pytest.mark.skipif(kernels.can_pack(fp32_model) is not None,
                                  reason=f"no packed float32 kernels here: {kernels.can_pack(fp32_model)}")


def assert_logits_close(model, twin, rtol: float) -> None:
    """The twin's logits on a random 13-token prompt within rtol (of their scale) of the model's."""
    ids = torch.randint(2, 96, (1, 13))
    with torch.inference_mode():
        a, b = model(ids).logits, twin(ids).logits
    torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * a.abs().max().item())


needs_onednn32 = pytest.mark.skipif(kernels.kernel_options(torch.float32)["onednn"] is not None,
                                    reason=f"no oneDNN float32 packing here: {kernels.kernel_options(torch.float32)['onednn']}")


@needs_onednn32
def test_float32_twin_is_within_rounding_and_decodes_like_generate():
    """fp32 packs with another summation order: outputs within rounding of the stock model, and
    greedy decoding (plain and with a tree) gives generate's tokens."""
    model = tiny_model("llama", vocab=96, seed=5)
    m, name, why = kernels.decode_model(model, "onednn")
    assert name == "onednn" and m is not model and "fp32" in why
    assert {p.data_ptr() for p in m.parameters()} == {p.data_ptr() for p in model.parameters()}
    assert_logits_close(model, m, 1e-5)
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    eng = Engine(model, None, heads, kernels="onednn")
    assert (eng.kernels, eng.runners["hydra"].kernels) == ("onednn", "onednn")
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    cfg = DecodeConfig(max_new_tokens=40, eos_token_ids=())
    for prompt in ([5, 9, 11, 5, 9], [7] * 3 + list(range(20, 40))):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        want = want[0, len(prompt):].tolist()
        assert eng.run(prompt, config=cfg).tokens == want
        assert eng.run(prompt, heads="hydra", tree=tree, config=cfg).tokens == want


@needs_onednn32
def test_onednn_for_tree_rows_keeps_the_stock_one_row_product_and_decodes_like_generate():
    """"onednn-trees": a one-row input takes F.linear itself (bitwise), more rows the prepacked
    kernel (within its probe); greedy decoding, plain and with a tree, gives generate's tokens."""
    model = tiny_model("llama", vocab=96, seed=6)
    m, name, why = kernels.decode_model(model, "onednn-trees")
    assert name == "onednn-trees" and "one-row" in why
    layer = m.lm_head
    assert isinstance(layer, kernels.PackedLinear) and layer.one_row_stock
    torch.manual_seed(1)
    with torch.inference_mode():
        one, rows = torch.randn(1, 1, layer.in_features), torch.randn(1, 6, layer.in_features)
        assert torch.equal(layer(one), nn.functional.linear(one, layer.weight, layer.bias))
        assert torch.equal(layer(rows), kernels.packed_linear(rows, layer.packed, layer.out_features, layer.bias))
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    eng = Engine(model, None, heads, kernels="onednn-trees")
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    cfg = DecodeConfig(max_new_tokens=30, eos_token_ids=())
    prompt = [7] * 3 + list(range(20, 40))
    want = model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    assert eng.run(prompt, config=cfg).tokens == want
    assert eng.run(prompt, heads="hydra", tree=tree, config=cfg).tokens == want
    assert kernels.kernel_options(torch.bfloat16)["onednn-trees"] is not None  # a float32 set


def test_a_float32_probe_outside_tolerance_refuses(monkeypatch):
    """A layer whose packed fp32 product strays beyond FP32_PROBE_RTOL is not used: auto falls back."""
    if kernels.can_pack(fp32_model) is not None:
        pytest.skip(kernels.can_pack(fp32_model))
    monkeypatch.setattr(kernels, "FP32_PROBE_RTOL", 0.0)
    exact_here = kernels.probe_ok(kernels.PackedLinear(fp32_model.lm_head))
    m, name, why = kernels.decode_model(fp32_model, "auto")
    if exact_here:  # this CPU's oneDNN happens to sum like F.linear: nothing to refuse
        assert name == "onednn"
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
    twin = kernels.packed_twin(model, method="onednn")
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

    monkeypatch.delenv("ENTMTP_ISA", raising=False)  # the CPU's own class: only the reorder fails
    kernels._onednn_packing_unavailable.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16)
    monkeypatch.setattr(kernels, "_panels_unavailable", lambda: "no compiler here")
    try:
        m, name, why = kernels.decode_model(bf16_model, "auto")
        # stock linears (the model itself, or a twin for float32 attention: `test_attention.py`)
        assert name == "stock" and "AVX-512" in why and "no compiler here" in why
        assert not any(isinstance(x, kernels._PackedBase) for x in m.modules())
        with pytest.raises(ValueError, match="cannot use packed kernels: this CPU"):
            kernels.decode_model(bf16_model, "packed")
        assert kernels.packed_layer(bf16_model.lm_head.weight) is None
    finally:
        kernels._onednn_packing_unavailable.cache_clear()


@needs_panels
def test_a_cpu_without_onednn_bf16_uses_the_panels(monkeypatch):
    """Where oneDNN refuses bf16 (AVX2 CPUs: ENTMTP_ISA=avx2), auto decodes on entmtp's panel kernels."""
    monkeypatch.setenv("ENTMTP_ISA", "avx2")
    try:
        assert kernels.pack_method(torch.bfloat16) == ("panels", None)
        m, name, why = kernels.decode_model(bf16_model, "auto")
        assert name == "panels" and "panels" in why and m is not bf16_model
        count = lambda model, cls: sum(type(x).__name__ == cls for x in model.modules())  # noqa: E731
        n_lin, n_mlp, n_attn = count(bf16_model, "Linear"), count(bf16_model, "LlamaMLP"), count(bf16_model, "LlamaAttention")
        # attentions (float32 on AVX2), gated MLPs and RMSNorms fused, every other linear on the panels
        assert n_mlp == n_attn == 2 and count(m, "FusedMLP") == n_mlp and count(m, "FusedAttention") == n_attn
        assert count(m, "FusedRMSNorm") == count(bf16_model, "LlamaRMSNorm") == 5
        assert count(m, "PanelLinear") == n_lin - 3 * n_mlp - 4 * n_attn == 1 and count(m, "Linear") == 0
        assert isinstance(kernels.packed_layer(bf16_model.lm_head.weight), kernels.PanelLinear)
    finally:
        pass


def test_panels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("ENTMTP_PANELS", "0")
    assert "ENTMTP_PANELS=0" in kernels._panels_unavailable()
    assert kernels.kernel_options(torch.bfloat16)["panels"] == kernels._panels_unavailable()


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_the_isa_switch_dispatches_as_on_another_cpu_class(isa, monkeypatch):
    """ENTMTP_ISA takes capabilities away: generic runs stock only, avx2 no oneDNN bf16; never more
    than the CPU has; an unknown name is a clear error."""
    from entmtp import hardware

    monkeypatch.setenv("ENTMTP_ISA", isa)
    assert hardware.cpu_isa() in hardware.ISA_ORDER[:hardware.ISA_ORDER.index(isa) + 1]
    opts = kernels.kernel_options(torch.bfloat16)
    if hardware.cpu_isa() == "generic":
        assert opts["onednn"] and opts["panels"] and kernels.decode_model(bf16_model, "auto")[1] == "stock"
    elif hardware.cpu_isa() == "avx2":
        assert "AVX-512" in opts["onednn"]
        assert kernels.decode_model(bf16_model, "auto")[1] == ("panels" if opts["panels"] is None else "stock")
    monkeypatch.setenv("ENTMTP_ISA", "sse9")
    with pytest.raises(ValueError, match="ENTMTP_ISA='sse9' is not one of"):
        hardware.cpu_isa()


@needs_pack
def test_auto_packs_small_bf16_models_and_respects_the_memory_cap(monkeypatch):
    m, name, _ = kernels.decode_model(bf16_model, "auto")
    assert name in ("panels", "onednn") and m is not bf16_model
    monkeypatch.setattr(kernels, "AUTO_MAX_BYTES", kernels.linear_bytes(bf16_model) - 1)
    m, name, why = kernels.decode_model(bf16_model, "auto")
    assert m is bf16_model and name == "stock" and "--kernels onednn or panels" in why
    assert kernels.decode_model(bf16_model, "onednn")[1] == "onednn"  # asked for: packs anyway


@needs_pack
@pytest.mark.parametrize("lookup", [0, 4])
def test_engine_decodes_like_the_stock_engine_with_either_kernels(lookup):
    """Speculation (with and without prompt lookup) emits exactly the plain greedy tokens of the
    same kernels, and the packed kernels' plain tokens are stock's up to the first bf16 near-tie
    (fused norms and float32 attention round differently from stock, so an exact tie may break
    the other way on another CPU)."""
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    packed, stock = Engine(model, None, heads, kernels="onednn"), Engine(model, None, heads, kernels="stock")
    assert (packed.kernels, stock.kernels) == ("onednn", "stock") and stock.decode_model is model
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    assert_lossless_and_near_stock(packed, stock, model, "hydra", tree, lookup=lookup)
    assert_lossless_and_near_stock(stock, stock, model, "hydra", tree, lookup=lookup)


@needs_pack
@pytest.mark.parametrize("kind,prefix", [("hydra", True), ("hydra", False), ("medusa", False)])
def test_packed_heads_draft_the_same_tokens(kind, prefix):
    from entmtp.heads import HeadRunner

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=7)
    heads = random_heads(model, kind, num_heads=3, prefix=prefix)
    packed, stock = HeadRunner(heads, model, kernels="onednn"), HeadRunner(heads, model, kernels="stock")
    assert (packed.kernels, stock.kernels) == ("onednn", "stock")
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


def test_packed_layer_only_for_bf16_and_the_screen_uses_it():
    from entmtp.kernels import packed_layer
    from entmtp.verify import ScreenedGreedyHead

    w32 = torch.randn(40, 12)
    assert packed_layer(w32) is None  # only the bf16 screen of a float32 head packs (packed_layer is bf16 only)
    if kernels.can_pack(bf16_model) is not None:
        pytest.skip("no packed kernels here")
    w = w32.to(torch.bfloat16)
    p = packed_layer(w)
    assert p is not None and p.weight.data_ptr() == w.data_ptr()
    x = torch.randn(3, 2, 12).to(torch.bfloat16)
    with torch.inference_mode():
        y = p(x)
    if isinstance(p, kernels.PackedLinear):
        assert torch.equal(y, x @ w.T)
    else:
        exact = x.float() @ w.float().T
        assert y.shape == (3, 2, 40) and (y.float() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
    head = ScreenedGreedyHead(w32 * 3)
    assert head.packed_bf16 is not None
    h = torch.randn(5, 12)
    targets, _ = head.targets(h)
    assert targets == (h @ (w32 * 3).T).argmax(1).tolist()


def _exact_and_slack(x, w, bias=None):
    """The exact product of bf16 inputs (fp32 of their values) and a bound on fp32 accumulation
    error in any order: K 2^-23 (|x| @ |w|.T)."""
    xf, wf = x.float(), w.float()
    exact = xf @ wf.T + (0 if bias is None else bias.float())
    return exact, w.shape[1] * 2.0 ** -23 * (xf.abs() @ wf.abs().T) + 1e-30


@needs_panels
@pytest.mark.parametrize("n,k", [(1, 1), (15, 7), (16, 8), (17, 33), (100, 64), (48, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_is_the_exact_product_up_to_rounding(n, k, bias):
    """Every row count (the 6-row blocks and every remainder), panel tails (n not a multiple of 16)
    and odd widths: fp32 output within accumulation error of the exact product, bf16 output its
    round-to-nearest up to that error."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    panels = torch.ops.entmtp_cpu.bf16_pack_panels(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for m in list(range(1, 14)) + [40]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        exact, slack = _exact_and_slack(x, w, b)
        y32 = torch.ops.entmtp_cpu.bf16_panels_linear(x, panels, n, b, True)
        assert y32.dtype == torch.float32 and y32.shape == (m, n)
        assert ((y32 - exact).abs() <= slack + 1e-6 * exact.abs()).all()
        y16 = torch.ops.entmtp_cpu.bf16_panels_linear(x, panels, n, b, False)
        assert y16.dtype == torch.bfloat16
        assert torch.equal(y16, y32.to(torch.bfloat16))  # its own rounding is torch's, bit for bit
        assert ((y16.float() - exact).abs() <= 2 ** -8 * exact.abs() + 2 * slack).all()


needs_wide_panels = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["panels"] is not None
                                       or not hardware.isa_at_least("avx512"),
                                       reason="the 32-column panel kernel needs AVX-512 (and the panel library)")
needs_pair_panels = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["panels"] is not None
                                       or not hardware.isa_at_least("avx512_bf16"),
                                       reason="the k-pair panel kernel needs AVX512-BF16 (and the panel library)")
needs_amx_panels = pytest.mark.skipif(kernels.kernel_options(torch.bfloat16)["panels"] is not None
                                      or not hardware.isa_at_least("amx"),
                                      reason="the AMX tile kernel needs a CPU with AMX, or ENTMTP_AMX_EMULATION=1 on one "
                                             "with AVX512-BF16 (and the panel library)")


@needs_wide_panels
@pytest.mark.parametrize("n,k", [(40, 24), (33, 7), (64, 96), (200, 576)])
def test_wide_panels_give_the_same_bits_as_the_avx2_panels(n, k):
    """The AVX-512 kernel (32-column panels) runs the same fp32 FMA chain per output column as the
    AVX2 one: bit-identical for every row count (its 12-row blocks and every remainder), panel
    tails and odd widths; and each row equals that row alone (row invariance)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    narrow, wide = kernels.pack_panels(w, "avx2"), kernels.pack_panels(w, "avx512")
    assert wide.shape == ((n + 31) // 32, k, 32)
    for m in list(range(1, 26)) + [40]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y16 = torch.ops.entmtp_cpu.bf16_panels_linear(x, narrow, n, None, True)
        y32 = torch.ops.entmtp_cpu.bf16_panels_linear(x, wide, n, None, True)
        assert torch.equal(y16, y32), m
        alone = torch.cat([torch.ops.entmtp_cpu.bf16_panels_linear(x[i:i + 1], wide, n, None, True) for i in range(m)])
        assert torch.equal(alone, y32), m


def _panels_rows_check(x, packed, w, b, tol):
    """The panel product of x [m, k] against `packed` (w [n, k], bias b): within `tol` (relative to
    the largest entry) of the exact product, and each row alone the same bits as all rows at once.
    Returns the product [m, n]."""
    n = w.shape[0]
    y = torch.ops.entmtp_cpu.bf16_panels_linear(x, packed, n, b, True)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert ((y.double() - exact).abs() <= tol * exact.abs().max()).all(), x.shape
    alone = torch.cat([torch.ops.entmtp_cpu.bf16_panels_linear(x[i:i + 1], packed, n, b, True) for i in range(len(x))])
    assert torch.equal(alone, y), x.shape
    # the bf16 output is these sums rounded as torch rounds them, bit for bit
    assert torch.equal(torch.ops.entmtp_cpu.bf16_panels_linear(x, packed, n, b, False), y.to(torch.bfloat16)), x.shape
    return y


@needs_pair_panels
@pytest.mark.parametrize("n,k,bias", [(40, 24, False), (33, 7, True), (64, 96, False), (200, 577, True)])
def test_pair_panels_are_row_invariant_and_exact_up_to_fp32_sums(n, k, bias):
    """AVX512-BF16 k-pair panels (vdpbf16ps): each row alone gives the same bits as in any block of
    rows; the fp32 result is the exact product up to fp32 summation; an fp32 input is taken
    rounded to bf16 (as a stock bf16 layer takes it); odd widths are zero-padded."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    pairs = kernels.pack_panels(w, "avx512_bf16")
    assert pairs.shape == ((n + 31) // 32, (k + 1) // 2, 64)
    for m in list(range(1, 26)) + [40]:
        _panels_rows_check(torch.randn(m, k, generator=g).to(torch.bfloat16), pairs, w, b, 1e-5)
        xf = torch.randn(m, k, generator=g)
        assert torch.equal(torch.ops.entmtp_cpu.bf16_panels_linear(xf, pairs, n, b, True),
                           torch.ops.entmtp_cpu.bf16_panels_linear(xf.to(torch.bfloat16), pairs, n, b, True))


@needs_amx_panels
@pytest.mark.parametrize("n,k,bias", [(40, 24, False), (33, 7, True), (64, 96, False), (200, 577, True), (96, 1536, False)])
def test_amx_tiles_are_row_invariant_and_exact_up_to_fp32_sums(n, k, bias):
    """AMX tiles (TDPBF16PS): each row alone gives the same bits as in any block of rows (16-row
    tiles, their remainders, several tiles); the result is the exact product up to fp32 sums for a
    bf16 input and to ~2^-16 for a float32 one (split into two bf16 terms, not rounded to one);
    panel tails and widths that are not whole k-chunks are zero-padded."""
    g = torch.Generator().manual_seed(n * 11 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    tiles = kernels.pack_panels(w, "amx", fp32_input=True)  # float32 inputs keep the tile layout
    k2 = (k + 1) // 2
    assert tiles.shape == ((n + 31) // 32, (k2 + 15) // 16, 16, 64)
    for m in [1, 2, 3, 5, 9, 15, 16, 17, 31, 33, 40]:
        _panels_rows_check(torch.randn(m, k, generator=g).to(torch.bfloat16), tiles, w, b, 1e-5)
        xf = torch.randn(m, k, generator=g)
        yf = _panels_rows_check(xf, tiles, w, b, 2e-5)
        rounded = torch.ops.entmtp_cpu.bf16_panels_linear(xf.to(torch.bfloat16), tiles, n, b, True)
        assert not torch.equal(yf, rounded), m
    with pytest.raises(RuntimeError, match="this input width"):
        torch.ops.entmtp_cpu.bf16_panels_linear(torch.randn(2, k + 40).to(torch.bfloat16), tiles, n, b, True)


@needs_panels
def test_panel_layout_follows_dispatch(monkeypatch):
    """ENTMTP_ISA lowers the layout on a wider CPU (so each kernel runs and is tested here); a
    layout only where dispatch allows it."""
    monkeypatch.setenv("ENTMTP_ISA", "avx2")
    assert kernels.panel_layout() == "avx2"
    assert kernels.pack_panels(torch.randn(20, 8).to(torch.bfloat16)).shape == (2, 8, 16)
    monkeypatch.delenv("ENTMTP_ISA")
    want = next((i for i in ("amx", "avx512_bf16", "avx512") if hardware.isa_at_least(i)), "avx2")
    assert kernels.panel_layout() == want
    if hardware.isa_at_least("amx"):
        monkeypatch.setenv("ENTMTP_ISA", "avx512_bf16")
        assert kernels.panel_layout() == "avx512_bf16"
        assert kernels.pack_panels(torch.randn(20, 8).to(torch.bfloat16)).shape == (1, 4, 64)
        monkeypatch.delenv("ENTMTP_ISA")
        assert kernels.pack_panels(torch.randn(20, 8).to(torch.bfloat16)).shape == (1, 1, 16, 64)
    if hardware.isa_at_least("avx512_bf16"):
        monkeypatch.setenv("ENTMTP_ISA", "avx512")
        assert kernels.panel_layout() == "avx512"
    with pytest.raises(RuntimeError, match="cols must be 16"):
        torch.ops.entmtp_cpu.bf16_pack_panels(torch.randn(20, 8).to(torch.bfloat16), 24)


@needs_panels
def test_panel_kernel_refuses_mismatched_inputs():
    w = torch.randn(20, 8).to(torch.bfloat16)
    panels = torch.ops.entmtp_cpu.bf16_pack_panels(w)
    x = torch.randn(3, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="n does not match"):
        torch.ops.entmtp_cpu.bf16_panels_linear(x, panels, 40, None, False)
    with pytest.raises(RuntimeError, match="this input width"):
        torch.ops.entmtp_cpu.bf16_panels_linear(torch.randn(3, 9).to(torch.bfloat16), panels, 20, None, False)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.entmtp_cpu.bf16_panels_linear(x.double(), panels, 20, None, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.entmtp_cpu.bf16_pack_panels(w.float())
    # float32 inputs (a fused MLP's middle) are taken as they are, not rounded to bf16 first
    xf = torch.randn(2, 4, 8)
    y = torch.ops.entmtp_cpu.bf16_panels_linear(xf, panels, 20, None, True)
    assert y.shape == (2, 4, 20) and y.dtype == torch.float32
    torch.testing.assert_close(y, xf @ w.float().T, rtol=1e-5, atol=1e-5)


@needs_panels
@pytest.mark.parametrize("shape", [(5,), (1, 5), (7, 5), (1, 9, 5), (2, 3, 5)])
def test_panel_linear_rows_and_shapes(shape):
    torch.manual_seed(0)
    lin = nn.Linear(5, 11).to(torch.bfloat16)
    layer = kernels.PanelLinear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        y, ref = layer(x), lin(x)
    assert y.shape == ref.shape == (*shape[:-1], 11)
    # every row count (a plain decoding step too) on the panels: within rounding of the exact product
    exact, slack = _exact_and_slack(x.reshape(-1, 5), lin.weight, lin.bias)
    assert ((y.reshape(-1, 11).float() - exact).abs() <= 2 ** -8 * exact.abs() + 2 * slack).all()


@needs_panels
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 7, 48), (300, 48), (3, 53)])  # 53: a tail past 8-lane blocks
def test_fused_rms_norm_is_the_llama_norm_up_to_rounding(shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    assert kernels.FusedRMSNorm.fits(norm)
    fused = kernels.FusedRMSNorm(norm)
    assert fused.weight is norm.weight and fused.eps == 1e-5 and kernels.probe_ok(fused)
    x = (torch.randn(*shape) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        y, ref = fused(x), norm(x)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    # the same fp32 formula, one summation order apart: at most one bf16 rounding step, rarely
    assert ((y.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-6).all()
    assert (y != ref).float().mean() < 0.01


class OnePlusRMSNorm(nn.Module):
    """Gemma's variant, (1 + weight) * norm(x): named like an RMSNorm, not the same formula."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        return ((1 + self.weight.float()) * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@needs_panels
def test_only_modules_that_compute_the_fused_formula_are_replaced(monkeypatch):
    """An RMSNorm-named module with another formula fails its probe and is kept; an MLP with
    another activation is not taken for a gated SiLU MLP."""
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    model.model.norm = OnePlusRMSNorm(32)
    model.model.layers[1].mlp.act_fn = nn.GELU()
    assert kernels.FusedRMSNorm.fits(model.model.norm) and not kernels.FusedMLP.fits(model.model.layers[1].mlp)
    twin = kernels.packed_twin(model, method="panels")
    assert type(twin.model.norm) is OnePlusRMSNorm and twin.model.norm is not model.model.norm
    assert type(twin.model.layers[0].mlp).__name__ == "FusedMLP"
    assert type(twin.model.layers[1].mlp).__name__ == "LlamaMLP"
    assert type(twin.model.layers[1].mlp.up_proj) is kernels.PanelLinear
    ids = torch.randint(2, 96, (1, 9))
    with torch.inference_mode():
        a, b = model(ids).logits.float(), twin(ids).logits.float()
    assert (a - b).abs().max() <= 0.03 * a.abs().max()


@needs_panels
@pytest.mark.parametrize("shape", [(1, 1, 32), (1, 9, 32), (40, 32)])
def test_fused_mlp_is_the_exact_gated_mlp_up_to_rounding(shape):
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=3)
    mlp = model.model.layers[0].mlp
    assert kernels.FusedMLP.fits(mlp)
    fused = kernels.FusedMLP(mlp)
    assert kernels.probe_ok(fused)
    assert {p.data_ptr() for p in fused.parameters()} == {p.data_ptr() for p in mlp.parameters()}
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        y, stock = fused(x).float(), mlp(x).float()
        xf = x.float()
        w = lambda lin: lin.weight.float()  # noqa: E731
        exact = (torch.nn.functional.silu(xf @ w(mlp.gate_proj).T) * (xf @ w(mlp.up_proj).T)) @ w(mlp.down_proj).T
    assert y.shape == exact.shape
    scale = exact.abs().max()
    assert (y - exact).abs().max() <= 2 ** -8 * scale  # one rounding
    assert (y - exact).abs().max() <= (stock - exact).abs().max() + 1e-6 * scale  # no worse than torch's


@needs_panels
def test_fused_ops_refuse_bad_inputs_with_a_message():
    ops = torch.ops.entmtp_cpu
    with pytest.raises(RuntimeError, match="bf16_rms_norm: x must be a bfloat16"):
        ops.bf16_rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="w must be a bfloat16 vector of x's width"):
        ops.bf16_rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(7, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match=r"silu_mul: gu must be a float32 CPU tensor \[..., 2I\]"):
        ops.silu_mul(torch.randn(2, 7))
    gu = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :5]) * gu[:, 5:])


@needs_panels
def test_panel_twin_decodes_the_same_tokens_as_stock(monkeypatch):
    """The panel twin (verification of trees, one-row steps and the prompt on the panel kernel,
    fused norms and MLPs, float32 attention; drafting heads too) is lossless: speculation emits
    exactly its own greedy tokens, and those are the stock engine's up to the first bf16
    near-tie of the stock logits."""
    try:
        model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)  # margins far above bf16 rounding, mostly
        heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
        panels, stock = Engine(model, None, heads, kernels="panels"), Engine(model, None, heads, kernels="stock")
        assert (panels.kernels, panels.runners["hydra"].kernels) == ("panels", "panels")
        assert "panels" in panels.kernels_reason
        # every branch of dispatch decodes here: the panel layout is the one this CPU class (or
        # ENTMTP_ISA, or the emulated AMX of `hardware.amx_emulated`) dispatches to
        dims = {m.panels.dim() for m in panels.decode_model.modules() if isinstance(m, kernels.PanelLinear)}
        assert dims == {4 if kernels.panel_layout() == "amx" else 3}, (dims, kernels.panel_layout())
        ids = torch.randint(2, 96, (1, 13))
        with torch.inference_mode():
            a, b = model(ids).logits, panels.decode_model(ids).logits
        assert (a.float() - b.float()).abs().max() <= 0.02 * a.float().abs().max()
        assert_lossless_and_near_stock(panels, stock, model, "hydra", resolve_tree("mc_sim_7b_63").truncated(4))
    finally:
        pass


def test_a_build_killed_midway_does_not_stall_the_next(tmp_path):
    """A build killed mid-way leaves torch's lock file, on which every later build waited forever.
    The build lock is the operating system's: it dies with its holder, and under it the leftover
    file goes. While a live process builds, the next one waits, then gives a one-line reason."""
    import subprocess
    import sys

    baton = tmp_path / "lock"
    baton.write_text("")  # as a killed build leaves it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from filelock import FileLock; "
        f"lock = FileLock({str(tmp_path / 'entmtp-build.lock')!r}); lock.acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=r"^another process has been building in .* for over 0 s$"):
            with kernels._build_lock(tmp_path, timeout_s=0.3):
                pass
        assert baton.exists()  # a live builder's files are left alone
    finally:
        holder.kill()
        holder.wait()
    with kernels._build_lock(tmp_path, timeout_s=5):  # its holder died: taken at once
        assert not baton.exists()


def test_the_build_reads_a_copy_of_the_source_beside_it(tmp_path, monkeypatch):
    """Two checkouts sharing the cache build from the same path, so the second loads the first's library."""
    src = tmp_path / "k.cpp"
    src.write_text("int a;\n")
    monkeypatch.setattr(kernels, "PANELS_SOURCE", src)
    build = tmp_path / "build"
    build.mkdir()
    staged = kernels._staged_source(build)
    assert staged == build / "k.cpp" and staged.read_text() == "int a;\n"
    mtime = staged.stat().st_mtime_ns
    assert kernels._staged_source(build).stat().st_mtime_ns == mtime  # unchanged: not rewritten
    src.write_text("int b;\n")
    assert kernels._staged_source(build).read_text() == "int b;\n"


def test_a_failed_build_gives_a_one_line_reason(tmp_path, monkeypatch):
    """No compiler, no ninja or a broken source: one line saying why, and decoding stays on stock."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.delenv("ENTMTP_PANELS", raising=False)
    monkeypatch.delenv("ENTMTP_ISA", raising=False)
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "PANELS_SOURCE", broken)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the panels are not tried on this CPU")
    available = kernels._panels_unavailable() is None
    monkeypatch.setattr(kernels, "_panel_ops_registered", lambda: False)  # try the build even if loaded
    kernels._build_panels.cache_clear()
    try:
        why = kernels._panels_unavailable()
        assert why.startswith("entmtp's panel kernels could not be built here (") and "\n" not in why
    finally:
        kernels._build_panels.cache_clear()
        monkeypatch.undo()
    # asking again in the same process neither rebuilds nor loads a second library registering the
    # same ops (that aborts the process): the loaded ops are reused
    assert (kernels._panels_unavailable() is None) == available
    kernels._build_panels.cache_clear()
    assert (kernels._panels_unavailable() is None) == available


def test_the_pip_ninja_is_found_without_an_activated_environment(monkeypatch):
    """`.venv/bin/python app.py` does not put .venv/bin on PATH, where pip installs ninja."""
    import os
    import shutil

    pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    with kernels._ninja_on_path():
        assert shutil.which("ninja") is not None
    assert os.environ["PATH"] == "/nonexistent"


def _rope_reference(x, cos, sin):
    """transformers' rotate-half rotary embedding in float64: x [B, H, q, d], cos/sin [B, q, d]."""
    x, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s


@needs_panels
@pytest.mark.parametrize("B, d", [(1, 8), (2, 24), (1, 64)])  # d/2 of 4 and 12: lanes one at a time (in part)
def test_rope_split_is_the_rotary_embedding_of_each_head(B, d):
    g = torch.Generator().manual_seed(0)
    q, H, Hkv = 5, 6, 2
    qkv = torch.randn(B, q, (H + 2 * Hkv) * d, generator=g)
    cos, sin = torch.randn(B, q, d, generator=g).bfloat16(), torch.randn(B, q, d, generator=g).bfloat16()
    qs, ks, vs = torch.ops.entmtp_cpu.rope_split(qkv, cos, sin, H, Hkv)
    heads = qkv.view(B, q, H + 2 * Hkv, d).transpose(1, 2)
    assert qs.shape == (B, H, q, d) and ks.shape == vs.shape == (B, Hkv, q, d) and qs.dtype == torch.float32
    torch.testing.assert_close(qs.double(), _rope_reference(heads[:, :H], cos, sin))
    torch.testing.assert_close(ks.double(), _rope_reference(heads[:, H:H + Hkv], cos, sin))
    assert torch.equal(vs, heads[:, H + Hkv:])
    # bf16 angles are read as they are: the same bits as their float32 values
    for a, b in zip(torch.ops.entmtp_cpu.rope_split(qkv, cos.float(), sin.float(), H, Hkv), (qs, ks, vs)):
        assert torch.equal(a, b)
    # every row alone: a row's q and k do not depend on the rows beside it
    one = torch.ops.entmtp_cpu.rope_split(qkv[:, 2:3].contiguous(), cos[:, 2:3], sin[:, 2:3], H, Hkv)
    assert torch.equal(one[0], qs[:, :, 2:3]) and torch.equal(one[1], ks[:, :, 2:3])
    with pytest.raises(RuntimeError, match="rope_split: qkv must be a float32 CPU tensor"):
        torch.ops.entmtp_cpu.rope_split(qkv.bfloat16(), cos, sin, H, Hkv)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        torch.ops.entmtp_cpu.rope_split(qkv, cos[:, :2], sin[:, :2], H, Hkv)


@needs_panels
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q, k and v
def test_fused_attention_is_the_attention_up_to_rounding(family):
    from transformers import DynamicCache

    model = tiny_model(family, vocab=96, dtype=torch.bfloat16, seed=2)
    attn = model.model.layers[1].self_attn
    assert kernels.FusedAttention.fits(attn)
    fused = kernels.FusedAttention(attn)
    assert kernels.probe_ok(fused) and (fused.qkv_bias is not None) == (family == "qwen2")
    # prompt of 6 rows (causal, no mask), then one row, then a 3-node tree, against the module in float32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 10, 32, generator=g).bfloat16()
    ids = torch.arange(10)[None]
    cos, sin = model.model.rotary_emb(x, ids)
    exact = __import__("copy").deepcopy(attn).float()
    tree = torch.zeros(1, 1, 3, 10)
    tree[0, 0, 2, 8] = float("-inf")  # node 2 is a sibling of node 1
    outs = []
    for mod, dtype in ((fused, torch.bfloat16), (exact, torch.float32)):
        cache, parts = DynamicCache(), []
        for lo, hi, mask in ((0, 6, None), (6, 7, None), (7, 10, tree)):
            out, _ = mod(x[:, lo:hi].to(dtype), position_embeddings=(cos[:, lo:hi].to(dtype), sin[:, lo:hi].to(dtype)),
                         attention_mask=None if mask is None else mask.to(dtype), cache=cache)
            parts.append(out.float())
        outs.append(torch.cat(parts, 1))
        assert cache.layers[1].keys.dtype == torch.float32 and cache.get_seq_length(1) == 10
    ours, ref = outs
    assert (ours - ref).abs().max() <= 2 ** -7 * ref.abs().max()


@pytest.fixture
def panels_only(monkeypatch):
    """The panel kernels even on a CPU with oneDNN's bf16 kernels (dispatch as on an AVX2 CPU)."""
    monkeypatch.setenv("ENTMTP_ISA", "avx2")
    yield


class DoubledAttention(torch.nn.Module):
    """Llama's attention with twice its output: shaped like it, another formula."""

    def __init__(self, attn):
        super().__init__()
        self.__dict__.update({k: v for k, v in attn.__dict__.items() if k != "_modules"})
        self._modules = dict(attn._modules)
        self._inner = attn.forward

    def forward(self, *args, **kwargs):
        out, w = self._inner(*args, **kwargs)
        return 2 * out, w


@needs_panels
def test_fused_attention_fits_and_probe_refuse_other_attentions(panels_only):
    import transformers

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    doubled = DoubledAttention(model.model.layers[0].self_attn)
    assert kernels.FusedAttention.fits(doubled) and not kernels.probe_ok(kernels.FusedAttention(doubled))
    model.model.layers[0].self_attn = doubled
    twin, _, why = kernels.decode_model(model, "auto")
    assert type(twin.model.layers[0].self_attn) is DoubledAttention
    assert type(twin.model.layers[1].self_attn) is kernels.FusedAttention and "attentions" in why
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral = transformers.MistralForCausalLM(cfg).to(torch.bfloat16)
    assert not kernels.FusedAttention.fits(mistral.model.layers[0].self_attn)  # sliding window
    qcfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    qwen3 = transformers.Qwen3ForCausalLM(qcfg).to(torch.bfloat16)
    assert not kernels.FusedAttention.fits(qwen3.model.layers[0].self_attn)  # q/k norms
    assert not kernels.FusedAttention.fits(model.half().model.layers[1].self_attn)  # float16
    mixed = copy.deepcopy(model.model.layers[1].self_attn)
    mixed.o_proj.float()
    assert not kernels.FusedAttention.fits(mixed)  # projections of two dtypes


@needs_panels
def test_fused_attention_only_where_attention_runs_in_float32(panels_only, monkeypatch):
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    count = lambda m: sum(isinstance(x, kernels.FusedAttention) for x in m.modules())  # noqa: E731
    assert count(kernels.decode_model(model, "auto")[0]) == 2
    eager = tiny_model("llama", vocab=96, dtype=torch.bfloat16, attn="eager")
    assert count(kernels.decode_model(eager, "panels")[0]) == 0  # an eager model attends as it does
    assert count(kernels.decode_model(model, "stock")[0]) == 0


@needs_panels
@pytest.mark.parametrize("d", [16, 64, 72, 128])  # 72: a 64-column chunk and an 8-column one
def test_attend_is_the_attention_and_each_row_its_own(d):
    """attend: within fp32 rounding of float64 attention, for a causal prompt, a tree mask and a
    bool mask; and a tree's row is bit for bit that row alone over just the keys it sees, stored
    contiguously -- what a one-token step on the accepted path computes. Rows see 38-43 keys, so
    the 8-key score blocks are padded (the padding must carry no weight)."""
    from test_attention import exact_attention

    ops = torch.ops.entmtp_cpu
    g = torch.Generator().manual_seed(4)
    past, n = 37, 6
    q = torch.randn(1, 6, n, d, generator=g)
    k, v = (torch.randn(1, 2, past + n, d, generator=g) for _ in range(2))
    parents = [-1, 0, 0, 1, 3, 2]  # a tree over the last n positions
    visible = torch.zeros(n, past + n, dtype=torch.bool)
    visible[:, :past] = True
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, past + j], j = True, parents[j]
    additive = torch.zeros(1, 1, n, past + n).masked_fill(~visible, torch.finfo(torch.float32).min)
    scale = d ** -0.5
    out = ops.attend(q, k, v, additive, False, scale)  # [1, n, 6, d]
    close = dict(rtol=1e-5, atol=1e-6)  # float32 against float64
    torch.testing.assert_close(out.double(), exact_attention(q, k, v, visible).transpose(1, 2), **close)
    assert torch.equal(ops.attend(q, k, v, visible[None, None], False, scale), out)
    causal = ops.attend(q, k, v, None, True, scale)
    prompt_mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # row i sees keys <= past + i
    torch.testing.assert_close(causal.double(), exact_attention(q, k, v, prompt_mask).transpose(1, 2), **close)
    for i in range(n):
        keep = visible[i].nonzero()[:, 0]
        alone = ops.attend(q[:, :, i:i + 1], k[:, :, keep], v[:, :, keep], None, False, scale)
        assert torch.equal(alone[:, 0], out[:, i])
    # a strided cache view (kvcache.GrowingLayer's) reads the same numbers
    buf = torch.zeros(1, 2, 64, d)
    buf[:, :, :past + n] = k
    assert torch.equal(ops.attend(q, buf[:, :, :past + n], v, additive, False, scale), out)
    with pytest.raises(RuntimeError, match="attend: shapes do not match"):
        ops.attend(q[..., :12], k[..., :12], v[..., :12], None, True, scale)  # 12 % 8 != 0
    with pytest.raises(RuntimeError, match=r"attend: mask must be \[B or 1, 1, Q, L\]"):
        ops.attend(q, k, v, additive[..., :-1], False, scale)


@needs_panels
@pytest.mark.parametrize("group", [1, 2, 3, 5])  # query heads per key/value head: passes of 3, 2 and 1 heads
def test_attend_gives_each_query_head_the_bits_it_has_alone(group):
    """attend computes the query heads of one key/value head in passes that share each key and value
    load; a head's output must not depend on which heads share its pass: bit for bit the output of
    that head attended alone (one query head on its key/value head), and within fp32 rounding of the
    float64 attention."""
    from test_attention import exact_attention

    ops = torch.ops.entmtp_cpu
    g = torch.Generator().manual_seed(11)
    hkv, q_len, keys, d = 2, 4, 29, 72  # 29 keys: padded score blocks; 72: a 32-column chunk and an 8-column one
    q = torch.randn(1, hkv * group, q_len, d, generator=g)
    k, v = (torch.randn(1, hkv, keys, d, generator=g) for _ in range(2))
    out = ops.attend(q, k, v, None, True, d ** -0.5)  # [1, q_len, H, d]
    for h in range(hkv * group):
        kv = h // group
        alone = ops.attend(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], None, True, d ** -0.5)
        assert torch.equal(alone[:, :, 0], out[:, :, h]), f"head {h}"
    causal = torch.ones(q_len, keys, dtype=torch.bool).tril(keys - q_len)
    torch.testing.assert_close(out.double(), exact_attention(q, k, v, causal).transpose(1, 2), rtol=1e-5, atol=1e-6)


@needs_panels
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 33), (8, 8195), (17, 7)])
def test_first_argmax_gives_torch_argmax_indices(rows, vocab):
    """Greedy acceptance's argmax on entmtp's op: torch's indices on every row -- ties to the first
    maximum (also across the op's four accumulators and its 8-wide tail), a NaN as the maximum,
    rows of -inf and of signed zeros -- for any leading shape; None where it cannot run."""
    kernels._panels_unavailable()  # loads the library if the suite has not yet
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # tie: the first one, past the vectorised head
    if rows > 1:
        x[-1, 2] = x[-1, 5] = 60.0  # tie inside one 8-wide block
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2] = 0.0
        x[2, vocab // 2] = -0.0
    if rows > 3:
        x[3, vocab - 2] = x[3, vocab - 1] = float("nan")
        x[4, 1] = 100.0  # a maximum inside the first 8-wide block of a later accumulator
    got = kernels.first_argmax(x)
    assert got is not None and got.dtype == torch.long
    assert torch.equal(got, x.argmax(-1))
    assert torch.equal(kernels.first_argmax(x[None]), x.argmax(-1)[None])  # leading dims kept
    assert int(kernels.first_argmax(x[0])) == int(x[0].argmax())
    # bf16 read in place: the same cases, and the ties rounding to bf16 makes of near-equal values
    xb = x.bfloat16()
    xb[0, 1:: max(1, vocab // 5)] = 50.0
    got_b = kernels.first_argmax(xb)
    assert got_b is not None and torch.equal(got_b, xb.argmax(-1)) and torch.equal(got_b, xb.float().argmax(-1))
    assert torch.equal(kernels.first_argmax(xb[None]), xb.argmax(-1)[None])
    from entmtp.acceptance import argmax
    assert torch.equal(argmax(xb), xb.argmax(-1)) and torch.equal(argmax(x.half()), x.half().argmax(-1))
    assert kernels.first_argmax(x.double()) is None and kernels.first_argmax(x.half()) is None


def test_first_argmax_steps_aside_when_the_library_is_off(monkeypatch):
    monkeypatch.setenv("ENTMTP_PANELS", "0")
    x = torch.randn(2, 40)
    assert kernels.first_argmax(x) is None
    from entmtp.acceptance import argmax
    assert torch.equal(argmax(x), x.argmax(-1))


@needs_panels
def test_fused_prefix_layer_is_the_hydrapp_layer_up_to_rounding(panels_only, monkeypatch):
    from entmtp.heads import FusedPrefixLayer, HeadRunner, PrefixState

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=7)
    heads = random_heads(model, "hydra", num_heads=3, prefix=True)
    fused, stock = HeadRunner(heads, model, kernels="auto"), HeadRunner(heads, model, kernels="stock")
    assert isinstance(fused.compute.prefix, FusedPrefixLayer) and not isinstance(heads.prefix, FusedPrefixLayer)
    h = model.config.hidden_size
    hidden, more = torch.randn(9, h).to(torch.bfloat16), torch.randn(3, h).to(torch.bfloat16)
    exact = copy.deepcopy(heads.prefix).float()
    with torch.inference_mode():
        (sa, fa), (sb, _) = fused.start(hidden), stock.start(hidden)
        se = PrefixState(dtype=torch.float32)
        fe = exact(hidden.float()[None], se)[0, -1]
        # a prompt, then continuations of one and of three rows (causal over the cached keys)
        for new in (more[:1], more):
            ga, gb, ge = fused.advance(sa, new, new[-1]), stock.advance(sb, new, new[-1]), exact(new.float()[None], se)[0, -1]
            for ours, theirs in ((fa, fe), (ga, ge)):
                assert (ours.float() - theirs).abs().max() <= 4 * 2.0 ** -8 * theirs.abs().max()
            assert (gb.float() - ge).abs().max() <= 32 * 2.0 ** -8 * ge.abs().max()
        assert sa.length == sb.length == 9 + 1 + 3 and sa.keys.dtype == torch.float32
        # another formula (here: twice the MLP) fails the probe, and then the layer stays unfused
        layer = copy.deepcopy(heads.prefix)
        layer.down_proj.weight.mul_(2)
        bad = FusedPrefixLayer(layer)
        bad.down = torch.ops.entmtp_cpu.bf16_pack_panels(heads.prefix.down_proj.weight.detach())
        assert not kernels.probe_ok(bad, rows=(2, 7))
    # oneDNN's set (or stock) keeps the layer's own bf16 path
    assert not isinstance(HeadRunner(heads, model, kernels="onednn").compute.prefix, FusedPrefixLayer)


needs_panels32 = pytest.mark.skipif(kernels.kernel_options(torch.float32)["panels"] is not None,
                                    reason=f"no float32 panel kernels here: {kernels.kernel_options(torch.float32)['panels']}")


@needs_panels32
@pytest.mark.parametrize("n,k,bias", [(49, 37, False), (100, 64, True), (16, 8, False), (33, 129, True)])
def test_float32_panels_are_row_invariant_and_within_rounding_of_f_linear(n, k, bias):
    """Every row of a 1-40 row float32 panel product is bitwise its one-row product, in the 16- and
    (where the CPU has AVX-512) 32-column layout alike, and within FP32_PROBE_RTOL of F.linear."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(40, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    layouts = ["avx2"] + (["avx512"] if hardware.isa_at_least("avx512") else [])
    results = []
    for layout in layouts:
        panels = kernels.pack_panels(w, layout)
        assert panels.dtype == torch.float32 and panels.shape[2] == kernels.PANEL_LAYOUTS[layout][0]
        y = kernels.panels_product(x, panels, n, b)
        ref = nn.functional.linear(x, w, b)
        assert y.dtype == torch.float32 and y.shape == (40, n)
        assert (y - ref).abs().max() <= kernels.FP32_PROBE_RTOL * ref.abs().max()
        for rows in (1, 2, 5, 12, 13, 40):
            assert torch.equal(kernels.panels_product(x[:rows], panels, n, b), y[:rows])
        assert torch.equal(torch.cat([kernels.panels_product(x[i:i + 1], panels, n, b) for i in range(40)]), y)
        results.append(y)
    assert all(torch.equal(r, results[0]) for r in results)  # one FMA chain per column, any width
    with pytest.raises(RuntimeError, match="f32_panels_linear: x must be a float32"):
        kernels.panels_product(x.bfloat16(), kernels.pack_panels(w, "avx2"), n)


@needs_panels32
def test_float32_panels_twin_is_row_invariant_and_decodes_like_generate():
    """A float32 model on the panels: every linear a panel product, gated MLPs and attentions fused,
    logits within rounding of the stock model; the twin's forward is row-invariant, so greedy
    speculation emits exactly its plain loop's tokens, and those are generate's."""
    model = tiny_model("llama", vocab=96, seed=5)  # no prompt below greedily emits its EOS (generate's min_new_tokens would differ)
    m, name, why = kernels.decode_model(model, "panels")
    assert name == "panels" and "float32 linears in panels" in why and m is not model
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"  # the model itself untouched
    assert any(isinstance(x, kernels.FusedAttention) for x in m.modules())
    assert any(isinstance(x, kernels.FusedMLP) for x in m.modules())
    assert isinstance(m.lm_head, kernels.PanelLinear) and m.lm_head.panels.dtype == torch.float32
    assert_logits_close(model, m, 1e-4)
    heads = {"hydra": random_heads(model, "hydra", num_heads=4)}
    eng = Engine(model, None, heads, kernels="panels")
    assert eng.kernels == "panels"
    tree = resolve_tree("mc_sim_7b_63").truncated(8)
    cfg = DecodeConfig(max_new_tokens=40, eos_token_ids=())
    for prompt in ([5, 9, 11, 5, 9], [7] * 3 + list(range(20, 40))):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        plain = eng.run(prompt, config=cfg)
        spec = eng.run(prompt, heads="hydra", tree=tree, config=cfg)
        assert plain.tokens == want[0, len(prompt):].tolist()
        assert spec.tokens == plain.tokens  # bitwise the plain loop's rows: identical, not merely close
    # row invariance itself: 6 tokens after a prompt in one forward give bitwise the logits of 6 one-token steps
    from transformers import DynamicCache

    prompt, more = torch.tensor([[7, 7, 7] + list(range(20, 40))]), torch.tensor([[41, 5, 9, 63, 2, 17]])
    with torch.inference_mode():
        cache = DynamicCache()
        m(prompt, cache=cache)
        chain = m(more, cache=cache).logits[0]
        cache = DynamicCache()
        m(prompt, cache=cache)
        steps = torch.cat([m(more[:, i:i + 1], cache=cache).logits[0] for i in range(6)])
    assert torch.equal(chain, steps)


@needs_panels32
def test_float32_fused_modules_probe_against_the_module_they_replace():
    """The fused float32 MLP and attention keep their claim on the real formula and refuse a module
    that computes something else (a doubled attention)."""
    model = tiny_model("llama", vocab=96, seed=8)
    layer = model.model.layers[0]
    mlp, attn = kernels.FusedMLP(layer.mlp), kernels.FusedAttention(layer.self_attn)
    assert mlp.gate_up.dtype == attn.qkv.dtype == torch.float32
    assert kernels.probe_ok(mlp) and kernels.probe_ok(attn, getattr(attn, "probe_rows", (1, 7)))
    assert "of the gated MLP" in mlp.claim and "of the attention" in attn.claim
    assert not kernels.probe_ok(kernels.FusedAttention(DoubledAttention(layer.self_attn)))


def test_quantize_rows_is_symmetric_per_row_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 29, generator=g) * torch.linspace(0.01, 5, 37)[:, None]
    w[4] = 0
    q, scales = kernels.quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (37,) and int(q.abs().max()) == 127
    assert scales[4] == 1 and not q[4].any()
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all()
    assert torch.equal(q[:, :1].float() * scales[:, None], (q[:, :1].float() * scales[:, None]))
    assert (q.abs().amax(1)[torch.arange(37) != 4] == 127).all()  # each row's largest weight is +-127


@needs_panels
@pytest.mark.parametrize("n,k", [(40, 24), (33, 7), (64, 96), (200, 576)])
def test_int8_draft_panels_are_the_dequantised_product_and_row_invariant(n, k, monkeypatch):
    """The int8 draft lm_head: each row x . (q * scale) within fp32 summation error, the same bits
    whatever the rows beside it, and the AVX2 and AVX-512 panels (ENTMTP_ISA) the same bits."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    q, scales = kernels.quantize_rows(w)
    ys = {}
    for isa in ("avx2",) + (("avx512",) if hardware.isa_at_least("avx512") else ()):
        monkeypatch.setenv("ENTMTP_ISA", isa)
        layer = kernels.int8_draft_layer(w)
        assert layer is not None and layer.panels.shape[-1] == (16 if isa == "avx2" else 32)
        x = torch.randn(13, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.inference_mode():
            y = layer(x)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(13)])
        assert y.dtype == torch.float32 and y.shape == (13, n)
        assert torch.equal(alone, y)
        exact, slack = _exact_and_slack(x, q.float())
        assert ((y - exact * scales).abs() <= slack * scales + 1e-6).all()
        ys[isa] = y
    assert all(torch.equal(y, ys["avx2"]) for y in ys.values())


@needs_panels
def test_int8_draft_panels_refuse_bad_inputs():
    layer = kernels.int8_draft_layer(torch.randn(20, 8).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="i8_panels_linear: panels must come from i8_pack_panels"):
        layer(torch.randn(2, 9).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="i8_panels_linear: scales must be float32"):
        torch.ops.entmtp_cpu.i8_panels_linear(torch.randn(2, 8), layer.panels, layer.scales[:5], 20)
    with pytest.raises(RuntimeError, match="i8_pack_panels: w must be a 2-D int8"):
        torch.ops.entmtp_cpu.i8_pack_panels(torch.randn(4, 4), 16)


@needs_panels
@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_int8_draft_lm_head_is_chosen_by_measurement_and_decoding_stays_lossless(kind, monkeypatch):
    """The drafting lm_head slice goes int8 where it is measured faster (ENTMTP_DRAFT_INT8 forces
    either way, a slice too small to matter stays as it is); drafts then follow the int8 logits'
    order, and speculation still emits exactly the plain loop's tokens."""
    from entmtp import heads as heads_mod

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=7)
    h = random_heads(model, kind, num_heads=3)
    assert not heads_mod.HeadRunner(h, model).lm_int8  # 96 x hidden: below INT8_DRAFT_MIN_WEIGHTS
    monkeypatch.setattr(heads_mod, "INT8_DRAFT_MIN_WEIGHTS", 0)
    from entmtp.autotune import draft_lm_entry, draft_lm_words

    for faster, want in (((2e-3, 1e-3), True), ((1e-3, 2e-3), False)):
        monkeypatch.setattr(heads_mod, "draft_lm_timings", lambda *a, t=faster: t)
        runner = heads_mod.HeadRunner(h, model)
        assert runner.lm_int8 is want and runner.lm_seconds == faster
        assert isinstance(runner.lm, kernels.Int8PanelLinear) is want
        # with the slice, the heads' residual blocks: on the int8 panels too, or all left as they were
        blocks = [m for m in runner.compute.modules() if isinstance(m, (heads_mod.ResBlock, heads_mod.Int8ResBlock))]
        assert len(blocks) == len([m for m in h.modules() if isinstance(m, heads_mod.ResBlock)]) > 0
        assert all(isinstance(m, heads_mod.Int8ResBlock) is want for m in blocks)
        entry = draft_lm_entry(runner)  # what `entmtp tune` and the Machine tab say
        assert entry == {"int8": want, "rows": 96, "ms": [faster[0] * 1e3, faster[1] * 1e3],
                         "int8_blocks": len(blocks) if want else 0, "int8_prefix": False}
        assert ("in int8 (" if want else "in the kernels' own dtype (") in draft_lm_words(entry)
        assert ("residual blocks in int8" in draft_lm_words(entry)) is want
    monkeypatch.setattr(heads_mod, "draft_lm_timings", lambda *a: (2e-3, 1e-3))
    assert not heads_mod.HeadRunner(h, model, kernels="stock").lm_int8  # stock asked for: stock drafts
    monkeypatch.setenv("ENTMTP_DRAFT_INT8", "0")
    assert not heads_mod.HeadRunner(h, model).lm_int8
    monkeypatch.setenv("ENTMTP_DRAFT_INT8", "1")
    runner = heads_mod.HeadRunner(h, model)
    assert runner.lm_int8 and runner.lm_seconds is None
    tree = resolve_tree("mc_sim_7b_63").truncated(3)
    hidden = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        _, feature = runner.start(hidden)
        root = torch.tensor(17)
        logits = runner.first_level(feature, root)
        assert logits.dtype == torch.float32  # the int8 panels' sums, scaled
        draft = runner.draft(tree, feature, root)
        first = [int(draft.tokens[i]) for i in range(1, tree.size) if tree.parent_list[i] == 0]
        assert sorted(first) == sorted(runner.to_full_vocab(torch.topk(logits, len(first)).indices).tolist())
    engine = Engine(model, heads={kind: h}, kernels="panels")
    assert engine.runners[kind].lm_int8
    assert_lossless_and_near_stock(engine, Engine(model, kernels="stock"), model, kind, tree)


@needs_panels
@pytest.mark.parametrize("hydra_input", [False, True])
def test_int8_residual_blocks_draft_what_their_int8_weights_compute(hydra_input):
    """A head's residual block on the int8 panels: within bf16 rounding of the same block computed
    exactly with its int8 weights (W and R stacked in one product; R the identity for a square
    block), each row alone; and close to the bf16 block it replaces."""
    from entmtp.heads import Int8ResBlock, ResBlock

    torch.manual_seed(3)
    h = 64
    block = ResBlock(3 * h if hydra_input else h, h)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    block = block.to(torch.bfloat16)
    fast = Int8ResBlock(block)
    assert fast.has_res is hydra_input and kernels.probe_ok(fast)
    x = torch.randn(9, block.linear.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        y = fast(x)
        alone = torch.cat([fast(x[i:i + 1]) for i in range(9)])
        ref = block(x).float()
    assert y.dtype == torch.bfloat16 and y.shape == (9, h) and torch.equal(y, alone)
    assert fast.matches(x)
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()  # int8 weights: drafts move at near-ties only
    fast.bias = fast.bias + 1.0  # a block that computes something else fails its probe
    assert not fast.matches(x)


@needs_panels
def test_int8_prefix_layer_is_the_hydrapp_layer_with_int8_weights(panels_only):
    """With the drafts on int8 panels, the Hydra++ layer's four products are too: within bf16
    rounding of the exact float32 layer whose weights are rounded to int8, over a prompt and
    continuations; a layer computing something else fails the probe."""
    from entmtp.heads import FusedPrefixLayer, HeadRunner, Int8PrefixLayer, PrefixState

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=7)
    heads = random_heads(model, "hydra", num_heads=3, prefix=True)
    runner = HeadRunner(heads, model, kernels="auto", lm_int8=True)
    assert isinstance(runner.compute.prefix, Int8PrefixLayer) and runner.int8_blocks == 3
    from entmtp.autotune import draft_lm_entry, draft_lm_words

    assert "3 residual blocks and the Hydra++ layer in int8 too" in draft_lm_words(draft_lm_entry(runner))
    assert isinstance(HeadRunner(heads, model, kernels="auto", lm_int8=True, int8_blocks=False).compute.prefix,
                      FusedPrefixLayer)
    exact = runner.compute.prefix._exact_copy()
    for name in ("q_proj", "down_proj"):  # the copy's weights are the int8 ones, not the layer's own
        assert not torch.equal(getattr(exact, name).weight, getattr(heads.prefix, name).weight.float())
    h = model.config.hidden_size
    hidden, more = torch.randn(9, h).to(torch.bfloat16), torch.randn(3, h).to(torch.bfloat16)
    with torch.inference_mode():
        st, f = runner.start(hidden)
        se = PrefixState(dtype=torch.float32)
        fe = exact(hidden.float()[None], se)[0, -1]
        pairs = [(f, fe)]
        for new in (more[:1], more):
            pairs.append((runner.advance(st, new, new[-1]), exact(new.float()[None], se)[0, -1]))
        for ours, theirs in pairs:
            assert ours.dtype == torch.bfloat16
            assert (ours.float() - theirs).abs().max() <= 4 * 2.0 ** -8 * theirs.abs().max()
        bad = Int8PrefixLayer(runner.compute.prefix)
        bad.down = kernels.int8_draft_layer(heads.prefix.down_proj.weight.detach() * 2)
        assert not kernels.probe_ok(bad, rows=(2, 7))


class DoubledResidualLayer(torch.nn.Module):
    """A decoder layer with a pre-norm layer's children and another formula (x + 2 mlp(...))."""

    def __init__(self, layer):
        super().__init__()
        self.__dict__.update({k: v for k, v in layer.__dict__.items() if k != "_modules"})
        self._modules = dict(layer._modules)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        a, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, cache=cache)
        x = hidden_states + a
        return x + 2 * self.mlp(self.post_attention_layernorm(x))


@needs_panels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lean_decoder_layers_decode_exactly_as_the_layers_own_forward(panels_only, dtype):
    """The decoding twin's decoder layers get a forward that calls their children directly: the
    twin decodes and records hidden states bit for bit as with the layers' own forward (plain and
    tree steps with heads), the model itself keeps transformers' class; a layer computing another
    formula, or whose children carry hooks, keeps its own forward."""
    import transformers

    model = tiny_model("llama", vocab=96, dtype=dtype, seed=5)
    engine = Engine(model, heads={"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="panels")
    layers = list(engine.decode_model.model.layers)
    assert all(type(m).__name__ == "LeanLlamaDecoderLayer" for m in layers)
    assert all(isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer) for m in layers)
    assert all(type(m) is transformers.models.llama.modeling_llama.LlamaDecoderLayer for m in model.model.layers)
    tree = resolve_tree("mc_sim_7b_63").truncated(3)
    prompt = [5, 9, 11, 5, 9, 30, 31]
    ids = torch.tensor([prompt])
    lean_class, own_class = type(layers[0]), type(layers[0]).__mro__[1]
    results = []
    for cls in (lean_class, own_class):
        for m in layers:
            m.__class__ = cls
        with torch.inference_mode():
            out = engine.decode_model(input_ids=ids, output_hidden_states=True)
        results.append((engine.run(prompt, config=DecodeConfig(max_new_tokens=24)).tokens,
                        engine.run(prompt, heads="hydra", tree=tree, config=DecodeConfig(max_new_tokens=24)).tokens,
                        out.logits, out.hidden_states))
    for m in layers:
        m.__class__ = lean_class
    (plain, spec, logits, hidden), (plain0, spec0, logits0, hidden0) = results
    assert plain == plain0 and spec == spec0 == plain and torch.equal(logits, logits0)
    assert len(hidden) == len(hidden0) == 3 and all(torch.equal(a, b) for a, b in zip(hidden, hidden0))
    # another formula with the same children: the probe keeps its own forward
    other = tiny_model("llama", vocab=96, dtype=dtype, seed=5)
    other.model.layers[0] = DoubledResidualLayer(other.model.layers[0])
    twin = kernels.decode_model(other, "panels")[0]
    assert type(twin.model.layers[0]) is DoubledResidualLayer
    assert type(twin.model.layers[1]).__name__ == "LeanLlamaDecoderLayer"
    # children with hooks (accelerate's device placement, a hook added to watch attention) are
    # called as modules, so their hooks fire, with the same tokens
    seen = []
    hook = layers[1].self_attn.register_forward_pre_hook(lambda mod, args: seen.append(1))
    try:
        assert engine.run(prompt, config=DecodeConfig(max_new_tokens=24)).tokens == plain and len(seen) >= 24
    finally:
        hook.remove()
    # a spare model's stock layers pass the probe as they are
    assert kernels.lean_decoder_layers(tiny_model("llama", vocab=96, dtype=dtype, seed=5)) == 2


@needs_panels
def test_tree_masks_come_in_the_dtype_the_twins_attention_reads(panels_only):
    """A bf16 twin whose every attention is entmtp's `FusedAttention` takes float32 tree masks (no
    conversion in each layer) and verifies trees exactly as with bf16 masks: the same logits bit
    for bit, so speculation still emits the plain loop's tokens; stock twins keep the model's dtype."""
    from entmtp.kvcache import decoding_cache
    from entmtp.verify import forward, tree_mask

    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    engine = Engine(model, heads={"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="panels")
    twin = engine.decode_model
    assert all(isinstance(layer.self_attn, kernels.FusedAttention) for layer in twin.model.layers)
    assert kernels.tree_mask_dtype(twin) == engine.mask_dtype == torch.float32
    assert kernels.tree_mask_dtype(model) == torch.bfloat16  # stock attention: sdpa wants the query's dtype
    assert Engine(model, kernels="stock").mask_dtype == torch.bfloat16
    tree = resolve_tree("mc_sim_7b_63").truncated(3)
    buf = tree.buffers(torch.device("cpu"))
    ids = torch.randint(3, 96, (1, tree.size), generator=torch.Generator().manual_seed(2))
    logits = []
    for dtype in (torch.float32, torch.bfloat16):
        cache = decoding_cache(twin)
        with torch.inference_mode():
            forward(twin, torch.tensor([[5, 9, 11, 5, 9]]), cache)
            logits.append(forward(twin, ids, cache, mask=tree_mask(buf.attention_bias(dtype), 5),
                                  position_ids=(buf.depths + 5)[None])[0])
    assert torch.equal(logits[0], logits[1])
    prompt = [5, 9, 11, 5, 9, 30, 31]
    plain = engine.run(prompt, config=DecodeConfig(max_new_tokens=24)).tokens
    assert engine.run(prompt, heads="hydra", tree=tree, config=DecodeConfig(max_new_tokens=24)).tokens == plain


def test_draft_lm_timings_time_a_draft_step_from_flushed_caches(monkeypatch):
    """Each variant's turn is a draft step as decoding meets it: the caches flushed (a verification
    forward streamed the base's weights), the first level's rows, then the next levels'; the two
    variants in alternating turns, the first turn untimed; the medians compared."""
    from entmtp import heads as heads_mod

    monkeypatch.setattr(heads_mod, "_DRAFT_LM_TIMINGS", {})
    log = []

    class Layer(torch.nn.Module):
        def __init__(self, name, ms):
            super().__init__()
            self.name, self.ms, self.out_features, self.in_features = name, ms, 64, 16

        def forward(self, x):
            log.append((self.name, x.shape[0]))
            t = time.perf_counter() + self.ms * 1e-3
            while time.perf_counter() < t:
                pass
            return x

    own, int8 = Layer("own", 2.0), Layer("int8", 0.5)
    t_own, t_int8 = heads_mod.draft_lm_timings(own, int8, torch.float32, "panels", rows=(1, 4),
                                               flush=lambda: log.append(("flush", 0)))
    turns = [log[i: i + 3] for i in range(0, len(log), 3)]
    assert len(turns) == 2 * (heads_mod.DRAFT_LM_TURNS + 1)
    assert all(t[0] == ("flush", 0) and [r for _, r in t[1:]] == [1, 4] and t[1][0] == t[2][0] for t in turns)
    assert [t[1][0] for t in turns[:4]] == ["own", "int8", "int8", "own"]  # the order alternated
    assert 4e-3 <= t_own < 8e-3 and 1e-3 <= t_int8 < t_own  # two 2 ms calls; two 0.5 ms calls


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    from entmtp.hardware import CACHE_SIZE_FALLBACK, largest_cache_bytes, parse_cache_size

    assert [parse_cache_size(t) for t in ("32768K", "1024K\n", "32M", "48", "x", "")] == [32 << 20, 1 << 20, 32 << 20, 48, 0, 0]
    for i, size in enumerate(("32K", "1024K", "32768K")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")  # not a cache level: skipped
    assert largest_cache_bytes(str(tmp_path)) == 32 << 20
    assert largest_cache_bytes(str(tmp_path / "missing")) == CACHE_SIZE_FALLBACK
