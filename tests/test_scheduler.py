"""Schedulers: policy logic, bank files, and losslessness of every policy (float32 greedy)."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_heads, tiny_model
from entmtp.decoding import DecodeConfig, Engine
from entmtp.scheduler import (ContextSwitch, DynamicScheduler, EntropyBucketScheduler, HysteresisScheduler,
                              LadderScheduler, Scheduler, StepSignals, load_bank, make_scheduler)
from entmtp.trees import Tree, TreeError, resolve_tree

VOCAB = 20


@pytest.fixture(scope="module")
def engine():
    m = tiny_model("llama", vocab=VOCAB, seed=7)
    return Engine(m, None, {"hydra": random_heads(m, "hydra", num_heads=4, seed=1),
                            "medusa": random_heads(m, "medusa", num_heads=4, seed=2),
                            "hydra++": random_heads(m, "hydra", num_heads=4, prefix=True, seed=3)})


def bank(tmp_path=None):
    trees = {"small": resolve_tree("chain_2"), "mid": resolve_tree("binary_2x2"), "big": resolve_tree("mc_sim_7b_63")}
    return EntropyBucketScheduler(trees, [0.5, 1.5], ["big", "mid", "small"], meta={"fitted_on": "test"})


def test_ladder_and_hysteresis_logic():
    a, b, c = Tree.chain(1), Tree.chain(2), Tree.chain(3)
    lad = LadderScheduler([a, b, c], [0.3, 0.7])
    assert [lad.choose(StepSignals(0, root_prob=v)).tree for v in (0.1, 0.3, 0.5, 0.9)] == [a, b, b, c]
    h = HysteresisScheduler(a, c, low=0.4, high=0.8).fresh()
    seq = [h.choose(StepSignals(0, root_prob=v)).tree for v in (0.5, 0.85, 0.6, 0.41, 0.39, 0.7)]
    assert seq == [a, c, c, c, a, a]
    with pytest.raises(ValueError):
        LadderScheduler([a, b], [0.7, 0.3, 0.1])


def test_entropy_buckets_and_bank_roundtrip(tmp_path):
    s = bank()
    assert s.choose(StepSignals(0, root_entropy=0.1)).tree.name == "mc_sim_7b_63"
    d = s.choose(StepSignals(0, root_entropy=1.0))
    assert d.tree == resolve_tree("binary_2x2") and d.reason["bucket"] == 1
    assert s.choose(StepSignals(0, root_entropy=3.0)).tree == resolve_tree("chain_2")
    s.save(tmp_path / "bank.json")
    s2 = load_bank(tmp_path / "bank.json")
    assert s2.edges == s.edges and s2.table == s.table and s2.meta == {"fitted_on": "test"}
    assert {n: t.paths for n, t in s2.bank.items()} == {n: t.paths for n, t in s.bank.items()}


@pytest.mark.parametrize("content,needle", [
    ("{}", "needs 'trees'"),
    ("[1,", "invalid JSON"),
    (json.dumps({"trees": {"a": [[0]]}, "edges": [1.0], "table": ["a", "zz"]}), "unknown trees: zz"),
    (json.dumps({"trees": {"a": [[0]]}, "edges": [1.0, 2.0], "table": ["a"]}), "needs 3 table rows"),
    (json.dumps({"trees": {"a": [[0, 0]]}, "edges": [], "table": ["a"]}), "no parent"),
])
def test_bad_bank_files(tmp_path, content, needle):
    p = tmp_path / "b.json"
    p.write_text(content)
    with pytest.raises(TreeError) as e:
        load_bank(p)
    assert needle in str(e.value) and "\n" not in str(e.value)


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=1,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


POLICIES = {
    "static": lambda: Scheduler(resolve_tree("mc_sim_7b_63")),
    "ladder": lambda: make_scheduler("ladder"),
    "hysteresis": lambda: make_scheduler("hysteresis"),
    "entropy": bank,
    "entropy2d": lambda: EntropyBucketScheduler({"a": Tree.chain(3), "b": resolve_tree("binary_2x2")}, [1.0],
                                                [["a", "b"], ["b", "a"]], draft_edges=[2.0]),
    "dynamic": lambda: DynamicScheduler(budget=12, depth=4, topk=4, beam=4),
    "by_context": lambda: ContextSwitch(Scheduler(resolve_tree("mc_sim_7b_63").truncated(4)), bank(), 9),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=12), n=st.integers(1, 30),
       heads=st.sampled_from(["hydra", "medusa", "hydra++"]))
def test_every_policy_is_lossless(engine, policy, prompt, n, heads):
    ref = hf_greedy(engine.model, prompt, n)
    r = engine.run(prompt, heads=heads, scheduler=POLICIES[policy](), config=DecodeConfig(max_new_tokens=n, eos_token_ids=()))
    assert r.tokens == ref
    for s in r.steps:
        if s.time_verify:
            assert s.scheduler["scheduler"] in ("static", "ladder", "hysteresis", "entropy", "dynamic")


def test_decisions_are_recorded_with_signals(engine):
    r = engine.run([3, 4, 5], heads="hydra", scheduler=bank(), config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    steps = [s for s in r.steps if s.time_verify]
    assert steps and all("root_entropy" in s.scheduler["signals"] and "bucket" in s.scheduler for s in steps)
    assert all(s.time_schedule > 0 for s in steps)
    # a one-bucket bank ignores every signal: none is computed (a root entropy costs ~0.2 ms a step on
    # a 49k-token vocabulary), and it decodes exactly its one tree
    one = EntropyBucketScheduler({"chain_2": resolve_tree("chain_2")}, [], ["chain_2"])
    assert not one.needs_root and not one.needs_draft
    r = engine.run([3, 4, 5], heads="hydra", scheduler=one, config=DecodeConfig(max_new_tokens=20, eos_token_ids=()))
    steps = [s for s in r.steps if s.time_verify]
    assert steps and all("signals" not in s.scheduler and s.tree_name == "chain_2" for s in steps)


def test_context_switch_follows_the_cache_length(engine):
    """ContextSwitch: the short-context policy below `from_tokens` cached tokens, the long one from
    there; both see every accepted length (stateful policies stay current); signals either needs
    are computed; decoding passes the cache length and switches mid-generation, emitting exactly
    the plain loop's tokens."""
    a, b = Tree.chain(3), resolve_tree("binary_2x2")
    seen = []

    class Hyst(HysteresisScheduler):
        def update(self, n):
            seen.append(n)

    sw = ContextSwitch(Scheduler(a), Hyst(Tree.chain(1), b, low=0.0, high=0.0), 10)
    assert sw.needs_root and not sw.needs_context and sw.trees == [a, Tree.chain(1), b] and sw.max_depth == 3
    assert sw.choose(StepSignals(0, root_prob=1.0, past=9)).tree == a
    d = sw.choose(StepSignals(0, root_prob=1.0, past=10))
    assert d.tree == b and d.reason["context"] == "long (switch at 10 tokens)"
    sw.update(2)
    assert seen == [2]
    assert sw.describe() == f"{a.describe()}; from 10 cached tokens hysteresis scheduler"
    fresh = sw.fresh()
    assert fresh is not sw and fresh.from_tokens == 10 and fresh.short.tree == a
    with pytest.raises(ValueError):
        ContextSwitch(Scheduler(a), Scheduler(b), -1)

    prompt, n = [3, 4, 5, 6], 24
    pasts = []

    class Spy(Scheduler):
        def choose(self, sig):
            pasts.append(sig.past)
            return super().choose(sig)

    r = engine.run(prompt, heads="hydra", scheduler=ContextSwitch(Spy(a), Spy(b), 12),
                   config=DecodeConfig(max_new_tokens=n, eos_token_ids=()))
    assert r.tokens == hf_greedy(engine.model, prompt, n)
    steps = [s for s in r.steps if s.time_verify]
    assert pasts[0] == len(prompt)  # the prompt is cached; the first root is the prefill's next token
    assert [q - p for p, q in zip(pasts, pasts[1:])] == [len(s.accepted) for s in steps[:-1]]
    longs = [s.scheduler["context"].startswith("long") for s in steps]
    assert longs == [p >= 12 for p in pasts] and True in longs and False in longs
    assert all(s.tree_name == (b.name if long else a.name) for s, long in zip(steps, longs))


