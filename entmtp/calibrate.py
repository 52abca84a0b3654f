"""The topology lab's measurements: one statistics pass over calibration prompts, and the
per-step latency model.

Statistics pass (`collect_stats`), two methods; either way every candidate tree is scored
from the records alone -- no decoding pass per candidate:

* "trace" (greedy and lossless sampling rules, the default for them): every prompt is
  continued once (batched) and, at every generated position t, the ranks of the true next
  tokens under the heads fed with the true prefix are recorded. If a step started at t, a
  tree T would accept exactly the longest prefix of that rank chain that lies in T -- the
  continuation does not depend on the tree (greedy: the base's argmax; sampling: tree
  speculative sampling with point-mass drafts emits a base sample and accepts its longest
  drafted prefix). So decoding with *any* tree is replayed exactly (`simulate`): the same
  steps, stops and accepted lengths the engine produces, with no step-start bias.
* "rollout" (any rule; needed for typical acceptance, whose accepted path changes the
  output): every prompt is decoded with a wide *union* tree and, per step, the set of union
  nodes the rule accepts is recorded (typical: every node whose token passes the threshold
  along an accepted path). A subtree T's accepted length at a step = max depth of
  (accepted set ∩ T), both prefix-closed. Steps start where the union's acceptances ended,
  which biases predictions for smaller trees (the held-out check measures it).

Every record (`StepRecord`) also carries the scheduler signals of a step starting there
(root entropy / probability, the first head's entropy / top-1 probability), for the
entropy-aware scheduler's tables.

Latency model (`measure_latency`): one decoding step's draft + verify + bookkeeping time,
measured with the real engine and heads for trees of every size up to 16 nodes (then a coarse
grid; `size_grid`) and every depth (round-robin, each timed step warm, a new prefill every
`LATENCY_WINDOW` tokens), cached per model, device, dtype and heads (`latency_cache_path`).
`LatencyModel.cost(n, depth)` interpolates it.

Library API (used by `entmtp.search`, the CLI and the app)::

    stats = collect_stats(engine, "hydra", prompts, rule=RuleSpec("greedy"), max_new_tokens=64)
    stats.predict_tau(tree)                  # tokens per verification step decoding with `tree`
    stats.save("stats.json"); CalibrationStats.load("stats.json"); CalibrationStats.merge([a, b])
    latency = load_or_measure_latency(engine, "hydra", max_nodes=64)
    latency.cost(tree.n_nodes, tree.depth)   # seconds per step
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .acceptance import AcceptanceRule, Sampling, TypicalRule, make_rule, warp
from .data import DataError, Prompt, render_prompt
from .decoding import DecodeConfig, Engine, Prefill
from .hardware import cpu_isa, hardware_class
from .models import describe_model
from .paths import cache_dir, write_json_atomic
from .scheduler import Decision, Scheduler, StepSignals
from .tuning import config_hash
from .trees import Path_, Tree, TreeError, resolve_tree
from .verify import base_features, last_positions, left_padded

STATS_FORMAT = "entmtp-calibration/1"
LATENCY_FORMAT = "entmtp-latency/1"
# How steps are timed (bump when `measure_latency` changes what it measures; older caches are
# measured again): 2 = warm step before each timed one, context window, dense size grid;
# 3 = plain steps interleaved with the rounds, fastest of the repeats; 4 = each tree as a ratio to
# the plain steps timed around its generation, the median of the rounds; 5 = every generation of a
# measurement starts from one prefill of the context (`context_prefill`).
LATENCY_PROTOCOL = 5

# Bounds on the expensive parameters (the app passes user input straight through).
MAX_UNION_NODES = 512
MAX_RANK = 32
MAX_NEW_TOKENS = 2048
MAX_PROMPTS = 20000
MAX_BUDGET = 256

Progress = Callable[[str, int, int], Any]  # (phase, done, total)


def _noop(*_a, **_k) -> None:
    return None


# ---- acceptance rule specification ----------------------------------------------------------

@dataclass(frozen=True)
class RuleSpec:
    """Which acceptance rule the statistics are for (recorded in every output)."""

    name: str = "greedy"  # greedy | typical | sampling
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    typical_epsilon: float = 0.09
    typical_alpha: Optional[float] = 0.3
    seed: int = 0  # per-prompt seeds derive from it (stochastic rules)

    def __post_init__(self):
        if self.name not in ("greedy", "typical", "sampling"):
            raise ValueError(f"unknown acceptance rule {self.name!r} (greedy, typical, sampling)")
        Sampling(self.temperature, self.top_p, self.top_k)  # validates
        if self.name == "greedy" and self.temperature != 0:
            raise ValueError("the greedy rule needs temperature 0 (use --rule sampling or typical)")
        if self.name == "sampling" and self.temperature <= 0:
            raise ValueError("the sampling rule needs temperature > 0")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    def make(self) -> AcceptanceRule:
        return make_rule(self.name, self.sampling, self.typical_epsilon, self.typical_alpha)

    def decode_config(self, max_new_tokens: int, seed: Optional[int] = None, **kw) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=max_new_tokens, sampling=self.sampling, rule=self.name,
                            typical_epsilon=self.typical_epsilon, typical_alpha=self.typical_alpha,
                            seed=seed, **kw)

    def prompt_seed(self, prompt_id: str) -> int:
        """A seed per prompt that does not depend on sharding or order."""
        h = hashlib.sha256(f"{self.seed}\x00{prompt_id}".encode()).digest()
        return int.from_bytes(h[:4], "big")

    @property
    def label(self) -> str:
        if self.name == "greedy":
            return "greedy"
        s = f"{self.name} (T={self.temperature:g}"
        if self.name == "typical":
            s += f", epsilon={self.typical_epsilon:g}, alpha={self.typical_alpha if self.typical_alpha is not None else 'sqrt(eps)'}"
        return s + ")"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: Any) -> "RuleSpec":
        if isinstance(d, str):
            return RuleSpec(d)
        if not isinstance(d, dict):
            raise DataError("rule must be an object")
        keys = {k: d[k] for k in RuleSpec.__dataclass_fields__ if k in d}
        return RuleSpec(**keys)


def as_rule_spec(rule: "RuleSpec | str | None") -> RuleSpec:
    if rule is None:
        return RuleSpec()
    if isinstance(rule, RuleSpec):
        return rule
    if isinstance(rule, str):
        return RuleSpec(rule, temperature=0.7 if rule == "sampling" else 0.0)
    raise ValueError(f"rule must be a RuleSpec or a rule name, got {type(rule).__name__}")


# ---- union tree -----------------------------------------------------------------------------

# A prior conditional acceptance rate by rank (depth discount 0.9 per level), shaped like the
# per-head top-k accuracies Medusa reports; used only to choose which nodes the union (and
# the latency model's representative trees) contain -- never to score.
PRIOR_RANK_RATES = (0.6, 0.12, 0.06, 0.04, 0.03, 0.025, 0.02, 0.017, 0.015, 0.013)
PRIOR_DEPTH_DISCOUNT = 0.9


def prior_value(path: Sequence[int]) -> float:
    v = 1.0
    for d, r in enumerate(path):
        base = PRIOR_RANK_RATES[r] if r < len(PRIOR_RANK_RATES) else PRIOR_RANK_RATES[-1] * len(PRIOR_RANK_RATES) / (r + 1)
        v *= base * PRIOR_DEPTH_DISCOUNT ** d
    return v


def expand_by_value(value: Callable[[Path_], float], n_nodes: int, max_depth: int, max_rank: int = 10,
                    start: Sequence[Sequence[int]] = ()) -> list[Path_]:
    """Best-first growth from the root: repeatedly add the frontier node of highest `value`.

    The frontier of a tree is every child (rank < max_rank, depth <= max_depth) of its nodes
    (and of the root). `start` nodes are included first (they must be prefix-closed).
    Ties: shallower, then lexicographically smaller. Returns canonical paths.
    """
    chosen: set[Path_] = {tuple(p) for p in start}
    heap: list = []

    def push_children(p: Path_):
        if len(p) >= max_depth:
            return
        for r in range(max_rank):
            c = p + (r,)
            if c not in chosen:
                heapq.heappush(heap, (-value(c), len(c), c))

    push_children(())
    for p in sorted(chosen, key=lambda q: (len(q), q)):
        push_children(p)
    while len(chosen) < n_nodes and heap:
        _, _, c = heapq.heappop(heap)
        if c in chosen:
            continue
        chosen.add(c)
        push_children(c)
    return sorted(chosen, key=lambda q: (len(q), q))


def union_tree(num_heads: int, max_nodes: int = 128, max_rank: int = 10,
               include: Sequence[Tree] = (), name: str = "") -> Tree:
    """The statistics pass's wide tree: the `max_nodes` nodes of highest prior value up to
    depth `num_heads` with ranks < `max_rank`, plus every node of the `include` trees
    (truncated to `num_heads`), so that reference trees are fully supported.
    """
    if not 1 <= num_heads <= 16:
        raise ValueError(f"num_heads must be in 1..16, got {num_heads}")
    if not 1 <= max_nodes <= MAX_UNION_NODES:
        raise ValueError(f"union size must be in 1..{MAX_UNION_NODES}, got {max_nodes}")
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"max rank must be in 1..{MAX_RANK}, got {max_rank}")
    paths = set(expand_by_value(prior_value, max_nodes, num_heads, max_rank))
    for t in include:
        paths |= set(t.truncated(num_heads).paths)
    return Tree.from_paths(paths, name or f"union_{len(paths)}_d{num_heads}")


# ---- records --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord:
    """What the rule accepts if a decoding step starts here.

    accepted_paths: the accepted rank paths (prefix-closed, canonical order; empty = only the
    root). In "trace" statistics there is one record per generated position (every position is
    a potential step start; `step` = `position` = tokens generated before it) and the accepted
    set is the chain of ranks of the true continuation under the heads. In "rollout"
    statistics there is one record per step of a union-tree rollout (`step` = step index).
    Signals (nan when unknown): root_entropy / root_prob of the base distribution that chose
    this step's root, draft_entropy / draft_top1 of the first draft head at the root.
    """

    prompt_id: str
    step: int
    accepted_paths: tuple[Path_, ...]
    root_entropy: float = float("nan")
    root_prob: float = float("nan")
    draft_entropy: float = float("nan")
    draft_top1: float = float("nan")
    position: int = 0

    @property
    def accept_length(self) -> int:
        return max((len(p) for p in self.accepted_paths), default=0)


def _f(x) -> Optional[float]:
    return round(float(x), 6) if x is not None and math.isfinite(float(x)) else None


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def _canon(paths) -> tuple[Path_, ...]:
    return tuple(sorted({tuple(p) for p in paths}, key=lambda q: (len(q), q)))


def read_stats_json(p: Path) -> Any:
    """Parse a statistics / search JSON file; failures are one-line DataErrors."""
    if not p.is_file():
        raise DataError(f"statistics file not found: {p}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{p.name}: not a JSON file ({type(e).__name__})") from None


@dataclass
class CalibrationStats:
    """Acceptance records of one statistics pass, and the scores of any tree computed from them.

    mode "trace" (greedy and sampling rules): one record per generated position; every rank
    path with ranks < `max_rank` and length <= `depth` is covered, and `simulate` replays
    decoding with any tree exactly (`prompts` holds each prompt's positions and EOS offset).
    mode "rollout" (any rule, needed for typical acceptance): one record per step of a rollout
    with the `union` tree; only the union's nodes are covered.

    Treat as immutable once built (indexes are cached). `meta`: provenance (model, heads, data
    sha256, max_new_tokens, eos ids, ...).
    """

    records: list[StepRecord]
    rule: RuleSpec = field(default_factory=RuleSpec)
    mode: str = "rollout"
    depth: int = 0
    max_rank: int = 0
    union: Optional[Tree] = None
    prompts: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.mode not in ("trace", "rollout"):
            raise DataError(f"unknown statistics mode {self.mode!r}")
        if self.mode == "rollout":
            if self.union is None:
                raise DataError("rollout statistics need their union tree")
            self.depth = self.depth or self.union.depth
            self.max_rank = self.max_rank or (max((p[-1] for p in self.union.paths), default=0) + 1)
        for r in self.records:
            if not self.covers_all(r.accepted_paths):
                bad = next(p for p in r.accepted_paths if not self.covers(p))
                raise DataError(f"record {r.prompt_id}#{r.step}: accepted path {list(bad)} is outside what the statistics cover")

    @staticmethod
    def rollout(union: Tree, rule: RuleSpec, records: list[StepRecord], meta: Optional[dict] = None) -> "CalibrationStats":
        return CalibrationStats(records, rule, "rollout", union.depth, 0, union, {}, dict(meta or {}))

    # ---- coverage and indexes ---------------------------------------------------------------
    def covers(self, path: Sequence[int]) -> bool:
        """Whether the statistics know if `path` is accepted (else it counts as never accepted)."""
        p = tuple(path)
        if self.mode == "rollout":
            return p in self.union.index
        return 1 <= len(p) <= self.depth and all(0 <= r < self.max_rank for r in p)

    def covers_all(self, paths) -> bool:
        return all(self.covers(p) for p in paths)

    @property
    def n_steps(self) -> int:
        return len(self.records)

    @property
    def prompt_ids(self) -> list[str]:
        return sorted({r.prompt_id for r in self.records} | set(self.prompts))

    @property
    def support(self) -> Tree:
        """Every accepted path seen (plus the union in rollout mode), as a tree."""
        t = self._cache.get("support")
        if t is None:
            paths = {p for r in self.records for p in r.accepted_paths}
            if self.union is not None:
                paths |= set(self.union.paths)
            t = self._cache["support"] = Tree.from_paths(paths, "support")
        return t

    def _index(self):
        ix = self._cache.get("index")
        if ix is None:
            sup = self.support
            idx = sup.index
            rec, col = [], []
            chain = all(sorted(len(p) for p in r.accepted_paths) == list(range(1, len(r.accepted_paths) + 1))
                        and all(p[:-1] == q for p, q in zip(r.accepted_paths[1:], r.accepted_paths)) for r in self.records)
            for i, r in enumerate(self.records):
                for p in r.accepted_paths:
                    rec.append(i)
                    col.append(idx[p])
            rec_a, col_a = np.array(rec, dtype=np.int64), np.array(col, dtype=np.int64)
            dep = np.array([len(p) for p in sup.node_paths], dtype=np.int64)
            chains = None
            if chain:
                D = max(1, self.depth)
                chains = np.full((len(self.records), D), sup.size, dtype=np.int64)  # sup.size: a "never" column
                for i, r in enumerate(self.records):
                    for p in r.accepted_paths:
                        chains[i, len(p) - 1] = idx[p]
            counts = np.bincount(col_a, minlength=sup.size) if len(col_a) else np.zeros(sup.size, dtype=np.int64)
            order = np.argsort(col_a, kind="stable")
            starts = np.searchsorted(col_a[order], np.arange(sup.size + 1))
            by_col = (rec_a[order], starts)
            ix = self._cache["index"] = (rec_a, col_a, dep, chains, counts, by_col)
        return ix

    def records_accepting(self, col: int) -> np.ndarray:
        """Record indices whose accepted set contains support node `col`."""
        _, _, _, _, _, (recs, starts) = self._index()
        return recs[starts[col]:starts[col + 1]]

    def columns(self, tree: Tree) -> tuple[np.ndarray, int]:
        """Support columns of the tree's nodes, and how many of its nodes are not covered."""
        idx = self.support.index
        cols = [idx[p] for p in tree.paths if p in idx]
        return np.array(cols, dtype=np.int64), sum(1 for p in tree.paths if not self.covers(p))

    # ---- scores ------------------------------------------------------------------------------
    def accepted_lengths(self, tree: Tree) -> np.ndarray:
        """[R] accepted drafts of `tree` at every record (nodes the statistics do not cover
        count as never accepted: then this is a lower bound)."""
        R = len(self.records)
        if not R:
            return np.zeros(0, dtype=np.int64)
        rec, col, dep, chains, _, _ = self._index()
        cols, _ = self.columns(tree)
        in_t = np.zeros(self.support.size + 1, dtype=bool)
        in_t[cols] = True
        if chains is not None:
            return np.cumprod(in_t[chains], axis=1).sum(1)
        out = np.zeros(R, dtype=np.int64)
        sel = in_t[col]
        np.maximum.at(out, rec[sel], dep[col[sel]])
        return out

    def expected_tau(self, tree: Tree) -> float:
        """1 + mean accepted drafts per record: per step for rollouts, per position (a step
        starting anywhere) for traces."""
        if not self.records:
            raise DataError("no calibration steps were recorded (every prompt ended at once?)")
        return 1.0 + float(self.accepted_lengths(tree).mean())

    def replay(self, accepted: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Trace mode: replay decoding on every prompt exactly as the engine does (same stops:
        max_new_tokens, EOS), where a step starting at record r accepts `accepted[r]` drafts
        ([R] ints). Returns per step, in order: (prompt's index in sorted(prompts), start record,
        accepted drafts, tokens emitted), each [steps]."""
        if self.mode != "trace":
            raise DataError("only trace statistics can replay decoding")
        acc = np.asarray(accepted, dtype=np.int64).tolist()  # Python ints: the walk below is the hot loop
        max_new = int(self.meta.get("max_new_tokens") or 0)
        start = self._cache.get("starts")
        if start is None:
            start = {}
            for k, r in enumerate(self.records):
                start.setdefault(r.prompt_id, k)
            self._cache["starts"] = start
        out_p, out_r, out_l, out_k = [], [], [], []
        for i, pid in enumerate(sorted(self.prompts)):
            info = self.prompts[pid]
            n, eos = int(info["n_positions"]), info.get("eos_at")
            s0 = start.get(pid, 0)
            emitted = o = 0
            while True:
                remaining = max_new - emitted
                if remaining <= 1 or (eos is not None and o == eos) or o >= n:
                    break
                l = acc[s0 + o]
                k = min(l + 1, remaining)
                ends = eos is not None and o <= eos < o + k
                if ends:
                    k = eos - o + 1
                out_p.append(i)
                out_r.append(s0 + o)
                out_l.append(l)
                out_k.append(k)
                emitted += k
                if ends or emitted >= max_new:
                    break
                o += l + 1
        as_array = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
        return as_array(out_p), as_array(out_r), as_array(out_l), as_array(out_k)

    def simulate(self, tree: Tree) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """Trace mode: replay decoding with `tree` (`replay`). Returns (steps, accepted
        drafts, per prompt (steps, accepted))."""
        if self.mode != "trace":
            raise DataError("only trace statistics can replay decoding")
        last = self._cache.get("simulated")  # predict_tau and tau_stderr of one tree replay it once
        if last is not None and last[0] == tree.key():
            return last[1]
        names = sorted(self.prompts)
        p, _, l, _ = self.replay(self.accepted_lengths(tree))
        steps = np.bincount(p, minlength=len(names)).tolist()
        acc = np.bincount(p, weights=l, minlength=len(names)).astype(np.int64).tolist()
        per = {pid: (steps[i], acc[i]) for i, pid in enumerate(names)}
        out = int(sum(steps)), int(sum(acc)), per
        self._cache["simulated"] = (tree.key(), out)
        return out

    def predict_tau(self, tree: Tree) -> float:
        """Predicted tau (tokens per verification step) of decoding with `tree`: the exact
        replay for traces, the per-step mean for rollouts."""
        if self.mode == "trace":
            steps, acc, _ = self.simulate(tree)
            if not steps:
                raise DataError("no decoding step to replay (every prompt ended at once?)")
            return 1.0 + acc / steps
        return self.expected_tau(tree)

    def tau_stderr(self, tree: Tree) -> float:
        """Standard error of `predict_tau`, clustered by prompt (steps of one prompt correlate)."""
        if self.mode == "trace":
            _, _, per = self.simulate(tree)
            return _ratio_stderr([acc for _, acc in per.values()], [st for st, _ in per.values()])
        return _clustered_stderr([r.prompt_id for r in self.records], self.accepted_lengths(tree))

    def node_acceptance(self) -> dict[Path_, float]:
        """P(support node accepted) per record."""
        R = len(self.records)
        counts = self._index()[4]
        return {p: (float(counts[i + 1]) / R if R else 0.0) for i, p in enumerate(self.support.paths)}

    def positional_rates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequoia's positional model with depth: p[d, r] = P(rank r at depth d accepted | its
        parent accepted), pooled over parents. Returns (p, accepted, trials), each
        [depth+1, max_rank] (row 0 unused)."""
        D, W = max(1, self.depth), max(1, self.max_rank)
        num = np.zeros((D + 1, W))
        den = np.zeros((D + 1, W))
        counts = self._index()[4]
        sup = self.support
        for j, p in enumerate(sup.node_paths[1:], start=1):
            if len(p) <= D and p[-1] < W:
                num[len(p), p[-1]] += counts[j]
        if self.mode == "trace":
            reach = np.zeros(D + 1)
            reach[0] = len(self.records)
            for r in self.records:
                for d in range(1, r.accept_length + 1):
                    reach[d] += 1
            den[1:] = reach[:-1, None]
        else:
            par = self.union.parent_list
            for j, p in enumerate(self.union.node_paths[1:], start=1):
                pj = sup.index[self.union.node_paths[par[j]]] if par[j] > 0 else 0
                den[len(p), p[-1]] += counts[pj] if pj else len(self.records)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(den > 0, num / np.maximum(den, 1), 0.0)
        return rate, num, den

    def subset(self, prompt_ids: Sequence[str]) -> "CalibrationStats":
        keep = set(prompt_ids)
        return CalibrationStats([r for r in self.records if r.prompt_id in keep], self.rule, self.mode, self.depth,
                                self.max_rank, self.union, {k: v for k, v in self.prompts.items() if k in keep}, dict(self.meta))

    def summary(self) -> dict:
        hist = np.bincount([r.accept_length for r in self.records], minlength=self.depth + 1).tolist() if self.records else []
        ent = [r.root_entropy for r in self.records if math.isfinite(r.root_entropy)]
        out = {"mode": self.mode, "n_prompts": len(self.prompt_ids), "n_records": self.n_steps,
               "depth": self.depth, "max_rank": self.max_rank, "support_nodes": self.support.n_nodes,
               "accept_histogram": hist, "rule": self.rule.label,
               "mean_root_entropy": statistics.fmean(ent) if ent else None}
        if self.union is not None:
            out["union_nodes"] = self.union.n_nodes
            out["union_tau"] = self.expected_tau(self.union) if self.records else None
        return out

    # ---- files -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        ids = self.prompt_ids
        pos = {p: i for i, p in enumerate(ids)}
        sup = self.support
        idx = sup.index
        rs = self.records
        return {
            "format": STATS_FORMAT,
            "mode": self.mode,
            "depth": self.depth,
            "max_rank": self.max_rank,
            "rule": self.rule.to_json(),
            "meta": self.meta,
            "union": [list(p) for p in self.union.paths] if self.union is not None else None,
            "support": [list(p) for p in sup.paths],
            "prompt_ids": ids,
            "prompts": self.prompts,
            "records": {
                "prompt": [pos[r.prompt_id] for r in rs],
                "step": [r.step for r in rs],
                "position": [r.position for r in rs],
                "accepted": [[idx[p] for p in r.accepted_paths] for r in rs],
                "root_entropy": [_f(r.root_entropy) for r in rs],
                "root_prob": [_f(r.root_prob) for r in rs],
                "draft_entropy": [_f(r.draft_entropy) for r in rs],
                "draft_top1": [_f(r.draft_top1) for r in rs],
            },
        }

    @staticmethod
    def from_json(d: Any, source: str = "statistics") -> "CalibrationStats":
        if not isinstance(d, dict) or d.get("format") != STATS_FORMAT:
            raise DataError(f"{source}: not an entmtp calibration statistics file (format {STATS_FORMAT})")
        try:
            union = Tree.from_paths(d["union"], "union") if d.get("union") is not None else None
            node_paths = Tree.from_paths(d["support"]).node_paths
            ids = list(d["prompt_ids"])
            rec = d["records"]
            cols = ("prompt", "step", "position", "accepted", "root_entropy", "root_prob", "draft_entropy", "draft_top1")
            n = len(rec["prompt"])
            if any(len(rec[c]) != n for c in cols):
                raise DataError(f"{source}: record columns have different lengths")
            records = []
            for i in range(n):
                acc = rec["accepted"][i]
                if any(isinstance(j, bool) or not isinstance(j, int) or not 1 <= j < len(node_paths) for j in acc):
                    raise DataError(f"{source}: record {i} has an accepted node outside the support")
                records.append(StepRecord(str(ids[rec["prompt"][i]]), int(rec["step"][i]), _canon(node_paths[j] for j in acc),
                                          _nan(rec["root_entropy"][i]), _nan(rec["root_prob"][i]),
                                          _nan(rec["draft_entropy"][i]), _nan(rec["draft_top1"][i]), int(rec["position"][i])))
            prompts = {str(k): dict(v) for k, v in (d.get("prompts") or {}).items()}
            return CalibrationStats(records, RuleSpec.from_json(d.get("rule", {})), str(d.get("mode", "rollout")),
                                    int(d.get("depth") or 0), int(d.get("max_rank") or 0), union, prompts, dict(d.get("meta") or {}))
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{source}: malformed statistics file ({type(e).__name__}: {e})") from None
        except TreeError as e:
            raise DataError(f"{source}: bad tree in statistics: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))

    @staticmethod
    def load(path: str | Path) -> "CalibrationStats":
        p = Path(path)
        return CalibrationStats.from_json(read_stats_json(p), p.name)

    # ---- several processes ----------------------------------------------------------------
    @staticmethod
    def merge(parts: Sequence["CalibrationStats"]) -> "CalibrationStats":
        """Union of shards of one statistics pass (same mode, coverage and rule): records
        sorted by (prompt id, step), so the result equals a single pass over all prompts."""
        parts = list(parts)
        if not parts:
            raise ValueError("nothing to merge")
        first = parts[0]
        for p in parts[1:]:
            if (p.mode, p.depth, p.max_rank) != (first.mode, first.depth, first.max_rank) or \
                    (p.union.paths if p.union else None) != (first.union.paths if first.union else None):
                raise DataError("cannot merge statistics of different modes or union trees")
            if p.rule != first.rule:
                raise DataError(f"cannot merge statistics of different rules ({first.rule.label} vs {p.rule.label})")
        records = sorted((r for p in parts for r in p.records), key=lambda r: (r.prompt_id, r.step))
        seen = set()
        for r in records:
            if (r.prompt_id, r.step) in seen:
                raise DataError(f"prompt {r.prompt_id!r} appears in two shards")
            seen.add((r.prompt_id, r.step))
        prompts: dict = {}
        for p in parts:
            if set(p.prompts) & set(prompts):
                raise DataError("a prompt appears in two shards")
            prompts.update(p.prompts)
        meta = dict(first.meta)
        meta["n_prompts"] = sum(int(p.meta.get("n_prompts", len(p.prompt_ids))) for p in parts)
        skipped = [s for p in parts for s in p.meta.get("skipped_prompts", [])]
        if skipped or "skipped_prompts" in meta:
            meta["skipped_prompts"] = sorted(skipped)
        return CalibrationStats(records, first.rule, first.mode, first.depth, first.max_rank, first.union,
                                dict(sorted(prompts.items())), meta)


def _ratio_stderr(acc: Sequence[float], steps: Sequence[float]) -> float:
    """Standard error of sum(acc)/sum(steps) over clusters (delta method)."""
    a, m = np.asarray(acc, float), np.asarray(steps, float)
    k = int((m > 0).sum())
    if k < 2 or m.sum() <= 0:
        return float("nan")
    r = a.sum() / m.sum()
    mbar = m.mean()
    var = ((a - r * m) ** 2).sum() / (len(m) * (len(m) - 1) * mbar ** 2)
    return float(math.sqrt(max(var, 0.0)))


def _clustered_stderr(groups: Sequence[str], values: np.ndarray) -> float:
    """Standard error of mean(values), treating equal `groups` as one cluster (ratio estimator)."""
    n = len(values)
    if n < 2:
        return float("nan")
    sums: dict[str, list[float]] = {}
    for g, v in zip(groups, values):
        s = sums.setdefault(g, [0.0, 0.0])
        s[0] += float(v)
        s[1] += 1.0
    if len(sums) < 2:
        return float(np.std(values, ddof=1) / math.sqrt(n))
    return _ratio_stderr([s[0] for s in sums.values()], [s[1] for s in sums.values()])


# ---- the statistics pass: traces (greedy, sampling) --------------------------------------------

def _entropy_prob_rows(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[list[float], list[float]]:
    """logits [B, V], tokens [B] -> entropy (nats) and probability of each row's token."""
    lp = torch.log_softmax(logits.float(), -1)
    ent = -(lp.exp() * lp).sum(-1)
    return ent.tolist(), lp.gather(1, tokens[:, None])[:, 0].exp().tolist()


@torch.inference_mode()
def _continue_batch(engine: Engine, batch: list[list[int]], n_new: int, spec: RuleSpec, seeds: list[int],
                    eos: set[int], need_after_eos: int,
                    layers: Sequence[int] = ()) -> tuple[list[list[int]], list[torch.Tensor], list[list[tuple]]]:
    """Continue every prompt by `n_new` tokens with the rule's sampling (argmax for greedy),
    batched with left padding, not stopping at EOS (generation stops early once every row is
    `need_after_eos` tokens past its first EOS). Returns per row the continuation, the heads'
    features (`base_features` of `layers`) of prompt + continuation positions [P + len - 1, F],
    and the root signals (entropy, probability) of every continuation token."""
    from transformers import DynamicCache

    model, dev = engine.model, engine.device
    lens = [len(x) for x in batch]
    ids, attn, pos = left_padded(batch, 0, dev)
    B, Pm = ids.shape
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                output_hidden_states=True, logits_to_keep=last_positions(Pm, 1, dev))
    h0 = base_features(out.hidden_states, layers)
    hidden = [[h0[i, Pm - lens[i]:]] for i in range(B)]
    logits = out.logits[:, -1]
    gens = None
    if not spec.sampling.greedy:
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    conts: list[list[int]] = [[] for _ in range(B)]
    signals: list[list[tuple]] = [[] for _ in range(B)]
    eos_at = [None] * B
    for j in range(n_new):
        if gens is None:
            tok = logits.argmax(-1)
        else:
            probs = warp(logits, spec.sampling)
            tok = torch.cat([torch.multinomial(probs[i], 1, generator=gens[i]) for i in range(B)])
        ent, prob = _entropy_prob_rows(logits, tok)
        tl = tok.tolist()
        for i in range(B):
            conts[i].append(tl[i])
            signals[i].append((ent[i], prob[i]))
            if eos_at[i] is None and tl[i] in eos:
                eos_at[i] = j
        if j == n_new - 1 or all(e is not None and j >= e + need_after_eos for e in eos_at):
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                    output_hidden_states=True)
        hl = base_features(out.hidden_states, layers)[:, 0]
        for i in range(B):
            hidden[i].append(hl[i:i + 1])
        logits = out.logits[:, -1]
    return conts, [torch.cat(h) for h in hidden], signals


@torch.inference_mode()
def head_ranks(runner, hidden: torch.Tensor, tokens: Sequence[int], start: int, n: int,
               max_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranks of the true continuation under the heads, for steps whose last accepted position
    is t = start .. start+n-1 (the root is tokens[t+1]).

    hidden [T, F] the heads' base features of `tokens` (`base_features`; T >= start+n); tokens must reach
    t + num_heads + 1. Returns (ranks [n, K] long, capped at max_rank = not drafted; head 0's
    entropy [n]; head 0's top-1 probability [n]) -- what `HeadRunner.draft` and `first_level`
    would see at those steps.
    """
    heads, cfg = runner.heads, runner.config
    K = cfg.num_heads
    dev = hidden.device
    hidden = hidden.to(runner.dtype)
    tok = torch.as_tensor(list(tokens), dtype=torch.long, device=dev)
    emb = runner.embed(tok).to(hidden.dtype)
    feats = heads.features(hidden[None], emb[None])
    steps = None
    if heads.eagle is not None:  # the draft layer's k-th step along the true continuation, as decoding drafts it
        steps = [s[0, start:start + n] for s in feats]
        f = steps[0]
    else:
        f = feats[0, start:start + n]
    t = torch.arange(start, start + n, device=dev)
    ranks = torch.full((n, K), max_rank, dtype=torch.long, device=dev)
    inv = None
    if runner.draft_vocab is not None:
        vocab = runner.embed.weight.shape[0]
        inv = torch.full((max(vocab, int(runner.draft_vocab.max()) + 1),), -1, dtype=torch.long, device=dev)
        inv[runner.draft_vocab] = torch.arange(len(runner.draft_vocab), device=dev)
    x = f
    ent0 = top0 = None
    for k in range(K):
        if cfg.kind == "hydra":
            x = torch.cat([x, emb[t + k + 1]], -1)
        logits = heads.head_logits(k, steps[k] if steps is not None else x if cfg.kind == "hydra" else f,
                                   runner.lm_weight).float()
        target = tok[t + k + 2]
        if inv is not None:
            target = inv[target]
        ok = target >= 0
        tl = logits.gather(1, target.clamp(min=0)[:, None])
        r = (logits > tl).sum(1)
        ranks[:, k] = torch.where(ok & (r < max_rank), r, torch.full_like(r, max_rank))
        if k == 0:
            lp = torch.log_softmax(logits, -1)
            ent0 = -(lp.exp() * lp).sum(-1)
            top0 = lp.max(-1).values.exp()
    return ranks.cpu(), ent0.cpu(), top0.cpu()


def _collect_trace(engine: Engine, heads: str, encoded: list[tuple[str, list[int]]], spec: RuleSpec, max_new_tokens: int,
                   max_rank: int, batch_size: int, progress: Progress, signals: bool) -> tuple[list[StepRecord], dict, list]:
    runner = engine.runners[heads]
    K = runner.config.num_heads
    eos = set(engine.eos_ids())
    n_new = max_new_tokens + K
    records: list[StepRecord] = []
    prompts: dict = {}
    skipped = []
    usable = []
    for pid, ids in encoded:
        if len(ids) + n_new + 1 > engine.max_context:
            skipped.append(pid)
        else:
            usable.append((pid, ids))
    # similar lengths together: less padding
    usable.sort(key=lambda x: len(x[1]))
    done = 0
    for b in range(0, len(usable), batch_size):
        batch = usable[b:b + batch_size]
        conts, hiddens, sigs = _continue_batch(engine, [ids for _, ids in batch], n_new, spec,
                                               [spec.prompt_seed(pid) for pid, _ in batch], eos, K + 1,
                                               runner.feature_layers)
        for (pid, ids), cont, hid, sg in zip(batch, conts, hiddens, sigs):
            eos_at = next((j for j, x in enumerate(cont) if x in eos), None)
            n_pos = max(0, max_new_tokens - 1)
            if eos_at is not None:
                n_pos = min(n_pos, eos_at)
            # the tokens themselves: what a prompt-lookup branch would have copied at each position
            # (`autotune.choose_lookup`), a property of the base's greedy continuation like the ranks
            prompts[pid] = {"n_positions": n_pos, "eos_at": eos_at, "prompt_tokens": len(ids),
                            "prompt_ids": [int(x) for x in ids],
                            "answer_ids": [int(x) for x in (cont if eos_at is None else cont[:eos_at + 1])]}
            if n_pos:
                seq = list(ids) + cont
                ranks, ent0, top0 = head_ranks(runner, hid, seq, len(ids) - 1, n_pos, max_rank)
                rl, el, tl = ranks.tolist(), ent0.tolist(), top0.tolist()
                for o in range(n_pos):
                    chain, path = [], ()
                    for r in rl[o]:
                        if r >= max_rank:
                            break
                        path = path + (r,)
                        chain.append(path)
                    re_, rp = sg[o] if signals else (None, None)
                    records.append(StepRecord(pid, o, tuple(chain), _nan(_f(re_)), _nan(_f(rp)),
                                              _nan(_f(el[o]) if signals else None), _nan(_f(tl[o]) if signals else None), o))
            done += 1
        progress("statistics", done, len(usable))
    return records, prompts, skipped


# ---- the statistics pass: union rollouts (any rule) --------------------------------------------

def typical_accepted_nodes(rule: TypicalRule, tree: Tree, tokens: list[int], logits: torch.Tensor) -> list[int]:
    """Every node the typical rule accepts (its token passes the threshold under its parent,
    and so do its ancestors'). The rule's chosen path is the deepest of these."""
    p = rule._probs(logits)
    ent = -(p * torch.log(p + 1e-9)).sum(-1)
    thresh = torch.minimum(torch.full_like(ent, rule.epsilon), rule.alpha * torch.exp(-ent))
    parents = tree.parent_list
    tok = torch.tensor(tokens, device=logits.device)
    par = torch.tensor([max(q, 0) for q in parents], device=logits.device)
    ok = (p[par, tok] > thresh[par]).tolist()
    acc = [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):  # canonical order: parents come first
        acc[i] = ok[i] and acc[parents[i]]
    return [i for i, a in enumerate(acc) if a]


class _RecordingRule:
    """Delegates to the real rule and keeps the set of accepted nodes of the last step."""

    def __init__(self, rule: AcceptanceRule):
        self.rule = rule
        self.name = rule.name
        self.lossless = rule.lossless
        self.last: Optional[list[int]] = None

    def first_token(self, logits, rng=None) -> int:
        return self.rule.first_token(logits, rng)

    def accept(self, tree, tokens, logits, rng=None):
        acc = self.rule.accept(tree, tokens, logits, rng)
        if isinstance(self.rule, TypicalRule):
            nodes = typical_accepted_nodes(self.rule, tree, tokens, logits)
            if set(acc.path) - set(nodes):  # cannot happen unless TypicalRule changes; stay consistent
                nodes = sorted(set(nodes) | set(acc.path))
        else:
            nodes = list(acc.path)
        self.last = nodes
        return acc


class _RecordingScheduler(Scheduler):
    """Always the union tree; keeps the signals the engine computed before each step."""

    name = "calibration"

    def __init__(self, tree: Tree, signals: bool = True):
        super().__init__(tree)
        self.needs_root = self.needs_draft = signals
        self.signals: list[StepSignals] = []

    def fresh(self) -> "_RecordingScheduler":
        return _RecordingScheduler(self.tree, self.needs_root)

    def choose(self, signals: StepSignals) -> Decision:
        self.signals.append(signals)
        return Decision(self.tree)


def _collect_rollout(engine: Engine, heads: str, encoded, union: Tree, spec: RuleSpec, max_new_tokens: int,
                     progress: Progress, signals: bool) -> list[StepRecord]:
    node_paths = union.node_paths
    records: list[StepRecord] = []
    for k, (pid, ids) in enumerate(encoded):
        rec_rule = _RecordingRule(spec.make())
        gen = engine.generate(ids, heads=heads, scheduler=_RecordingScheduler(union, signals),
                              config=spec.decode_config(max_new_tokens, seed=spec.prompt_seed(pid)), rule=rec_rule)
        position = 0
        for step in gen:
            if step.time_verify > 0 and step.n_nodes == union.n_nodes and rec_rule.last is not None:
                sig = gen.scheduler.signals[step.index]
                acc = tuple(node_paths[i] for i in rec_rule.last if i > 0)
                records.append(StepRecord(pid, step.index, acc, _nan(_f(sig.root_entropy)), _nan(_f(sig.root_prob)),
                                          _nan(_f(sig.draft_entropy)), _nan(_f(sig.draft_top1)), position))
            rec_rule.last = None
            position += step.n_emitted
        progress("statistics", k + 1, len(encoded))
    return records


def encode_prompts(engine: Engine, prompts: Sequence[Any]) -> list[tuple[str, list[int]]]:
    """(id, token ids) pairs from `Prompt`s (rendered with the chat template), (id, ids)
    pairs, or bare token-id lists (named p0, p1, ...)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            if engine.tokenizer is None:
                raise ValueError("the engine has no tokenizer to render prompts; pass token ids")
            out.append((p.id, render_prompt(p, engine.tokenizer)))
        elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            out.append((p[0], [int(t) for t in p[1]]))
        elif isinstance(p, (list, tuple)) or torch.is_tensor(p):
            out.append((f"p{i}", torch.as_tensor(p).flatten().tolist()))
        else:
            raise ValueError(f"prompt #{i}: expected a Prompt, (id, ids) or a token-id list, got {type(p).__name__}")
        if not out[-1][1]:
            raise ValueError(f"prompt {out[-1][0]!r} is empty")
    if len({pid for pid, _ in out}) != len(out):
        raise ValueError("prompt ids must be unique")
    return out


def collect_stats(engine: Engine, heads: str, prompts: Sequence[Any], union_tree: Optional[Tree] = None,
                  rule: RuleSpec | str | None = None, max_new_tokens: int = 64,
                  progress: Optional[Progress] = None, meta: Optional[dict] = None, signals: bool = True,
                  method: str = "auto", max_rank: int = 32, batch_size: int = 16) -> CalibrationStats:
    """The one statistics pass over `prompts` (`Prompt`s, (id, token ids) pairs or id lists).

    method "trace" (default for the greedy and sampling rules): continue every prompt once
    (batched, `batch_size` prompts at a time) with the rule's own sampling, and record at
    every position the ranks of the true continuation under the heads -- which nodes of *any*
    tree with ranks < `max_rank` would be accepted if a step started there. Exact for these
    rules because the continuation does not depend on the tree (greedy: the base's argmax;
    sampling: tree speculative sampling with point-mass drafts emits a base sample and accepts
    its longest drafted prefix). `union_tree` is not used.

    method "rollout" (default for the typical rule): decode every prompt with `union_tree`
    (default `union_tree_for`) and record, per step, every union node the rule accepts.

    progress(phase, done, total) is called as prompts finish.
    """
    if heads not in engine.runners:
        raise ValueError(f"no heads named {heads!r} loaded (have: {', '.join(engine.runners) or 'none'})")
    runner = engine.runners[heads]
    K = runner.config.num_heads
    spec = as_rule_spec(rule)
    if method == "auto":
        method = "rollout" if spec.name == "typical" else "trace"
    if method not in ("trace", "rollout"):
        raise ValueError(f"unknown statistics method {method!r} (auto, trace, rollout)")
    if method == "trace" and spec.name == "typical":
        raise ValueError("typical acceptance depends on the tree's trajectory: use the rollout method")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{len(prompts)} prompts; at most {MAX_PROMPTS} per statistics pass")
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"max_rank must be in 1..{MAX_RANK}")
    if not 1 <= batch_size <= 256:
        raise ValueError("batch_size must be in 1..256")
    progress = progress or _noop
    encoded = encode_prompts(engine, prompts)
    m = {"heads": runner.label, "num_heads": K, "max_new_tokens": max_new_tokens, "n_prompts": len(encoded),
         "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
         "eos_token_ids": sorted(engine.eos_ids()), "method": method}
    m.update(meta or {})
    progress("statistics", 0, len(encoded))
    if method == "trace":
        records, pinfo, skipped = _collect_trace(engine, heads, encoded, spec, max_new_tokens, max_rank, batch_size,
                                                 progress, signals)
        m["skipped_prompts"] = skipped
        records.sort(key=lambda r: (r.prompt_id, r.step))
        return CalibrationStats(records, spec, "trace", K, max_rank, None, dict(sorted(pinfo.items())), m)
    union = union_tree if union_tree is not None else union_tree_for(K)
    if union.n_nodes == 0:
        raise ValueError("the union tree has no draft nodes")
    if union.depth > K:
        raise ValueError(f"union tree depth {union.depth} exceeds the {K} draft heads")
    if union.n_nodes > MAX_UNION_NODES:
        raise ValueError(f"the union tree has {union.n_nodes} nodes; at most {MAX_UNION_NODES}")
    records = _collect_rollout(engine, heads, encoded, union, spec, max_new_tokens, progress, signals)
    records.sort(key=lambda r: (r.prompt_id, r.step))
    return CalibrationStats.rollout(union, spec, records, m)


def union_tree_for(num_heads: int, max_nodes: int = 128) -> Tree:
    """The default union: `union_tree` plus mc_sim_7b_63 (the usual reference tree)."""
    return union_tree(num_heads, max_nodes, include=[resolve_tree("mc_sim_7b_63")])

# ---- latency model ---------------------------------------------------------------------------

def _isotonic(y: Sequence[float]) -> list[float]:
    """Non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * int(c)
    return out


def _interpolate(xs: np.ndarray, ys: np.ndarray, n: float) -> float:
    """A monotone fit's value at size n: linear between points, the last slope beyond them,
    proportional to size beyond a single point."""
    if len(xs) == 1:
        return float(ys[0]) * max(1.0, n / xs[0]) if n > xs[0] else float(ys[0])
    if n <= xs[-1]:
        return float(np.interp(n, xs, ys))
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return float(ys[-1] + slope * (n - xs[-1]))


@dataclass
class LatencyModel:
    """Seconds per decoding step (draft + verify + bookkeeping) by tree size and depth.

    points[depth] = [(n_nodes, seconds), ...] measured (median of repeats), sorted by size;
    baseline_s: a root-only (plain decoding) step. `cost` interpolates linearly in the
    size after a monotone fit, and extrapolates with the last slope. The fit is non-decreasing
    in size per depth, and in depth at equal size within the sizes the shallower depth was
    measured at: a deeper tree of as many nodes verifies as many rows and drafts more levels, so
    it never costs less (a noisy, lucky measurement of one depth would otherwise make its trees
    look cheaper than they are and win the search).
    """

    baseline_s: float
    points: dict[int, list[tuple[int, float]]]
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.points = {int(d): sorted((int(n), float(t)) for n, t in pts) for d, pts in self.points.items() if pts}
        self._fit = {}
        shallower = None
        for d in sorted(self.points):
            xs = np.array([n for n, _ in self.points[d]], float)
            ys = np.array(_isotonic([t for _, t in self.points[d]]))
            if shallower is not None:  # where the shallower depth was measured (not extrapolated)
                ys = np.maximum(ys, [_interpolate(*shallower, n) if n <= shallower[0][-1] else 0.0 for n in xs])
            self._fit[d] = shallower = (xs, ys)

    @property
    def max_nodes(self) -> int:
        return max((pts[-1][0] for pts in self.points.values()), default=0)

    @property
    def depths(self) -> list[int]:
        return sorted(self.points)

    def covers(self, sizes: Sequence[int], depths: Sequence[int]) -> bool:
        """Whether every (size, depth) point `latency_jobs` would measure is here: a model from a
        coarser grid (an older cache) does not cover a dense one."""
        have = {(n, d) for d, pts in self.points.items() for n, _ in pts}
        return set(latency_jobs(sizes, depths)) <= have

    def measured_size(self, depth: int) -> int:
        """The largest tree size timed at `depth` (0: none): beyond it `cost` extrapolates."""
        pts = self.points.get(depth)
        return pts[-1][0] if pts else 0

    def floor(self, n_nodes: int, depth: int) -> float:
        """A lower bound on the step time of `n_nodes` nodes at `depth` from what was timed: a
        tree of as many or more rows, at as many or more levels, never costs less (the fit's own
        rules), so the bound is the highest fitted time at a size <= n_nodes and depth <= `depth`."""
        out = self.baseline_s
        for d, (xs, ys) in self._fit.items():
            if d <= depth:
                out = max(out, _interpolate(xs, ys, min(n_nodes, xs[-1])))
        return out

    def merged(self, other: "LatencyModel") -> "LatencyModel":
        """This model and `other` (more trees timed in later rounds) as one: each point's ratio to
        its own model's plain step, times the faster of the two plain steps (what
        `measure_latency` does within one model); `other`'s point wins where both timed one."""
        base = min(self.baseline_s, other.baseline_s)
        pts: dict[int, dict[int, float]] = {}
        for lm in (self, other):
            for d, ps in lm.points.items():
                pts.setdefault(d, {}).update({n: t / lm.baseline_s * base for n, t in ps})
        meta = dict(self.meta, stages=int(self.meta.get("stages", 1)) + int(other.meta.get("stages", 1)))
        return LatencyModel(base, {d: sorted(p.items()) for d, p in pts.items()}, meta)

    def cost(self, n_nodes: int, depth: int) -> float:
        if n_nodes <= 0 or not self._fit:
            return self.baseline_s
        d = depth if depth in self._fit else min(self._fit, key=lambda k: (abs(k - depth), -k))
        return _interpolate(*self._fit[d], n_nodes)

    def tokens_per_s(self, tau: float, n_nodes: int, depth: int) -> float:
        c = self.cost(n_nodes, depth)
        return tau / c if c > 0 else float("nan")

    def speedup(self, tau: float, n_nodes: int, depth: int) -> float:
        """Predicted tokens/s relative to plain decoding (one token per baseline step)."""
        c = self.cost(n_nodes, depth)
        return tau * self.baseline_s / c if c > 0 else float("nan")

    def to_json(self) -> dict:
        return {"format": LATENCY_FORMAT, "baseline_s": self.baseline_s,
                "points": {str(d): [[n, t] for n, t in pts] for d, pts in self.points.items()},
                "fitted": {str(d): [[int(n), float(t)] for n, t in zip(*self._fit[d])] for d in self._fit},
                "meta": self.meta}

    @staticmethod
    def from_json(d: Any, source: str = "latency") -> "LatencyModel":
        if not isinstance(d, dict) or d.get("format") != LATENCY_FORMAT:
            raise DataError(f"{source}: not an entmtp latency file")
        try:
            return LatencyModel(float(d["baseline_s"]), {int(k): [(int(n), float(t)) for n, t in v] for k, v in d["points"].items()},
                                dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{source}: malformed latency file ({e})") from None


def tree_capacity(depth: int, max_rank: int = 10) -> int:
    """Most nodes a tree of `depth` levels with ranks < `max_rank` can have."""
    return sum(max_rank ** k for k in range(1, depth + 1))


def latency_jobs(sizes: Sequence[int], depths: Sequence[int], max_rank: int = 16) -> list[tuple[int, int]]:
    """The (n_nodes, depth) points a latency model measures: every size a tree of that depth
    can have (ranks < max_rank), plus the chain of each depth; sorted by depth, then size."""
    jobs = {(n, d) for d in depths for n in sizes if d <= n <= tree_capacity(d, max_rank)} | {(d, d) for d in depths}
    return sorted(jobs, key=lambda x: (x[1], x[0]))


def representative_tree(n_nodes: int, depth: int, max_rank: int = 16) -> Tree:
    """A typical tree of `n_nodes` nodes and exactly `depth` levels (n_nodes >= depth): the
    top-1 chain plus the nodes of highest prior value -- what searched trees look like."""
    if not depth <= n_nodes <= tree_capacity(depth, max_rank):
        raise ValueError(f"no tree of depth {depth} with ranks < {max_rank} has {n_nodes} nodes")
    chain = [(0,) * k for k in range(1, depth + 1)]
    return Tree.from_paths(expand_by_value(prior_value, n_nodes, depth, max_rank, start=chain), f"rep_n{n_nodes}_d{depth}")


DENSE_SIZES = 16  # every tree size up to this is measured


def size_grid(max_nodes: int) -> list[int]:
    """Tree sizes the latency model measures: every size up to `DENSE_SIZES`, then a coarse grid.

    Dense where the searched trees live, because step time is not smooth there: matrix
    kernels block the rows (tree nodes + root), so one more node can cross a block edge. On
    the 2-core AVX-512 CPU of docs/bench, trees of 1-4 nodes cost the same, the 5th node
    +1.4 ms and the 6th +2.3 ms of a 33 ms step (assets/search/reports/smollm2-135m-hydra-latency.json,
    pooled over depths); a grid of 4, 6, 8 interpolated that edge away.
    """
    coarse = [24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    dense = range(1, min(DENSE_SIZES, max_nodes) + 1)
    return sorted({*dense, *(n for n in coarse if n <= max_nodes), max_nodes})


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9+.]+", "-", str(s).lower()).strip("-").replace("+", "p") or "x"


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_isa": cpu_isa(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def latency_key(engine: Engine, heads: str) -> dict:
    """What a cached latency model depends on: the architecture (config, not the path or the
    weights), device and its hardware class, dtype, the heads' shape, the CPU threads and the
    decoding kernels (their kind and what they are)."""
    info = describe_model(engine.model)
    heads_cfg = {k: v for k, v in engine.runners[heads].config.to_dict().items() if k not in ("base_model", "notes")}
    return {"model": info.get("name"), "architecture": info.get("architecture"), "n_params": info.get("n_params"),
            "model_config": config_hash(engine.model),
            "device": str(engine.device), "hardware": hardware_class(engine.device),
            "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
            "dtype": str(engine.dtype).removeprefix("torch."), "heads": heads_cfg,
            "threads": torch.get_num_threads() if engine.device.type == "cpu" else None, "torch": torch.__version__,
            "kernels": [getattr(engine, "kernels", "stock"), getattr(engine.runners[heads], "kernels", "stock")],
            # which kernels exactly (panels, fused norms and MLPs, float32 attention): a step's cost changes with them
            "kernels_reason": getattr(engine, "kernels_reason", None)}


def latency_cache_path(engine: Engine, heads: str) -> Path:
    """`cache_dir()/latency/<model>-<device>-<dtype>-<heads>-<hash>.json`."""
    key = latency_key(engine, heads)
    tag = hashlib.sha256(json.dumps({k: v for k, v in key.items() if k != "model"}, sort_keys=True,
                                    default=str).encode()).hexdigest()[:8]
    model = _slug(Path(str(key["model"])).name)
    label = engine.runners[heads].label
    return cache_dir() / "latency" / f"{model}-{_slug(key['device'])}-{key['dtype']}-{_slug(label)}-{tag}.json"


def _trees_per_generation(engine: Engine, bank: list[Tree], ids: list[int], steps_per_tree: int = 2) -> int:
    """How many trees of `bank` one measuring generation times (`steps_per_tree` steps each: a warm
    and a timed one, or the timed one alone) after `ids`, within `LATENCY_WINDOW` tokens and the
    model's context."""
    room = engine.max_context - len(ids) - max(t.size for t in bank) - 2
    per_step = max(t.depth for t in bank) + 1  # most tokens one step adds
    if room < steps_per_tree * per_step:
        raise ValueError("the model's context is too short for the latency measurement")
    return max(1, min(room, LATENCY_WINDOW) // (steps_per_tree * per_step))


class _Cycle(Scheduler):
    """Plays a fixed sequence of trees, one per step (the latency measurement)."""

    name = "latency-cycle"

    def __init__(self, bank: list[Tree], sequence: list[int]):
        super().__init__(bank[0])
        self.bank, self.sequence, self.used = bank, sequence, []

    @property
    def trees(self) -> list[Tree]:
        return self.bank

    def fresh(self) -> "_Cycle":
        return self

    def choose(self, signals: StepSignals) -> Decision:
        j = self.sequence[min(len(self.used), len(self.sequence) - 1)]
        self.used.append(j)
        return Decision(self.bank[j])


LATENCY_WINDOW = 128  # most tokens one measuring generation adds to its context before a new prefill


def _cycle_times(engine: Engine, heads: Optional[str], bank: list[Tree], sequence: list[int],
                 ids: list[int], progress: Callable[[int], Any], prefill: Optional[Prefill] = None,
                 warm: bool = True) -> dict[int, list[float]]:
    """Step times of the trees `bank[j]` for j in `sequence`, in that order, in as few
    generations as the context allows, each started from `prefill` (`context_prefill`) where
    given, else from a prefill of its own. Returns {j: [seconds, ...]}.

    Two things keep the measurement close to what decoding pays (both measured on the 2-core
    CPU of docs/bench, where together they had inflated a 64-node step from 90 to 125 ms and a
    5-node step from 33 to 37 ms):
    * each timed step comes right after an untimed step of the same tree: kernels keep
      per-shape state (oneDNN primitives per row count) that a round-robin over ~90 tree sizes
      evicts, while decoding reuses a few sizes;
    * a generation adds at most `LATENCY_WINDOW` tokens before the next prefill: step time
      grows with the context (a 33-row step: 58 ms at 100 tokens, 98 ms at 1,000), and one long
      generation would measure the later trees at ever longer contexts.
    warm=False times every step, each tree's first after another tree's (`measure_latency`)."""
    times: dict[int, list[float]] = {}
    todo = list(sequence)
    per_tree = 2 if warm else 1
    n = _trees_per_generation(engine, bank, ids, per_tree)
    per_step = max(t.depth for t in bank) + 1  # most tokens one step adds
    while todo:
        chunk, todo = todo[:n], todo[n:]
        plan = [j for j in chunk for _ in range(per_tree)]  # (warm, timed) per tree, or timed alone
        cfg = DecodeConfig(max_new_tokens=(len(plan) + 1) * per_step + 1, eos_token_ids=())
        if heads is None:
            gen = engine.generate(ids, config=cfg, prefill=prefill)
        else:
            gen = engine.generate(ids, heads=heads, scheduler=_Cycle(bank, plan), config=cfg, prefill=prefill)
        k = -1
        for step in gen:
            if step.time_verify <= 0:
                continue
            k += 1
            if warm and k % 2 == 0:  # the warm step
                continue
            j = plan[k]
            if heads is None or step.n_nodes == bank[j].n_nodes:
                times.setdefault(j, []).append(step.time_total)
            progress(1)
            if k == len(plan) - 1:
                break
        else:
            if k < len(plan) - 1:  # ended early (should not happen without EOS); retry the rest
                done = (k + 1) // per_tree
                if done <= 0:
                    raise ValueError("the latency measurement made no progress (context too short?)")
                todo = chunk[done:] + todo
    return times


class ContextPrefills:
    """The measuring contexts' prefills, shared by the measurements of several heads (a tune of
    every loaded kind): the kinds are timed on the same random contexts, each prefilled once
    (before `COMPUTED_CONTEXT`, a 1,536-token prefill cost ~2 s on a 2-core CPU, and each kind's
    measurement had paid it again). Keyed
    by the context and the base layers the heads read; a prefill serves one generation at a time
    (`Prefill.start`), which the measurements, run one after another, respect. Lives as long as
    its holder (`autotune.tune_all`), not on the engine."""

    def __init__(self):
        self._by_key: dict[tuple, Prefill] = {}

    def get(self, engine: Engine, ids: list[int], heads: Optional[str] = None) -> Optional[Prefill]:
        runner = engine.runner(heads)
        key = (tuple(ids), None if runner is None else tuple(runner.feature_layers))
        p = self._by_key.get(key)
        if p is None:
            p = context_prefill(engine, ids, heads)
            if p is not None:
                self._by_key[key] = p
        return p


COMPUTED_CONTEXT = 128  # tokens of a measuring context the model runs; a longer one repeats their cache rows


def context_prefill(engine: Engine, ids: list[int], heads: Optional[str] = None,
                    shared: Optional[ContextPrefills] = None) -> Optional[Prefill]:
    """The measuring context's prefill, for every generation of a measurement to start from
    (plain steps and the steps of `heads` or of heads reading the same base layers): timing ~30
    steps after 1,536 cached tokens took ~2 s of prefill for each generation of ~0.3 s of steps.
    Taken from `shared` where given (computed there once). None where the model's cache cannot be
    cropped back (sliding-window layers): each generation then prefills the context itself.

    Only the first `COMPUTED_CONTEXT` tokens go through the model; a longer context's cache and
    features are theirs repeated to its length (`repeated_prefill`): a step's time depends on how
    many positions it attends over, not on what they hold, and the one prefill of 1,536 tokens was
    ~2 s of a ~30 s tune of three kinds on a 2-core CPU."""
    if shared is not None:
        return shared.get(engine, ids, heads)
    p = engine.prefill(ids[:COMPUTED_CONTEXT], heads=heads)
    if not p.rewindable:
        return None
    return repeated_prefill(p, ids) if len(ids) > len(p.prompt) else p


@torch.inference_mode()
def repeated_prefill(p: Prefill, ids: list[int]) -> Prefill:
    """`p` grown to a prefill of `ids` (len(ids) > len(p.prompt), a rewindable cache): every cache
    layer's keys and values [B, H, T, D] and the features [T, F] repeated from their first rows to
    len(ids) positions. The cache holds the shape of `ids`' prefill, not its contents: for timing."""
    n, t = len(ids), len(p.prompt)
    for layer in p.cache.layers:
        k, v = layer.keys, layer.values
        for start in range(t, n, t):
            q = min(t, n - start)
            layer.update(k[:, :, :q].clone(), v[:, :, :q].clone())
    hidden = None if p.hidden is None else p.hidden.repeat((n + t - 1) // t, 1)[:n]
    return Prefill(list(ids), p.cache, p.logits, hidden, p.layers)


def ratios_to_plain_around(ts: Sequence[float], before: float, after: float) -> list[float]:
    """Step times `ts` over the mean of the plain steps timed just before and just after them:
    a load change between the two hits the tree's steps and their yardstick alike."""
    return [t / ((before + after) / 2) for t in ts]


def measure_latency(engine: Engine, heads: str, *, max_nodes: int = 64, depths: Optional[Sequence[int]] = None,
                    sizes: Optional[Sequence[int]] = None, context_ids: Optional[list[int]] = None,
                    context_tokens: int = 128, repeats: int = 5, progress: Optional[Progress] = None,
                    prefills: Optional[ContextPrefills] = None, warm: bool = True,
                    jobs: Optional[Sequence[tuple[int, int]]] = None) -> LatencyModel:
    """Measure one decoding step's time (draft + verify + bookkeeping) with the real engine and
    heads, for representative trees of every size in `sizes` (default `size_grid`) at every depth
    in `depths` (default 1..num_heads), plus a root-only (plain decoding) step: each tree as the
    median over `repeats` rounds of its step's ratio to plain steps timed around its generation,
    times the fastest plain step. All trees run round-robin, on a context of `context_tokens` random
    tokens or the given `context_ids`, so drift in machine load hits every size alike; each
    timed step follows an untimed step of the same tree and each generation adds at most
    `LATENCY_WINDOW` tokens before a new prefill (`_cycle_times`: as decoding pays). The context
    past its first `COMPUTED_CONTEXT` tokens is cached as their rows repeated (`context_prefill`).
    prefills: the context's prefill shared with other heads' measurements (`ContextPrefills`). warm=False:
    no untimed steps, each tree timed on its first step after another tree's. jobs: the (size,
    depth) points to time instead of `latency_jobs(sizes, depths)` (a staged grid, `autotune`)."""
    if heads not in engine.runners:
        raise ValueError(f"no heads named {heads!r} loaded")
    if not 1 <= max_nodes <= MAX_UNION_NODES:
        raise ValueError(f"max_nodes must be in 1..{MAX_UNION_NODES}")
    if not 1 <= repeats <= 50:
        raise ValueError("repeats must be in 1..50")
    K = engine.runners[heads].config.num_heads
    depths = sorted(set(depths or range(1, K + 1)))
    if jobs is not None:
        jobs = sorted(set((int(n), int(d)) for n, d in jobs), key=lambda x: (x[1], x[0]))
        if not jobs or any(not 1 <= d <= min(K, n) or n > MAX_UNION_NODES for n, d in jobs):
            raise ValueError(f"latency jobs must be (size, depth) with 1 <= depth <= min(size, {K})")
        depths = sorted({d for _, d in jobs})
    if any(not 1 <= d <= K for d in depths):
        raise ValueError(f"latency depths must be in 1..{K}")
    sizes = sorted(set(sizes or size_grid(max_nodes)))
    if context_ids is None:
        g = torch.Generator().manual_seed(0)
        vocab = engine.model.get_input_embeddings().weight.shape[0]
        context_ids = torch.randint(2, max(3, vocab), (max(1, context_tokens),), generator=g).tolist()
    ctx = list(context_ids)[-max(1, min(len(context_ids), engine.max_context // 4)):]
    progress = progress or _noop
    jobs = jobs if jobs is not None else latency_jobs(sizes, depths)
    bank = [representative_tree(n, d) for n, d in jobs]
    total = (len(jobs) + 3) * repeats
    done = [0]

    def tick(k=1):
        done[0] += k
        progress("latency", min(done[0], total), total)

    progress("latency", 0, total)
    # A shared machine's speed drifts by tens of percent within seconds (a 2-core cloud VM: trees
    # timed in a fast second looked cheaper than plain steps timed in a slow one, and the search
    # chose a 24-node tree that ran at 1.1x plain instead of the predicted 1.6x). So each tree is
    # timed as a ratio to plain steps timed just before and just after its generation (about a
    # second apart), the median ratio of the rounds kept; a step's cost is that ratio times the
    # plain step (the fastest measured). Predicted speedups depend on the ratios alone.
    plain = [Tree.from_paths([])]
    per_gen = _trees_per_generation(engine, bank, ctx, 2 if warm else 1)
    ratios: dict[int, list[float]] = {}
    base: list[float] = []
    pre = context_prefill(engine, ctx, heads, prefills)

    def plain_step() -> float:
        ts = _cycle_times(engine, None, plain, [0] * 3, ctx, lambda k=1: None, pre).get(0, [])
        base.extend(ts)
        return statistics.median(ts)

    before = plain_step()
    for _ in range(repeats):
        order = list(range(len(bank)))
        for c in range(0, len(order), per_gen):
            times = _cycle_times(engine, heads, bank, order[c: c + per_gen], ctx, tick, pre, warm)
            after = plain_step()
            for j, ts in times.items():
                ratios.setdefault(j, []).extend(ratios_to_plain_around(ts, before, after))
            before = after
        tick(3)
    baseline = min(base) if base else float("nan")
    points = {d: [] for d in depths}
    for j, (n, d) in enumerate(jobs):
        if ratios.get(j):
            points[d].append((n, statistics.median(ratios[j]) * baseline))
    meta = {"key": latency_key(engine, heads), "protocol": LATENCY_PROTOCOL, "context_tokens": len(ctx), "repeats": repeats, "warm": warm,
            "machine": machine_info(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return LatencyModel(baseline, points, meta)


def measure_step_ratios(engine: Engine, trees: dict[str, Tree], *, rounds: int = 6, context_tokens: int = 96,
                        seed: int = 0) -> dict[str, float]:
    """Each heads' step with its tree over a plain step, all measured in the same rounds: every
    round times one step of each heads' tree (after an untimed one, `_cycle_times`) and plain steps
    before and after them. {heads: median over the rounds of step / mean(plain around it)}.

    `measure_latency` times one heads' trees in a few seconds; on a machine whose plain step
    switches between speeds for seconds at a time (a 2-core EPYC VM: 10 and 12.5 ms while a
    6-node step held at 15 ms), heads measured a few seconds apart are compared across phases.
    Here every round's phase is shared by all heads, so their ratios compare."""
    if not trees:
        return {}
    if not 1 <= rounds <= 50:
        raise ValueError("rounds must be in 1..50")
    missing = [h for h in trees if h not in engine.runners]
    if missing:
        raise ValueError(f"no heads named {', '.join(missing)} loaded")
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    ctx = torch.randint(2, max(3, vocab), (max(1, context_tokens),), generator=g).tolist()
    ctx = ctx[-max(1, min(len(ctx), engine.max_context // 4)):]
    plain = [Tree.from_paths([])]
    pre: dict[str, Optional[Prefill]] = {}  # heads reading the same base layers share one
    for h in trees:
        same = next((g for g in pre if engine.runners[g].feature_layers == engine.runners[h].feature_layers), None)
        pre[h] = pre[same] if same is not None else context_prefill(engine, ctx, h)
    plain_pre = next(iter(pre.values()))

    def plain_step() -> float:
        return statistics.median(_cycle_times(engine, None, plain, [0] * 3, ctx, lambda k=1: None, plain_pre).get(0, [float("nan")]))

    ratios: dict[str, list[float]] = {h: [] for h in trees}
    before = plain_step()
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]  # neither heads always first after the plain steps
        times = {h: _cycle_times(engine, h, [trees[h]], [0] * 3, ctx, lambda k=1: None, pre[h]).get(0, []) for h in order}
        after = plain_step()
        for h, ts in times.items():
            ratios[h].extend(ratios_to_plain_around(ts, before, after))
        before = after
    return {h: statistics.median(v) if v else float("nan") for h, v in ratios.items()}


def load_or_measure_latency(engine: Engine, heads: str, *, max_nodes: int = 64, remeasure: bool = False,
                            cache: bool = True, progress: Optional[Progress] = None, **kw) -> LatencyModel:
    """The cached latency model of (model, device, dtype, heads), measured when missing, when
    it does not cover `max_nodes`, or when `remeasure`."""
    path = latency_cache_path(engine, heads)
    if cache and not remeasure and path.is_file():
        try:
            lm = LatencyModel.from_json(json.loads(path.read_text()), path.name)
            K = engine.runners[heads].config.num_heads
            if lm.meta.get("protocol") == LATENCY_PROTOCOL and lm.covers(size_grid(max_nodes), range(1, K + 1)):
                lm.meta["cache_file"] = str(path)
                lm.meta["cached"] = True
                return lm
        except (DataError, ValueError, json.JSONDecodeError, OSError):
            pass  # unreadable cache: measure again
    lm = measure_latency(engine, heads, max_nodes=max_nodes, progress=progress, **kw)
    if cache:
        write_json_atomic(path, lm.to_json())
        lm.meta["cache_file"] = str(path)
    lm.meta["cached"] = False
    return lm


__all__ = ["RuleSpec", "StepRecord", "CalibrationStats", "LatencyModel", "collect_stats", "union_tree", "measure_step_ratios",
           "ContextPrefills", "context_prefill",
           "union_tree_for", "measure_latency", "load_or_measure_latency", "latency_cache_path",
           "representative_tree", "expand_by_value", "prior_value", "encode_prompts", "typical_accepted_nodes",
           "machine_info", "size_grid"]
