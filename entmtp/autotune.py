"""Draft trees and entropy banks chosen on this machine: the heads' shipped acceptance statistics
(which nodes the base accepts: a property of model and heads, not of the machine) scored with
step latencies measured here, by the topology lab's own scoring (`search.search_trees`,
`bank.fit_entropy_bank`). Measured once per (machine, kernels, model shapes, dtype, heads) and
cached beside the kernel profile (`entmtp.tuning`).

Why: a tree's speed is tau / step time, and step time by tree size differs by machine far more
than tau does: on a CPU whose 8-row step costs 1.6 one-row steps a 4-node tree wins, on a GPU
where 64 rows cost one, a 60-node tree. A table of trees recorded per machine class is right only
on the machines it was recorded on; this measures.

The grid of tree sizes and depths is timed in stages, only where a tree could still be chosen
(`staged_latency`): where rows are dear the large deep trees are never timed.

Step latency grows with the context (a tree's extra rows attend to every cached token), so trees
are timed after `SHORT_CONTEXT` cached tokens and again after `LONG_CONTEXT`; a smaller tree that
pays there is switched to from the context where it starts to (`tune_long_context`).

`ENTMTP_TUNE=0` skips it: the trees the heads record (`default_tree...`) or the papers' tree.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from .bank import compare_on, fit_entropy_bank
from .calibrate import (LATENCY_PROTOCOL, CalibrationStats, ContextPrefills, LatencyModel, latency_jobs, measure_latency,
                        measure_step_ratios)
from .lookup import chain_outcomes
from .paths import write_json_atomic
from .scheduler import EntropyBucketScheduler
from .search import Candidate, price_candidates, search_trees
from .threads import CoreLoad, busy_note, torch_threads
from .trees import Tree
from .tuning import machine_dir, model_key

ACCEPTANCE_FILE = "acceptance.json.gz"  # shipped in a heads directory (scripts/ship_acceptance.py)
TREES_FORMAT = "entmtp-tuned-trees/3"  # /2: the prompt-lookup choice; /3: a tree for long contexts
CPU_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SHORT_CONTEXT = 96  # cached tokens the trees are first timed after
LONG_CONTEXT = 1536  # ... and timed again after, for a tree that pays in long contexts (capped at a quarter of the model's)
CUDA_SIZES = CPU_SIZES + (48, 64, 96, 128)
LOOKUP_LENGTH = 4  # tokens of the prompt-lookup branch a method with heads grafts (methods.py: entmtp)
LOOKUP_MIN_NGRAMS = (1, 2, 3)  # the shortest matched n-gram grafted, the choices `choose_lookup` scores


@dataclass
class LongContextTrees:
    """The tree (and entropy bank) for long contexts: a tree's extra rows attend to every cached
    token, so where rows cost arithmetic (a CPU) the tree that pays shrinks as the context grows.
    Chosen with step latencies timed after `context` cached tokens; decoding switches to it from
    `from_tokens` cached tokens on (`scheduler.ContextSwitch`), where the two trees' predicted
    tokens/s cross, each tree's step time taken as linear in the context between the two timings."""

    from_tokens: int
    context: int
    tree: Tree
    predicted_tau: float
    predicted_speedup: float  # at `context` cached tokens, over plain decoding there
    short_tree_speedup: float  # the short-context tree's, at `context` cached tokens
    latency: LatencyModel
    bank: Optional[EntropyBucketScheduler] = None

    def to_json(self) -> dict:
        return {"from_tokens": self.from_tokens, "context": self.context, "tree": [list(p) for p in self.tree.paths],
                "tree_name": self.tree.name, "predicted_tau": self.predicted_tau,
                "predicted_speedup": self.predicted_speedup, "short_tree_speedup": self.short_tree_speedup,
                "latency": self.latency.to_json(), "bank": self.bank.to_json() if self.bank is not None else None}

    @staticmethod
    def from_json(d: dict) -> "LongContextTrees":
        return LongContextTrees(int(d["from_tokens"]), int(d["context"]), Tree.from_paths(d["tree"], d["tree_name"]),
                                float(d["predicted_tau"]), float(d["predicted_speedup"]), float(d["short_tree_speedup"]),
                                LatencyModel.from_json(d["latency"]), _bank_from_json(d.get("bank")))

    def summary(self) -> str:
        return (f"from {self.from_tokens} cached tokens {self.tree.name} ({self.tree.n_nodes} nodes, depth "
                f"{self.tree.depth}): {self.predicted_speedup:.2f}x plain decoding after {self.context} tokens, "
                f"where the short-context tree predicts {self.short_tree_speedup:.2f}x")


def _bank_from_json(b: Optional[dict]) -> Optional[EntropyBucketScheduler]:
    if not b:
        return None
    return EntropyBucketScheduler({n: Tree.from_paths(p, n) for n, p in b["trees"].items()}, b["edges"], b["table"],
                                  b.get("draft_edges"), b.get("meta"))