def test_dynamic_tree_respects_budget_and_depth(engine):
    r = engine.run([3, 4, 5], heads="hydra", scheduler=DynamicScheduler(budget=10, depth=3, topk=3, beam=3),
                   config=DecodeConfig(max_new_tokens=20, eos_token_ids=(), trace="full"))
    for s in r.steps:
        if s.time_verify:
            assert 1 <= s.n_nodes <= 10 and max(s.depths) <= 3
            assert s.draft_probs[1] == s.draft_probs[1]  # drafted with statistics (not NaN)


@pytest.mark.parametrize("heads", ["hydra", "medusa", "hydra++"])
@pytest.mark.parametrize("budget", [1, 2, 4, 7])
def test_dynamic_tree_is_the_best_budget_nodes_of_the_full_expansion(engine, heads, budget, monkeypatch):
    # the scheduler's caps (depth, topk, beam <= budget) and grow's early stop only skip drafts
    # that could never be chosen: the tree is the `budget` best nodes of every path to depth 3.
    # Sharpened logits (x25): random heads are near-uniform, and deeper nodes must compete with
    # shallower ones for the check to mean anything.
    runner = engine.runners[heads]
    real = type(runner).head_logits
    monkeypatch.setattr(type(runner), "head_logits", lambda self, k, x: real(self, k, x) * 25)
    g = torch.Generator().manual_seed(budget)
    feature = torch.randn(runner.config.hidden_size, generator=g).to(runner.dtype)
    root = torch.tensor(3)
    full, draft = runner.grow(feature, root, depth=3, topk=3, beam=9, budget=39)
    assert full.n_nodes == 39
    logp = {tuple(p): float(torch.log(draft.probs[1 + i])) for i, p in enumerate(full.paths)}
    score = {p: sum(logp[p[:k]] for k in range(1, len(p) + 1)) for p in logp}
    token = {tuple(p): int(draft.tokens[1 + i]) for i, p in enumerate(full.paths)}
    best = sorted(score, key=lambda p: (-score[p], len(p), p))[:budget]
    assert budget < 7 or max(map(len, best)) == 3  # the deepest level competes too
    s = DynamicScheduler(budget=budget, depth=3, topk=3, beam=9)
    assert (s.depth, s.topk, s.beam) == (min(3, budget), min(3, budget), min(9, budget))
    tree, d = runner.grow(feature, root, s.depth, s.topk, s.beam, s.budget)
    assert sorted(map(tuple, tree.paths)) == sorted(best)
    assert [int(t) for t in d.tokens[1:]] == [token[tuple(p)] for p in tree.paths]


