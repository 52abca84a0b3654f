"""The topology lab: search draft trees from one statistics pass, check them on held-out
prompts, and report the frontiers. CLI: `entmtp search` and `entmtp score`.

Pipeline (`run_search`):

1. Split the prompts (seeded, disjoint) into calibration and held-out sets.
2. One statistics pass over the calibration prompts (`entmtp.calibrate.collect_stats`).
   Greedy and sampling rules ("trace"): every prompt is continued once and, at every
   position, the ranks of the true continuation under the heads are recorded -- which nodes
   of any tree would be accepted if a step started there; decoding with any tree is then
   replayed exactly, so predictions carry no step-start bias. Typical acceptance
   ("rollout"): every prompt is decoded with a wide union tree, recording per step which
   union nodes the rule accepts.
3. For every depth limit, two searches up to the largest budget, from the statistics alone:
   * greedy expansion (Medusa style): add the frontier node of largest empirical gain in
     expected accepted length (`greedy_trees`). For the greedy rule the accepted set of a
     step is one chain, so E[accepted] = sum of the nodes' acceptance probabilities and the
     expansion yields the top-N nodes, the exact in-sample optimum for every size;
   * an exact dynamic program over tree shapes (Sequoia style) under the positional model
     p(depth, rank) = P(rank accepted | parent accepted) estimated from the statistics
     (`optimal_subtrees`, a tree knapsack: exact for any additive node value).
   Every candidate is then scored by its predicted tau (traces: the exact replay of decoding
   the calibration prompts with it; rollouts: the per-step mean) and by expected tokens/s =
   tau / measured step time of a tree of its size and depth (`LatencyModel`).
4. Frontier: per budget B, the best tree by tokens/s (and by tau) among the candidates with
   at most B nodes, and per depth; Pareto frontiers nodes vs tau and nodes vs tokens/s.
5. Debiasing: every chosen tree is replayed on statistics of the held-out prompts, and the
   trees chosen by tokens/s, `mc_sim_7b_63` (cut to the heads' depth) and plain decoding
   decode the first held-out prompts on their own (interleaved per prompt): predicted vs
   held-out tau and tokens/s side by side, with an explanation wherever they differ by more
   than 5% (the replay of exactly those prompts splits the gap into prompt shift + selection
   and on-policy effects).
6. Race (optional, `race_prompts`): where the latency model is noisier than the differences
   between small trees (a shared CPU), the statistics propose the best-replayed tree of every
   small (size, depth) (`race_proposals`); they and the trees chosen by tokens/s decode further
   held-out prompts on-policy, interleaved with plain decoding (`race_trees`), and the fastest
   is saved as `<model>-<heads>-race.json`: chosen by decoding itself, not by the model.

Library API (the app calls these)::

    report = run_search(engine, "hydra", prompts, budgets=[4, 8, 16, 32, 64])
    report.write("runs/search")          # search.json, stats.json, trees/, frontier.html, report.md
    report.to_json(); report.figures()   # dict, {"tau": go.Figure, "tokens_per_s": go.Figure}

    stats = collect_stats(engine, "hydra", prompts, rule="greedy", max_new_tokens=64)
    latency = load_or_measure_latency(engine, "hydra", max_nodes=64)
    candidates = search_trees(stats, [8, 16, 32], latency)
    measured = evaluate_trees(engine, "hydra", [c.tree for c in candidates[:3]], prompts)
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .calibrate import (MAX_BUDGET, MAX_NEW_TOKENS, MAX_PROMPTS, MAX_UNION_NODES, CalibrationStats, LatencyModel,
                        Progress, RuleSpec, _clustered_stderr, _noop, _slug, as_rule_spec, collect_stats, encode_prompts,
                        expand_by_value, load_or_measure_latency, machine_info, read_stats_json, union_tree)
from .bank import fit_entropy_bank
from .data import DataError, Prompt, PromptSet, bundled_prompts, load_prompts, split_prompts
from .interleave import rotated
from .models import describe_model
from .trees import Path_, Tree, TreeError, resolve_tree

SEARCH_FORMAT = "entmtp-search/1"
REFERENCE_TREE = "mc_sim_7b_63"
TOLERANCE = 0.05  # held-out tau is expected within 5% of the prediction
MAX_EVAL_PROMPTS = 2000


# ---- searches ---------------------------------------------------------------------------------

def greedy_trees(stats: CalibrationStats, max_nodes: int, max_depth: Optional[int] = None) -> list[Tree]:
    """Medusa-style greedy expansion from the statistics: trees[i] has i+1 nodes.

    Each step adds the frontier node (a child of the current tree among the nodes ever seen
    accepted, depth <= max_depth) whose addition raises the recorded accepted lengths the
    most (exact integer sums; ties: higher acceptance count, then canonical order). Nodes
    are added even when no gain is left, so every size up to the number of such nodes is
    present. For chain records (greedy and sampling rules) the gain of a node is its
    acceptance count, so this yields the top-N nodes: the exact in-sample optimum.
    """
    sup = stats.support
    limit = stats.depth if max_depth is None else min(max_depth, stats.depth)
    R = len(stats.records)
    _, _, dep, _, counts, _ = stats._index()
    children = sup.children
    cur = np.zeros(R, dtype=np.int64)
    frontier = [c for c in children[0] if dep[c] <= limit]
    chosen: list[Path_] = []
    out: list[Tree] = []
    while len(chosen) < max_nodes and frontier:
        best, best_key = -1, None
        for f in frontier:
            recs = stats.records_accepting(f)
            gain = int(np.maximum(dep[f] - cur[recs], 0).sum()) if len(recs) else 0
            key = (-gain, -int(counts[f]), f)
            if best_key is None or key < best_key:
                best, best_key = f, key
        recs = stats.records_accepting(best)
        if len(recs):
            cur[recs] = np.maximum(cur[recs], dep[best])
        frontier.remove(best)
        frontier += [c for c in children[best] if dep[c] <= limit]
        chosen.append(sup.node_paths[best])
        out.append(Tree.from_paths(chosen))
    return out


def optimal_subtrees(support: Tree, value: Mapping[Path_, float] | Callable[[Path_], float], max_nodes: int,
                     max_depth: Optional[int] = None) -> list[tuple[float, Tree]]:
    """Exact dynamic program (tree knapsack): for every n = 1..max_nodes, the prefix-closed
    subtree of `support` (cut at `max_depth`) with at most n nodes that maximises the sum of
    its nodes' values (values >= 0). Returns [(value, tree)] indexed by n-1.

    With value(node) = P(node accepted) this maximises the expected accepted length whenever
    at most one child of a node can be accepted (greedy and sampling rules); with Sequoia's
    positional model value(path) = prod_d p(d, r_d) it is Sequoia's DP, generalised to
    depth-dependent rates and to any support. Ties prefer fewer nodes, then lower ranks.
    """
    sup = support.truncated(max_depth) if max_depth is not None else support
    vf = value if callable(value) else (lambda p: float(value.get(p, 0.0)))
    vals = np.array([0.0] + [max(0.0, float(vf(p))) for p in sup.paths])
    B = max(0, min(int(max_nodes), sup.n_nodes))
    if B == 0:
        return []
    ch = sup.children
    m_idx = np.arange(B + 1)[:, None]
    y_idx = np.arange(B + 1)[None, :]
    valid = y_idx <= m_idx
    diff = np.where(valid, m_idx - y_idx, 0)
    F: list[Optional[np.ndarray]] = [None] * sup.size
    picks: list[list[np.ndarray]] = [[] for _ in range(sup.size)]
    root_H = None
    for u in range(sup.size - 1, -1, -1):
        H = np.zeros(B + 1)
        for c in ch[u]:
            M = np.where(valid, H[diff] + F[c][y_idx], -np.inf)
            y = M.argmax(1)  # first maximum: the smallest share for this (later) child
            H = M[np.arange(B + 1), y]
            picks[u].append(y)
        if u == 0:
            root_H = H
        else:
            F[u] = np.concatenate([[0.0], vals[u] + H[:-1]])
    paths = sup.node_paths

    def build(u: int, m: int, out: list[Path_]) -> None:
        for k in range(len(ch[u]) - 1, -1, -1):
            y = int(picks[u][k][m])
            m -= y
            if y >= 1:
                c = ch[u][k]
                out.append(paths[c])
                build(c, y - 1, out)

    result = []
    for n in range(1, B + 1):
        nodes: list[Path_] = []
        build(0, n, nodes)
        result.append((float(root_H[n]), Tree.from_paths(nodes)))
    return result


def positional_value_fn(stats: CalibrationStats) -> Callable[[Path_], float]:
    """Sequoia's positional model (with depth): value(path) = prod_d p(d, r_d), with
    p(d, r) = P(rank r at depth d accepted | parent accepted) from the statistics."""
    rate, _, _ = stats.positional_rates()

    def value(p: Path_) -> float:
        v = 1.0
        for d, r in enumerate(p, start=1):
            if d >= rate.shape[0] or r >= rate.shape[1]:
                return 0.0
            v *= rate[d, r]
        return float(v)

    return value


def positional_values(stats: CalibrationStats) -> dict[Path_, float]:
    """`positional_value_fn` on every node of `dp_support(stats)`."""
    f = positional_value_fn(stats)
    return {p: f(p) for p in dp_support(stats).paths}


def dp_support(stats: CalibrationStats, max_nodes: int = 64, max_depth: Optional[int] = None) -> Tree:
    """The nodes the DP chooses from (up to `max_depth`): the rollout's union tree, or (traces,
    where every rank path is covered) the most valuable nodes under the positional model --
    enough for optimality, since the positional value never grows from parent to child, so a
    best tree of n nodes only uses nodes among the n most valuable (ties aside: a margin is kept)."""
    depth = stats.depth if max_depth is None else min(max_depth, stats.depth)
    if stats.mode == "rollout":
        return stats.union.truncated(depth)
    n = min(MAX_UNION_NODES, max(2 * max_nodes, max_nodes + 32))
    return Tree.from_paths(expand_by_value(positional_value_fn(stats), n, depth, stats.max_rank), "dp_support")


# ---- candidates, frontier -----------------------------------------------------------------------

def tree_id(tree: Tree) -> str:
    h = hashlib.sha256(json.dumps([list(p) for p in tree.paths]).encode()).hexdigest()[:8]
    return f"n{tree.n_nodes}-d{tree.depth}-{h}"


@dataclass
class Candidate:
    """A searched tree and its predicted scores (from the statistics and the latency model)."""

    tree: Tree
    methods: list[str]
    depth_limits: list[int]
    predicted_tau: float
    tau_stderr: float
    step_cost_s: float = float("nan")
    predicted_tokens_per_s: float = float("nan")
    predicted_speedup: float = float("nan")
    model_tau: Optional[float] = None  # the positional model's own expectation (DP trees)
    position_tau: Optional[float] = None  # traces: 1 + mean accepted drafts over all positions
    unsupported_nodes: int = 0  # nodes the statistics do not cover: never counted as accepted
    edge_nodes: int = 0  # nodes whose first child or next sibling the statistics do not cover

    @property
    def id(self) -> str:
        return tree_id(self.tree)

    @property
    def n_nodes(self) -> int:
        return self.tree.n_nodes

    @property
    def depth(self) -> int:
        return self.tree.depth

    def to_json(self, paths: bool = True) -> dict:
        d = {"id": self.id, "name": self.tree.name or None, "n_nodes": self.n_nodes, "depth": self.depth,
             "depth_counts": self.tree.depth_counts, "methods": self.methods, "depth_limits": self.depth_limits,
             "predicted_tau": self.predicted_tau, "tau_stderr": self.tau_stderr, "step_cost_s": self.step_cost_s,
             "predicted_tokens_per_s": self.predicted_tokens_per_s, "predicted_speedup": self.predicted_speedup,
             "model_tau": self.model_tau, "position_tau": self.position_tau, "unsupported_nodes": self.unsupported_nodes, "edge_nodes": self.edge_nodes}
        if paths:
            d["paths"] = [list(p) for p in self.tree.paths]
        return _clean(d)


def _edge_nodes(tree: Tree, stats: CalibrationStats) -> int:
    """Nodes whose first child or next sibling the statistics do not cover (the search could
    not look there)."""
    n = 0
    for p in tree.paths:
        child, sib = p + (0,), p[:-1] + (p[-1] + 1,)
        if (len(p) < stats.depth and not stats.covers(child)) or not stats.covers(sib):
            n += 1
    return n


def score_tree(stats: CalibrationStats, tree: Tree, latency: Optional[LatencyModel] = None,
               methods: Sequence[str] = ("given",), depth_limits: Sequence[int] = ()) -> Candidate:
    """Predicted tau (and tokens/s with a latency model) of one tree from the statistics:
    the exact replay of decoding for traces, the per-step mean for rollouts."""
    tau = stats.predict_tau(tree)
    c = Candidate(tree, list(methods), list(depth_limits), tau, stats.tau_stderr(tree),
                  unsupported_nodes=stats.columns(tree)[1], edge_nodes=_edge_nodes(tree, stats),
                  position_tau=stats.expected_tau(tree) if stats.mode == "trace" else None)
    return price_candidates([c], latency)[0] if latency is not None else c


def price_candidates(cands: Sequence[Candidate], latency: LatencyModel) -> list[Candidate]:
    """`cands` with step cost, tokens/s and speedup read from `latency` (their taus as they are)."""
    return [dataclasses.replace(c, step_cost_s=latency.cost(c.n_nodes, c.depth),
                    predicted_tokens_per_s=latency.tokens_per_s(c.predicted_tau, c.n_nodes, c.depth),
                    predicted_speedup=latency.speedup(c.predicted_tau, c.n_nodes, c.depth)) for c in cands]


def search_trees(stats: CalibrationStats, budgets: Sequence[int], latency: Optional[LatencyModel] = None, *,
                 depths: Optional[Sequence[int]] = None, methods: Sequence[str] = ("greedy", "dp"),
                 references: Sequence[Tree] = (), progress: Optional[Progress] = None) -> list[Candidate]:
    """Every tree of the greedy expansion and of the DP, for each depth limit and every size
    up to max(budgets), plus the `references`, deduplicated and scored; sorted by size."""
    budgets = _check_budgets(budgets)
    bad = set(methods) - {"greedy", "dp"}
    if bad:
        raise ValueError(f"unknown search method(s) {', '.join(sorted(bad))} (greedy, dp)")
    if not stats.records:
        raise DataError("no calibration steps were recorded: nothing to search from")
    D = stats.depth
    depths = sorted(set(depths or range(1, D + 1)))
    if any(not 1 <= d <= D for d in depths):
        raise ValueError(f"depth limits must be in 1..{D} (the heads' depth)")
    max_b = max(budgets)
    progress = progress or _noop
    found: dict[tuple, tuple[Tree, set, set, Optional[float]]] = {}

    def add(tree: Tree, method: str, d: Optional[int], model_value: Optional[float] = None):
        if tree.n_nodes == 0:
            return
        t, ms, ds, mv = found.get(tree.key(), (tree, set(), set(), None))
        ms.add(method)
        if d is not None:
            ds.add(d)
        found[tree.key()] = (t, ms, ds, model_value if model_value is not None else mv)

    pos = positional_value_fn(stats) if "dp" in methods else None
    total = len(depths) * len(methods)
    done = 0
    progress("search", 0, total)
    for d in depths:
        if "greedy" in methods:
            for t in greedy_trees(stats, max_b, d):
                add(t, "greedy", d)
            done += 1
            progress("search", done, total)
        if "dp" in methods:
            for v, t in optimal_subtrees(dp_support(stats, max_b, d), pos, max_b, d):
                add(t, "dp", d, 1.0 + v)
            done += 1
            progress("search", done, total)
    for ref in references:
        add(ref, "reference", None)
    out = []
    for t, ms, ds, mv in found.values():
        c = score_tree(stats, t, latency, sorted(ms), sorted(ds))
        c.model_tau = mv
        out.append(c)
    out.sort(key=lambda c: (c.n_nodes, -c.predicted_tau, c.id))
    return out


def _key_tps(c: Candidate) -> tuple:
    v = c.predicted_tokens_per_s
    return (v if math.isfinite(v) else -1.0, c.predicted_tau, -c.n_nodes)


def _key_tau(c: Candidate) -> tuple:
    v = c.predicted_tokens_per_s
    return (c.predicted_tau, -c.n_nodes, v if math.isfinite(v) else -1.0)


def frontier(candidates: Sequence[Candidate], budgets: Sequence[int], include_references: bool = False) -> list[dict]:
    """Per budget B: the best candidate by predicted tokens/s and by predicted tau among those
    with at most B nodes, and the best by tokens/s for each exact depth. Reference trees
    are not chosen unless `include_references`."""
    out = []
    pool_all = [c for c in candidates if include_references or c.methods != ["reference"]]
    for b in _check_budgets(budgets):
        pool = [c for c in pool_all if c.n_nodes <= b]
        if not pool:
            out.append({"budget": b, "best_tokens_per_s": None, "best_tau": None, "per_depth": {}})
            continue
        per_depth = {}
        for d in sorted({c.depth for c in pool}):
            per_depth[str(d)] = max((c for c in pool if c.depth == d), key=_key_tps).id
        out.append({"budget": b, "best_tokens_per_s": max(pool, key=_key_tps).id,
                    "best_tau": max(pool, key=_key_tau).id, "per_depth": per_depth})
    return out


def pareto(points: Sequence[Any], value: Callable[[Any], float], size: Callable[[Any], int] = lambda c: c.n_nodes) -> list[Any]:
    """The points no other point beats with fewer or equal nodes: sorted by size, keeping
    each point that strictly improves on every smaller one."""
    best = -math.inf
    out = []
    for p in sorted(points, key=lambda p: (size(p), -value(p))):
        v = value(p)
        if math.isfinite(v) and v > best:
            out.append(p)
            best = v
    return out


def _check_budgets(budgets: Sequence[int]) -> list[int]:
    try:
        bs = sorted({int(b) for b in budgets})
    except (TypeError, ValueError):
        raise ValueError(f"budgets must be integers, got {budgets!r}") from None
    if not bs:
        raise ValueError("give at least one node budget")
    if len(bs) > 32:
        raise ValueError("at most 32 budgets")
    if bs[0] < 1 or bs[-1] > MAX_BUDGET:
        raise ValueError(f"node budgets must be in 1..{MAX_BUDGET}, got {bs[0] if bs[0] < 1 else bs[-1]}")
    return bs


# ---- on-policy evaluation ------------------------------------------------------------------------

@dataclass
class Measured:
    """A tree (None: plain decoding) decoding prompts on its own.

    tau = 1 + mean accepted drafts per verification step (what the statistics predict);
    tokens_per_s = those tokens / step time (prefill excluded, like the prediction);
    engine_tau and e2e_tokens_per_s count the prefill too (as `entmtp generate` prints).
    """

    name: str
    tree: Optional[Tree]
    n_prompts: int = 0
    n_steps: int = 0
    accepted: int = 0
    new_tokens: int = 0
    step_time_s: float = 0.0
    prefill_s: float = 0.0
    forwards: int = 0
    tau_stderr: float = float("nan")
    accept_histogram: list[int] = field(default_factory=list)
    identical_to_baseline: Optional[bool] = None
    _lengths: list[int] = field(default_factory=list, repr=False)
    _groups: list[str] = field(default_factory=list, repr=False)

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.n_steps if self.n_steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return (self.n_steps + self.accepted) / self.step_time_s if self.step_time_s > 0 else float("nan")

    @property
    def mean_step_s(self) -> float:
        return self.step_time_s / self.n_steps if self.n_steps else float("nan")

    @property
    def engine_tau(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else float("nan")

    @property
    def e2e_tokens_per_s(self) -> float:
        t = self.step_time_s + self.prefill_s
        return self.new_tokens / t if t > 0 else float("nan")

    def to_json(self) -> dict:
        t = self.tree
        return _clean({"name": self.name, "id": tree_id(t) if t is not None else "baseline",
                       "n_nodes": t.n_nodes if t is not None else 0, "depth": t.depth if t is not None else 0,
                       "n_prompts": self.n_prompts, "n_steps": self.n_steps, "tau": self.tau, "tau_stderr": self.tau_stderr,
                       "tokens_per_s": self.tokens_per_s, "mean_step_s": self.mean_step_s, "engine_tau": self.engine_tau,
                       "e2e_tokens_per_s": self.e2e_tokens_per_s, "new_tokens": self.new_tokens,
                       "accept_histogram": self.accept_histogram, "identical_to_baseline": self.identical_to_baseline})


def evaluate_trees(engine, heads: str, trees: Sequence[Tree], prompts: Sequence[Any], rule: RuleSpec | str | None = None,
                   max_new_tokens: int = 64, progress: Optional[Progress] = None, baseline: bool = True,
                   warmup: bool = True) -> list[Measured]:
    """Decode every prompt with every tree on its own (on-policy), interleaved: for prompt i
    the order of the trees is rotated by i, so drift in machine load hits all alike.
    Returns one `Measured` per tree, in order, then plain decoding when `baseline`."""
    if heads not in engine.runners:
        raise ValueError(f"no heads named {heads!r} loaded")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}")
    if len(prompts) > MAX_EVAL_PROMPTS:
        raise ValueError(f"at most {MAX_EVAL_PROMPTS} evaluation prompts")
    spec = as_rule_spec(rule)
    progress = progress or _noop
    encoded = encode_prompts(engine, prompts)
    entries: list[Optional[Tree]] = list(trees) + ([None] if baseline else [])
    res = [Measured(t.name or f"{t.n_nodes}-node" if t is not None else "baseline", t) for t in entries]
    outputs: list[dict[str, list[int]]] = [dict() for _ in entries]
    if warmup and encoded:
        for t in entries:
            engine.run(encoded[0][1][-32:], heads=heads if t is not None else None, tree=t,
                       config=spec.decode_config(min(4, max_new_tokens), seed=0))
    total = len(encoded) * len(entries)
    done = 0
    progress("held-out", 0, total)
    for i, (pid, ids) in enumerate(encoded):
        for j in rotated(range(len(entries)), i):
            t, m = entries[j], res[j]
            r = engine.run(ids, heads=heads if t is not None else None, tree=t,
                           config=spec.decode_config(max_new_tokens, seed=spec.prompt_seed(pid)))
            m.n_prompts += 1
            m.new_tokens += len(r.tokens)
            m.prefill_s += r.time_prefill
            m.forwards += 1 + sum(1 for s in r.steps if s.time_verify > 0)
            for s in r.steps:
                if s.time_verify > 0:
                    m.n_steps += 1
                    m.accepted += s.accept_length
                    m.step_time_s += s.time_total
                    m._lengths.append(s.accept_length)
                    m._groups.append(pid)
            outputs[j][pid] = list(r.tokens)
            done += 1
            progress("held-out", done, total)
    for m in res:
        if m._lengths:
            m.accept_histogram = np.bincount(m._lengths).tolist()
            m.tau_stderr = _clustered_stderr(m._groups, np.array(m._lengths))
    if baseline:
        ref = outputs[-1]
        for j in range(len(entries) - 1):
            res[j].identical_to_baseline = outputs[j] == ref
    return res


def race_proposals(stats: CalibrationStats, max_nodes: int = 6, max_depth: int = 3, min_nodes: int = 1) -> list[Candidate]:
    """For every (nodes, depth) with min_nodes <= nodes <= max_nodes and depth <= max_depth, the
    searched tree with the highest replayed tau: the few small trees a CPU can afford, between
    which a noisy step-time model cannot choose (`race_trees` lets decoding decide)."""
    if not 1 <= min_nodes <= max_nodes <= MAX_BUDGET:
        raise ValueError(f"race sizes must satisfy 1 <= min_nodes <= max_nodes <= {MAX_BUDGET}")
    if max_depth < 1:
        raise ValueError("the race's max_depth must be >= 1")
    depth = min(max_depth, stats.depth)
    best: dict[tuple[int, int], Candidate] = {}
    for c in search_trees(stats, [max_nodes], None, depths=range(1, depth + 1)):
        key = (c.n_nodes, c.depth)
        if c.n_nodes >= min_nodes and (key not in best or c.predicted_tau > best[key].predicted_tau):
            best[key] = c
    return [best[k] for k in sorted(best)]


def race_trees(engine, heads: str, trees: Sequence[Tree], prompts: Sequence[Any], rule: RuleSpec | str | None = None,
               max_new_tokens: int = 64, progress: Optional[Progress] = None) -> dict:
    """Decode `prompts` with every tree on-policy, interleaved with plain decoding
    (`evaluate_trees`); the results sorted by tokens/s, the first is the winner.

    Returns {"n_prompts", "prompt_ids", "max_new_tokens", "baseline_tokens_per_s",
    "identical_outputs" (greedy; None otherwise), "results": [{"name", "id", "paths", "n_nodes",
    "depth", "tau", "tau_stderr", "tokens_per_s", "speedup", "identical_to_baseline"}, ...]}."""
    if not trees:
        raise ValueError("no trees to race")
    if not prompts:
        raise DataError("no prompts to race the trees on")
    spec = as_rule_spec(rule)
    measured = evaluate_trees(engine, heads, trees, prompts, spec, max_new_tokens,
                              progress=(lambda ph, d, t: progress("race", d, t)) if progress else None, baseline=True)
    base = measured[-1]
    rows = []
    for m in measured[:-1]:
        rows.append({"name": m.name, "id": tree_id(m.tree), "paths": [list(p) for p in m.tree.paths],
                     "n_nodes": m.tree.n_nodes, "depth": m.tree.depth, "tau": m.tau, "tau_stderr": m.tau_stderr,
                     "tokens_per_s": m.tokens_per_s,
                     "speedup": m.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else float("nan"),
                     "identical_to_baseline": m.identical_to_baseline})
    rows.sort(key=lambda r: -r["tokens_per_s"] if math.isfinite(r["tokens_per_s"]) else math.inf)
    ident = [r["identical_to_baseline"] for r in rows]
    return {"n_prompts": len(prompts), "prompt_ids": [getattr(p, "id", None) for p in prompts],
            "max_new_tokens": max_new_tokens, "baseline_tokens_per_s": base.tokens_per_s,
            "identical_outputs": all(ident) if spec.name == "greedy" else None, "results": rows}


# ---- the whole search ---------------------------------------------------------------------------

@dataclass
class SearchReport:
    """Everything one search produced; `write` saves it, `to_json` / `figures` / `markdown`
    render it."""

    provenance: dict
    budgets: list[int]
    stats: CalibrationStats
    latency: Optional[LatencyModel]
    candidates: list[Candidate]
    frontier: list[dict]
    evaluation: Optional[dict] = None
    held_out_stats: Optional[CalibrationStats] = None
    timings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    bank: Optional[Any] = None  # EntropyBucketScheduler fitted from the same statistics
    bank_report: Optional[dict] = None
    race: Optional[dict] = None  # `race_trees` result on further held-out prompts (step 6), or None

    def fit_bank(self, n_buckets: int = 4) -> None:
        """Fit the entropy bank (bucket of the root entropy -> tree) from these statistics:
        the candidates are every searched tree; the objective is overall expected tokens/s."""
        if self.latency is None or not any(math.isfinite(r.root_entropy) for r in self.stats.records):
            return
        pool = [c for c in self.candidates if c.methods != ["reference"]]
        if not pool:  # no draft was ever accepted: nothing to schedule between
            return
        trees = [Tree(c.tree.paths, f"{self.tree_prefix()}-{c.id}") for c in pool]
        # bucket layouts: root entropy only, the first draft head's entropy only, and both
        fits = [fit_entropy_bank(self.stats, trees, self.latency, n_buckets=nb, draft_buckets=db)
                for nb, db in ((n_buckets, 0), (1, n_buckets), (1, 2 * n_buckets - 2), (n_buckets - 1, n_buckets - 1))]
        self.bank, self.bank_report = max(fits, key=lambda f: f[1]["predicted_tokens_per_s"])

    # ---- lookups ---------------------------------------------------------------------------
    def candidate(self, cid: str) -> Candidate:
        for c in self.candidates:
            if c.id == cid:
                return c
        raise KeyError(cid)

    def chosen(self) -> list[dict]:
        """One row per (budget, role): role 'tokens_per_s' (the tree to use) or 'tau'."""
        rows = []
        for f in self.frontier:
            if f["best_tokens_per_s"]:
                rows.append({"budget": f["budget"], "role": "tokens_per_s", "candidate": self.candidate(f["best_tokens_per_s"])})
            if f["best_tau"] and f["best_tau"] != f["best_tokens_per_s"]:
                rows.append({"budget": f["budget"], "role": "tau", "candidate": self.candidate(f["best_tau"])})
        return rows

    def reference(self) -> Optional[Candidate]:
        return next((c for c in self.candidates if "reference" in c.methods), None)

    def pareto_ids(self) -> dict:
        cands = [c for c in self.candidates]
        out = {"tau": [c.id for c in pareto(cands, lambda c: c.predicted_tau)]}
        if self.latency is not None:
            out["tokens_per_s"] = [c.id for c in pareto(cands, lambda c: c.predicted_tokens_per_s)]
        return out

    def tree_prefix(self) -> str:
        p = self.provenance
        model = str((p.get("model") or {}).get("name") or "model")
        model = _slug(Path(model).name).replace("-instruct", "")
        tag = f"-{_slug(p['tag'])}" if p.get("tag") else ""
        return f"{model}-{_slug((p.get('heads') or {}).get('label') or 'heads')}{tag}"

    # ---- rendering -------------------------------------------------------------------------
    def to_json(self) -> dict:
        ev = self.evaluation
        return _clean({
            "format": SEARCH_FORMAT,
            "provenance": self.provenance,
            "entropy_bank": self.bank_report,
            "budgets": self.budgets,
            "union": ({"n_nodes": self.stats.union.n_nodes, "depth": self.stats.union.depth,
                       "depth_counts": self.stats.union.depth_counts, "paths": [list(p) for p in self.stats.union.paths]}
                      if self.stats.union is not None else None),
            "stats": {"file": "stats.json", **self.stats.summary(),
                      "held_out_file": "held_out_stats.json" if self.held_out_stats is not None else None,
                      "positional_rates": self.stats.positional_rates()[0].round(5).tolist()},
            "latency": self.latency.to_json() if self.latency is not None else None,
            "chosen": [{"budget": r["budget"], "role": r["role"], "id": r["candidate"].id,
                        "file": f"trees/{self._tree_file(r)}"} for r in self.chosen()],
            "frontier": self.frontier,
            "pareto": self.pareto_ids(),
            "held_out": ev,
            "race": self.race,
            "candidates": [c.to_json() for c in self.candidates],
            "timings": self.timings,
            "warnings": self.warnings,
        })

    def _tree_file(self, row: dict) -> str:
        suffix = "" if row["role"] == "tokens_per_s" else "-tau"
        return f"{self.tree_prefix()}-b{row['budget']}{suffix}.json"

    def race_tree_file(self) -> str:
        return f"{self.tree_prefix()}-race.json"

    def _held_out_rows(self) -> dict[str, dict]:
        """Held-out comparison rows by candidate id."""
        return {r["id"]: r for r in (self.evaluation or {}).get("comparisons", [])}

    def figures(self) -> dict:
        """Plotly figures: {"tau": nodes vs tau, "tokens_per_s": nodes vs tokens/s}, each with
        every candidate (by search method), the predicted Pareto frontier, the held-out
        measurements of the chosen trees, and mc_sim_7b_63."""
        import plotly.graph_objects as go

        figs = {}
        ho = self._held_out_rows()
        metrics = [("tau", "predicted_tau", "held_out_tau", "tau (tokens per step)")]
        if self.latency is not None:
            metrics.append(("tokens_per_s", "predicted_tokens_per_s", "held_out_tokens_per_s", "tokens/s"))
        for key, pred_attr, ho_key, label in metrics:
            fig = go.Figure()
            for method, color in (("greedy", "#1f77b4"), ("dp", "#ff7f0e")):
                cs = [c for c in self.candidates if method in c.methods]
                if cs:
                    fig.add_trace(go.Scatter(x=[c.n_nodes for c in cs], y=[getattr(c, pred_attr) for c in cs], mode="markers",
                                             name=f"{method} (predicted)", marker=dict(color=color, size=5, opacity=0.35),
                                             text=[f"{c.id} depth {c.depth}" for c in cs], hovertemplate="%{text}<br>%{x} nodes: %{y:.3f}"))
            front = pareto(self.candidates, lambda c: getattr(c, pred_attr))
            fig.add_trace(go.Scatter(x=[c.n_nodes for c in front], y=[getattr(c, pred_attr) for c in front], mode="lines+markers",
                                     name="Pareto frontier (predicted)", line=dict(color="#2ca02c", shape="hv")))
            if key == "tau":
                rp = [r for r in ho.values() if r.get("held_out_replay_tau") is not None]
                if rp:
                    fig.add_trace(go.Scatter(x=[r["n_nodes"] for r in rp], y=[r["held_out_replay_tau"] for r in rp],
                                             mode="markers", name="chosen (held-out replay)",
                                             marker=dict(symbol="diamond-open", size=10, color="#9467bd"),
                                             text=[r["name"] for r in rp], hovertemplate="%{text}<br>%{x} nodes: %{y:.3f}"))
            rows = [r for r in ho.values() if r.get(ho_key) is not None]
            if rows:
                fig.add_trace(go.Scatter(x=[r["n_nodes"] for r in rows], y=[r[pred_attr] for r in rows], mode="markers",
                                         name="chosen (predicted)", marker=dict(symbol="circle-open", size=11, color="#d62728")))
                fig.add_trace(go.Scatter(x=[r["n_nodes"] for r in rows], y=[r[ho_key] for r in rows], mode="markers",
                                         name="chosen (held-out, on-policy)", marker=dict(symbol="x", size=10, color="#d62728"),
                                         text=[r["name"] for r in rows], hovertemplate="%{text}<br>%{x} nodes: %{y:.3f}"))
            ref = self.reference()
            if ref is not None:
                fig.add_trace(go.Scatter(x=[ref.n_nodes], y=[getattr(ref, pred_attr)], mode="markers", name=f"{ref.tree.name} (predicted)",
                                         marker=dict(symbol="star", size=14, color="gold", line=dict(color="black", width=1))))
            base = (self.evaluation or {}).get("baseline")
            if key == "tokens_per_s" and base:
                fig.add_hline(y=base["tokens_per_s"], line_dash="dot", annotation_text="plain decoding (held-out)")
            fig.update_layout(title=f"nodes vs {label}", xaxis_title="draft nodes", yaxis_title=label, template="plotly_white",
                              legend=dict(orientation="h", y=-0.2))
            figs[key] = fig
        return figs

    def _stats_line(self) -> str:
        st = self.stats
        if st.mode == "trace":
            return (f"- statistics: traces, {st.n_steps} positions of {len(st.prompts)} prompts, every rank path with "
                    f"ranks < {st.max_rank} up to depth {st.depth} covered; decoding with each tree replayed exactly")
        return (f"- statistics: union rollouts, {st.n_steps} steps; union tree {st.union.n_nodes} nodes "
                f"{st.union.depth_counts}, union tau {st.expected_tau(st.union):.3f}")

    def markdown(self) -> str:
        p = self.provenance
        L = [f"# Tree search: {(p.get('model') or {}).get('name')} + {(p.get('heads') or {}).get('label')} heads", ""]
        d = p.get("data") or {}
        L += [f"- data: {d.get('source')} (sha256 {str(d.get('sha256'))[:12]}), {d.get('n_calibration')} calibration / "
              f"{d.get('n_held_out')} held-out prompts (split seed {p.get('seed')})",
              f"- rule: {self.stats.rule.label}; max new tokens {p.get('max_new_tokens')}; dtype {p.get('dtype')}; device {p.get('device')}",
              f"- machine: {(p.get('machine') or {}).get('platform')}, {(p.get('machine') or {}).get('cpu_count')} CPUs, "
              f"{(p.get('machine') or {}).get('torch_threads')} torch threads",
              self._stats_line(),
              "- tau = tokens per verification step (1 + accepted drafts); tokens/s = tau / step time (prefill excluded)", ""]
        if p.get("command"):
            L += ["```", p["command"], "```", ""]
        if self.latency is not None:
            L += [f"Plain decoding step: {self.latency.baseline_s * 1e3:.2f} ms (latency model, "
                  f"{'cached' if self.latency.meta.get('cached') else 'measured now'}).", ""]
        L += ["## Chosen trees (predicted)", "",
              "| budget | role | tree | nodes | depth | per depth | methods | pred. tau | pred. tokens/s | pred. speedup |",
              "|---:|---|---|---:|---:|---|---|---:|---:|---:|"]
        for r in self.chosen():
            c = r["candidate"]
            L.append(f"| {r['budget']} | {r['role']} | `{self._tree_file(r)}` | {c.n_nodes} | {c.depth} | {c.tree.depth_counts} | "
                     f"{','.join(c.methods)} | {c.predicted_tau:.3f} ± {c.tau_stderr:.3f} | {_fmt(c.predicted_tokens_per_s, 1)} | "
                     f"{_fmt(c.predicted_speedup, 2)}x |")
        ref = self.reference()
        if ref is not None:
            L.append(f"| - | reference | {ref.tree.name} | {ref.n_nodes} | {ref.depth} | {ref.tree.depth_counts} | reference | "
                     f"{ref.predicted_tau:.3f} ± {ref.tau_stderr:.3f} | {_fmt(ref.predicted_tokens_per_s, 1)} | {_fmt(ref.predicted_speedup, 2)}x |")
        ev = self.evaluation
        if ev:
            L += ["", "## Held-out check", "",
                  ("Predicted = replay of decoding on the calibration statistics. " if self.stats.mode == "trace" else
                   "Predicted = per-step mean over the calibration union rollouts. ")
                  + f"Held-out replay = the same on the statistics of {ev['n_replay_prompts']} held-out prompts. On-policy = "
                  f"each tree decoding {ev['n_prompts']} held-out prompts on its own (interleaved with plain decoding); "
                  "'replay, same prompts' predicts exactly those runs" + (" (exact for greedy decoding)." if self.stats.mode == "trace" else "."), "",
                  "| tree | nodes | pred. tau | held-out replay | on-policy tau | replay, same prompts | diff | "
                  "pred. tokens/s | on-policy tokens/s | diff | on-policy speedup | within 5% |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for r in ev["comparisons"]:
                L.append(f"| {r['name']} | {r['n_nodes']} | {r['predicted_tau']:.3f} | {_fmt(r.get('held_out_replay_tau'), 3)} | "
                         f"{_fmt(r.get('held_out_tau'), 3)} | {_fmt(r.get('held_out_predicted_tau'), 3)} | {_pct(r['tau_rel_err'])} | "
                         f"{_fmt(r['predicted_tokens_per_s'], 1)} | {_fmt(r.get('held_out_tokens_per_s'), 1)} | "
                         f"{_pct(r.get('tokens_per_s_rel_err'))} | {_fmt(r.get('held_out_speedup'), 2)}x | "
                         f"{'yes' if r['within_tolerance'] else 'no'} ({r['tolerance_basis']}) |")
            b = ev.get("baseline")
            if b:
                L.append(f"| plain decoding | 0 | 1.000 | 1.000 | 1.000 | 1.000 | | "
                         f"{_fmt(self.latency.tokens_per_s(1, 0, 0) if self.latency else None, 1)} | {_fmt(b['tokens_per_s'], 1)} | | 1.00x | |")
            notes = [r for r in ev["comparisons"] if r.get("explanation")]
            if notes:
                L += ["", "Why predictions and held-out measurements differ:", ""]
                for r in notes:
                    L.append(f"- **{r['name']}**: {r['explanation']}")
            if ev.get("identical_outputs") is not None:
                L += ["", f"Outputs identical to plain decoding on every on-policy prompt: {'yes' if ev['identical_outputs'] else 'NO'}"]
        if self.race:
            ra = self.race
            L += ["", "## On-policy race", "",
                  f"The best-replayed tree of every small (size, depth) and the trees chosen by tokens/s, each decoding "
                  f"{ra['n_prompts']} further held-out prompts (not those of the check above) on its own, interleaved "
                  f"with plain decoding ({ra['max_new_tokens']} new tokens). The fastest is saved as "
                  f"`{self.race_tree_file()}`.", "",
                  "| tree | nodes | depth | paths | pred. tau | on-policy tau | tokens/s | speedup vs plain |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]
            for r in ra["results"]:
                L.append(f"| {r['name']} | {r['n_nodes']} | {r['depth']} | `{r['paths']}` | {_fmt(r.get('predicted_tau'), 3)} | "
                         f"{_fmt(r['tau'], 3)} | {_fmt(r['tokens_per_s'], 1)} | {_fmt(r['speedup'], 3)}x |")
            L.append(f"| plain decoding | 0 | 0 | | 1.000 | 1.000 | {_fmt(ra['baseline_tokens_per_s'], 1)} | 1.000x |")
            if ra.get("identical_outputs") is not None:
                L += ["", f"Outputs identical to plain decoding on every race prompt: {'yes' if ra['identical_outputs'] else 'NO'}"]
        L += ["", "## Pareto frontiers (predicted)", ""]
        for key, ids in self.pareto_ids().items():
            pts = [self.candidate(i) for i in ids]
            val = (lambda c: f"{c.predicted_tau:.2f}") if key == "tau" else (lambda c: f"{c.predicted_tokens_per_s:.1f}")
            L.append(f"- nodes vs {key}: " + ", ".join(f"{c.n_nodes}:{val(c)}" for c in pts))
        if self.bank_report:
            b = self.bank_report
            L += ["", "## Entropy bank (buckets of this step's entropies -> tree)", "",
                  f"Root-entropy edges (nats): {b['edges']}; first-draft-head entropy edges: {b['draft_edges']}; predicted {b['predicted_tokens_per_s']:.2f} tokens/s vs the best static tree "
                  f"{b['best_static']['tree']} {b['best_static']['predicted_tokens_per_s']:.2f} ({b['predicted_gain_vs_static']:+.1%}), "
                  "same records and latency model.", "", "| bucket | records | tree | predicted tau |", "|---|---|---|---|"]
            L += [f"| {i} | {c['records']} | {c['tree']} | {c['predicted_tau']:.2f} |" for i, c in enumerate(b["cells"])]
        if self.warnings:
            L += ["", "## Warnings", ""] + [f"- {w}" for w in self.warnings]
        if self.timings:
            L += ["", "Timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())]
        return "\n".join(L) + "\n"

    def write(self, out_dir: str | Path, save_trees_to: Optional[str | Path] = None) -> dict[str, Path]:
        """Write search.json, stats.json (+ held_out_stats.json), trees/*.json, frontier.html
        and report.md under out_dir; copy the chosen trees to `save_trees_to` if given."""
        out = Path(out_dir)
        (out / "trees").mkdir(parents=True, exist_ok=True)
        files: dict[str, Path] = {}
        self.stats.save(out / "stats.json")
        files["stats"] = out / "stats.json"
        if self.held_out_stats is not None:
            self.held_out_stats.save(out / "held_out_stats.json")
        ho = self._held_out_rows()
        prov = self.provenance
        short = {"model": (prov.get("model") or {}).get("name"), "heads": (prov.get("heads") or {}).get("label"),
                 "data_sha256": (prov.get("data") or {}).get("sha256"), "rule": self.stats.rule.label,
                 "dtype": prov.get("dtype"), "device": prov.get("device"), "machine": (prov.get("machine") or {}).get("platform")}
        tree_files = []
        for r in self.chosen():
            c = r["candidate"]
            name = self._tree_file(r)[:-5]
            h = ho.get(c.id, {})
            extra = {"budget": r["budget"], "chosen_by": r["role"], "methods": c.methods,
                     "predicted_tau": c.predicted_tau, "predicted_tokens_per_s": c.predicted_tokens_per_s,
                     "predicted_speedup": c.predicted_speedup, "held_out_tau": h.get("held_out_tau"),
                     "held_out_tokens_per_s": h.get("held_out_tokens_per_s"), "provenance": short}
            path = out / "trees" / f"{name}.json"
            Tree(c.tree.paths, name).save(path, extra=_clean(extra))
            tree_files.append(path)
        if self.race and self.race["results"]:
            win = self.race["results"][0]
            name = self.race_tree_file()[:-5]
            path = out / "trees" / f"{name}.json"
            extra = {"chosen_by": "on-policy race", "predicted_tau": win.get("predicted_tau"),
                     "held_out_tau": win["tau"], "held_out_tokens_per_s": win["tokens_per_s"],
                     "held_out_speedup": win["speedup"], "race_prompts": self.race["n_prompts"],
                     "race": [{"paths": r["paths"], "tau": r["tau"], "tokens_per_s": r["tokens_per_s"]}
                              for r in self.race["results"]], "provenance": short}
            Tree.from_paths(win["paths"], name).save(path, extra=_clean(extra))
            tree_files.append(path)
        files["trees"] = out / "trees"
        (out / "search.json").write_text(json.dumps(self.to_json(), indent=1))
        files["search"] = out / "search.json"
        figs = self.figures()
        parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs.values())]
        title = html.escape(f"entmtp tree search: {short['model']} + {short['heads']}")
        (out / "frontier.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
                                           f"<body><h2>{title}</h2>{''.join(parts)}</body></html>\n")
        files["frontier"] = out / "frontier.html"
        (out / "report.md").write_text(self.markdown())
        files["report"] = out / "report.md"
        if self.bank is not None:
            self.bank.meta["provenance"] = short
            self.bank.save(out / "bank.json")
            files["bank"] = out / "bank.json"
        if save_trees_to:
            dst = Path(save_trees_to)
            dst.mkdir(parents=True, exist_ok=True)
            for p in tree_files:
                shutil.copyfile(p, dst / p.name)
            if self.bank is not None:
                shutil.copyfile(out / "bank.json", dst / f"{self.tree_prefix()}-bank.json")
            files["saved_trees"] = dst
        return files


def _fmt(x, nd: int) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _pct(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.1%}"


def _clean(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (np.floating, np.integer)):
        return _clean(x.item())
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def explain_gap(pred: float, pred_se: float, held: float, held_se: float, held_pred: Optional[float],
                rule: RuleSpec, mode: str = "trace", selected: bool = True, tolerance: float = TOLERANCE) -> str:
    """Why held-out tau differs from the prediction by more than `tolerance` ('' if it does not).

    held_pred: the prediction from statistics of the held-out prompts themselves, which splits
    the gap into a prompt part (prompt shift, and selection bias: the tree was chosen as the
    best on the calibration prompts) and an on-policy part (decoding with the tree itself).
    """
    if not (math.isfinite(pred) and math.isfinite(held)) or pred <= 0:
        return "no held-out steps were measured"
    gap = held - pred
    if abs(gap) <= tolerance * pred:
        return ""
    parts = [f"held-out tau {held:.3f} vs predicted {pred:.3f} ({gap / pred:+.1%})"]
    se = math.sqrt(sum(v * v for v in (pred_se, held_se) if math.isfinite(v)))
    if se > 0 and abs(gap) <= 2 * se:
        parts.append(f"the gap is within twice the combined standard error ({2 * se:.3f}): too few steps to resolve 5%; "
                     "use more prompts or tokens")
    if held_pred is not None and math.isfinite(held_pred):
        shift, onp = held_pred - pred, held - held_pred
        parts.append(f"{shift:+.3f} comes from the prompts (statistics of the held-out prompts predict {held_pred:.3f}: prompt "
                     f"shift" + (", plus selection bias since the tree was chosen as the best on the calibration prompts)"
                                 if selected else ")"))
        if mode == "trace":
            why = ("the replay is exact for greedy decoding, so this is float noise between the batched statistics pass "
                   "and the engine's own forwards (near-tied logits)") if rule.name == "greedy" else \
                  ("sampling: the engine's own random draws differ from the statistics pass's (same distribution)")
        else:
            why = ("in union rollouts every step starts where the union's longer acceptances ended, so the tree is scored "
                   "at other positions than it decodes from on its own")
            if rule.name != "greedy":
                why += f"; under the {rule.name} rule the outputs themselves also diverge"
        if abs(onp) < 1e-9:
            parts.append("nothing from decoding on-policy (the replay predicted these runs exactly)")
        else:
            parts.append(f"{onp:+.3f} from decoding on-policy ({why})")
    else:
        parts.append("possible causes: prompt shift" + (" and selection bias (the tree was chosen on the calibration prompts)"
                                                        if selected else "")
                     + ("" if mode == "trace" else ", and step-start bias of union rollouts"))
    return "; ".join(parts)


def explain_speed(pred_cost: float, measured_step: float, pred_tps: float, held_tps: float, context: Optional[int],
                  tolerance: float = TOLERANCE) -> str:
    if not (math.isfinite(pred_tps) and math.isfinite(held_tps)) or pred_tps <= 0:
        return ""
    if abs(held_tps - pred_tps) <= tolerance * pred_tps:
        return ""
    s = f"tokens/s {held_tps:.1f} vs predicted {pred_tps:.1f} ({(held_tps - pred_tps) / pred_tps:+.1%})"
    if math.isfinite(pred_cost) and math.isfinite(measured_step):
        s += (f": the latency model predicts {pred_cost * 1e3:.2f} ms per step, the held-out steps took {measured_step * 1e3:.2f} ms"
              f" (the model was measured at a {context}-token context; longer contexts and machine load change step time)")
    return s


def _shard(items: list, state) -> list:
    return items[state.process_index::state.num_processes]


def _gather_stats(local: CalibrationStats, state) -> CalibrationStats:
    from accelerate.utils import gather_object

    parts = gather_object([local.to_json()])
    return CalibrationStats.merge([CalibrationStats.from_json(p) for p in parts])


def _stats_prompt_ids(stats: CalibrationStats) -> list:
    return list(stats.prompts) or list(dict.fromkeys(r.prompt_id for r in stats.records))


def reused_stats(path: str | Path, want: dict, heads_config: dict, spec: RuleSpec, max_rank: int, union: Optional[Tree],
                 calib_ids: list, held: list) -> tuple[CalibrationStats, Optional[CalibrationStats]]:
    """(statistics, held-out statistics or None) of the earlier search in directory `path`, after
    checking that they answer this search: the same model, heads (count and configuration),
    data, rule, dtype, new tokens per prompt, statistics method, ranks / union, and calibration
    prompts; held-out statistics are kept when they cover exactly this search's held-out prompts.
    DataError with the first mismatch otherwise."""
    d = Path(path)
    if not (d / "stats.json").is_file():
        raise DataError(f"--stats {path}: no stats.json there (give an earlier search's output directory)")
    try:
        stats = CalibrationStats.load(d / "stats.json")
    except DataError as e:
        raise DataError(f"--stats {path}: {e}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"--stats {path}: stats.json is not a statistics file ({type(e).__name__}: {e})") from None
    meta = stats.meta
    for k, v in want.items():
        if meta.get(k) != v:
            raise DataError(f"--stats {path}: its statistics are for {k} = {meta.get(k)!r}, this search's is {v!r}")
    if stats.rule.to_json() != spec.to_json():
        raise DataError(f"--stats {path}: its statistics are for the rule {stats.rule.label}, this search's is {spec.label}")
    if stats.mode == "trace" and stats.max_rank != max_rank:
        raise DataError(f"--stats {path}: its statistics cover ranks < {stats.max_rank}, this search asks for < {max_rank}")
    if stats.mode == "rollout" and union is not None and stats.union.paths != union.paths:
        raise DataError(f"--stats {path}: its rollouts used another union tree than --union")
    ids = _stats_prompt_ids(stats)
    if sorted(ids) != sorted(calib_ids):
        raise DataError(f"--stats {path}: its statistics are for {len(ids)} other calibration prompts than this search's "
                        f"{len(calib_ids)} (same --data, --held-out, --seed and --max-prompts?)")
    prov_file = d / "search.json"
    if prov_file.is_file():
        prov = (read_stats_json(prov_file).get("provenance") or {}).get("heads") or {}
        if prov.get("config") is not None and prov["config"] != heads_config:
            raise DataError(f"--stats {path}: its statistics are for other heads (another configuration)")
    held_stats = None
    if held and (d / "held_out_stats.json").is_file():
        hs = CalibrationStats.load(d / "held_out_stats.json")
        ids = _stats_prompt_ids(hs)
        if sorted(ids) == sorted(p.id for p in held[:len(ids)]) and hs.meta.get("data_sha256") == want["data_sha256"]:
            held_stats = hs
    return stats, held_stats


@dataclass
class SearchConfig:
    """What a topology search does (see `run_search`).

    held_out: fraction of prompts held out (0 = no held-out check); at most `max_calibration`
    calibration prompts are used, held-out statistics (replay) of at most `max_held_out` and
    on-policy decoding of the first `max_eval` held-out prompts. stats_method / max_rank /
    batch_size: see `collect_stats` (`union` / `union_nodes`: the union tree of rollouts).
    decompose: also collect statistics of the held-out prompts (always for traces, which are
    cheap), to split a prediction gap into prompt and on-policy effects.
    reuse_stats: an earlier search's output directory whose statistics (and held-out statistics)
    replace the statistics pass -- checked to be for these heads, prompts, rule, dtype and
    length -- so that a search after a kernel or latency change only re-times and re-chooses.
    race_prompts: also race small trees on-policy (step 6) on this many held-out prompts after
    the first `max_eval` (`race_max_nodes` / `race_max_depth` bound the proposals).
    command: the command line recorded in the provenance.
    """

    budgets: Sequence[int] = (4, 8, 16, 32, 64)
    rule: RuleSpec | str | None = None
    max_new_tokens: int = 64
    union: Optional[Tree] = None
    union_nodes: int = 128
    depths: Optional[Sequence[int]] = None
    methods: Sequence[str] = ("greedy", "dp")
    held_out: float = 0.25
    seed: int = 0
    max_calibration: int = 200
    max_eval: int = 6
    max_held_out: int = 48
    decompose: bool = True
    remeasure: bool = False
    latency_repeats: int = 5
    stats_method: str = "auto"
    max_rank: int = 32
    batch_size: int = 16
    reuse_stats: str | Path | None = None
    race_prompts: int = 0
    race_max_nodes: int = 6
    race_max_depth: int = 3
    command: Optional[str] = None

    def check(self) -> "SearchConfig":
        """This config with its budgets sorted; ValueError (one line) for a value out of range."""
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}")
        if not 0.0 <= self.held_out < 1.0:
            raise ValueError(f"held_out must be in [0, 1), got {self.held_out}")
        if not 1 <= self.max_calibration <= MAX_PROMPTS:
            raise ValueError(f"max_calibration must be in 1..{MAX_PROMPTS}")
        if not 1 <= self.max_eval <= MAX_EVAL_PROMPTS:
            raise ValueError(f"max_eval must be in 1..{MAX_EVAL_PROMPTS}")
        if not 1 <= self.max_held_out <= MAX_PROMPTS:
            raise ValueError(f"max_held_out must be in 1..{MAX_PROMPTS}")
        if not 0 <= self.race_prompts <= MAX_EVAL_PROMPTS:
            raise ValueError(f"race_prompts must be in 0..{MAX_EVAL_PROMPTS}")
        if self.race_prompts and self.held_out <= 0:
            raise ValueError("the race decodes held-out prompts: give a held-out fraction > 0")
        if self.race_prompts and not (1 <= self.race_max_nodes <= MAX_BUDGET and self.race_max_depth >= 1):
            raise ValueError(f"race_max_nodes must be in 1..{MAX_BUDGET} and race_max_depth >= 1")
        return dataclasses.replace(self, budgets=tuple(_check_budgets(self.budgets)))


def _prompt_list(prompts: Sequence[Prompt] | PromptSet) -> tuple[list[Prompt], dict]:
    """The prompts as a list, and their provenance (source, sha256, format, rows skipped)."""
    data = {"source": None, "sha256": None, "skipped": 0}
    if isinstance(prompts, PromptSet):
        data = {"source": prompts.source, "sha256": prompts.sha256, "format": prompts.format, "skipped": len(prompts.skipped)}
        prompts = prompts.prompts
    prompts = list(prompts)
    if not prompts:
        raise DataError("no prompts")
    if not all(isinstance(p, Prompt) for p in prompts):
        raise ValueError("run_search needs Prompt objects (load them with entmtp.data.load_prompts)")
    if data["sha256"] is None:
        data["sha256"] = hashlib.sha256(json.dumps([p.messages for p in prompts], sort_keys=True).encode()).hexdigest()
    return prompts, data


def _split(prompts: list[Prompt], cfg: SearchConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(calibration, held-out) prompts: a seeded split, each side cut to what the search uses."""
    calib, held = split_prompts(prompts, cfg.held_out, cfg.seed) if cfg.held_out > 0 else (prompts, [])
    calib, held = calib[:cfg.max_calibration], held[:max(cfg.max_eval + cfg.race_prompts, cfg.max_held_out)]
    if cfg.race_prompts and len(held) <= cfg.max_eval:
        raise DataError(f"the race needs held-out prompts beyond the {cfg.max_eval} of the on-policy check, but the split "
                        f"holds {len(held)}: give more prompts, a larger held-out fraction or fewer eval prompts")
    if cfg.held_out > 0 and not held:
        raise DataError("the held-out set is empty: give at least two distinct prompts or --held-out 0")
    return calib, held


def _typical_context(engine, calib: list[Prompt], max_new_tokens: int) -> Optional[list[int]]:
    """Token ids of a typical decoding context for the latency model: the median calibration
    prompt plus half a generation (None without a tokenizer)."""
    if not calib or engine.tokenizer is None:
        return None
    enc = sorted(encode_prompts(engine, calib[:64]), key=lambda x: len(x[1]))
    mid = enc[len(enc) // 2][1]
    return mid + (mid * (1 + max_new_tokens // max(1, len(mid))))[: max_new_tokens // 2]


def _statistics(engine, heads: str, cfg: SearchConfig, spec, method: str, union, calib: list, held: list, meta: dict,
                state, progress: Progress):
    """The calibration prompts' acceptance statistics and the held-out ones (None when not
    needed): collected here, sharded over `state`'s processes and gathered, or reused from
    `cfg.reuse_stats`. None on processes other than the main one."""
    distributed = state is not None and getattr(state, "num_processes", 1) > 1
    runner = engine.runners[heads]
    K, max_new_tokens, reuse_stats = runner.config.num_heads, cfg.max_new_tokens, cfg.reuse_stats
    mine = _shard(calib, state) if distributed else calib
    kw = dict(method=method, max_rank=cfg.max_rank, batch_size=cfg.batch_size)
    held_stats = None
    if reuse_stats is not None:
        if distributed:
            raise ValueError("reused statistics need no statistics pass: run the search in one process")
        want = {"model": meta["model"], "data_sha256": meta["data_sha256"], "num_heads": K,
                "max_new_tokens": max_new_tokens, "dtype": str(engine.dtype).removeprefix("torch."), "method": method}
        stats, held_stats = reused_stats(reuse_stats, want, runner.config.to_dict(), spec, cfg.max_rank, union,
                                         [p.id for p in calib], held)
    else:
        stats = collect_stats(engine, heads, mine, union, spec, max_new_tokens, progress=progress, meta=meta, **kw)
    if reuse_stats is None and held and (cfg.decompose or method == "trace"):
        # traces are cheap: replay on many held-out prompts; rollouts: only the evaluated ones
        hp = held[:cfg.max_held_out] if method == "trace" else held[:cfg.max_eval]
        mine_h = _shard(hp, state) if distributed else hp
        held_stats = collect_stats(engine, heads, mine_h, union, spec, max_new_tokens,
                                   progress=lambda ph, d, t: progress("held-out statistics", d, t), meta=meta,
                                   signals=False, **kw)
    if distributed:
        stats = _gather_stats(stats, state)
        if held_stats is not None:
            held_stats = _gather_stats(held_stats, state)
        if not state.is_main_process:
            return None
    return stats, held_stats


def run_search(engine, heads: str, prompts: Sequence[Prompt] | PromptSet, config: SearchConfig | Sequence[int] | None = None,
               *, latency: Optional[LatencyModel] = None, progress: Optional[Progress] = None, state=None,
               **fields) -> Optional[SearchReport]:
    """The whole topology search (see the module docstring).

    prompts: `Prompt`s or a `PromptSet` (its source and sha256 go into the provenance).
    config: a `SearchConfig`, or just the node budgets; `fields` override its fields.
    latency: a latency model to use instead of the cached or measured one.
    state: an `accelerate.PartialState` with several processes shards the statistics passes;
    then only the main process returns the report (the others return None).
    """
    if config is None or not isinstance(config, SearchConfig):
        config = SearchConfig(**({"budgets": tuple(config)} if config is not None else {}))
    cfg = dataclasses.replace(config, **fields).check()
    t_start = time.perf_counter()
    budgets = list(cfg.budgets)
    spec = as_rule_spec(cfg.rule)
    progress = progress or _noop
    if heads not in engine.runners:
        raise ValueError(f"no heads named {heads!r} loaded (have: {', '.join(engine.runners) or 'none'})")
    max_new_tokens, held_out, seed, union = cfg.max_new_tokens, cfg.held_out, cfg.seed, cfg.union
    max_eval, race_prompts, reuse_stats = cfg.max_eval, cfg.race_prompts, cfg.reuse_stats
    prompts, data = _prompt_list(prompts)
    calib, held = _split(prompts, cfg)
    runner = engine.runners[heads]
    K = runner.config.num_heads
    ref = resolve_tree(REFERENCE_TREE).truncated(K)
    ref = Tree(ref.paths, REFERENCE_TREE if K >= 4 else f"{REFERENCE_TREE}@d{K}")
    method = cfg.stats_method if cfg.stats_method != "auto" else ("rollout" if spec.name == "typical" else "trace")
    if method == "rollout":
        if union is None:
            union = union_tree(K, cfg.union_nodes, include=[ref])
        if union.depth > K:
            raise TreeError(f"the union tree has depth {union.depth} but the heads draft {K} levels")
    model_info = describe_model(engine.model)
    meta = {"model": model_info.get("name"), "data_sha256": data["sha256"]}
    timings = {}

    # 1. statistics (sharded over the processes; only the main one goes on)
    t0 = time.perf_counter()
    got = _statistics(engine, heads, cfg, spec, method, union, calib, held, meta, state, progress)
    if got is None:
        return None
    stats, held_stats = got
    timings["statistics_s"] = time.perf_counter() - t0

    # 2. latency
    t0 = time.perf_counter()
    if latency is None:
        ctx = _typical_context(engine, calib, max_new_tokens)
        latency = load_or_measure_latency(engine, heads, max_nodes=max(max(budgets), ref.n_nodes), remeasure=cfg.remeasure,
                                          repeats=cfg.latency_repeats, progress=progress, context_ids=ctx)
    timings["latency_s"] = time.perf_counter() - t0

    # 3. search
    t0 = time.perf_counter()
    cands = search_trees(stats, budgets, latency, depths=cfg.depths, methods=cfg.methods, references=[ref], progress=progress)
    front = frontier(cands, budgets)
    timings["search_s"] = time.perf_counter() - t0

    provenance = {"model": model_info, "heads": {"name": heads, "label": runner.label, "config": runner.config.to_dict()},
                  "data": {**data, "n_prompts": len(prompts), "n_calibration": len(calib), "n_held_out": len(held),
                           "calibration_ids": [p.id for p in calib], "held_out_ids": [p.id for p in held]},
                  "rule": spec.to_json(), "rule_label": spec.label, "dtype": str(engine.dtype).removeprefix("torch."),
                  "device": str(engine.device), "machine": machine_info(), "seed": seed, "held_out_fraction": held_out,
                  "max_new_tokens": max_new_tokens, "methods": list(cfg.methods), "command": cfg.command,
                  "processes": getattr(state, "num_processes", 1) if state is not None else 1,
                  "reused_statistics": str(reuse_stats) if reuse_stats is not None else None,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    report = SearchReport(provenance, budgets, stats, latency, cands, front, None, held_stats, timings)
    report.fit_bank()

    # 4. held-out, on-policy
    if held:
        t0 = time.perf_counter()
        report.evaluation = _held_out(report, engine, heads, held, spec, max_new_tokens, max_eval, progress)
        timings["held_out_s"] = time.perf_counter() - t0

    # 6. race, on-policy, on further held-out prompts
    if race_prompts:
        t0 = time.perf_counter()
        pool = held[max_eval:max_eval + race_prompts]
        if len(pool) < race_prompts:
            report.warnings.append(f"the race decoded {len(pool)} held-out prompts, not the {race_prompts} asked for: "
                                   f"the held-out split has no more beyond the {max_eval} of the on-policy check")
        report.race = _race(report, engine, heads, pool, spec, max_new_tokens, cfg.race_max_nodes, cfg.race_max_depth, progress)
        if report.race["identical_outputs"] is False:
            report.warnings.append("greedy outputs of a raced tree differ from plain decoding on some race prompt "
                                   "(float noise on near-ties, or a bug)")
        timings["race_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    report.warnings += _warnings(report)
    return report


def _held_out(report: SearchReport, engine, heads, held, spec, max_new_tokens, max_eval, progress) -> dict:
    """Every chosen tree (and the reference): its prediction replayed on the held-out
    statistics, and -- for the trees chosen by tokens/s and the reference -- its own decoding
    of the first `max_eval` held-out prompts (interleaved, with plain decoding)."""
    chosen = report.chosen()
    cands: list[Candidate] = []
    for r in chosen:
        if all(r["candidate"] is not c for c in cands):
            cands.append(r["candidate"])
    ref = report.reference()
    if ref is not None and all(ref is not c for c in cands):
        cands.append(ref)
    names = {}
    for c in cands:
        roles = [f"b{r['budget']}" + ("" if r["role"] == "tokens_per_s" else "-tau") for r in chosen if r["candidate"] is c]
        names[c.id] = "/".join(roles) if roles else c.tree.name or c.id
    run_on = [c for c in cands if c is ref or any(r["candidate"] is c and r["role"] == "tokens_per_s" for r in chosen)]
    eval_prompts = held[:max_eval]
    measured = evaluate_trees(engine, heads, [Tree(c.tree.paths, names[c.id]) for c in run_on], eval_prompts, spec,
                              max_new_tokens, progress=progress, baseline=True)
    base = measured[-1]
    by_id = {c.id: m for c, m in zip(run_on, measured)}
    hs = report.held_out_stats
    hs_eval = hs.subset([p.id for p in eval_prompts]) if hs is not None else None
    mode = report.stats.mode
    ctx = (report.latency.meta.get("context_tokens") if report.latency else None)
    rows = []
    for c in cands:
        m = by_id.get(c.id)
        replay_all = hs.predict_tau(c.tree) if hs is not None and hs.records else None
        replay_eval = hs_eval.predict_tau(c.tree) if hs_eval is not None and hs_eval.records else None
        held_tau = m.tau if m is not None else replay_all
        basis = "on-policy" if m is not None else "held-out replay"
        tau_err = (held_tau - c.predicted_tau) / c.predicted_tau if held_tau is not None and math.isfinite(held_tau) else float("nan")
        expl = []
        if held_tau is not None:
            expl.append(explain_gap(c.predicted_tau, c.tau_stderr, held_tau, m.tau_stderr if m else float("nan"),
                                    replay_eval if m is not None else None, spec, mode, selected=c is not ref))
        if m is not None:
            expl.append(explain_speed(c.step_cost_s, m.mean_step_s, c.predicted_tokens_per_s, m.tokens_per_s, ctx))
        row = {"name": names[c.id], "id": c.id, "n_nodes": c.n_nodes, "depth": c.depth, "methods": c.methods,
               "predicted_tau": c.predicted_tau, "predicted_tau_stderr": c.tau_stderr,
               "held_out_replay_tau": replay_all, "held_out_replay_prompts": len(hs.prompt_ids) if hs is not None else 0,
               "held_out_predicted_tau": replay_eval, "held_out_tau": m.tau if m else None,
               "held_out_tau_stderr": m.tau_stderr if m else None, "tau_rel_err": tau_err, "tolerance_basis": basis,
               "predicted_tokens_per_s": c.predicted_tokens_per_s, "held_out_tokens_per_s": m.tokens_per_s if m else None,
               "predicted_step_s": c.step_cost_s, "held_out_step_s": m.mean_step_s if m else None,
               "predicted_speedup": c.predicted_speedup,
               "held_out_speedup": (m.tokens_per_s / base.tokens_per_s if m and base.tokens_per_s > 0 else None),
               "held_out_engine_tau": m.engine_tau if m else None, "held_out_e2e_tokens_per_s": m.e2e_tokens_per_s if m else None,
               "held_out_steps": m.n_steps if m else None,
               "within_tolerance": bool(math.isfinite(tau_err) and abs(tau_err) <= TOLERANCE),
               "explanation": " | ".join(e for e in expl if e), "identical_to_baseline": m.identical_to_baseline if m else None}
        if m is not None and math.isfinite(c.predicted_tokens_per_s) and c.predicted_tokens_per_s > 0:
            row["tokens_per_s_rel_err"] = (m.tokens_per_s - c.predicted_tokens_per_s) / c.predicted_tokens_per_s
        else:
            row["tokens_per_s_rel_err"] = None
        rows.append(row)
    ident = [m.identical_to_baseline for m in measured[:-1]]
    return {"n_prompts": len(eval_prompts), "prompt_ids": [p.id for p in eval_prompts],
            "n_replay_prompts": len(hs.prompt_ids) if hs is not None else 0, "tolerance": TOLERANCE, "comparisons": rows,
            "measured": [m.to_json() for m in measured], "baseline": base.to_json(),
            "identical_outputs": all(ident) if spec.name == "greedy" and ident else None}


def _race(report: SearchReport, engine, heads, prompts, spec, max_new_tokens, max_nodes, max_depth, progress) -> dict:
    """Step 6: the race proposals plus the trees chosen by tokens/s (deduplicated), raced."""
    names: dict[tuple, list[str]] = {}
    cands: dict[tuple, Candidate] = {}
    for c in race_proposals(report.stats, max_nodes, max_depth):
        cands[c.tree.key()] = c
        names[c.tree.key()] = [f"n{c.n_nodes}-d{c.depth}"]
    for r in report.chosen():
        if r["role"] == "tokens_per_s":
            c = r["candidate"]
            cands.setdefault(c.tree.key(), c)
            names.setdefault(c.tree.key(), []).append(f"b{r['budget']}")
    trees = [Tree(c.tree.paths, "/".join(names[k])) for k, c in cands.items()]
    out = race_trees(engine, heads, trees, prompts, spec, max_new_tokens, progress)
    predicted = {c.id: c.predicted_tau for c in cands.values()}
    for row in out["results"]:
        row["predicted_tau"] = predicted.get(row["id"])
    return out


def _warnings(report: SearchReport) -> list[str]:
    w = []
    st = report.stats
    if st.n_steps < 200:
        w.append(f"only {st.n_steps} calibration {'positions' if st.mode == 'trace' else 'steps'} were recorded: "
                 "predictions are noisy (use more prompts or tokens)")
    for r in report.chosen():
        c = r["candidate"]
        if c.edge_nodes:  # either role: a 64-node tau tree of weak heads can use every covered rank
            w.append(f"the budget-{r['budget']} {'tau ' if r['role'] == 'tau' else ''}tree has {c.edge_nodes} nodes on the edge of what the statistics cover: "
                     + ("a larger --max-rank" if st.mode == "trace" else "a wider union (--union-nodes)")
                     + " might find a better tree")
            break
    ev = report.evaluation
    if ev:
        bad = [r for r in ev["comparisons"] if not r["within_tolerance"]]
        if bad:
            w.append(f"{len(bad)} of {len(ev['comparisons'])} trees: held-out tau is not within 5% of the prediction "
                     "(explanations in the held-out table)")
        if ev.get("identical_outputs") is False:
            w.append("greedy outputs differ from plain decoding on some held-out prompt (float noise on near-ties, "
                     "or a bug): check with `entmtp generate --json`")
    return w


# ---- helpers of the command line ----------------------------------------------------------------

class ProgressBars:
    """tqdm bars per phase, driven by progress(phase, done, total) callbacks."""

    def __init__(self, enabled: bool, position: int = 0):
        self.enabled, self.position, self.bars = enabled, position, {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        bar = self.bars.get(phase)
        if bar is None:
            bar = self.bars[phase] = tqdm(total=total, desc=phase, file=sys.stderr, position=self.position, leave=True,
                                          dynamic_ncols=True)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()


def load_data(spec: str) -> PromptSet:
    """Prompts from a file (any format the loader reads) or a bundled set by name."""
    p = Path(spec)
    if p.exists() or os.sep in spec or "." in p.name:
        return load_prompts(p)
    return load_prompts(bundled_prompts(spec))


def accelerate_state(device: str):
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=str(device).startswith("cpu"))


def end_distributed() -> None:
    """Leave the process group once the statistics are gathered (only the main process
    goes on to measure latency and decode the held-out prompts)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # every rank reaches here before any tears the group down: a gloo peer that vanishes
        # while another still talks to it aborts that process
        dist.barrier()
        dist.destroy_process_group()


def summary_table(report: SearchReport) -> str:
    """The chosen trees (by tokens/s) and the reference: predicted vs held-out, one line each."""
    ho = report._held_out_rows()
    head = (f"{'budget':>6} {'nodes':>5} {'depth':>5} {'pred tau':>8} {'held tau':>8} {'pred tok/s':>10} {'held tok/s':>10} "
            f"{'pred x':>6} {'held x':>6}  tree")
    lines = [head]

    def line(label, c, where):
        h = ho.get(c.id, {})
        held_tau = h.get("held_out_tau") if h.get("held_out_tau") is not None else h.get("held_out_replay_tau")
        lines.append(f"{label:>6} {c.n_nodes:>5} {c.depth:>5} {c.predicted_tau:>8.3f} {_fmt(held_tau, 3):>8} "
                     f"{_fmt(c.predicted_tokens_per_s, 1):>10} {_fmt(h.get('held_out_tokens_per_s'), 1):>10} "
                     f"{_fmt(c.predicted_speedup, 2):>5}x {_fmt(h.get('held_out_speedup'), 2):>5}x  {where}")

    for r in report.chosen():
        if r["role"] == "tokens_per_s":
            line(str(r["budget"]), r["candidate"], f"trees/{report._tree_file(r)}")
    ref = report.reference()
    if ref is not None:
        line("ref", ref, ref.tree.name)
    if report.race and report.race["results"]:
        w = report.race["results"][0]
        lines.append(f"{'race':>6} {w['n_nodes']:>5} {w['depth']:>5} {_fmt(w.get('predicted_tau'), 3):>8} {_fmt(w['tau'], 3):>8} "
                     f"{'':>10} {_fmt(w['tokens_per_s'], 1):>10} {'':>6} {_fmt(w['speedup'], 2):>5}x  "
                     f"trees/{report.race_tree_file()} (fastest of {len(report.race['results'])} on "
                     f"{report.race['n_prompts']} further held-out prompts)")
    return "\n".join(lines)


def load_stats_any(path: str | Path) -> CalibrationStats:
    """Statistics from a search output directory, its search.json, or a stats.json."""
    p = Path(path)
    if p.is_dir():
        p = p / "stats.json"
    d = read_stats_json(p)
    if isinstance(d, dict) and d.get("format") == SEARCH_FORMAT:
        f = (d.get("stats") or {}).get("file") or "stats.json"
        return CalibrationStats.load(p.parent / f)
    return CalibrationStats.from_json(d, p.name)


def score(engine, heads: str, tree: Tree, prompts: Sequence[Any], stats: Optional[CalibrationStats] = None, *,
          rule: RuleSpec | str | None = None, max_new_tokens: int = 64, union_nodes: int = 128,
          latency: Optional[LatencyModel] = None, remeasure: bool = False, latency_repeats: int = 5,
          stats_method: str = "auto", max_rank: int = 32, batch_size: int = 16,
          progress: Optional[Progress] = None) -> dict:
    """Predicted (from `stats`, or from a statistics pass over `prompts` -- a rollout's union
    then contains the tree) and measured on-policy tau and tokens/s of one tree on `prompts`."""
    K = engine.runners[heads].config.num_heads if heads in engine.runners else 0
    if heads not in engine.runners:
        raise ValueError(f"no heads named {heads!r} loaded")
    if tree.n_nodes == 0:
        raise TreeError("the tree has no draft nodes")
    if tree.depth > K:
        raise TreeError(f"tree depth {tree.depth} exceeds the {K} draft heads")
    if stats is None:
        spec = as_rule_spec(rule)
        union = union_tree(K, union_nodes, include=[tree, resolve_tree(REFERENCE_TREE)])
        stats = collect_stats(engine, heads, prompts, union, spec, max_new_tokens, progress=progress, method=stats_method,
                              max_rank=max(max_rank, max(p[-1] for p in tree.paths) + 1), batch_size=batch_size)
        source = "statistics pass over the same prompts (in-sample)"
    else:
        spec = stats.rule
        source = "given statistics"
    notes = []
    label = engine.runners[heads].label
    if stats.meta.get("heads") not in (None, label) or stats.depth != K:
        notes.append(f"the statistics are for {stats.meta.get('heads')} heads with {stats.depth} levels, these are {label} "
                     f"with {K}: the prediction is for other heads")
    if rule is not None and stats is not None and source == "given statistics" and as_rule_spec(rule) != spec:
        notes.append(f"using the statistics' rule ({spec.label})")
    if latency is None:
        latency = load_or_measure_latency(engine, heads, max_nodes=max(tree.n_nodes, 1), remeasure=remeasure,
                                          repeats=latency_repeats, progress=progress)
    c = score_tree(stats, tree, latency)
    m, base = evaluate_trees(engine, heads, [tree], prompts, spec, max_new_tokens, progress=progress, baseline=True)
    ctx = latency.meta.get("context_tokens")
    return _clean({
        "tree": {"name": tree.name, "n_nodes": tree.n_nodes, "depth": tree.depth, "depth_counts": tree.depth_counts,
                 "paths": [list(p) for p in tree.paths]},
        "rule": spec.label, "statistics": source, "statistics_steps": stats.n_steps,
        "predicted": {"tau": c.predicted_tau, "tau_stderr": c.tau_stderr, "step_s": c.step_cost_s,
                      "tokens_per_s": c.predicted_tokens_per_s, "speedup": c.predicted_speedup,
                      "nodes_not_covered": c.unsupported_nodes},
        "measured": m.to_json(), "baseline": base.to_json(),
        "measured_speedup": m.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else None,
        "tau_rel_err": (m.tau - c.predicted_tau) / c.predicted_tau,
        "explanation": " | ".join(e for e in (explain_gap(c.predicted_tau, c.tau_stderr, m.tau, m.tau_stderr, None, spec, stats.mode,
                                                          selected=False),
                                              explain_speed(c.step_cost_s, m.mean_step_s, c.predicted_tokens_per_s, m.tokens_per_s, ctx)) if e),
        "n_prompts": len(prompts), "notes": notes,
    })


def score_lines(res: dict, tree_name: str) -> list[str]:
    """`score`'s result as the lines `entmtp score` prints."""
    p, m, b = res["predicted"], res["measured"], res["baseline"]
    t = res["tree"]
    lines = [f"tree {t['name'] or tree_name}: {t['n_nodes']} nodes, depth {t['depth']} {t['depth_counts']}; "
             f"rule {res['rule']}; {res['n_prompts']} prompts",
             f"  predicted ({res['statistics']}, {res['statistics_steps']} records): tau {p['tau']:.3f} ± {_fmt(p.get('tau_stderr'), 3)}, "
             f"{_fmt(p.get('tokens_per_s'), 1)} tokens/s, speedup {_fmt(p.get('speedup'), 2)}x"
             + (f" ({p['nodes_not_covered']} nodes the statistics do not cover: a lower bound)" if p.get("nodes_not_covered") else ""),
             f"  measured on-policy: tau {_fmt(m.get('tau'), 3)} ± {_fmt(m.get('tau_stderr'), 3)}, {_fmt(m.get('tokens_per_s'), 1)} tokens/s "
             f"(plain decoding {_fmt(b.get('tokens_per_s'), 1)}), speedup {_fmt(res.get('measured_speedup'), 2)}x"]
    if res.get("explanation"):
        lines.append(f"  why they differ: {res['explanation']}")
    lines += [f"  note: {n}" for n in res.get("notes") or []]
    return lines


__all__ = ["greedy_trees", "optimal_subtrees", "positional_value_fn", "positional_values", "dp_support", "tree_id",
           "Candidate", "score_tree", "price_candidates", "search_trees", "frontier", "pareto", "Measured", "evaluate_trees", "SearchConfig",
           "SearchReport", "run_search", "score", "score_lines", "load_stats_any", "explain_gap", "load_data",
           "ProgressBars", "accelerate_state", "end_distributed", "summary_table"]