@dataclass
class TunedTrees:
    """One heads' static tree and entropy bank for this machine, with the figures behind them."""

    heads: str
    tree: Tree
    predicted_tau: float
    predicted_speedup: float  # over plain decoding on the same kernels, by the latency model
    latency: LatencyModel
    bank: Optional[EntropyBucketScheduler] = None
    bank_speedup: Optional[float] = None
    why: str = ""
    stats_steps: int = 0
    meta: dict = field(default_factory=dict)
    # the prompt-lookup branch: shortest grafted n-gram (0: no branch; None: not scored, no tokens
    # in the statistics), and the predicted speedup over plain decoding of each choice ("off", "1", ...)
    lookup_min_ngram: Optional[int] = None
    lookup_speedups: dict = field(default_factory=dict)
    long: Optional[LongContextTrees] = None  # None: the same tree pays at every context measured

    def to_json(self) -> dict:
        return {"format": TREES_FORMAT, "heads": self.heads, "tree": [list(p) for p in self.tree.paths],
                "tree_name": self.tree.name, "predicted_tau": self.predicted_tau,
                "predicted_speedup": self.predicted_speedup, "latency": self.latency.to_json(),
                "bank": self.bank.to_json() if self.bank is not None else None, "bank_speedup": self.bank_speedup,
                "why": self.why, "stats_steps": self.stats_steps, "meta": self.meta,
                "lookup_min_ngram": self.lookup_min_ngram, "lookup_speedups": self.lookup_speedups,
                "long": self.long.to_json() if self.long is not None else None}

    @staticmethod
    def from_json(d: dict) -> "TunedTrees":
        if d.get("format") != TREES_FORMAT:
            raise ValueError("not an entmtp tuned-trees file")
        return TunedTrees(d["heads"], Tree.from_paths(d["tree"], d.get("tree_name", "tuned")), float(d["predicted_tau"]),
                          float(d["predicted_speedup"]), LatencyModel.from_json(d["latency"]), _bank_from_json(d.get("bank")),
                          d.get("bank_speedup"), d.get("why", ""), int(d.get("stats_steps", 0)), d.get("meta") or {},
                          d.get("lookup_min_ngram"), d.get("lookup_speedups") or {},
                          LongContextTrees.from_json(d["long"]) if d.get("long") else None)

    def summary(self) -> str:
        bank = f"; entropy bank {self.bank_speedup:.2f}x" if self.bank_speedup else ""
        long = f"; {self.long.summary()}" if self.long is not None else ""
        return (f"{self.heads}: {self.tree.name} ({self.tree.n_nodes} nodes, depth {self.tree.depth}), predicted tau "
                f"{self.predicted_tau:.2f}, {self.predicted_speedup:.2f}x plain decoding{bank}{long}")


def shipped_stats(runner) -> Optional[CalibrationStats]:
    """The acceptance statistics shipped in the heads' directory, or None."""
    d = getattr(runner.heads, "source_dir", None)
    path = Path(d) / ACCEPTANCE_FILE if d else None
    if path is None or not path.is_file():
        return None
    with gzip.open(path, "rt") as f:
        return CalibrationStats.from_json(json.load(f), str(path))


# the engine code a step's time depends on besides the kernel library (whose version names the
# machine directory): fused modules, drafting, the loop's bookkeeping, the cache; and this tuner,
# whose rules turn the timings into trees (a changed rule chooses again)
STEP_SOURCES = ("kernels.py", "heads.py", "decoding.py", "verify.py", "kvcache.py", "attention.py", "lookup.py",
                "autotune.py")


@functools.lru_cache(maxsize=None)
def engine_code_id(sources: tuple[str, ...] = STEP_SOURCES) -> str:
    """A short hash of the engine's step code (`STEP_SOURCES`): tree timings taken with another
    version (int8 drafts, a leaner layer) are measured again rather than trusted."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in sources:
        path = here / name
        h.update(name.encode() + (path.read_bytes() if path.is_file() else b""))
    return h.hexdigest()[:8]


def _heads_id(runner) -> str:
    cfg = json.dumps(runner.config.to_dict(), sort_keys=True, default=str)
    created = str((getattr(runner.heads, "meta", {}) or {}).get("created", ""))
    return hashlib.sha256((cfg + created).encode()).hexdigest()[:10]


def decoding_threads(engine) -> Optional[int]:
    """The CPU thread count the trees are chosen for: the governor's full count where one follows
    the load (it drops to one thread only while other processes use the cores, so a tree chosen
    then would stay too small once they stop), else torch's current count; None on a GPU."""
    if engine.device.type != "cpu":
        return None
    gov = getattr(engine, "governor", None)
    return gov.wide if gov is not None else torch.get_num_threads()


def trees_path(engine, heads: str) -> Path:
    """`tuning.machine_dir()/trees-<model>-<dtype>-<kernels>-<heads>-<id>[-t<threads>]-p<protocol>-e<code>.json`.

    On a CPU the step latencies the trees are chosen by depend on the torch threads decoding runs
    with (a tree's extra rows are arithmetic, which a second thread halves; a one-row step is
    memory-bound), so trees timed with one count are not reused with another."""
    key = model_key(engine.model)
    label = heads.replace("+", "p")
    n = decoding_threads(engine)
    threads = f"-t{n}" if n else ""
    name = (f"trees-{key['architecture']}-{key['config']}-{key['dtype']}-{engine.kernels}-{label}-"
            f"{_heads_id(engine.runners[heads])}{threads}-p{LATENCY_PROTOCOL}-e{engine_code_id()}.json")
    # remeasured when the timing protocol or the engine's step code changes
    return machine_dir(engine.device) / name


