"""Prompt lookup: the n-gram index, grafting a copied chain onto a tree, and lossless decoding with it."""

import random

import pytest

from entmtp.decoding import DecodeConfig
from entmtp.lookup import NgramIndex, graft_chain
from entmtp.trees import Tree, resolve_tree
from test_decoding import engine_for, hf_greedy


def naive_continuation(ctx, length, max_ngram, min_ngram=1):
    for n in range(min(max_ngram, len(ctx)), min_ngram - 1, -1):
        key = ctx[-n:]
        for e in range(len(ctx) - 2, n - 2, -1):  # latest earlier occurrence with a continuation
            if ctx[e - n + 1: e + 1] == key:
                return ctx[e + 1: e + 1 + length]
    return []


def test_continuation_matches_a_naive_search():
    rnd = random.Random(0)
    for trial in range(300):
        toks = [rnd.randrange(6) for _ in range(rnd.randrange(0, 40))]
        idx = NgramIndex(max_ngram=3)
        cut = rnd.randrange(0, len(toks) + 1)
        idx.extend(toks[:cut])
        idx.extend(toks[cut:])  # incremental extension == one extension
        root = rnd.randrange(6)
        L = rnd.randrange(0, 6)
        assert idx.continuation([root], L) == naive_continuation(toks + [root], L, 3), (toks, root, L)


def test_continuation_prefers_the_longest_ngram():
    idx = NgramIndex(max_ngram=3)
    idx.extend([1, 2, 3, 9, 9, 5, 2, 3, 7, 7])
    # suffix "2 3" occurred twice; the trigram "1 2 3" only once, followed by 9 9
    assert idx.continuation([1, 2, 3], 2) == [9, 9]
    assert idx.continuation([2, 3], 3) == [7, 7, 2]  # the latest bigram occurrence; its continuation runs into the suffix
    assert idx.continuation([42], 4) == []
    assert idx.continuation([3], 0) == []


def test_graft_reuses_shared_prefix_and_adds_a_branch():
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1]], "t")
    # canonical order: root, (0), (1), (0,0), (0,1)
    tokens = [10, 20, 21, 30, 31]
    merged, mtoks, added = graft_chain(tree, tokens, [20, 31, 40, 41])
    assert [mtoks[i] for i in added] == [40, 41]
    # the chain follows root -> 20 -> 31 and continues below node (0, 1)
    paths = merged.node_paths
    assert paths[added[0]] == (0, 1, 0) and paths[added[1]] == (0, 1, 0, 0)
    by_path = dict(zip(merged.node_paths, mtoks))
    for p, t in zip(tree.node_paths, tokens):
        assert by_path[p] == t  # the heads' nodes keep their tokens
    assert merged.n_nodes == tree.n_nodes + 2 and merged.name == "t+lookup2"
    # a fully shared chain adds nothing; a new first token becomes a new root child with the next free rank
    same, stoks, none = graft_chain(tree, tokens, [20, 30])
    assert same is tree and stoks == tokens and none == []
    m2, t2, a2 = graft_chain(tree, tokens, [99])
    assert m2.node_paths[a2[0]] == (2,) and t2[a2[0]] == 99
    # memoised: the same graft point and length give the same Tree (buffers built once)
    assert graft_chain(tree, tokens, [20, 31, 1, 2])[0] is merged


def test_graft_onto_root_only_tree():
    root_only = Tree.from_paths([], "root_only")
    merged, toks, added = graft_chain(root_only, [5], [6, 7, 8])
    assert toks == [5, 6, 7, 8] and merged.parent_list == [-1, 0, 1, 2] and added == [1, 2, 3]


@pytest.mark.parametrize("heads", [None, "hydra", "medusa"])
def test_lookup_is_lossless_and_accepts_copied_spans(heads):
    eng = engine_for("llama")
    prompt = [5, 9, 2, 7, 11, 5, 9, 2]
    ref = hf_greedy(eng.model, prompt, 60)
    tree = None if heads is None else resolve_tree("binary_2x2")
    base = eng.run(prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=60, eos_token_ids=()))
    g = eng.generate(prompt, heads=heads, tree=tree,
                     config=DecodeConfig(max_new_tokens=60, eos_token_ids=(), lookup=6, trace="full"))
    steps = list(g)
    r = g.result
    assert r.tokens == ref == base.tokens
    used = [s for s in steps if s.lookup_nodes]
    assert used, "the tiny model's output repeats: lookup must find matches"
    # some step accepted a copied node, and copied spans made the generation need fewer forwards
    assert any(set(s.lookup_nodes) & set(s.accepted) for s in used)
    assert r.tau > base.tau
    for s in used:
        assert len(s.tokens) == len(s.parents) == s.n_nodes + 1
        assert len(s.draft_probs) == len(s.tokens)
        if heads is not None:
            assert all(s.draft_probs[i] != s.draft_probs[i] for i in s.lookup_nodes)  # NaN: no head distribution


def test_lookup_config_is_validated():
    with pytest.raises(ValueError):
        DecodeConfig(lookup=-1)
    with pytest.raises(ValueError):
        DecodeConfig(lookup=4, lookup_ngram=0)
    for bad in (0, 4):  # between 1 and lookup_ngram (3)
        with pytest.raises(ValueError, match="lookup_min_ngram"):
            DecodeConfig(lookup=4, lookup_min_ngram=bad)


@pytest.mark.parametrize("heads", [None, "hydra"])
def test_lookup_min_ngram_grafts_only_longer_matches_and_stays_lossless(heads):
    eng = engine_for("llama")
    prompt = [5, 9, 2, 7, 11, 5, 9, 2, 3, 9, 4]
    tree = None if heads is None else resolve_tree("binary_2x2")
    runs = {}
    for k in (1, 2, 3):
        g = eng.generate(prompt, heads=heads, tree=tree,
                         config=DecodeConfig(max_new_tokens=60, eos_token_ids=(), lookup=6, lookup_min_ngram=k, trace="full"))
        steps = list(g)
        runs[k] = (g.result, steps)
        emitted = list(prompt)
        for s in steps:
            ctx = emitted + [s.tokens[0]]  # the context a step's lookup matches against ends with its root
            if s.lookup_nodes:
                # some n-gram of length >= k ending the context occurred earlier in it
                assert any(ctx[-n:] == ctx[e - n + 1: e + 1] for n in range(k, 4) for e in range(n - 1, len(ctx) - 1)), (k, s)
            emitted += s.emitted
    ref = hf_greedy(eng.model, prompt, 60)
    assert all(r.tokens == ref for r, _ in runs.values())
    copied = {k: sum(len(s.lookup_nodes or ()) for s in steps) for k, (_, steps) in runs.items()}
    assert copied[1] > copied[3] and copied[1] >= copied[2] >= copied[3]


def test_app_stats_count_tokens_accepted_from_lookup():
    from entmtp import ui_chat as ui

    eng = engine_for("llama")
    prompt = [5, 9, 2, 7, 11, 5, 9, 2]
    r = eng.run(prompt, config=DecodeConfig(max_new_tokens=60, eos_token_ids=(), lookup=6))
    copied = sum(len(set(s.lookup_nodes or ()) & set(s.accepted)) for s in r.steps)
    assert copied > 0
    assert f"{copied} tokens accepted from prompt lookup" in ui._stats_md(r, 1.0, "lookup", False)
    plain = eng.run(prompt, config=DecodeConfig(max_new_tokens=10, eos_token_ids=()))
    assert "prompt lookup" not in ui._stats_md(plain, 1.0, "baseline", False)
