"""The engine is lossless: float32 greedy speculative output equals `model.generate`.

The models attend sharply and by position (`peaked.peaked_model`): a random tiny model attends
almost uniformly, and with wrong tree position ids it still emits the right tokens. The oracle
runs below fail with wrong position ids, a causal instead of a tree mask, or the first rows of
the tree kept in the cache instead of the accepted ones (`python scripts/mutants.py`)."""

import functools
import random
import threading

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, random_heads, tiny_model
from peaked import attention_entropy, peaked_model
from entmtp.acceptance import Sampling, TypicalRule
from entmtp.decoding import ROOT_ONLY, ContextError, DecodeConfig, Engine, Prefill
from entmtp.heads import Draft, HeadRunner
from entmtp.scheduler import Decision as _Decision
from entmtp.trees import Tree, resolve_tree
from entmtp.verify import UnsupportedModelError, base_features

VOCAB = 24  # small, so that random heads' drafts are often accepted


@functools.lru_cache(maxsize=None)
def engine_for(family: str, attn: str = "sdpa") -> Engine:
    m = peaked_model(family, vocab=VOCAB, seed=3, attn=attn)
    heads = {
        "medusa": random_heads(m, "medusa", num_heads=6, seed=1),
        "hydra": random_heads(m, "hydra", num_heads=6, seed=2),
        "hydra++": random_heads(m, "hydra", num_heads=6, prefix=True, seed=3),
        "hydra-dv": random_heads(m, "hydra", num_heads=6, seed=4, draft_vocab_size=12),
        "eagle": random_heads(m, "eagle", num_heads=6, seed=5),
        "eagle-layers": random_heads(m, "eagle", num_heads=6, seed=6, feature_layers=[1, 0]),
    }
    with torch.no_grad():
        heads["hydra-dv"].draft_vocab.copy_(torch.arange(0, VOCAB, 2))
    return Engine(m, None, heads)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_attend_sharply(family):
    """What makes the exactness tests below see position, mask and cache bugs: attention rows far
    from uniform (a random tiny model's are nearly uniform: 2.7 nats of at most 3.0 over 20 keys)."""
    ids = list(range(2, 22))
    assert attention_entropy(engine_for(family).model, ids) < 1.2 < 2.5 < attention_entropy(tiny_model(family, vocab=VOCAB, seed=3), ids)


def hf_greedy(model, ids, n, eos=None):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=1, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@st.composite
def trees(draw, max_depth=6, max_nodes=24):
    """Random valid trees: gaps in ranks, uneven widths, depth 1..6."""
    depth = draw(st.integers(1, max_depth))
    paths = {(draw(st.integers(0, 4)),)}
    frontier = sorted(paths)
    for d in range(1, depth):
        parent = draw(st.sampled_from(frontier))
        new = {parent + (r,) for r in draw(st.sets(st.integers(0, 5), min_size=1, max_size=3))}
        paths |= new
        frontier = sorted(new)
    extra = draw(st.lists(st.tuples(st.sampled_from(sorted(paths)), st.integers(0, 7)), max_size=8))
    for parent, r in extra:
        if len(parent) < depth:
            paths.add(parent + (r,))
    paths = sorted(paths)[:max_nodes]
    paths = [p for p in paths if all(p[:k] in set(paths) for k in range(1, len(p)))]
    return Tree.from_paths([list(p) for p in paths])


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees(), heads=st.sampled_from(["medusa", "hydra", "hydra++", "hydra-dv", "eagle", "eagle-layers"]),
       prompt=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=20), n=st.integers(1, 40),
       lookup=st.sampled_from([0, 0, 2, 8]))
def test_greedy_equals_generate(family, tree, heads, prompt, n, lookup):
    eng = engine_for(family)
    ref = hf_greedy(eng.model, prompt, n)
    cfg = DecodeConfig(max_new_tokens=n, eos_token_ids=(), lookup=lookup)
    got = eng.run(prompt, heads=heads, tree=tree, config=cfg)
    assert got.tokens == ref
    assert eng.run(prompt, config=cfg).tokens == ref  # baseline in the same engine