NEAR_TIE = 0.02  # trees predicted within this share of the best tokens/s: the one with the fewest nodes


def choose_tree(cands):
    """The searched tree (`search.search_trees` candidates) to decode with: the highest predicted
    tokens/s, except that among the trees predicted within NEAR_TIE of it the one with the fewest
    nodes (then levels) wins. The latency model prices a tree's extra rows against plain steps timed
    around it, and where the one-row step switches between two speeds for seconds at a time while
    multi-row steps hold theirs (a 2-core EPYC VM: 10.3 and 12.3 ms), a few seconds of timing can
    price rows several percent too cheap: there Medusa's 8-node tree, predicted at 1.31x plain
    decoding, decoded at 1.00x. A smaller tree loses at most NEAR_TIE where the model is right."""
    top = max(c.predicted_tokens_per_s for c in cands)
    near = [c for c in cands if c.predicted_tokens_per_s >= (1 - NEAR_TIE) * top]
    return min(near, key=lambda c: (c.n_nodes, c.depth, -c.predicted_tokens_per_s))


FIRST_STAGE_NODES = 8  # the latency grid's first stage: every depth up to this size, and depth 1 at every size


def priced(cands: Iterable[Candidate], latency: LatencyModel) -> list[Candidate]:
    """The candidates whose size was timed at their depth (none priced by extrapolation), priced."""
    return price_candidates([c for c in cands if c.n_nodes <= latency.measured_size(c.depth)], latency)


def _next_size(grid: list[tuple[int, int]], depth: int, timed: int) -> Optional[int]:
    """The smallest size of `grid` at `depth` past `timed`, or None."""
    return min((n for n, d in grid if d == depth and n > timed), default=None)


