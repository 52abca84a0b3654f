"""Entropy-bank fitting: the per-bucket choice maximises overall tokens/s (brute force check)."""

import itertools

import numpy as np
import pytest

from entmtp.bank import fit_entropy_bank, quantile_edges
from entmtp.calibrate import CalibrationStats, LatencyModel, RuleSpec, StepRecord
from entmtp.scheduler import StepSignals, load_bank
from entmtp.trees import Tree


def synthetic_stats(seed=0, n=600):
    """Low root entropy -> long accepted chains; high entropy -> short ones."""
    rng = np.random.default_rng(seed)
    union = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    recs = []
    for i in range(n):
        e = float(rng.uniform(0, 4))
        p_long = max(0.05, 1 - e / 3)
        depth = int(rng.binomial(4, p_long))
        first = 0 if rng.random() < 0.8 else 1
        path = [first] + [0] * (depth - 1) if depth else []
        if first == 1:
            path = path[:2]
        accepted = tuple(tuple(path[:k]) for k in range(1, len(path) + 1))
        recs.append(StepRecord(f"p{i % 30}", i, accepted, root_entropy=e, root_prob=float(np.exp(-e))))
    return CalibrationStats.rollout(union, RuleSpec(), recs)


def latency():
    # per-step seconds grow with size: a 1-node step is cheap, a 7-node step is twice the cost
    return LatencyModel(0.05, {1: [(1, 0.055)], 2: [(2, 0.06), (3, 0.062)], 4: [(4, 0.07), (7, 0.1)]})


CANDS = [Tree.from_paths([[0]], "c1"), Tree.from_paths([[0], [1]], "w2"), Tree.from_paths([[0], [0, 0], [0, 0, 0]], "c3"),
         Tree.from_paths([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "c4"),
         Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]], "u7")]


def overall_tps(stats, lat, edges, assign):
    ent = np.array([r.root_entropy for r in stats.records])
    b = np.searchsorted(np.array(edges), ent, side="right")
    toks = time = 0.0
    for c, t in enumerate(assign):
        m = b == c
        toks += (1 + stats.accepted_lengths(t)[m]).sum()
        time += m.sum() * lat.cost(t.n_nodes, t.depth)
    return toks / time


def test_bank_is_optimal_and_beats_static(tmp_path):
    stats, lat = synthetic_stats(), latency()
    sched, rep = fit_entropy_bank(stats, CANDS, lat, n_buckets=3, min_records=1)
    edges = rep["edges"]
    assert len(edges) == 2
    brute = max(overall_tps(stats, lat, edges, a) for a in itertools.product(CANDS, repeat=3))
    chosen = [next(t for t in CANDS if t.name == name) for name in sched.table]
    assert overall_tps(stats, lat, edges, chosen) == pytest.approx(brute, rel=1e-9)
    assert rep["predicted_tokens_per_s"] == pytest.approx(brute, rel=1e-9)
    assert rep["predicted_gain_vs_static"] >= 0
    # low entropy gets a deeper tree than high entropy
    lo = sched.choose(StepSignals(0, root_entropy=0.1)).tree
    hi = sched.choose(StepSignals(0, root_entropy=3.9)).tree
    assert lo.depth > hi.depth
    sched.save(tmp_path / "bank.json")
    again = load_bank(tmp_path / "bank.json")
    assert again.table == sched.table and again.meta["fit"]["edges"] == edges


def test_sparse_buckets_fall_back_to_static():
    stats, lat = synthetic_stats(n=40), latency()
    sched, rep = fit_entropy_bank(stats, CANDS, lat, n_buckets=4, min_records=1000)
    assert set(sched.table) == {rep["best_static"]["tree"]}
    assert rep["predicted_gain_vs_static"] == pytest.approx(0.0)


def test_quantile_edges_and_errors():
    assert quantile_edges(np.array([1.0, 2.0, 3.0, 4.0, np.nan]), 2) == [2.5]
    assert quantile_edges(np.array([np.nan]), 3) == []
    with pytest.raises(ValueError):
        fit_entropy_bank(synthetic_stats(n=10), [], latency())


def shuffled_entropy(stats, seed=1):
    """The same records with their entropies permuted: entropy then says nothing about acceptance."""
    rng = np.random.default_rng(seed)
    ents = [r.root_entropy for r in stats.records]
    rng.shuffle(ents)
    recs = [StepRecord(r.prompt_id, r.step, r.accepted_paths, root_entropy=e) for r, e in zip(stats.records, ents)]
    return CalibrationStats.rollout(stats.union, RuleSpec(), recs)


def test_bank_is_kept_only_where_it_wins_on_held_out_prompts():
    """`autotune.choose_bank` fits on half the prompts and compares with the static tree on the
    other half: where entropy predicts acceptance the bank is kept; where it is noise (entropies
    shuffled), fitting alone would still claim a gain, and the held-out check refuses it."""
    from entmtp.autotune import choose_bank
    from entmtp.bank import compare_on

    stats, lat = synthetic_stats(n=1200), latency()
    static = CANDS[3]
    bank, speedup, why = choose_bank(stats, CANDS, static, lat)
    assert len(bank.bank) > 1 and speedup is not None and "held-out" in why and "no gain" not in why
    b, s = compare_on(stats, bank, static, lat)
    assert b > s
    noise = shuffled_entropy(synthetic_stats(seed=0, n=300), seed=0)
    ids = noise.prompt_ids
    half, report = fit_entropy_bank(noise.subset(ids[0::2]), CANDS, lat)
    assert len(set(half.table)) > 1 and report["predicted_gain_vs_static"] >= 0  # the fit finds buckets in noise
    on_held = compare_on(noise.subset(ids[1::2]), half, next(t for t in CANDS if t.name == report["best_static"]["tree"]), lat)
    assert on_held[0] < on_held[1]  # ... which lose on the other prompts
    bank, speedup, why = choose_bank(noise, CANDS, static, lat)
    assert list(bank.bank) == [static.name] and bank.edges == [] and speedup is None and "no gain" in why
