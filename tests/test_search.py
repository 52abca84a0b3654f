"""The topology lab: statistics pass, exact searches, latency model, held-out check, CLI."""

import functools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_heads, save_tiny_base, tiny_model
from entmtp import cli
from entmtp.calibrate import (CalibrationStats, LatencyModel, RuleSpec, StepRecord, collect_stats, expand_by_value,
                              LATENCY_PROTOCOL, latency_cache_path, latency_jobs, load_or_measure_latency, prior_value, representative_tree,
                              size_grid, union_tree)
from entmtp.checkpoints import save_heads
from entmtp.data import DataError
from entmtp.decoding import DecodeConfig, Engine
from entmtp.search import (SearchReport, dp_support, evaluate_trees, frontier, greedy_trees, optimal_subtrees, pareto,
                           positional_value_fn, positional_values, run_search, search_trees)
from entmtp.trees import Tree, resolve_tree

VOCAB = 24  # small, so that random heads' drafts are often accepted


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread avoids oversubscribing the shared CPUs (much faster here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- helpers ----------------------------------------------------------------------------------

def full_tree(widths):
    """Every rank path with rank < widths[d] at depth d."""
    paths, level = [], [()]
    for w in widths:
        level = [p + (r,) for p in level for r in range(w)]
        paths += level
    return Tree.from_paths(paths)


def all_subtrees(support: Tree, max_n: int):
    """Brute force: every prefix-closed subset of `support` with at most max_n nodes (each once)."""
    ch, paths = support.children, support.node_paths

    def rec(chosen, cands):
        yield chosen
        if len(chosen) == max_n:
            return
        for i, c in enumerate(cands):
            yield from rec(chosen + [paths[c]], cands[i + 1:] + ch[c])

    for nodes in rec([], list(ch[0])):
        yield Tree.from_paths(nodes)


def chain_records(union: Tree, n: int, seed: int) -> list[StepRecord]:
    """Greedy-like records: each step accepts one random root-to-node chain (or nothing)."""
    rnd = random.Random(seed)
    ch, paths = union.children, union.node_paths
    out = []
    for i in range(n):
        node, acc = 0, []
        while ch[node] and rnd.random() < 0.7:
            node = rnd.choice(ch[node][:3] if rnd.random() < 0.8 else ch[node])
            acc.append(paths[node])
        out.append(StepRecord(f"p{i % 7}", i, tuple(acc)))
    return out


def set_records(union: Tree, n: int, seed: int) -> list[StepRecord]:
    """Typical-like records: random prefix-closed accepted sets (several children may pass)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        acc: set = set()
        for p in union.paths:
            if (len(p) == 1 or p[:-1] in acc) and rnd.random() < 0.45:
                acc.add(p)
        out.append(StepRecord(f"p{i % 5}", i, tuple(sorted(acc, key=lambda q: (len(q), q)))))
    return out


def walk_length(tree: Tree, accepted: set) -> int:
    """Accepted drafts of `tree` by walking it: the deepest node reachable through accepted nodes."""
    best, stack = 0, [0]
    while stack:
        node = stack.pop()
        best = max(best, len(tree.node_paths[node]))
        stack += [c for c in tree.children[node] if tree.node_paths[c] in accepted]
    return best


@functools.lru_cache(maxsize=None)
def engine3() -> Engine:
    m = tiny_model("llama", vocab=VOCAB, seed=3)
    return Engine(m, None, {"hydra": random_heads(m, "hydra", num_heads=3, seed=2),
                            "medusa": random_heads(m, "medusa", num_heads=3, seed=1)})


PROMPTS = [("a", [5, 9, 2, 7]), ("b", [3, 4, 5, 6, 7, 8]), ("c", [11, 12]), ("d", [20, 2, 2, 9, 13])]


# ---- exact searches ---------------------------------------------------------------------------

@pytest.mark.parametrize("widths,seed", [((3, 2, 2), 0), ((4, 2), 1), ((2, 2, 2, 1), 2)])
def test_dp_equals_brute_force(widths, seed):
    support = full_tree(widths)
    rnd = random.Random(seed)
    value = {p: rnd.random() * (0.3 if rnd.random() < 0.3 else 1.0) for p in support.paths}
    dp = optimal_subtrees(support, value, 6)
    for n in range(1, 7):
        best = max(sum(value[p] for p in t.paths) for t in all_subtrees(support, n))
        v, tree = dp[n - 1]
        assert v == pytest.approx(best, abs=1e-12)
        assert tree.n_nodes <= n and sum(value[p] for p in tree.paths) == pytest.approx(v, abs=1e-12)
    # a depth limit cuts the support
    v2, t2 = optimal_subtrees(support, value, 4, max_depth=1)[-1]
    assert t2.depth == 1 and v2 == pytest.approx(max(sum(value[p] for p in t.paths) for t in all_subtrees(support.truncated(1), 4)))


def test_positional_dp_equals_brute_force_on_records():
    union = full_tree((3, 2, 2))
    stats = CalibrationStats.rollout(union, RuleSpec(), chain_records(union, 300, seed=4))
    pos = positional_values(stats)
    rate = stats.positional_rates()[0]
    assert pos[(1, 0, 1)] == pytest.approx(rate[1, 1] * rate[2, 0] * rate[3, 1])
    for n, (v, t) in enumerate(optimal_subtrees(union, pos, 5), start=1):
        assert v == pytest.approx(max(sum(pos[p] for p in s.paths) for s in all_subtrees(union, n)), abs=1e-12)


def test_greedy_expansion_is_the_optimum_on_chain_records():
    union = full_tree((3, 2, 2))
    stats = CalibrationStats.rollout(union, RuleSpec(), chain_records(union, 400, seed=1))
    greedy = greedy_trees(stats, 6)
    subtrees = list(all_subtrees(union, 6))
    probs = stats.node_acceptance()
    for n in range(1, 7):
        best = max(stats.expected_tau(t) for t in subtrees if t.n_nodes <= n)
        assert greedy[n - 1].n_nodes == n
        assert stats.expected_tau(greedy[n - 1]) == pytest.approx(best, abs=1e-12)
        # chain records: E[accepted] = sum of node acceptance probabilities (top-N is optimal)
        assert stats.expected_tau(greedy[n - 1]) == pytest.approx(1 + sum(probs[p] for p in greedy[n - 1].paths))
    # the DP with empirical node values agrees
    dp = optimal_subtrees(union, probs, 6)
    for n in range(1, 7):
        assert 1 + dp[n - 1][0] == pytest.approx(stats.expected_tau(greedy[n - 1]))
    # greedy with a depth limit
    assert all(t.depth <= 2 for t in greedy_trees(stats, 5, max_depth=2))


def test_scorer_equals_direct_walk_on_typical_records():
    union = full_tree((3, 2, 2))
    records = set_records(union, 120, seed=7)
    stats = CalibrationStats.rollout(union, RuleSpec("typical"), records)
    rnd = random.Random(0)
    subtrees = list(all_subtrees(union, 5))
    for t in rnd.sample(subtrees, 40) + [union]:
        direct = [walk_length(t, set(r.accepted_paths)) for r in records]
        assert stats.accepted_lengths(t).tolist() == direct
        assert stats.expected_tau(t) == pytest.approx(1 + np.mean(direct))
    # greedy is a heuristic here, never better than the brute-force optimum
    g = greedy_trees(stats, 4)
    assert stats.expected_tau(g[3]) <= max(stats.expected_tau(t) for t in subtrees if t.n_nodes <= 4) + 1e-12
    # nodes outside the union count as never accepted
    outside = Tree.from_paths([[0], [7], [7, 0]])
    assert stats.columns(outside)[1] == 2
    assert stats.expected_tau(outside) == stats.expected_tau(Tree.from_paths([[0]]))


def test_union_and_representative_trees():
    u = union_tree(4, 128, include=[resolve_tree("mc_sim_7b_63")])
    assert u.depth == 4 and 128 <= u.n_nodes <= 140
    assert set(resolve_tree("mc_sim_7b_63").paths) <= set(u.paths)
    assert union_tree(2, 30).n_nodes == 30 and union_tree(2, 30).depth == 2
    for n, d in [(1, 1), (7, 2), (30, 4), (64, 3)]:
        t = representative_tree(n, d)
        assert (t.n_nodes, t.depth) == (n, d)
    assert expand_by_value(prior_value, 3, 2) == [(0,), (1,), (0, 0)]
    with pytest.raises(ValueError):
        union_tree(4, 10_000)


# ---- the statistics pass on a real (tiny) engine ----------------------------------------------------

def reference_continuation(model, ids, n):
    """Plain greedy continuation without a cache (independent of the engine)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("heads", ["hydra", "medusa"])
def test_recorded_stats_replay_a_fixed_greedy_trace(heads):
    eng = engine3()
    union = union_tree(3, 30)
    stats = collect_stats(eng, heads, PROMPTS, union, "greedy", max_new_tokens=16, method="rollout")
    by_key = {(r.prompt_id, r.step): r for r in stats.records}
    replay: dict = {}
    for pid, ids in PROMPTS:
        res = eng.run(ids, heads=heads, tree=union, config=DecodeConfig(max_new_tokens=16))
        ref = reference_continuation(eng.model, ids, 16 + union.depth + 1)
        pos = 0
        for s in res.steps:
            if s.time_verify > 0:
                assert ref[pos] == s.tokens[0]
                acc = set()
                for j, p in enumerate(union.node_paths[1:], start=1):
                    chain, node = [], j
                    while node > 0:
                        chain.append(node)
                        node = union.parent_list[node]
                    if all(s.tokens[k] == ref[pos + len(union.node_paths[k])] for k in chain):
                        acc.add(p)
                rec = by_key[(pid, s.index)]
                assert set(rec.accepted_paths) == acc and rec.position == pos
                replay[(pid, s.index)] = acc
            pos += s.n_emitted
    assert len(replay) == stats.n_steps and stats.n_steps > 10
    assert any(r.accepted_paths for r in stats.records)  # something is accepted: the test is not vacuous
    rnd = random.Random(1)
    subs = [Tree.from_paths(rnd.sample(list(t.paths), 0) + list(t.paths)) for t in
            [union.truncated(1), union.truncated(2), Tree.from_paths([[0], [0, 0], [0, 0, 0]]), union]]
    for t in subs:
        direct = [walk_length(t, replay[(r.prompt_id, r.step)]) for r in stats.records]
        assert stats.expected_tau(t) == pytest.approx(1 + np.mean(direct))
    # the signals of every step are recorded
    r0 = stats.records[0]
    assert 0 < r0.root_prob <= 1 and r0.root_entropy > 0 and 0 < r0.draft_top1 <= 1 and r0.draft_entropy > 0


@pytest.mark.parametrize("heads", ["hydra", "medusa"])
def test_trace_replay_with_a_lookup_branch_equals_on_policy_decoding(heads):
    """The trace holds the greedy continuations, so a prompt-lookup branch replays exactly too
    (`autotune.lookup_speedup`): with every step costing the same, its predicted speedup is the
    tau of the engine decoding with that tree and branch, for each shortest match; and the rows
    it adds are what the engine grafts (chain tokens beyond the accepted heads path)."""
    from entmtp.autotune import choose_lookup, lookup_speedup

    eng = engine_all()
    stats = collect_stats(eng, heads, PROMPTS, rule="greedy", max_new_tokens=20, batch_size=2, max_rank=10)
    assert all(len(p["prompt_ids"]) == p["prompt_tokens"] and len(p["answer_ids"]) >= p["n_positions"] + 1
               for p in stats.prompts.values())
    flat = LatencyModel(1.0, {d: [(1, 1.0), (200, 1.0)] for d in range(1, 8)})
    grafted_any = False
    for t in [resolve_tree(n).truncated(3) for n in ("binary_2x2", "chain_3")]:
        for k in (1, 2, 3):
            steps = accepted = 0
            for pid, ids in PROMPTS:
                cfg = RuleSpec("greedy").decode_config(20, lookup=4, lookup_min_ngram=k)
                r = eng.run(ids, heads=heads, tree=t, config=cfg)
                live = [s for s in r.steps if s.time_verify > 0]
                steps += len(live)
                accepted += sum(s.accept_length for s in live)
                grafted_any |= any(s.lookup_nodes for s in live)
            assert lookup_speedup(stats, t, flat, 4, k) == pytest.approx(1 + accepted / steps, abs=1e-12), (t.name, k)
        assert lookup_speedup(stats, t, flat, 0, 1) == pytest.approx(stats.predict_tau(t), abs=1e-12)
    assert grafted_any  # the branch was grafted: not vacuous
    # where rows are free a branch never loses; where a row beyond the tree's costs many steps, none pays
    chosen, scores, why = choose_lookup(stats, resolve_tree("chain_3"), flat)
    assert scores["off"] == min(scores.values()) and (chosen == 0) == (max(scores.values()) == scores["off"])
    dear = LatencyModel(1.0, {d: [(1, 1.0), (3, 1.0), (4, 50.0), (200, 50.0)] for d in range(1, 8)})
    chosen, scores, why = choose_lookup(stats, resolve_tree("chain_3"), dear)
    assert chosen == 0 and "prompt lookup: off" in why and scores["off"] > max(scores[str(n)] for n in (1, 2, 3))


@pytest.mark.parametrize("rule", ["greedy", "typical"])
def test_rollout_prediction_equals_on_policy_tau_for_the_union_itself(rule):
    eng = engine3()
    tree = resolve_tree("binary_2x2")
    stats = collect_stats(eng, "hydra", PROMPTS, tree, rule, max_new_tokens=20, signals=False, method="rollout")
    assert stats.mode == "rollout"
    m, base = evaluate_trees(eng, "hydra", [tree], PROMPTS, rule, max_new_tokens=20)
    assert m.n_steps == stats.n_steps
    assert stats.expected_tau(tree) == pytest.approx(m.tau, abs=1e-12)
    assert base.tau == 1.0 and base.name == "baseline"
    if rule == "greedy":
        assert m.identical_to_baseline is True
    else:  # typical: every accepted set is prefix-closed and contains the chosen path
        assert all(all(len(p) == 1 or p[:-1] in set(r.accepted_paths) for p in r.accepted_paths) for r in stats.records)


@functools.lru_cache(maxsize=None)
def engine_all() -> Engine:
    """hydra, medusa, hydra++ and a hydra with a draft vocabulary; EOS set to a token the
    model emits often, so generations end early and the replay's EOS handling is exercised."""
    m = tiny_model("llama", vocab=VOCAB, seed=3)
    heads = {"hydra": random_heads(m, "hydra", num_heads=3, seed=2), "medusa": random_heads(m, "medusa", num_heads=3, seed=1),
             "hydra++": random_heads(m, "hydra", num_heads=3, prefix=True, seed=3),
             "hydra-dv": random_heads(m, "hydra", num_heads=3, seed=4, draft_vocab_size=12)}
    with torch.no_grad():
        heads["hydra-dv"].draft_vocab.copy_(torch.arange(0, VOCAB, 2))
    eng = Engine(m, None, heads)
    cont = reference_continuation(m, PROMPTS[1][1], 12)
    m.config.eos_token_id = cont[9]
    return eng


TREES = ["binary_2x2", "wide3_chain2", "chain_3", "gappy_5"]


@pytest.mark.parametrize("heads", ["hydra", "medusa", "hydra++", "hydra-dv"])
def test_trace_replay_equals_on_policy_decoding(heads):
    """Trace statistics replay decoding exactly: the predicted tau of a tree equals the tau of
    the engine decoding the same prompts with that tree (greedy), EOS and max_new_tokens included."""
    eng = engine_all()
    stats = collect_stats(eng, heads, PROMPTS, rule="greedy", max_new_tokens=20, batch_size=2, max_rank=10)
    assert stats.mode == "trace" and stats.n_steps > 20
    assert any(info["eos_at"] is not None for info in stats.prompts.values())  # EOS is exercised
    trees = [resolve_tree(t).truncated(3) for t in TREES] + [union_tree(3, 40)]
    measured = evaluate_trees(eng, heads, trees, PROMPTS, "greedy", max_new_tokens=20, baseline=False, warmup=False)
    for t, m in zip(trees, measured):
        steps, acc, _ = stats.simulate(t)
        assert stats.columns(t)[1] == 0
        assert (steps, acc) == (m.n_steps, m.accepted), t.name
        assert stats.predict_tau(t) == pytest.approx(m.tau, abs=1e-12)
    assert any(m.accepted for m in measured)  # drafts are accepted: not vacuous
    # a rank the statistics do not cover counts as never accepted (a lower bound)
    narrow = collect_stats(eng, heads, PROMPTS, rule="greedy", max_new_tokens=20, max_rank=2)
    assert narrow.columns(trees[-1])[1] > 0 and narrow.predict_tau(trees[-1]) <= stats.predict_tau(trees[-1])
    r0 = stats.records[0]
    assert 0 < r0.root_prob <= 1 and r0.root_entropy > 0 and 0 < r0.draft_top1 <= 1 and r0.draft_entropy > 0


def test_trace_batched_equals_one_by_one_and_sampling_runs():
    eng = engine_all()
    a = collect_stats(eng, "hydra", PROMPTS, rule="greedy", max_new_tokens=16, batch_size=1)
    b = collect_stats(eng, "hydra", PROMPTS, rule="greedy", max_new_tokens=16, batch_size=4)
    assert [r.accepted_paths for r in a.records] == [r.accepted_paths for r in b.records]
    assert a.prompts == b.prompts
    s = collect_stats(eng, "hydra", PROMPTS, rule=RuleSpec("sampling", temperature=0.8, seed=1), max_new_tokens=16)
    s2 = collect_stats(eng, "hydra", PROMPTS[::-1], rule=RuleSpec("sampling", temperature=0.8, seed=1), max_new_tokens=16)
    assert s.mode == "trace" and s.to_json()["records"] == s2.to_json()["records"]  # per-prompt seeds: order-free
    assert 1.0 <= s.predict_tau(resolve_tree("binary_2x2")) <= 3.0
    with pytest.raises(ValueError, match="rollout"):
        collect_stats(eng, "hydra", PROMPTS, rule="typical", method="trace")


def test_trace_positional_rates_and_greedy_search():
    eng = engine_all()
    stats = collect_stats(eng, "hydra", PROMPTS, rule="greedy", max_new_tokens=20, max_rank=6)
    rate, num, den = stats.positional_rates()
    assert den[1, 0] == stats.n_steps and 0 <= rate.min() and rate.max() <= 1
    assert num[1].sum() == sum(1 for r in stats.records if r.accept_length >= 1)
    # the DP's trace support (top nodes by positional value) loses nothing against all rank paths
    pos = positional_value_fn(stats)
    full = full_tree((6, 6, 6))
    for d in (1, 2, 3):
        a = [v for v, _ in optimal_subtrees(full, pos, 8, d)]
        b = [v for v, _ in optimal_subtrees(dp_support(stats, 8, d), pos, 8, d)]
        assert a == pytest.approx(b, abs=1e-12)
    probs = stats.node_acceptance()
    for n, t in enumerate(greedy_trees(stats, 6), start=1):
        # top-N by acceptance probability: the per-position expectation is the optimum
        assert t.n_nodes == min(n, stats.support.n_nodes)
        assert stats.expected_tau(t) == pytest.approx(1 + sum(sorted(probs.values(), reverse=True)[:t.n_nodes]))


def test_stats_json_round_trip_and_merge_of_shards(tmp_path):
    eng = engine3()
    union = union_tree(3, 20)
    for method in ("trace", "rollout"):
        kw = dict(max_new_tokens=12, meta={"data_sha256": "x"}, method=method, batch_size=1)
        one = collect_stats(eng, "hydra", PROMPTS, union, "greedy", **kw)
        a = collect_stats(eng, "hydra", PROMPTS[::2], union, "greedy", **kw)
        b = collect_stats(eng, "hydra", PROMPTS[1::2], union, "greedy", **kw)
        merged = CalibrationStats.merge([b, a])
        assert merged.to_json() == one.to_json() and merged.mode == method
        one.save(tmp_path / "s.json")
        back = CalibrationStats.load(tmp_path / "s.json")
        assert back.to_json() == one.to_json()
        assert back.predict_tau(union) == one.predict_tau(union)
        with pytest.raises(DataError):
            CalibrationStats.merge([a, a])
    with pytest.raises(DataError):
        CalibrationStats.merge([a, collect_stats(eng, "hydra", PROMPTS[:1], union_tree(3, 10), "greedy", 4, method="rollout")])
    with pytest.raises(DataError):
        CalibrationStats.merge([a, collect_stats(eng, "hydra", PROMPTS[:1], None, "greedy", 4)])
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(DataError, match="not an entmtp calibration"):
        CalibrationStats.load(tmp_path / "bad.json")


# ---- latency model ----------------------------------------------------------------------------

def test_latency_model_fit_and_json():
    lm = LatencyModel(0.010, {1: [(1, 0.020), (4, 0.018), (8, 0.030)], 2: [(2, 0.025), (8, 0.035)]})
    assert lm.cost(0, 0) == 0.010
    assert lm.cost(1, 1) == pytest.approx(0.019)  # monotone fit pools the noisy dip
    assert lm.cost(4, 1) == pytest.approx(0.019)
    assert lm.cost(6, 1) == pytest.approx(0.019 + 0.011 / 2)
    assert lm.cost(16, 1) == pytest.approx(0.030 + 8 * 0.011 / 4)  # extrapolated with the last slope
    assert lm.cost(5, 2) == pytest.approx(0.030)
    assert lm.cost(5, 3) == lm.cost(5, 2)  # nearest measured depth
    assert lm.speedup(2.0, 8, 1) == pytest.approx(2.0 * 0.010 / 0.030)
    back = LatencyModel.from_json(json.loads(json.dumps(lm.to_json())))
    assert back.points == lm.points and back.cost(6, 1) == lm.cost(6, 1)


def test_latency_model_never_makes_a_deeper_tree_cheaper():
    """A lucky measurement of a deep tree (below a shallower tree of the same size) is raised to
    the shallower one's cost; a deeper tree that really costs more keeps its own."""
    lm = LatencyModel(0.030, {1: [(1, 0.033), (2, 0.0355), (3, 0.038)], 2: [(2, 0.031), (3, 0.040)], 3: [(3, 0.039)]})
    assert lm.cost(2, 2) == pytest.approx(0.0355)  # measured 0.031: cheaper than one level of 2 nodes
    assert lm.cost(3, 2) == pytest.approx(0.040)  # measured above depth 1: kept
    assert lm.cost(3, 3) == pytest.approx(0.040)  # not below depth 2's fitted cost
    assert lm.points[2][0] == (2, 0.031)  # the measurements themselves are kept as measured
    assert all(lm.cost(n, d) <= lm.cost(n, d + 1) for n in range(3, 4) for d in (1, 2))
    # beyond the shallower depth's measured sizes its extrapolation does not bind the deeper one
    wide = LatencyModel(0.030, {1: [(1, 0.033)], 2: [(2, 0.036), (8, 0.05)]})
    assert wide.cost(8, 2) == pytest.approx(0.05) and wide.cost(8, 1) > 0.05


def test_size_grid_is_dense_where_trees_live():
    assert size_grid(64) == list(range(1, 17)) + [24, 32, 48, 64]
    assert size_grid(5) == [1, 2, 3, 4, 5]
    assert size_grid(40) == list(range(1, 17)) + [24, 32, 40]
    # depth 1 has at most 16 nodes (ranks < 16); every deeper depth starts at its chain
    jobs = latency_jobs(size_grid(24), [1, 3])
    assert (16, 1) in jobs and (17, 1) not in jobs and (24, 1) not in jobs
    assert (2, 3) not in jobs and (3, 3) in jobs and (5, 3) in jobs and (24, 3) in jobs
    assert jobs == sorted(jobs, key=lambda x: (x[1], x[0]))


def test_latency_model_covers():
    lm = LatencyModel(0.01, {1: [(n, 0.01 + n * 1e-3) for n in range(1, 9)], 2: [(n, 0.02) for n in range(2, 9)]})
    assert lm.covers(size_grid(8), [1, 2])
    assert not lm.covers(size_grid(8), [1, 2, 3])  # a depth never measured
    coarse = LatencyModel(0.01, {1: [(1, 0.01), (2, 0.01), (4, 0.01), (6, 0.01), (8, 0.01)]})
    assert coarse.covers([1, 2, 4, 6, 8], [1]) and not coarse.covers(size_grid(8), [1])  # an old, coarse cache


def test_latency_steps_are_warm_and_contexts_bounded(monkeypatch):
    """Every timed step follows an untimed step of the same tree, a generation adds at most
    LATENCY_WINDOW tokens before the next starts from the context again, and the context is
    prefilled once for all of them."""
    import entmtp.calibrate as cal
    import entmtp.decoding as dec

    eng = engine3()
    monkeypatch.setattr(cal, "LATENCY_WINDOW", 16)
    gens, real = [], eng.generate

    def spy(ids, **kw):
        g = real(ids, **kw)
        gens.append((len(ids), kw.get("scheduler"), g))
        return g

    prefills, real_prefill = [], dec.run_prefill

    def counted(*a, **kw):
        prefills.append(a[1])
        return real_prefill(*a, **kw)

    monkeypatch.setattr(eng, "generate", spy)
    monkeypatch.setattr(dec, "run_prefill", counted)
    lm = cal.measure_latency(eng, "hydra", sizes=[1, 2, 3, 4], repeats=2, context_tokens=8)
    with_heads = [(n, s, g) for n, s, g in gens if s is not None]
    assert len(with_heads) > 1  # the window forced several generations
    # ... all started from one prefill of the context, plain ones included: the prompt's forward once
    assert len(prefills) == 1 and len(gens) > len(with_heads)
    assert all(g._from_prefill is gens[0][2]._from_prefill is not None for _, _, g in gens)
    bank = with_heads[0][1].bank
    timed = 0
    for _, sched, g in with_heads:
        used = sched.used
        assert len(used) % 2 == 0 and used[0::2] == used[1::2]  # (warm, timed) pairs of one tree
        timed += len(used) // 2
        assert len(g.tokens) <= 16 + max(t.depth for t in bank) + 1
    assert timed == sum(len(v) for v in lm.points.values()) * 2  # every (size, depth) point, twice
    assert all(len(pts) == 4 - d + 1 for d, pts in lm.points.items())


def test_latency_without_warm_steps_times_each_tree_once_a_round(monkeypatch):
    """warm=False (`scripts/latency_noise.py --warm yes,no` compares the two): no untimed steps, every
    tree timed once a round, more of them in a generation, the same grid covered."""
    import entmtp.calibrate as cal

    eng = engine3()
    monkeypatch.setattr(cal, "LATENCY_WINDOW", 16)
    scheds, real = [], eng.generate

    def spy(ids, **kw):
        if kw.get("scheduler") is not None:
            scheds.append(kw["scheduler"])
        return real(ids, **kw)

    monkeypatch.setattr(eng, "generate", spy)
    lm = cal.measure_latency(eng, "hydra", sizes=[1, 2, 3, 4], repeats=2, context_tokens=8, warm=False)
    jobs = cal.latency_jobs([1, 2, 3, 4], [1, 2, 3])
    used = [j for s in scheds for j in s.used]
    assert sorted(used) == sorted(list(range(len(jobs))) * 2)  # each point once in each of the 2 rounds
    assert any(len(set(s.used)) == len(s.used) > 1 for s in scheds)  # no (warm, timed) pairs
    assert {(n, d) for d, pts in lm.points.items() for n, _ in pts} == set(jobs) and lm.meta["warm"] is False
    # a warm measurement fits half as many trees in a generation
    bank = [cal.representative_tree(n, d) for n, d in jobs]
    assert cal._trees_per_generation(eng, bank, [5] * 8, 1) == 2 * cal._trees_per_generation(eng, bank, [5] * 8, 2)


def test_a_long_measuring_context_runs_only_its_first_tokens_through_the_model(monkeypatch):
    """A measuring context longer than COMPUTED_CONTEXT is prefilled from its first tokens, their
    cache rows and features repeated to its length: a step then attends over as many positions
    as after the whole context's prefill, for a fraction of its cost."""
    import entmtp.calibrate as cal
    import entmtp.decoding as dec

    eng = engine3()
    monkeypatch.setattr(cal, "COMPUTED_CONTEXT", 8)
    run, real_prefill = [], dec.run_prefill

    def counted(*a, **kw):
        run.append(list(a[1]))
        return real_prefill(*a, **kw)

    monkeypatch.setattr(dec, "run_prefill", counted)
    ids = [(7 * i) % (VOCAB - 3) + 2 for i in range(30)]
    pre = cal.context_prefill(eng, ids, "hydra")
    assert run == [ids[:8]]  # the model ran 8 tokens, not 30
    assert pre.prompt == ids and pre.cache.get_seq_length() == 30 and pre.hidden.shape[0] == 30
    assert torch.equal(pre.hidden[8:16], pre.hidden[:8]) and torch.equal(pre.hidden[24:], pre.hidden[:6])
    for layer in pre.cache.layers:
        assert layer.keys.shape[-2] == 30 and torch.equal(layer.keys[:, :, 16:24], layer.keys[:, :, :8])
        assert torch.equal(layer.values[:, :, 24:], layer.values[:, :, :6])
    cfg = DecodeConfig(max_new_tokens=6, eos_token_ids=())
    for _ in range(2):  # generations start from it one after another, each after its 30 positions
        g = eng.generate(ids, heads="hydra", tree=resolve_tree("binary_2x2"), config=cfg, prefill=pre)
        steps = list(g)
        assert steps and g.past == 30 + len(g.tokens) - 1
    assert cal.context_prefill(eng, ids[:8], "hydra").prompt == ids[:8] and len(run) == 2  # a short one as it is


def test_latency_is_measured_against_plain_steps_around_each_generation(monkeypatch):
    """On a machine whose speed drifts between generations (here: every generation 10% slower than
    the one before), a tree's cost is its ratio to the plain steps timed around its generation, so
    the model predicts each tree's true ratio to a plain step; timing the trees alone against plain
    steps timed elsewhere would have made the later trees look dearer and the earlier ones cheaper."""
    import entmtp.calibrate as cal

    eng = engine3()
    monkeypatch.setattr(cal, "LATENCY_WINDOW", 16)  # a few trees a generation: several generations a round
    plain_s, calls = 0.02, []

    def true_ratio(tree):
        return 1.0 + 0.05 * tree.n_nodes + 0.1 * tree.depth

    def drifting(engine, heads, bank, sequence, ids, progress, prefill=None, warm=True):
        speed = 1.0 + 0.1 * len(calls)  # seconds scale of this generation
        calls.append(heads)
        out = {}
        for j in sequence:
            out.setdefault(j, []).append(speed * plain_s * (1.0 if heads is None else true_ratio(bank[j])))
        return out

    monkeypatch.setattr(cal, "_cycle_times", drifting)
    lm = cal.measure_latency(eng, "hydra", sizes=[1, 2, 3, 4], repeats=2, context_tokens=8)
    assert calls.count("hydra") > 2 and calls[0] is None and calls[-1] is None
    assert all(calls[i - 1] is None and calls[i + 1] is None for i, c in enumerate(calls) if c)  # plain around each
    assert lm.baseline_s == pytest.approx(plain_s)  # the fastest plain steps
    for d, pts in lm.points.items():
        for n, cost in pts:
            want = true_ratio(representative_tree(n, d)) * plain_s
            assert cost == pytest.approx(want, rel=1e-9), (n, d)


def test_latency_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    eng = engine3()
    lm = load_or_measure_latency(eng, "hydra", max_nodes=4, repeats=1, context_tokens=16)
    path = latency_cache_path(eng, "hydra")
    assert path.is_file() and path.parent == tmp_path / "latency" and not lm.meta["cached"]
    assert lm.depths == [1, 2, 3] and lm.max_nodes == 4 and lm.baseline_s > 0
    again = load_or_measure_latency(eng, "hydra", max_nodes=4)
    assert again.meta["cached"] and again.points == lm.points
    assert not load_or_measure_latency(eng, "hydra", max_nodes=4, remeasure=True, repeats=1, context_tokens=16).meta["cached"]
    assert lm.meta["protocol"] == LATENCY_PROTOCOL
    # a cache measured on a coarser grid (an older version: sizes 1, 2, 4) is measured again
    coarse = LatencyModel(0.01, {d: [(n, 0.02) for n in (1, 2, 4) if n >= d] + [(d, 0.02)] for d in (1, 2, 3)},
                          {"protocol": LATENCY_PROTOCOL})
    path.write_text(json.dumps(coarse.to_json()))
    fresh = load_or_measure_latency(eng, "hydra", max_nodes=4, repeats=1, context_tokens=16)
    assert not fresh.meta["cached"] and fresh.covers(size_grid(4), [1, 2, 3])
    # so is one timed the older way (no protocol recorded), even on the same grid
    older = LatencyModel.from_json(fresh.to_json())
    older.meta.pop("protocol")
    path.write_text(json.dumps(older.to_json()))
    assert not load_or_measure_latency(eng, "hydra", max_nodes=4, repeats=1, context_tokens=16).meta["cached"]
    assert load_or_measure_latency(eng, "hydra", max_nodes=4).meta["cached"]
    assert latency_cache_path(eng, "medusa") != path
    # step times measured on another class of CPU (the cache dir moved with a home directory, say)
    # are not reused: the hardware class is part of the key
    import entmtp.hardware as hardware

    monkeypatch.setattr(hardware, "cpu_isa", lambda: "some-other-isa")
    assert latency_cache_path(eng, "hydra") != path


# ---- search, frontier, report ---------------------------------------------------------------------

def test_frontier_and_pareto():
    union = full_tree((3, 2, 2))
    stats = CalibrationStats.rollout(union, RuleSpec(), chain_records(union, 200, seed=2), {"num_heads": 3})
    lm = LatencyModel(0.01, {d: [(1, 0.012), (4, 0.016), (12, 0.04)] for d in (1, 2, 3)})
    cands = search_trees(stats, [2, 4, 8], lm, references=[resolve_tree("binary_2x2")])
    assert len({c.id for c in cands}) == len(cands)
    assert {"greedy", "dp", "reference"} <= {m for c in cands for m in c.methods}
    front = frontier(cands, [2, 4, 8])
    byid = {c.id: c for c in cands}
    for f in front:
        best = byid[f["best_tokens_per_s"]]
        pool = [c for c in cands if c.n_nodes <= f["budget"] and c.methods != ["reference"]]
        assert best.n_nodes <= f["budget"]
        assert best.predicted_tokens_per_s == max(c.predicted_tokens_per_s for c in pool)
        assert byid[f["best_tau"]].predicted_tau == max(c.predicted_tau for c in pool)
    pts = pareto(cands, lambda c: c.predicted_tau)
    assert [c.n_nodes for c in pts] == sorted(c.n_nodes for c in pts)
    assert all(b.predicted_tau > a.predicted_tau for a, b in zip(pts, pts[1:]))
    with pytest.raises(ValueError, match="budgets"):
        search_trees(stats, [0, 4], lm)


def test_bank_is_skipped_when_no_draft_was_ever_accepted():
    union = full_tree((3, 2))
    recs = [StepRecord(f"p{i % 3}", i, (), root_entropy=1.0 + i % 4) for i in range(60)]
    stats = CalibrationStats.rollout(union, RuleSpec(), recs, {"num_heads": 2})
    lm = LatencyModel(0.01, {d: [(1, 0.012), (4, 0.016), (12, 0.04)] for d in (1, 2)})
    cands = search_trees(stats, [4], lm, references=[resolve_tree("binary_2x2")])
    assert all(c.predicted_tau == 1.0 for c in cands)
    # trace statistics with no accepted draft have no support, so only the references remain
    cands = [c for c in cands if c.methods == ["reference"]]
    report = SearchReport({"heads": {"label": "hydra"}, "model": {"name": "m"}}, [4], stats, lm, cands, frontier(cands, [4]))
    report.fit_bank()  # nothing to schedule between: no bank, no error
    assert report.bank is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("search")
    model, tok = save_tiny_base(d / "base")
    save_heads(random_heads(model, "hydra", num_heads=3, seed=2), d / "hydra")
    texts = ["hello world", "the cat sat on the mat", "what is the capital of france?", "one two three four",
             "paris is the capital", "how are you today?", "five six seven", "the mat", "hello there", "ten nine eight"]
    (d / "prompts.jsonl").write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": t}) for i, t in enumerate(texts)) + "\n")
    return d


def test_run_search_library_api(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    from entmtp.checkpoints import load_heads
    from entmtp.data import load_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "base")
    eng = Engine(model, AutoTokenizer.from_pretrained(tiny_dir / "base"), {"hydra": load_heads(tiny_dir / "hydra")})
    seen = set()
    rep = run_search(eng, "hydra", load_prompts(tiny_dir / "prompts.jsonl"), [2, 4], max_new_tokens=10, union_nodes=20,
                     latency_repeats=1, progress=lambda phase, done, total: seen.add(phase))
    assert {"statistics", "latency", "search", "held-out"} <= seen
    d = rep.to_json()
    assert d["provenance"]["data"]["sha256"] and d["provenance"]["machine"]["cpu_count"]
    ho = set(d["provenance"]["data"]["held_out_ids"])
    assert ho and not ho & set(d["provenance"]["data"]["calibration_ids"])
    rows = d["held_out"]["comparisons"]
    assert rows and all(r["within_tolerance"] or r["explanation"] for r in rows)
    assert d["held_out"]["identical_outputs"] is True
    assert set(rep.figures()) == {"tau", "tokens_per_s"}
    json.dumps(d)  # JSON-safe (no NaN)
    assert d["stats"]["mode"] == "trace"
    # a second search reusing these statistics (after a kernel change, say) runs no statistics pass
    # and, from the same statistics, predicts the same taus; statistics for another length are refused
    rep.write(tmp_path / "first")
    seen.clear()
    again = run_search(eng, "hydra", load_prompts(tiny_dir / "prompts.jsonl"), [2, 4], max_new_tokens=10, latency_repeats=1,
                       progress=lambda phase, done, total: seen.add(phase), reuse_stats=tmp_path / "first")
    assert "statistics" not in seen and "held-out statistics" not in seen and "search" in seen
    assert again.held_out_stats is not None and again.provenance["reused_statistics"] == str(tmp_path / "first")
    taus = lambda r: {c.tree.paths: round(c.predicted_tau, 9) for c in r.candidates}
    assert taus(again) == taus(rep)
    with pytest.raises(DataError, match="max_new_tokens = 10, this search's is 8"):
        run_search(eng, "hydra", load_prompts(tiny_dir / "prompts.jsonl"), [2, 4], max_new_tokens=8, latency_repeats=1,
                   reuse_stats=tmp_path / "first")
    # typical acceptance: union rollouts, the held-out gap split by a union pass over the held-out prompts
    typ = run_search(eng, "hydra", load_prompts(tiny_dir / "prompts.jsonl"), [2, 4], rule="typical", max_new_tokens=8,
                     union_nodes=20, latency_repeats=1, max_eval=2)
    t = typ.to_json()
    assert t["stats"]["mode"] == "rollout" and t["union"]["n_nodes"] >= 20
    assert all(r["held_out_predicted_tau"] is not None for r in t["held_out"]["comparisons"] if r["held_out_tau"] is not None)
    assert "union rollouts" in typ.markdown()



def test_run_search_race_decides_on_policy(tiny_dir, tmp_path, monkeypatch, capsys):
    """Step 6: small proposals + the tokens/s choices decode further held-out prompts (not the
    check's), interleaved with plain decoding; the fastest is saved as <prefix>-race.json."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    from entmtp.checkpoints import load_heads
    from entmtp.data import load_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "base")
    eng = Engine(model, AutoTokenizer.from_pretrained(tiny_dir / "base"), {"hydra": load_heads(tiny_dir / "hydra")})
    ps = load_prompts(tiny_dir / "prompts.jsonl")
    seen = set()
    rep = run_search(eng, "hydra", ps, [2, 4], max_new_tokens=8, latency_repeats=1, held_out=0.5, max_eval=1,
                     race_prompts=2, race_max_nodes=3, race_max_depth=2, progress=lambda ph, d, t: seen.add(ph))
    ra = rep.race
    assert "race" in seen and ra["n_prompts"] == 2 and not any("the race decoded" in w for w in rep.warnings)
    held = rep.provenance["data"]["held_out_ids"]
    assert set(ra["prompt_ids"]) <= set(held) and not set(ra["prompt_ids"]) & set(rep.evaluation["prompt_ids"])
    res = ra["results"]
    tps = [r["tokens_per_s"] for r in res]
    assert tps == sorted(tps, reverse=True) and all(r["predicted_tau"] >= 1 for r in res)
    proposals = [r for r in res if r["name"].startswith("n")]
    assert proposals and all(r["n_nodes"] <= 3 and r["depth"] <= 2 for r in proposals)
    assert len({(r["n_nodes"], r["depth"]) for r in proposals}) == len(proposals)  # one per (size, depth)
    raced = {tuple(map(tuple, r["paths"])) for r in res}
    assert all(r["candidate"].tree.paths in raced for r in rep.chosen() if r["role"] == "tokens_per_s")
    assert ra["identical_outputs"] is True and all(r["identical_to_baseline"] for r in res)
    files = rep.write(tmp_path / "out", save_trees_to=tmp_path / "saved")
    win = json.loads((tmp_path / "out" / "trees" / rep.race_tree_file()).read_text())
    assert win["paths"] == res[0]["paths"] and win["chosen_by"] == "on-policy race"
    assert (tmp_path / "saved" / rep.race_tree_file()).is_file()
    assert "## On-policy race" in files["report"].read_text()
    assert json.loads(files["search"].read_text())["race"]["results"][0]["paths"] == res[0]["paths"]
    # the race needs held-out prompts beyond the check's, and a held-out split at all
    with pytest.raises(DataError, match="the race needs held-out prompts beyond the 6"):
        run_search(eng, "hydra", ps, [2], max_new_tokens=8, latency_repeats=1, race_prompts=2)
    with pytest.raises(ValueError, match="held-out fraction > 0"):
        run_search(eng, "hydra", ps, [2], max_new_tokens=8, latency_repeats=1, held_out=0, race_prompts=2)
    # CLI: the race line in the summary; bad --race values are one line
    code, stdout, err = run(capsys, "search", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--data",
                            tiny_dir / "prompts.jsonl", "--budgets", "2", "--out", tmp_path / "cli", "--max-new-tokens", 6,
                            "--latency-repeats", 1, "--no-progress", "--held-out", "0.5", "--eval-prompts", 1, "--race", 9,
                            "--race-max-nodes", 2)
    assert code == 0, err
    assert "race" in stdout and (tmp_path / "cli" / "trees" / rep.race_tree_file()).is_file()
    assert re.search(r"warning: the race decoded \d held-out prompts, not the 9 asked for", err), err  # said, not hidden
    for bad, needle in ((["--race", "-1"], "--race must be in 0.."), (["--race", "1", "--race-max-nodes", "0"], "--race-max-nodes must be")):
        code, _, err = run(capsys, "search", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--data",
                           tiny_dir / "prompts.jsonl", "--budgets", "2", "--out", tmp_path / "bad", "--max-new-tokens", 6,
                           "--latency-repeats", 1, "--no-progress", "--held-out", "0.4", "--eval-prompts", 1, *bad)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ---- CLI ---------------------------------------------------------------------------------------

def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_search_and_score_end_to_end(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    out, saved = tmp_path / "out", tmp_path / "saved"
    code, stdout, err = run(capsys, "search", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra",
                            "--data", tiny_dir / "prompts.jsonl", "--budgets", "2,4", "--out", out, "--max-new-tokens", 10,
                            "--union-nodes", 20, "--latency-repeats", 1, "--no-progress", "--save-trees-to", saved,
                            "--tag", "fp32")
    assert code == 0, err
    assert all(p.name.startswith("base-hydra-fp32-") for p in saved.glob("*.json"))  # the tag names the files
    for f in ("search.json", "stats.json", "frontier.html", "report.md"):
        assert (out / f).is_file()
    res = json.loads((out / "search.json").read_text())
    assert res["format"] == "entmtp-search/1" and res["budgets"] == [2, 4]
    assert res["provenance"]["rule"]["name"] == "greedy" and res["provenance"]["heads"]["label"] == "hydra"
    chosen = [c for c in res["chosen"] if c["role"] == "tokens_per_s"]
    assert [c["budget"] for c in chosen] == [2, 4]
    for c in res["chosen"]:
        tree = resolve_tree(str(out / c["file"]))
        assert tree.n_nodes <= c["budget"] and (saved / (out / c["file"]).name).is_file()
        saved_json = json.loads((out / c["file"]).read_text())
        assert saved_json["paths"] == [list(p) for p in tree.paths] and "predicted_tau" in saved_json
    assert "Held-out check" in (out / "report.md").read_text()
    # the entropy bank is fitted from the same statistics and works with `--scheduler entropy`
    bank_file = next(saved.glob("*-bank.json"))
    assert (out / "bank.json").is_file() and res["entropy_bank"]["predicted_gain_vs_static"] >= -1e-9
    code, _, err = run(capsys, "generate", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--scheduler", "entropy",
                       "--bank", bank_file, "hello", "--max-new-tokens", 6)
    assert code == 0, err
    assert "plotly" in (out / "frontier.html").read_text()[:200000].lower()
    assert "b2" in stdout and "pred tau" in stdout
    tree_file = out / chosen[-1]["file"]
    # the saved tree works with `entmtp generate`
    code, _, err = run(capsys, "generate", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--tree", tree_file,
                       "hello", "--max-new-tokens", 6)
    assert code == 0, err
    # score with the search's statistics, and with a fresh statistics pass
    for extra in (["--stats", out / "search.json"], []):
        code, stdout, err = run(capsys, "score", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--tree", tree_file,
                                "--data", tiny_dir / "prompts.jsonl", "--max-new-tokens", 8, "--max-prompts", 3,
                                "--union-nodes", 20, "--no-progress", "--json", *extra)
        assert code == 0, err
        r = json.loads(stdout)
        assert r["predicted"]["tau"] >= 1 and r["measured"]["tau"] >= 1 and r["n_prompts"] == 3
        assert r["measured"]["identical_to_baseline"] is True
    assert r["statistics"].startswith("statistics pass") and r["predicted"]["nodes_not_covered"] == 0
    # reused statistics that do not answer the search, or none at all: one line, no traceback
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "stats.json").write_text('{"records": 3}')
    for stats_dir, needle in ((out, "max_new_tokens = 10, this search's is 8"), (tmp_path / "nowhere", "no stats.json there"),
                              (tmp_path / "junk", "junk")):
        code, _, err = run(capsys, "search", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--data",
                           tiny_dir / "prompts.jsonl", "--budgets", "2", "--out", tmp_path / "again", "--max-new-tokens", 8,
                           "--no-progress", "--stats", stats_dir)
        assert code != 0 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err


@pytest.mark.parametrize("content,extra,needle", [
    ('{"not json', [], "prompts.json"),
    ('[]', [], ""),
    ('{"id": 1, "prompt": "hi"}\n', ["--budgets", "4,x"], "--budgets must be comma-separated integers"),
    ('{"id": 1, "prompt": "hi"}\n', ["--budgets", "0"], "node budgets must be in 1.."),
])
def test_cli_bad_input_is_one_line(tiny_dir, tmp_path, capsys, content, extra, needle):
    f = tmp_path / "prompts.json"
    f.write_text(content)
    code, _, err = run(capsys, "search", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--data", f,
                       "--out", tmp_path / "o", "--no-progress", *extra)
    assert code == 2 and err.startswith("error:") and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cli_score_errors(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "stats.json"
    bad.write_text("[1, 2]")
    code, _, err = run(capsys, "score", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--tree", "chain_2",
                       "--data", tiny_dir / "prompts.jsonl", "--stats", bad)
    assert code == 2 and "not an entmtp calibration statistics file" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "score", "--base", tiny_dir / "base", "--heads", tiny_dir / "hydra", "--tree", "chain_5",
                       "--data", tiny_dir / "prompts.jsonl", "--max-prompts", 1)
    assert code == 2 and "exceeds the 3 draft heads" in err


@pytest.mark.slow  # rank 1 aborted (SIGABRT) in 2 of ~6 full-suite runs, never alone; cause not found yet
def test_accelerate_two_processes_equal_one(tiny_dir, tmp_path, capsys, monkeypatch):
    """`accelerate launch` with 2 CPU processes: prompts are sharded, the statistics gathered
    and merged on the main process -- the same statistics as one process.
    (accelerate 1.15's `--cpu` launcher starts one process; `--multi_gpu` (torchrun) starts two.)"""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    args = ["search", "--base", str(tiny_dir / "base"), "--heads", str(tiny_dir / "hydra"), "--data", str(tiny_dir / "prompts.jsonl"),
            "--budgets", "2,4", "--max-new-tokens", "10", "--latency-repeats", "1", "--threads", "1", "--no-progress",
            "--eval-prompts", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ENTMTP_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    import socket

    with socket.socket() as sock:  # a free port: other test runs on this machine may use the default one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "entmtp", *args,
           "--out", str(tmp_path / "two")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert run(capsys, *args, "--out", tmp_path / "one")[0] == 0
    two = json.loads((tmp_path / "two" / "stats.json").read_text())
    one = json.loads((tmp_path / "one" / "stats.json").read_text())
    assert two["prompts"] == one["prompts"] and two["prompt_ids"] == one["prompt_ids"] and len(one["prompt_ids"]) > 2
    r1, r2 = one["records"], two["records"]
    for col in ("prompt", "step", "position", "accepted"):
        assert r2[col] == r1[col]
    for col in ("root_entropy", "root_prob", "draft_entropy", "draft_top1"):  # batches are padded differently
        assert r2[col] == pytest.approx(r1[col], abs=1e-4)
    assert json.loads((tmp_path / "two" / "search.json").read_text())["provenance"]["processes"] == 2


@pytest.mark.slow
@pytest.mark.model
def test_benchmark_search_200_prompts_embedded_model_under_15_minutes():
    """Benchmark (slow, not in the default run): search budgets up to 64 on 200 calibration
    prompts of the embedded SmolLM2-135M with its Hydra heads (random heads when none are
    trained yet -- the trace statistics cost does not depend on acceptance), on this CPU."""
    import time

    from entmtp.data import load_prompts
    from entmtp.models import DEFAULT_HEADS_DIR, HEAD_KINDS, load_engine

    torch.set_num_threads(1)  # the 2 cores are shared: one thread is faster here
    trained = (DEFAULT_HEADS_DIR / HEAD_KINDS["hydra"]).is_dir()
    eng = load_engine("default", {"hydra": "hydra"} if trained else {}, progress=None)
    if not trained:
        from entmtp.heads import DraftHeads, HeadsConfig

        eng.add_heads("hydra", DraftHeads(HeadsConfig.for_base(eng.model.config, "hydra", num_heads=4)))
    data = Path(__file__).resolve().parent.parent / "runs" / "train_prompts.jsonl"
    if not data.is_file():
        pytest.skip("runs/train_prompts.jsonl is missing")
    ps = load_prompts(data)
    t0 = time.perf_counter()
    rep = run_search(eng, "hydra", ps, [4, 8, 16, 32, 64], max_calibration=200, max_eval=1, max_held_out=8,
                     remeasure=True)
    total = time.perf_counter() - t0
    assert rep.provenance["data"]["n_calibration"] == 200
    search_time = rep.timings["statistics_s"] + rep.timings["latency_s"] + rep.timings["search_s"]
    print(f"benchmark: statistics+latency+search {search_time:.0f} s, total with held-out {total:.0f} s; {rep.timings}")
    assert search_time < 15 * 60