def test_dynamic_growth_stops_where_no_deeper_node_can_enter(engine, monkeypatch):
    # near-uniform random heads: every first-level node outscores every second-level one, so
    # with a budget of 3 the tree is the top 3 first tokens and the third level is never drafted
    runner = engine.runners["hydra"]
    levels = []
    real = type(runner).head_logits
    monkeypatch.setattr(type(runner), "head_logits", lambda self, k, x: levels.append(k) or real(self, k, x))
    s = DynamicScheduler(budget=3, depth=4, topk=4, beam=4)
    assert (s.depth, s.topk, s.beam) == (3, 3, 3)
    tree, _ = runner.grow(torch.randn(runner.config.hidden_size).to(runner.dtype), torch.tensor(3),
                          s.depth, s.topk, s.beam, s.budget)
    assert sorted(map(list, tree.paths)) == [[0], [1], [2]] and levels == [0, 1]
    with pytest.raises(ValueError, match="at least 1"):
        DynamicScheduler(budget=0)


def test_dynamic_tree_reuses_shapes_and_computes_entropies_only_when_asked(engine):
    runner = engine.runners["hydra++"]
    feature, root, cache = torch.randn(runner.config.hidden_size).to(runner.dtype), torch.tensor(3), {}
    a, da = runner.grow(feature, root, 3, 3, 3, 5, with_stats=False, trees=cache)
    b, db = runner.grow(feature, root, 3, 3, 3, 5, with_stats=True, trees=cache)
    assert b is a and list(cache.values()) == [a]  # the same shape: the same Tree, its buffers kept
    assert da.entropies is None and torch.equal(da.tokens, db.tokens) and torch.equal(da.probs[1:], db.probs[1:])
    assert (db.entropies[1:] > 0).all() and (db.probs[1:] > 0).all() and (db.probs[1:] <= 1).all()
    r = engine.run([3, 4, 5], heads="hydra", scheduler=DynamicScheduler(budget=4, depth=3),
                   config=DecodeConfig(max_new_tokens=12, eos_token_ids=()))
    assert all(s.draft_entropies is None for s in r.steps)  # a light trace records none


def test_dynamic_budget_defaults_to_the_static_trees_nodes(engine):
    d = make_scheduler("dynamic", engine=engine, heads="hydra", tree=resolve_tree("binary_2x2"))
    assert d.budget == resolve_tree("binary_2x2").n_nodes
    assert make_scheduler("dynamic", engine=engine, heads="hydra", tree=resolve_tree("binary_2x2"), budget=20).budget == 20
    assert make_scheduler("dynamic").budget == 32