def next_grid_jobs(cands: list[Candidate], latency: LatencyModel, grid: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The grid points (size, depth) to time next: at each depth, the next size past those timed,
    where some tree that needs it could still come within NEAR_TIE of the best timed tree's
    predicted tokens/s, priced at its floor (`LatencyModel.floor`: more rows or levels never cost
    less). Where none could, those trees cannot be chosen and their steps are not timed."""
    top = max((c.predicted_speedup for c in priced(cands, latency)), default=0.0)
    need = set()
    for c in cands:
        timed = latency.measured_size(c.depth)
        if c.n_nodes <= timed:
            continue
        bound = c.predicted_tau * latency.baseline_s / latency.floor(c.n_nodes, c.depth)
        nxt = _next_size(grid, c.depth, timed)
        if bound >= (1 - NEAR_TIE) * top and nxt is not None:
            need.add((nxt, c.depth))
    return sorted(need)


def lookup_grid_jobs(tree: Tree, latency: LatencyModel, grid: list[tuple[int, int]],
                     length: int = LOOKUP_LENGTH) -> list[tuple[int, int]]:
    """The grid points to time next so that `choose_lookup` prices `tree` with a grafted chain of
    up to `length` tokens (up to `length` more rows, at most `length` levels) from timed steps."""
    need = []
    for d in range(tree.depth, max(tree.depth, length) + 1):
        timed = latency.measured_size(d)
        nxt = _next_size(grid, d, timed)
        if timed and timed < tree.n_nodes + length and nxt is not None:
            need.append((nxt, d))
    return need


def staged_grid(cands: list[Candidate], grid: list[tuple[int, int]],
                time_jobs: Callable[[list[tuple[int, int]]], LatencyModel]) -> LatencyModel:
    """The latency model of `grid` timed in stages by `time_jobs` (points -> their model), only
    where a tree of `cands` could be chosen: first every tree of up to FIRST_STAGE_NODES nodes and
    the depth-1 trees of every size (the cost of rows), then the next sizes that `next_grid_jobs`
    asks for, until none, and the rows the chosen tree's prompt-lookup branch adds
    (`lookup_grid_jobs`). meta["untimed"]: the grid's points never timed."""
    latency = time_jobs([(n, d) for n, d in grid if n <= FIRST_STAGE_NODES or d == 1])
    while True:
        need = next_grid_jobs(cands, latency, grid)
        if not need:
            pool = priced(cands, latency)
            need = lookup_grid_jobs(choose_tree(pool).tree, latency, grid) if pool else []
        if not need:
            break
        latency = latency.merged(time_jobs(need))
    have = {(n, d) for d, pts in latency.points.items() for n, _ in pts}
    latency.meta["untimed"] = [list(j) for j in grid if j not in have]
    return latency


def staged_latency(engine, heads: str, cands: list[Candidate], sizes, depths, repeats: int = 2,
                   context_tokens: int = SHORT_CONTEXT, prefills: Optional[ContextPrefills] = None) -> LatencyModel:
    """The step latency of `latency_jobs(sizes, depths)` measured in stages (`staged_grid`): where
    rows are dear (a CPU) the large deep trees, the dearest steps of the grid, are never timed;
    where they are cheap (a GPU) the stages time the whole grid."""
    return staged_grid(cands, latency_jobs(sizes, depths), lambda jobs: measure_latency(
        engine, heads, max_nodes=max(sizes), jobs=jobs, repeats=repeats, context_tokens=context_tokens, prefills=prefills))


def tune_trees(engine, heads: str, stats: Optional[CalibrationStats] = None, repeats: int = 2,
               progress: Optional[Callable[[str], object]] = None,
               prefills: Optional[ContextPrefills] = None) -> Optional[TunedTrees]:
    """Measure step latency here for trees of each size and depth, then choose the static tree of
    highest predicted tokens/s and fit the entropy bank, from `stats` (default: shipped with the
    heads). None when there are no statistics. prefills: the measuring contexts' prefills, shared
    with other heads' tunes (`tune_all`)."""
    runner = engine.runners[heads]
    stats = stats if stats is not None else shipped_stats(runner)
    if stats is None or not stats.records:
        return None
    K = min(runner.config.num_heads, stats.depth)
    sizes = CUDA_SIZES if engine.device.type == "cuda" else CPU_SIZES
    if progress:
        progress(f"tuning: step latency of {heads} trees on this machine")
    prefills = prefills if prefills is not None else ContextPrefills()  # the grid's stages share them
    searched = search_trees(stats, [max(sizes)], None, depths=range(1, K + 1))  # taus: the machine's part is timed next
    latency = staged_latency(engine, heads, searched, sizes, range(1, K + 1), repeats=repeats, prefills=prefills)
    cands = priced(searched, latency)
    best = choose_tree(cands)
    tree = Tree(best.tree.paths, f"tuned-{heads}-n{best.n_nodes}-d{best.depth}")
    top = max(cands, key=lambda c: (c.predicted_tokens_per_s, -c.n_nodes))
    what = ("highest predicted tokens/s" if best is top else
            f"fewest nodes within {NEAR_TIE:.0%} of the highest predicted tokens/s ({top.n_nodes} nodes, "
            f"{top.predicted_speedup:.2f}x)")
    untimed = latency.meta.get("untimed") or []
    bounded = (f"; {len(searched) - len(cands)} larger trees could not come within {NEAR_TIE:.0%} of it even at the "
               f"step time of fewer rows, so {len(untimed)} of the grid's sizes were not timed") if untimed else ""
    why = (f"{what} of {len(searched)} trees searched from {stats.n_steps} shipped acceptance "
           f"records: tau {best.predicted_tau:.2f} at {best.step_cost_s * 1e3:.1f} ms a step "
           f"(plain step {latency.baseline_s * 1e3:.1f} ms){bounded}")
    out = TunedTrees(heads, tree, float(best.predicted_tau), float(best.predicted_speedup), latency, why=why,
                     stats_steps=stats.n_steps, meta={"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    pool = sorted({c.tree.key(): c for c in cands if c.predicted_speedup > 0}.values(),
                  key=lambda c: -c.predicted_tokens_per_s)[:24]
    if any(r.root_entropy == r.root_entropy for r in stats.records):  # some finite entropies
        trees = [Tree(c.tree.paths, f"tuned-{heads}-n{c.n_nodes}-d{c.depth}") for c in pool]
        out.bank, out.bank_speedup, note = choose_bank(stats, trees, tree, latency)
        out.why += f"; {note}"
    choice = choose_lookup(stats, tree, latency)
    if choice is not None:
        out.lookup_min_ngram, out.lookup_speedups, note = choice
        out.why += f"; {note}"
    context = min(LONG_CONTEXT, engine.max_context // 4)
    if context >= 4 * SHORT_CONTEXT and tree.n_nodes > 1:
        if progress:
            progress(f"tuning: step latency of {heads} trees after {context} cached tokens")
        out.long, note = tune_long_context(engine, heads, stats, out, context, repeats=repeats, prefills=prefills,
                                           searched=searched)
        if out.long is None:  # a long-context tree is shown on its own line (`long_context_words`)
            out.why += f"; {note}"
    return out


def tune_long_context(engine, heads: str, stats: CalibrationStats, short: TunedTrees, context: int,
                      repeats: int = 2, prefills: Optional[ContextPrefills] = None,
                      searched: Optional[list[Candidate]] = None) -> tuple[Optional[LongContextTrees], str]:
    """Time trees no larger nor deeper than the short-context one after `context` cached tokens
    (rows only get dearer as the context grows, so no larger tree can pay there) and choose the
    best by the same scoring; (its `LongContextTrees`, why) where it beats the short-context tree
    there, else (None, why). searched: the short-context search's trees, of which those small and
    shallow enough are scored (default: searched again)."""
    size, depth = short.tree.n_nodes, short.tree.depth
    # the short tree's own size too: a 5-node tree is not priced from the 3- and 4-node steps' slope
    sizes = sorted({n for n in (CUDA_SIZES if engine.device.type == "cuda" else CPU_SIZES) if n <= size} | {size})
    latency = measure_latency(engine, heads, max_nodes=size, sizes=sizes, depths=range(1, depth + 1),
                              repeats=repeats, context_tokens=context, prefills=prefills)
    if searched is None:
        searched = search_trees(stats, [size], None, depths=range(1, depth + 1))
    cands = price_candidates([c for c in searched if c.n_nodes <= size and c.depth <= depth], latency)
    best = max(cands, key=lambda c: (c.predicted_tokens_per_s, -c.n_nodes))
    kept = latency.speedup(short.predicted_tau, size, depth)
    if best.tree.key() == short.tree.key() or best.predicted_speedup <= kept:
        return None, f"after {context} cached tokens the same tree still pays best ({kept:.2f}x plain decoding)"
    tree = Tree(best.tree.paths, f"tuned-{heads}-n{best.n_nodes}-d{best.depth}-long")
    start = switch_point(short.predicted_tau, short.latency.cost(size, depth), latency.cost(size, depth),
                         float(best.predicted_tau), short.latency.cost(best.n_nodes, best.depth),
                         latency.cost(best.n_nodes, best.depth), SHORT_CONTEXT, context)
    bank = None
    if short.bank is not None and short.bank.edges:  # the bank paid: refit it with this context's step times
        pool = sorted({c.tree.key(): c for c in cands if c.predicted_speedup > 0}.values(),
                      key=lambda c: -c.predicted_tokens_per_s)[:24]
        trees = [Tree(c.tree.paths, f"tuned-{heads}-n{c.n_nodes}-d{c.depth}-long") for c in pool]
        bank, _, _ = choose_bank(stats, trees, tree, latency)
    out = LongContextTrees(start, context, tree, float(best.predicted_tau), float(best.predicted_speedup), kept,
                           latency, bank)
    return out, f"long contexts: {out.summary()}"


def switch_point(tau_a: float, cost_a0: float, cost_a1: float, tau_b: float, cost_b0: float, cost_b1: float,
                 c0: int, c1: int) -> int:
    """The context (cached tokens, in [c0, c1]) from which tree b predicts at least tree a's
    tokens/s, each tree's step time linear in the context between its timings at c0 and c1
    (attention over the cache is linear in it): the root of tau_b * cost_a(c) - tau_a * cost_b(c)."""
    f0, f1 = tau_b * cost_a0 - tau_a * cost_b0, tau_b * cost_a1 - tau_a * cost_b1
    if f0 >= 0:
        return c0
    if f1 <= 0:
        return c1
    return int(round(c0 + (c1 - c0) * -f0 / (f1 - f0)))


def lookup_speedup(stats: CalibrationStats, tree: Tree, latency: LatencyModel, length: int, min_ngram: int) -> float:
    """Predicted speedup over plain decoding of `tree` with a prompt-lookup branch of `length`
    tokens grafted after matches of >= `min_ngram` tokens (length 0: no branch), replaying the
    statistics' greedy continuations: a step accepts the longer of the heads' path and the copied
    chain, and verifies the tree's rows plus the chain's rows beyond the heads' accepted ones."""
    L = stats.accepted_lengths(tree)  # [R]
    look: dict[tuple[str, int], tuple[int, int]] = {}
    if length:
        for pid, info in stats.prompts.items():
            for o, pa in enumerate(chain_outcomes(info["prompt_ids"], info["answer_ids"], int(info["n_positions"]),
                                                  length, min_ngram)):
                look[(pid, o)] = pa
    # [R, 2]: the chain's proposed tokens and how many of them the base accepts, per record
    chain = np.array([look.get((r.prompt_id, r.position), (0, 0)) for r in stats.records], dtype=np.int64).reshape(-1, 2)
    proposed, chain_ok = chain[:, 0], chain[:, 1]
    _, starts, _, emitted = stats.replay(np.maximum(L, chain_ok))
    p = proposed[starts]
    extra = np.where(p > 0, p - np.minimum(chain_ok[starts], L[starts]), 0)  # rows shared with the accepted heads path
    rows_levels, counts = np.unique(np.stack([tree.n_nodes + extra, np.maximum(tree.depth, p)], 1), axis=0,
                                    return_counts=True)
    seconds = sum(int(c) * latency.cost(int(n), int(d)) for (n, d), c in zip(rows_levels, counts))
    tokens = float(emitted.sum())
    return tokens / seconds * latency.baseline_s if seconds else 0.0


def choose_lookup(stats: CalibrationStats, tree: Tree, latency: LatencyModel, length: int = LOOKUP_LENGTH
                  ) -> Optional[tuple[int, dict[str, float], str]]:
    """The prompt-lookup branch that pays here: no branch, or `length` tokens after matches of at
    least 1, 2 or 3 tokens, whichever predicts the most tokens/s with `tree` (`lookup_speedup`:
    hardware-independent continuations, step times measured here; a branch costs rows, which are
    nearly free on one machine and dear on another). None when the statistics hold no tokens
    (older files). Returns (shortest grafted n-gram, 0 for none; predicted speedups; why)."""
    if stats.mode != "trace" or not stats.prompts or not all(
            "prompt_ids" in p and "answer_ids" in p for p in stats.prompts.values()):
        return None
    scores = {"off": lookup_speedup(stats, tree, latency, 0, 1)}
    for n in LOOKUP_MIN_NGRAMS:
        scores[str(n)] = lookup_speedup(stats, tree, latency, length, n)
    best = max(scores, key=lambda k: (scores[k], k == "off"))  # a tie keeps the rows
    chosen = 0 if best == "off" else int(best)
    table = ", ".join(f"{k}: {v:.3f}x" for k, v in scores.items())
    note = ("prompt lookup: off" if not chosen else f"prompt lookup: {length} tokens after matches of >= {chosen}") + \
        f" (predicted speedup by shortest match: {table})"
    return chosen, {k: round(v, 4) for k, v in scores.items()}, note


def choose_bank(stats: CalibrationStats, trees: list[Tree], static: Tree, latency: LatencyModel,
                min_prompts: int = 8) -> tuple[Optional[EntropyBucketScheduler], Optional[float], str]:
    """The entropy bank the entropy scheduler uses: fitted on half the prompts and compared with
    the static tree on the other half; kept (refitted on all prompts) only where it predicts more
    tokens/s there, else a one-bucket bank of the static tree. Returns (bank, predicted speedup
    over plain decoding, why)."""
    ids = stats.prompt_ids
    single = EntropyBucketScheduler({static.name: static}, [], [static.name], meta={"fit": "static: no held-out gain"})
    try:
        if len(ids) >= min_prompts:
            fit, held = stats.subset(ids[0::2]), stats.subset(ids[1::2])
            half, report = fit_entropy_bank(fit, trees, latency)
            static_half = next(t for t in trees if t.name == report["best_static"]["tree"])
            bank_tps, static_tps = compare_on(held, half, static_half, latency)
            if bank_tps <= static_tps:
                return single, None, (f"entropy bank: no gain on held-out prompts ({bank_tps / static_tps:.3f}x the "
                                      f"static tree), so the static tree on every step")
            gain = f"{bank_tps / static_tps:.3f}x the static tree on held-out prompts"
        else:
            gain = f"not checked on held-out prompts (fewer than {min_prompts} prompts)"
        bank, report = fit_entropy_bank(stats, trees, latency)
        bank.meta["held_out"] = gain
        return bank, float(report["predicted_tokens_per_s"]) * latency.baseline_s, f"entropy bank: {gain}"
    except ValueError:
        return single, None, "entropy bank: too few records, so the static tree on every step"


def tuned_trees(engine, heads: str, progress: Optional[Callable[[str], object]] = None,
                prefills: Optional[ContextPrefills] = None) -> Optional[TunedTrees]:
    """The cached `tune_trees` result for (machine, engine, heads), measured when missing (and
    cached unless other processes used the cores meanwhile: `threads.busy_note`). None when
    ENTMTP_TUNE=0 or the heads ship no statistics. prefills: as `tune_trees`."""
    mode = os.environ.get("ENTMTP_TUNE", "1").strip().lower()
    if mode in ("0", "off", "false", "no") or heads not in engine.runners:
        return None
    path = trees_path(engine, heads)
    if mode != "refresh" and path.is_file():
        try:
            return TunedTrees.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError, OSError):
            pass
    if heads in engine.held_tunes:  # measured under load earlier in this process
        return engine.held_tunes[heads]
    load = CoreLoad()
    with torch.inference_mode(), torch_threads(decoding_threads(engine)):
        out = tune_trees(engine, heads, progress=progress, prefills=prefills)
    if out is None:
        return None
    busy = busy_note(load, "the step latency was")
    if busy:  # this engine decodes with these trees; the next load measures again
        out.why += f" ({busy})"
        engine.held_tunes[heads] = out
        return out
    try:
        write_json_atomic(path, out.to_json())
    except OSError as e:  # a read-only cache: the choice still holds in this process, which holds it
        out.why += f" (not cached: {e.strerror or e})"
        engine.held_tunes[heads] = out
    return out


def tune_all(engine, heads: Iterable[str], progress: Optional[Callable[[str], object]] = None
             ) -> dict[str, Optional[TunedTrees]]:
    """`tuned_trees` of each of `heads`, in order, the measuring contexts prefilled once for all
    (`calibrate.ContextPrefills`: kinds reading the same base layers share them; the long
    context's prefill was ~2 s of each kind's ~9 s on a 2-core CPU). {heads: tuned or None}."""
    prefills = ContextPrefills()
    return {h: tuned_trees(engine, h, progress=progress, prefills=prefills) for h in heads}


FAMILY_RACE_ROUNDS = 6  # rounds of `measure_step_ratios` that compare the tuned trees of several heads


def best_speedup(t: TunedTrees) -> float:
    """A tune's predicted speedup over plain decoding: its bank's where that beats the static tree."""
    return max(t.predicted_speedup, t.bank_speedup or 0.0)


def compared_speedups(engine, tuned: dict[str, TunedTrees], progress: Optional[Callable[[str], object]] = None) -> dict[str, float]:
    """The predicted speedups of several heads' tunes, made comparable: each heads' latency model
    was measured on its own, a few seconds from the others' (`tuned_trees`), and where the
    machine's speed moves in phases that long, two models disagree by more than the heads do (a
    2-core EPYC: a 6-node step at 1.18x a plain one in one model, 1.5x in the next). So the tuned
    trees are timed again in shared rounds (`measure_step_ratios`) and each prediction is scaled by
    (its model's step ratio / the shared one). Cached per machine beside the trees, unless other
    processes used the cores meanwhile. {heads: speedup}."""
    if len(tuned) < 2:
        return {h: best_speedup(t) for h, t in tuned.items()}
    trees = {h: t.tree for h, t in tuned.items()}
    ident = hashlib.sha256(json.dumps({h: [trees_path(engine, h).name, [list(p) for p in trees[h].paths],
                                           t.meta.get("measured_at")] for h, t in sorted(tuned.items())},
                                      sort_keys=True).encode()).hexdigest()[:12]
    path = machine_dir(engine.device) / f"compared-{ident}.json"
    shared = None
    if os.environ.get("ENTMTP_TUNE", "1").strip().lower() != "refresh" and path.is_file():
        try:
            shared = {h: float(v) for h, v in json.loads(path.read_text())["step_ratios"].items()}
        except (ValueError, KeyError, TypeError, json.JSONDecodeError, OSError):
            shared = None
    if shared is None or set(shared) != set(tuned):
        shared = engine.held_tunes.get(f"compared-{ident}")
    if shared is None:
        if progress:
            progress(f"tuning: {', '.join(tuned)} trees timed side by side")
        load = CoreLoad()
        with torch.inference_mode(), torch_threads(decoding_threads(engine)):
            shared = measure_step_ratios(engine, trees, rounds=FAMILY_RACE_ROUNDS, context_tokens=SHORT_CONTEXT)
        if busy_note(load, "the side-by-side timing was"):
            engine.held_tunes[f"compared-{ident}"] = shared
        else:
            try:
                write_json_atomic(path, {"step_ratios": shared, "trees": {h: t.name for h, t in trees.items()},
                                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
            except OSError as e:  # a read-only cache: the comparison holds for this engine, which says so
                engine.held_tunes[f"compared-{ident}"] = shared
                if progress:
                    progress(f"tuning: the side-by-side timing is not cached ({e.strerror or e}); it holds for this process")
    out = {}
    for h, t in tuned.items():
        own = t.latency.cost(t.tree.n_nodes, t.tree.depth) / t.latency.baseline_s
        ratio = shared.get(h, float("nan"))
        out[h] = best_speedup(t) * own / ratio if ratio == ratio and ratio > 0 else best_speedup(t)
    return out


def tuned_bank(engine, heads: str) -> Optional[EntropyBucketScheduler]:
    """The entropy bank tuned for these heads here (a one-bucket bank of the static tree where no
    bank paid), or None when nothing was tuned. Taken as an object, never through a file that an
    earlier tune could have left behind."""
    t = tuned_trees(engine, heads)
    return None if t is None else t.bank


__all__ = ["ACCEPTANCE_FILE", "STEP_SOURCES", "engine_code_id", "LOOKUP_LENGTH", "SHORT_CONTEXT", "NEAR_TIE", "choose_tree", "LONG_CONTEXT", "LongContextTrees", "TunedTrees", "tune_long_context", "tune_all", "FIRST_STAGE_NODES", "priced", "next_grid_jobs", "lookup_grid_jobs", "staged_grid", "staged_latency", "switch_point", "shipped_stats", "tune_trees", "choose_bank", "choose_lookup", "lookup_speedup", "tuned_trees", "trees_path", "tuned_bank",
           "FAMILY_RACE_ROUNDS", "best_speedup", "compared_speedups"]


def machine_profile(engine, progress: Optional[Callable[[str], object]] = None, family: tuple[str, ...] = ()) -> dict:
    """Everything tuned for `engine` on this machine, as one JSON-able dict: fingerprint, the
    kernel trials and choice, threads, and per loaded heads the tuned tree, bank and latency curve.
    family: heads kinds one method chooses among (entmtp's Hydra family); where two or more are
    loaded and tuned, "family" holds their speedups timed side by side and the one chosen."""
    prof = engine.kernel_profile
    out = {"fingerprint": prof.fingerprint if prof else None, "dtype": str(engine.dtype).removeprefix("torch."),
           "device": str(engine.device), "kernels": engine.kernels, "kernels_why": engine.kernels_reason,
           "row_invariant": engine.row_invariant, "threads": decoding_threads(engine),
           "threads_governed": getattr(engine, "governor", None) is not None,
           "kernel_trials": [t.to_json() for t in prof.trials] if prof else [], "probe_s": prof.probe_s if prof else 0.0,
           "cache_file": prof.cache_file if prof else None, "heads": {}}
    tuned_all = tune_all(engine, engine.runners, progress=progress)
    for name in engine.runners:
        t = tuned_all[name]
        if t is None:
            out["heads"][name] = None
            continue
        curve = {str(n): round(s * 1e3, 2) for n, s in sorted(t.latency.points.get(1, []))}
        out["heads"][name] = {"tree": t.tree.name, "nodes": t.tree.n_nodes, "depth": t.tree.depth,
                              "paths": [list(p) for p in t.tree.paths], "predicted_tau": round(t.predicted_tau, 3),
                              "predicted_speedup": round(t.predicted_speedup, 3), "bank_speedup": t.bank_speedup,
                              "plain_step_ms": round(t.latency.baseline_s * 1e3, 2), "step_ms_by_nodes_depth1": curve,
                              "lookup_min_ngram": t.lookup_min_ngram, "lookup_speedups": t.lookup_speedups,
                              "long_context": None if t.long is None else {
                                  "from_tokens": t.long.from_tokens, "context": t.long.context, "tree": t.long.tree.name,
                                  "nodes": t.long.tree.n_nodes, "depth": t.long.tree.depth,
                                  "predicted_speedup": round(t.long.predicted_speedup, 3),
                                  "short_tree_speedup": round(t.long.short_tree_speedup, 3)},
                              "why": t.why, "draft_lm": draft_lm_entry(engine.runners[name])}
    tuned = {h: tuned_all[h] for h in family if h in engine.runners}
    if len(tuned) >= 2 and all(t is not None for t in tuned.values()):
        speedups = compared_speedups(engine, tuned, progress=progress)
        out["family"] = {"heads": max(tuned, key=lambda h: speedups[h]),
                         "speedups": {h: round(v, 3) for h, v in speedups.items()}}
    return out


def draft_lm_entry(runner) -> Optional[dict]:
    """How a heads' drafts score tokens through the shared lm_head slice: int8 or the kernels' own
    dtype, with the timings that chose it (ms of a 1-row call on flushed caches plus a 4-row call,
    `heads.draft_lm_timings`; None when forced or too small to measure). None for heads with their
    own lm_heads."""
    if runner.lm is None:
        return None
    ms = None if runner.lm_seconds is None else [round(s * 1e3, 3) for s in runner.lm_seconds]
    return {"int8": runner.lm_int8, "rows": runner.lm_weight.shape[0], "ms": ms, "int8_blocks": runner.int8_blocks,
            "int8_prefix": runner.int8_prefix}


def draft_lm_words(d: Optional[dict]) -> str:
    """`draft_lm_entry` in words ("" for none)."""
    if not d:
        return ""
    what = "int8" if d["int8"] else "the kernels' own dtype"
    why = (f" ({d['ms'][1]:.2f} ms in int8 against {d['ms'][0]:.2f} ms for a 1-row call on flushed caches and a 4-row call)"
           if d.get("ms") else "")
    layer = " and the Hydra++ layer" if d.get("int8_prefix") else ""
    blocks = f"; the heads' {d['int8_blocks']} residual blocks{layer} in int8 too" if d.get("int8_blocks") else ""
    return f"drafts score {d['rows']} tokens through the lm_head in {what}{why}{blocks}"


def format_profile(p: dict) -> str:
    """`machine_profile` as text for a terminal (markdown tables)."""
    fp = p.get("fingerprint") or {}
    what = fp.get("gpu") or f"{fp.get('cpu', '?')} ({fp.get('isa', '?')}, {fp.get('cores', '?')} cores)"
    lines = [f"machine: {what}; torch {fp.get('torch', torch.__version__)}; {p['dtype']} on {p['device']}",
             f"kernels: {p['kernels']} -- {p['kernels_why']}",
             "lossless: " + ("tree rows are bitwise one-row steps: speculation emits exactly the plain loop's tokens"
                             if p["row_invariant"] else "not row-invariant here: speculation matches plain decoding up "
                             "to rounding (identity is measured by `entmtp bench`)"),
             (f"threads: {p['threads']}" + (" while the cores are free, one while other processes use them (governor)"
                                            if p.get("threads_governed") else "")) if p.get("threads") else "", "",
             "| kernel set | runs here | 1 row | 2 | 4 | 8 | 16 | 32 | row-invariant |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for t in p["kernel_trials"]:
        ms = t.get("ms_by_rows", {})
        cells = " | ".join(f"{float(ms[str(r)]):.1f}" if str(r) in ms else "-" for r in (1, 2, 4, 8, 16, 32))
        inv = t.get("invariant_rows") or {}
        lines.append(f"| {t['name']} | {'yes' if t['ran'] else 'no: ' + t['why']} | {cells} | "
                     f"{'-' if not inv else ('yes' if all(inv.values()) else 'no')} |")
    lines.append("\n(ms per forward of a chain of that many tree rows after 96 cached tokens)\n")
    for name, h in p["heads"].items():
        if h is None:
            lines.append(f"{name}: no shipped acceptance statistics (the heads' recorded tree is used)")
            continue
        bank = f"; entropy bank {h['bank_speedup']:.2f}x" if h.get("bank_speedup") else ""
        look = h.get("lookup_min_ngram")
        look = ("" if look is None else "; prompt lookup off" if not look else
                f"; prompt lookup of {LOOKUP_LENGTH} tokens after matches of >= {look}")
        lines.append(f"{name}: tree {h['nodes']} nodes, depth {h['depth']}, predicted tau {h['predicted_tau']:.2f}, "
                     f"{h['predicted_speedup']:.2f}x plain decoding{bank}{look} -- {h['why']}")
        if h.get("long_context"):
            lines.append(f"{name}, long contexts: {long_context_words(h['long_context'])}")
        if h.get("draft_lm"):
            lines.append(f"{name}, drafting: {draft_lm_words(h['draft_lm'])}")
    if p.get("family"):
        f = p["family"]
        lines.append(f"{' / '.join(f['speedups'])} timed side by side: " + ", ".join(
            f"{h} {v:.2f}x" for h, v in f["speedups"].items()) + f" plain decoding; entmtp drafts with {f['heads']}")
    return "\n".join(x for x in lines if x is not None)


def long_context_words(lc: dict) -> str:
    """`machine_profile`'s long-context entry of one heads, in words."""
    return (f"from {lc['from_tokens']} cached tokens a tree of {lc['nodes']} nodes, depth {lc['depth']}: "
            f"{lc['predicted_speedup']:.2f}x plain decoding after {lc['context']} tokens, where the first tree "
            f"predicts {lc['short_tree_speedup']:.2f}x")


__all__ += ["machine_profile", "format_profile", "long_context_words", "draft_lm_entry", "draft_lm_words"]