class _Override:
    """A HeadRunner with some attributes replaced."""

    def __init__(self, base, **over):
        self._base, self._over = base, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._base, name)


def oracle_run(eng, prompt, tree, ref, heads="hydra", seed=0, config=None):
    """Run with drafts that put the true continuation on a random root-to-leaf path."""
    rnd = random.Random(seed)
    g = eng.generate(prompt, heads=heads, tree=tree, config=config or DecodeConfig(max_new_tokens=len(ref), eos_token_ids=()))
    real = g.runner.draft
    leaves = tree.buffers().retrieve.tolist()

    def draft(tr, feature, root, with_stats=False, **kw):
        d = real(tr, feature, root, with_stats, **kw)
        toks = d.tokens.clone()
        pos = len(g.tokens)  # the root is ref[pos]
        path = [i for i in rnd.choice(leaves) if i >= 0]
        for depth, node in enumerate(path[1:], start=1):
            if pos + depth < len(ref):
                toks[node] = ref[pos + depth]
        return Draft(toks, d.probs, d.entropies)

    g.runner = _Override(eng.runners[heads], draft=draft)
    for _ in g:
        pass
    return g.result


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "gappy_5", "binary_2x2", "chain_4"])
def test_oracle_drafts_accept_long_paths_and_stay_exact(family, tree_name):
    eng = engine_for(family)
    prompt = [5, 9, 2, 7, 11]
    ref = hf_greedy(eng.model, prompt, 48)
    tree = resolve_tree(tree_name)
    for heads in ("medusa", "hydra", "hydra++"):
        r = oracle_run(eng, prompt, tree, ref, heads=heads)
        assert r.tokens == ref
        assert r.tau > 1.8  # the oracle path is accepted: compaction of non-prefix paths is exercised
        assert any(s.accepted != list(range(len(s.accepted))) for s in r.steps) or tree_name == "chain_4"


def test_eager_attention_is_exact():
    eng = engine_for("llama", attn="eager")
    prompt = [3, 4, 5, 6]
    ref = hf_greedy(eng.model, prompt, 30)
    r = oracle_run(eng, prompt, resolve_tree("mc_sim_7b_63"), ref)
    assert r.tokens == ref


def test_eos_stops_like_generate():
    eng = engine_for("llama")
    prompt = [4, 8, 15, 16]
    free = hf_greedy(eng.model, prompt, 30)
    eos = free[7]
    ref = hf_greedy(eng.model, prompt, 30, eos=eos)
    r = oracle_run(eng, prompt, resolve_tree("binary_2x2"), free, config=DecodeConfig(max_new_tokens=30, eos_token_ids=(eos,)))
    assert r.tokens == ref and r.tokens[-1] == eos and r.stop_reason == "eos"


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13])
def test_max_new_tokens_counts_tokens_not_steps(n):
    eng = engine_for("qwen2")
    prompt = [2, 3, 4]
    ref = hf_greedy(eng.model, prompt, 40)
    r = oracle_run(eng, prompt, resolve_tree("chain_5"), ref, config=DecodeConfig(max_new_tokens=n, eos_token_ids=()))
    assert r.tokens == ref[:n] and r.stop_reason == "max_new_tokens"


