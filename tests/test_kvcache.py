"""kvcache: the decoding loop's cache keeps what transformers' DynamicCache keeps, without
concatenating every step, and stores float32 exactly when the model attends in float32."""

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from conftest import random_heads, tiny_model
from peaked import peaked_model
from entmtp import attention, kernels
from entmtp.decoding import DecodeConfig, Engine
from entmtp.kvcache import GrowingLayer, decoding_cache
from entmtp.trees import resolve_tree
from entmtp.verify import keep_cache_entries


def kv(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=g).to(dtype), torch.randn(1, 2, n, 4, generator=g).to(dtype)


def test_growing_layer_keeps_what_a_dynamic_layer_keeps_through_growth_and_crops():
    grow, ref = GrowingLayer(capacity=4), DynamicLayer()
    for i, (n, crop) in enumerate([(3, 0), (5, -2), (1, 0), (9, -4), (2, -1)]):  # grows 4 -> 8 -> 16
        k, v = kv(n, i)
        a, b = grow.update(k, v), ref.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        grow.crop(crop), ref.crop(crop)
        assert grow.get_seq_length() == ref.get_seq_length()
        assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)
    assert grow._keys.shape[-2] == 16
    with pytest.raises(ValueError, match="negative count"):
        grow.crop(3)


def test_growing_layer_stores_its_dtype_exactly():
    layer = GrowingLayer(torch.float32)
    k, v = kv(5, 0, torch.bfloat16)
    keys, values = layer.update(k, v)
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys, k.float()) and torch.equal(values, v.float())  # bf16 -> fp32 is exact


@pytest.mark.parametrize("one_op", [True, False])  # entmtp's keep_rows op (where built), or torch indexing per layer
def test_keep_cache_entries_on_growing_layers_matches_dynamic_layers(one_op, monkeypatch):
    """A non-prefix accepted path: the kept positions, in order, then writing continues after them."""
    if one_op and kernels._panels_unavailable():
        pytest.skip(kernels._panels_unavailable())
    if not one_op:
        monkeypatch.setattr("entmtp.verify.move_rows", lambda *a: False)
    caches = [DynamicCache(), DynamicCache()]
    caches[1].layers = [GrowingLayer(capacity=8) for _ in range(2)]
    caches[0].layers = [DynamicLayer() for _ in range(2)]
    for cache in caches:
        for layer in range(2):
            cache.update(*kv(10, layer), layer)  # 4 past positions + a 6-node tree
        keep_cache_entries(cache, past=4, path=[0, 2, 5], n_tree=6)
        for layer in range(2):
            cache.update(*kv(1, 9), layer)
    for a, b in zip(*(c.layers for c in caches)):
        assert a.get_seq_length() == b.get_seq_length() == 8
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(caches[1].layers[0].keys[:, :, 4:7], kv(10, 0)[0][:, :, [4, 6, 9]])


def test_keep_rows_refuses_moves_it_cannot_make_in_place():
    """The op moves rows only downwards and in ascending order (so no source is overwritten before it
    is read): anything else is a one-line error, not a silently scrambled cache."""
    if kernels._panels_unavailable():
        pytest.skip(kernels._panels_unavailable())
    t = torch.arange(2 * 3 * 8 * 16, dtype=torch.float32).view(2, 3, 8, 16)
    expect = t.clone()
    expect[:, :, 2:4] = t[:, :, [3, 6]]
    assert kernels.move_rows([t], [3, 6], 2) and torch.equal(t, expect)
    for src, dst in (([1, 6], 2), ([6, 3], 2), ([3, 9], 2)):  # upwards, descending, outside the cache
        with pytest.raises(RuntimeError, match="keep_rows: src must ascend"):
            torch.ops.entmtp_cpu.keep_rows([t], src, dst)


def test_decoding_cache_layers_and_dtype():
    model = tiny_model("llama")
    cache = decoding_cache(model)
    assert [type(x) for x in cache.layers] == [GrowingLayer, GrowingLayer] and cache.layers[0].store_dtype is None
    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    twin = kernels.twin_of(bf16, lambda mod: None)
    attention.use_fp32_attention(twin, bf16.config)
    assert decoding_cache(twin).layers[0].store_dtype == torch.float32
    assert decoding_cache(bf16).layers[0].store_dtype is None
    # sliding-window layers stay transformers' own
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    sliding = decoding_cache(transformers.MistralForCausalLM(cfg))
    assert all(type(x) is not GrowingLayer for x in sliding.layers)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_forward_with_the_decoding_cache_is_the_stock_one(family):
    model = tiny_model(family)
    ids = torch.arange(3, 40)[None] % 64
    with torch.inference_mode():
        outs = []
        for cache in (DynamicCache(config=model.config), decoding_cache(model)):
            a = model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits
            b = model(input_ids=ids[:, 30:], cache=cache, use_cache=True).logits
            outs.append(torch.cat([a, b], 1))
    assert torch.equal(outs[0], outs[1])


def test_engine_decodes_the_same_with_either_cache(monkeypatch):
    import entmtp.decoding as dec

    model = peaked_model("llama", vocab=96, seed=3)  # sharp attention: a wrong cached row changes tokens
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=4)})
    tree = resolve_tree("mc_sim_7b_63").truncated(8)
    cfg = DecodeConfig(max_new_tokens=40, eos_token_ids=())
    prompt = [7] * 3 + list(range(20, 40))
    new = [eng.run(prompt, heads=h, tree=tree if h else None, config=cfg) for h in ("hydra", None)]
    monkeypatch.setattr(dec, "decoding_cache", lambda m: DynamicCache(config=m.config))
    old = [eng.run(prompt, heads=h, tree=tree if h else None, config=cfg) for h in ("hydra", None)]
    assert new[0].tokens == new[1].tokens == old[0].tokens == old[1].tokens and len(new[0].tokens) == 40
    assert [s.accepted for s in new[0].steps] == [s.accepted for s in old[0].steps]