def test_dynamic_depth_defaults_to_the_heads_and_never_exceeds_them():
    m = tiny_model("llama", vocab=VOCAB, seed=7)
    eng = Engine(m, None, {"five": random_heads(m, "hydra", num_heads=5, seed=1),
                           "two": random_heads(m, "hydra", num_heads=2, seed=2)})
    assert make_scheduler("dynamic", engine=eng, heads="five").depth == 5
    assert make_scheduler("dynamic", engine=eng, heads="five", depth=3).depth == 3
    assert make_scheduler("dynamic", engine=eng, heads="two", depth=4).depth == 2
    r = eng.run([3, 4, 5], heads="five", scheduler=make_scheduler("dynamic", engine=eng, heads="five", budget=12),
                config=DecodeConfig(max_new_tokens=30, eos_token_ids=(), trace="full"))
    assert max(max(s.depths) for s in r.steps if s.time_verify) <= 5


def test_make_scheduler_errors():
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_scheduler("nope")
    with pytest.raises(TreeError, match="bank file not found"):
        make_scheduler("entropy", bank="/nonexistent/bank.json")


def test_recorded_defaults_are_chosen_per_dtype():
    from entmtp.methods import default_tree
    from entmtp.scheduler import default_bank_path, recorded_default

    m = tiny_model("llama", vocab=VOCAB, seed=7)
    heads = random_heads(m, "hydra", num_heads=4, seed=1)
    heads.meta = {"default_tree": "chain_2.json", "default_tree_float32": "binary_2x2.json",
                  "default_bank": "no-such-bank.json"}
    eng = Engine(m, None, {"hydra": heads})
    assert recorded_default(eng, "hydra", "default_tree") == "binary_2x2.json"  # the engine is float32
    assert default_tree(eng, "hydra").key() == resolve_tree("binary_2x2").key()
    heads.meta.pop("default_tree_float32")
    assert default_tree(eng, "hydra").key() == resolve_tree("chain_2").key()
    # a tree recorded for this machine's hardware class wins over the dtype's and the generic one
    from entmtp.hardware import hardware_class

    here = hardware_class("cpu")
    heads.meta.update({f"default_tree_float32@{here}": "chain_3.json", "default_tree_float32@cpu-other": "chain_4.json",
                       "default_tree_float32": "binary_2x2.json"})
    assert recorded_default(eng, "hydra", "default_tree") == "chain_3.json"
    heads.meta.pop(f"default_tree_float32@{here}")
    assert recorded_default(eng, "hydra", "default_tree") == "binary_2x2.json"  # another class's tree is not used
    with pytest.raises(TreeError, match="no entropy bank"):
        default_bank_path(eng, "hydra")  # recorded, but the file does not exist


def test_lookup_min_ngram_is_recorded_per_dtype_and_hardware():
    """The shortest grafted lookup match comes from the heads' meta for this dtype and hardware
    class (like their trees), else the method's default; flags override; baseline never looks up."""
    from entmtp.methods import DEFAULT_LOOKUP, method_lookup
    from entmtp.hardware import hardware_class

    m = tiny_model("llama", vocab=VOCAB, seed=7)
    heads = random_heads(m, "hydra", num_heads=4, seed=1)
    eng = Engine(m, None, {"hydra": heads})
    here = hardware_class("cpu")
    heads.meta = {"default_lookup_min_ngram_float32@cpu-other": 3}
    assert method_lookup("entmtp", eng, "hydra") == {"lookup": DEFAULT_LOOKUP["entmtp"][0], "lookup_min_ngram": 1}
    heads.meta[f"default_lookup_min_ngram_float32@{here}"] = 2  # the engine is float32, on this class
    assert method_lookup("entmtp", eng, "hydra")["lookup_min_ngram"] == 2
    assert method_lookup("entmtp", None, "hydra")["lookup_min_ngram"] == 1  # no engine: nothing recorded
    flags = {"lookup": 6, "min_ngram": 3}
    assert method_lookup("entmtp", eng, "hydra", **flags) == {"lookup": 6, "lookup_min_ngram": 3}
    assert method_lookup("hydra", eng, "hydra", lookup=None, min_ngram=None)["lookup"] == 0
    assert method_lookup("baseline", eng, "hydra", **flags) == {"lookup": 0, "lookup_min_ngram": 1}
    heads.meta[f"default_lookup_min_ngram_float32@{here}"] = "2"  # a malformed checkpoint is an error, not ignored
    with pytest.raises(ValueError, match="default_lookup_min_ngram '2'"):
        method_lookup("entmtp", eng, "hydra")