class CharTokenizer:
    """Minimal tokenizer stand-in: token i is a letter."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


def test_stop_strings_and_full_trace():
    eng = engine_for("llama")
    eng2 = Engine(eng.model, CharTokenizer(), {"hydra": eng.runners["hydra"].heads})
    prompt = [5, 6, 7]
    ref = hf_greedy(eng.model, prompt, 40)
    stop = CharTokenizer().decode(ref[10:12])
    r = eng2.run(prompt, heads="hydra", tree=resolve_tree("mc_sim_7b_63"),
                 config=DecodeConfig(max_new_tokens=40, eos_token_ids=(), stop_strings=(stop,), trace="full"))
    assert r.stop_reason == "stop_string"
    full = CharTokenizer().decode(ref)
    first = full.find(stop) + len(stop)  # one character per token
    assert r.tokens == ref[: len(r.tokens)] and first <= len(r.tokens) < first + 7
    assert stop not in r.text and r.text == full[: full.find(stop)]
    for s in r.steps:
        if not s.time_verify:
            continue
        n1 = s.n_nodes + 1
        assert len(s.token_texts) == len(s.base_probs) == len(s.draft_probs) == len(s.depths) == n1
        assert all(0 <= p <= 1 for p in s.base_probs) and all(e >= 0 for e in s.base_entropies)
        assert [s.tokens[i] for i in s.accepted] == s.emitted[: len(s.accepted)]
        for a, b in zip(s.accepted, s.accepted[1:]):
            assert s.parents[b] == a
        assert s.time_draft >= 0 and s.time_verify > 0


def test_context_limit_never_overflows():
    m = tiny_model("llama", vocab=VOCAB, seed=3, max_pos=48)
    eng = Engine(m, None, {"hydra": random_heads(m, "hydra", num_heads=4)})
    prompt = list(range(2, 22))  # 20 tokens
    ref = hf_greedy(m, prompt, 48 - 20 + 1)  # the last token needs no forward of its own
    r = eng.run(prompt, heads="hydra", tree=resolve_tree("mc_sim_7b_63"), config=DecodeConfig(max_new_tokens=100, eos_token_ids=()))
    assert r.stop_reason == "context"
    assert len(prompt) + len(r.tokens) <= 48 + 1  # the last token is emitted without a forward
    assert r.tokens == ref[: len(r.tokens)] and len(r.tokens) >= 26
    assert any("context" in n or "does not fit" in n for n in r.notices)


def test_long_prompt_truncated_or_error():
    m = tiny_model("llama", vocab=VOCAB, seed=3, max_pos=32)
    eng = Engine(m)
    prompt = [3] * 40
    r = eng.run(prompt, config=DecodeConfig(max_new_tokens=4, eos_token_ids=()))
    assert len(r.tokens) == 4 and r.prompt_tokens < 32 and "truncated" in r.notices[0]
    with pytest.raises(ContextError, match="context is 32"):
        eng.run(prompt, config=DecodeConfig(max_new_tokens=4, on_long_prompt="error"))


def test_unsupported_models_get_a_clear_error():
    cfg = transformers.MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        Engine(transformers.MistralForCausalLM(cfg))
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1)
    with pytest.raises(UnsupportedModelError):
        Engine(transformers.Qwen2ForCausalLM(cfg))


def test_heads_for_another_model_are_rejected():
    m = tiny_model("llama", vocab=VOCAB)
    other = tiny_model("llama", vocab=VOCAB + 4)
    with pytest.raises(ValueError, match="vocab size"):
        Engine(m, None, {"hydra": random_heads(other, "hydra")})


def test_tree_deeper_than_heads_is_rejected():
    eng = engine_for("llama")
    short = Engine(eng.model, None, {"h": random_heads(eng.model, "hydra", num_heads=2)})
    with pytest.raises(ValueError, match="exceeds the 2 draft heads"):
        short.generate([3, 4], heads="h", tree=resolve_tree("chain_3"))


def test_concurrent_generations_do_not_mix():
    eng = engine_for("llama")
    prompts = [[3, 4, 5], [9, 8, 7, 6], [10, 2], [5, 5, 5, 5, 5]]
    refs = [hf_greedy(eng.model, p, 25) for p in prompts]
    results = [None] * len(prompts)

    def work(i):
        results[i] = eng.run(prompts[i], heads="hydra", tree=resolve_tree("binary_2x2"),
                             config=DecodeConfig(max_new_tokens=25, eos_token_ids=(), trace="full")).tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == refs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", [None, "hydra++", "eagle-layers"])
def test_generations_from_one_prefill_decode_as_from_their_own(family, heads):
    """Generations started one after another from one `Engine.prefill` emit what generations
    with their own prefill emit, step for step (the cache cropped back to the prompt each time,
    the heads started from the kept features): after trees that grew the cache by several
    positions and a generation stopped half-way."""
    eng = engine_for(family)
    prompt = [3, 7, 4, 9, 2, 11, 5]
    pre = eng.prefill(prompt, heads=heads)
    assert pre.rewindable and pre.cache.get_seq_length() == len(prompt)
    runs = [("binary_2x2", 20), ("chain_4", 9), ("binary_2x2", 20), ("chain_4", 3)] if heads else [(None, 20), (None, 5)]
    half = eng.generate(prompt, heads=heads, tree=resolve_tree(runs[0][0]) if heads else None,
                        config=DecodeConfig(max_new_tokens=30, eos_token_ids=()), prefill=pre)
    next(half), next(half)  # a generation left half-way
    for tree, n in runs:
        kw = dict(heads=heads, tree=resolve_tree(tree) if tree else None, config=DecodeConfig(max_new_tokens=n, eos_token_ids=()))
        own = eng.run(prompt, **kw)
        shared = eng.run(prompt, prefill=pre, **kw)
        assert shared.tokens == own.tokens and len(shared.tokens) == n
        assert [(s.tokens, s.accepted) for s in shared.steps] == [(s.tokens, s.accepted) for s in own.steps]


def test_a_prefill_serves_one_generation_at_a_time_and_its_own_prompt():
    eng = engine_for("llama")
    prompt = [3, 7, 4, 9, 2]
    pre = eng.prefill(prompt, heads="hydra")
    cfg = DecodeConfig(max_new_tokens=10, eos_token_ids=())
    first = eng.generate(prompt, heads="hydra", tree=resolve_tree("binary_2x2"), config=cfg, prefill=pre)
    next(first)
    second = eng.generate(prompt, config=cfg, prefill=pre)  # plain decoding may share it
    next(second)
    with pytest.raises(RuntimeError, match="took its cache"):
        next(first)
    with pytest.raises(ValueError, match="another prompt"):
        eng.generate(prompt[:-1], config=cfg, prefill=pre)
    with pytest.raises(ValueError, match="no features for these heads"):
        eng.generate(prompt, heads="eagle-layers", tree=resolve_tree("chain_4"), config=cfg, prefill=pre)
    with pytest.raises(ValueError, match="no features"):
        eng.generate(prompt, heads="hydra", tree=resolve_tree("chain_4"), config=cfg, prefill=eng.prefill(prompt))
    with pytest.raises(ContextError):
        eng.prefill(list(range(2, 20)) * 200)


def test_a_prefill_whose_cache_cannot_be_cropped_back_says_so():
    """Sliding-window layers drop early positions: such a prefill starts one generation, then
    refuses to be cropped (`calibrate.context_prefill` then prefills each generation)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    eng = engine_for("llama")
    prompt = [3, 7, 4, 9, 2]
    pre = eng.prefill(prompt)
    pre.cache.layers[0] = DynamicSlidingWindowLayer(sliding_window=4)
    assert not pre.rewindable
    pre.cache.get_seq_length = lambda layer_idx=0: len(prompt) + 3  # as after a generation
    with pytest.raises(ValueError, match="cannot be cropped back"):
        pre.start(object())
    assert isinstance(pre, Prefill)


def test_typical_rule_runs_and_is_deterministic_at_greedy_bonus():
    eng = engine_for("llama")
    rule = TypicalRule(Sampling(temperature=0.0), epsilon=0.09, alpha=0.3)
    a = eng.run([3, 4, 5], heads="hydra", tree=resolve_tree("mc_sim_7b_63"), rule=rule, config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    b = eng.run([3, 4, 5], heads="hydra", tree=resolve_tree("mc_sim_7b_63"), rule=rule, config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    assert a.tokens == b.tokens and len(a.tokens) == 20
    # a loose threshold accepts more than exact greedy does
    loose = TypicalRule(Sampling(temperature=0.0), epsilon=1e-6, alpha=1e-6)
    c = eng.run([3, 4, 5], heads="hydra", tree=resolve_tree("mc_sim_7b_63"), rule=loose, config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    g = eng.run([3, 4, 5], heads="hydra", tree=resolve_tree("mc_sim_7b_63"), config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    assert c.tau > g.tau


def test_summary_and_json():
    eng = engine_for("gpt2")
    r = eng.run([3, 4, 5], heads="medusa", tree=resolve_tree("binary_2x2"), config=DecodeConfig(max_new_tokens=12, eos_token_ids=(), trace="full"))
    s = r.summary()
    assert s["new_tokens"] == 12 and s["tau"] >= 1.0 and 0 <= s["bookkeeping_share"] < 1
    import json
    json.dumps(r.to_dict())  # NaN-free, serialisable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_layer_steps_equal_one_causal_pass(dtype):
    """Hydra++'s layer fed step by step (its KV storage growing past its first capacity, one-
    and many-token steps) gives the outputs of one causal pass over the whole sequence."""
    from entmtp.heads import PrefixState
    layer = random_heads(tiny_model("llama", vocab=VOCAB, seed=3), "hydra", num_heads=2, prefix=True, seed=5).prefix
    layer = layer.to(dtype)
    torch.manual_seed(0)
    x = torch.randn(1, 150, layer.q_proj.in_features, dtype=dtype)
    with torch.inference_mode():
        full = layer(x)
        state, outs, i = PrefixState(), [], 0
        for t in [40, 1, 3, 1, 1, 30, 2, 1, 71]:  # 150 tokens; storage grows at 64 and 128
            outs.append(layer(x[:, i: i + t], state))
            i += t
    assert state.length == 150 and state.keys.shape[-2] >= 150
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=tol, atol=tol)


def _eagle_runner(layers=()):
    m = peaked_model("llama", vocab=VOCAB, seed=3)
    heads = random_heads(m, "eagle", num_heads=4, seed=7, feature_layers=list(layers))
    return m, HeadRunner(heads, m, draft_dtype=torch.float32, kernels="stock")


@pytest.mark.parametrize("layers", [(), (1, 0)])
def test_eagle_drafting_follows_the_training_unroll(layers):
    """EAGLE's draft rows at decoding time (the root row in the layer's context, deeper rows
    attending to the context and their own chain) compute what training optimises: along the
    true continuation, level k's logits equal `training_logits`' step k at that position
    (with multi-layer features too: decoding and training read the same base layers)."""
    m, runner = _eagle_runner(layers)
    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (1, 30))
    with torch.no_grad():
        hid = base_features(m(ids, output_hidden_states=True).hidden_states, layers)
        ref = runner.heads.training_logits(hid, ids, m.get_input_embeddings(), runner.lm_weight)
        for t in (0, 11, 20):
            state, feature = runner.start(hid[0, : t + 1], ids[0, : t + 1])
            logits = runner.first_level(feature, ids[0, t + 1])
            torch.testing.assert_close(logits, ref[0][0, t], rtol=1e-5, atol=1e-5)
            rows, chain = runner._eagle_root(feature, ids[0, t + 1])[None], ([], [])
            for k in range(1, 4):
                rows, chain = runner._eagle_rows(feature, rows, chain, torch.tensor([0]), ids[0, t + k + 1].view(1), k)
                torch.testing.assert_close(runner.head_logits(k, rows)[0], ref[k][0, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [(), (2, 1)])
def test_eagle_context_after_decoding_equals_one_pass(layers):
    """After a generation (tree steps, root-only steps, rejected branches), the draft layer's
    context holds exactly the rows of one causal pass over prompt + output: accepted positions
    read the base's real features (those of every layer the heads read), drafted rows never stay."""
    m, runner = _eagle_runner(layers)
    eng = Engine(m, None)
    eng.runners["eagle"] = runner
    prompt = [3, 9, 4, 17, 5, 6]
    steps = iter([resolve_tree("mc_sim_7b_63"), ROOT_ONLY, Tree.from_paths([[0], [1], [0, 0]])] * 20)
    gen = eng.generate(prompt, heads="eagle", tree=resolve_tree("mc_sim_7b_63"), config=DecodeConfig(max_new_tokens=30, eos_token_ids=()))
    gen.scheduler = _Override(gen.scheduler, choose=lambda sig: _Decision(next(steps)))
    for _ in gen:
        pass
    st = gen.feature
    seq = prompt + gen.tokens[:-1]  # the last token is the pending root (no hidden state yet)
    assert st.position == len(seq) - 1 and st.kv.length == st.position
    with torch.no_grad():
        hid = base_features(m(torch.tensor([seq]), output_hidden_states=True).hidden_states, layers)[0]
        fresh, _ = runner.start(hid, torch.tensor(seq))
    n = fresh.kv.length
    assert n == st.kv.length
    torch.testing.assert_close(st.kv.keys[:, :, :n], fresh.kv.keys[:, :, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.hidden, fresh.hidden, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,layers", [("medusa", ()), ("hydra", ()), ("eagle", ()), ("eagle", (1,))])
def test_head_ranks_are_the_drafts_ranks_along_the_true_continuation(kind, layers):
    """The tree search's acceptance statistics (`calibrate.head_ranks`) rank the true next tokens
    under each level's draft logits as decoding computes them, for every kind of heads."""
    from entmtp.calibrate import head_ranks
    m = peaked_model("llama", vocab=VOCAB, seed=3)
    heads = random_heads(m, kind, num_heads=3, seed=8, feature_layers=list(layers))
    runner = HeadRunner(heads, m, draft_dtype=torch.float32, kernels="stock")
    torch.manual_seed(1)
    ids = torch.randint(2, VOCAB, (1, 25))
    with torch.no_grad():
        hid = base_features(m(ids, output_hidden_states=True).hidden_states, layers)
        ref = heads.training_logits(hid, ids, m.get_input_embeddings(), runner.lm_weight)
    ranks, _, _ = head_ranks(runner, hid[0], ids[0].tolist(), start=2, n=10, max_rank=5)
    for k in range(3):
        for i in range(10):
            t = 2 + i
            logits = ref[k][0, t]
            assert int(ranks[i, k]) == min(5, int((logits > logits[ids[0, t + k + 2]]).sum()))


@pytest.mark.parametrize("n_kv", [1, 3])
def test_chain_attention_is_masked_attention_over_context_and_chain(n_kv):
    """Grouped-query attention of draft rows over context keys (some masked) and each row's own
    chain equals plain masked softmax attention over all those keys."""
    from entmtp.heads import chain_attention
    torch.manual_seed(0)
    B, H, T, S, d = 2, 6, 5, 7, 8
    q = torch.randn(B, H, T, d)
    k_ctx, v_ctx = torch.randn(B, n_kv, S, d), torch.randn(B, n_kv, S, d)
    chain_k = [torch.randn(B, n_kv, T, d) for _ in range(3)]
    chain_v = [torch.randn(B, n_kv, T, d) for _ in range(3)]
    allow = torch.rand(T, S) > 0.3
    allow[:, 0] = True
    got = chain_attention(q, k_ctx, v_ctx, allow, chain_k, chain_v, 0.3)
    rep = H // n_kv
    for b in range(B):
        for h in range(H):
            g = h // rep
            for t in range(T):
                keys = torch.cat([k_ctx[b, g][allow[t]]] + [c[b, g, t][None] for c in chain_k])
                vals = torch.cat([v_ctx[b, g][allow[t]]] + [c[b, g, t][None] for c in chain_v])
                want = torch.softmax(keys @ q[b, h, t] * 0.3, 0) @ vals
                torch.testing.assert_close(got[b, h, t], want, rtol=1e-5, atol=1e-5)


def test_heads_that_read_missing_base_layers_are_refused():
    """Feature layers are checked against the base when heads are added, and only EAGLE heads
    read several layers."""
    from entmtp.heads import HeadsConfig
    m = peaked_model("llama", vocab=VOCAB, seed=3)
    with pytest.raises(ValueError, match=r"base layers \[3\].*0\.\.2"):
        Engine(m, None, {"e": random_heads(m, "eagle", num_heads=2, feature_layers=[1, 3])})
    with pytest.raises(ValueError, match="EAGLE heads only"):
        HeadsConfig.for_base(m.config, "hydra", num_heads=2, feature_layers=[1])
