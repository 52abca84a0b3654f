"""Tree schedulers: choose each step's draft tree.

A scheduler sees this step's signals before drafting -- the base model's entropy and top-1
probability of the distribution that produced the root, the first draft head's entropy and
top-1 probability at the root (computed in this step), the recent acceptance history -- and
picks a tree from a bank of pre-built trees (buffers built once; a switch is a reference
swap). After verification it is told the accepted length. Each generation works on its own
`fresh()` copy, which shares the immutable trees.

Policies:
* `Scheduler` (static): one tree.
* `LadderScheduler`: entmtp's threshold ladder -- a confidence signal against ascending
  thresholds picks a rung (a bigger tree when the model is more certain).
* `HysteresisScheduler`: entmtp's two-tree switch with hysteresis on the same signal.
* `EntropyBucketScheduler`: buckets of the root entropy (optionally the draft entropy) map
  to trees; the table is fitted by the topology lab from calibration statistics (per bucket,
  the tree with the best expected tokens/s) and stored as a bank JSON.
* `DynamicScheduler`: EAGLE-2 style; grows each step's tree by cumulative draft
  log-probability under a node budget (the tree is built from this step's head outputs).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .hardware import hardware_class
from .trees import TREES_DIR, Tree, TreeError, dumps_compact, read_json_file, resolve_tree, tree_from_json


@dataclass
class StepSignals:
    step: int
    root_entropy: float = float("nan")  # base entropy (nats) of the distribution that chose the root
    root_prob: float = float("nan")  # base probability of the root token
    draft_entropy: float = float("nan")  # first draft head's entropy at the root (this step)
    draft_top1: float = float("nan")  # first draft head's top-1 probability at the root
    history: tuple[int, ...] = ()  # accepted lengths of the previous steps (most recent last)
    past: int = 0  # tokens in the cache (prompt and emitted) before this step
    context: Any = field(default=None, repr=False)  # DraftContext for schedulers that draft


@dataclass
class DraftContext:
    """What a drafting scheduler needs: the heads and this step's head feature and root, and
    whether the step's trace records the draft's statistics (entropies)."""

    runner: Any
    feature: torch.Tensor
    root: torch.Tensor
    with_stats: bool = True


@dataclass
class Decision:
    tree: Tree
    reason: dict[str, Any] = field(default_factory=dict)
    draft: Any = None  # a ready Draft when the scheduler drafted the tree itself


class Scheduler:
    """Static: always the same tree. Subclasses override `choose` (and `update`)."""

    name = "static"
    needs_root = False  # compute root entropy/probability before choosing
    needs_draft = False  # compute the first head level's entropy before choosing
    needs_context = False  # pass the DraftContext (drafting schedulers)

    def __init__(self, tree: Tree):
        self.tree = tree

    @property
    def trees(self) -> list[Tree]:
        return [self.tree]

    @property
    def max_depth(self) -> int:
        return max(t.depth for t in self.trees)

    def fresh(self) -> "Scheduler":
        return self

    def describe(self) -> str:
        """Its one tree described, else the policy's name."""
        trees = self.trees
        return trees[0].describe() if len(trees) == 1 else f"{self.name} scheduler"

    def choose(self, signals: StepSignals) -> Decision:
        return Decision(self.tree)

    def update(self, accepted_length: int) -> None:
        pass


StaticScheduler = Scheduler


class ContextSwitch(Scheduler):
    """`short` below `from_tokens` cached tokens, `long` from there on. A tree's extra rows attend
    to every cached token, so where rows cost arithmetic (a CPU) a smaller tree pays once the
    context is long (`autotune.tune_long_context` times both and sets the switch)."""

    def __init__(self, short: Scheduler, long: Scheduler, from_tokens: int):
        if from_tokens < 0:
            raise ValueError("a context switch needs from_tokens >= 0")
        self.short, self.long, self.from_tokens = short, long, int(from_tokens)
        self.name = short.name
        self.needs_root = short.needs_root or long.needs_root
        self.needs_draft = short.needs_draft or long.needs_draft
        self.needs_context = short.needs_context or long.needs_context
        self.tree = short.tree

    @property
    def trees(self) -> list[Tree]:
        return self.short.trees + self.long.trees

    def fresh(self) -> "ContextSwitch":
        return ContextSwitch(self.short.fresh(), self.long.fresh(), self.from_tokens)

    def describe(self) -> str:
        return f"{self.short.describe()}; from {self.from_tokens} cached tokens {self.long.describe()}"

    def choose(self, s: StepSignals) -> Decision:
        long = s.past >= self.from_tokens
        d = (self.long if long else self.short).choose(s)
        d.reason = {**d.reason, "context": f"{'long' if long else 'short'} (switch at {self.from_tokens} tokens)"}
        return d

    def update(self, accepted_length: int) -> None:
        self.short.update(accepted_length)
        self.long.update(accepted_length)


def _signal(s: StepSignals, name: str) -> float:
    if name == "root_confidence":  # 1 - normalised root entropy proxy: the base's top-1 prob
        return s.root_prob
    if name == "neg_root_entropy":
        return -s.root_entropy
    if name == "neg_draft_entropy":
        return -s.draft_entropy
    if name == "recent_accept":
        return sum(s.history[-4:]) / max(1, len(s.history[-4:]))
    return float(getattr(s, name))


class LadderScheduler(Scheduler):
    """trees[i] is used when thresholds[i-1] <= signal < thresholds[i] (ascending thresholds)."""

    name = "ladder"
    needs_root = True

    def __init__(self, trees: list[Tree], thresholds: list[float], signal: str = "root_prob"):
        if len(trees) != len(thresholds) + 1:
            raise ValueError("a ladder needs one more tree than thresholds")
        if list(thresholds) != sorted(thresholds):
            raise ValueError("ladder thresholds must be ascending")
        self.rungs, self.thresholds, self.signal = list(trees), list(thresholds), signal
        self.needs_draft = "draft" in signal
        self.tree = self.rungs[0]

    @property
    def trees(self) -> list[Tree]:
        return self.rungs

    def choose(self, s: StepSignals) -> Decision:
        v = _signal(s, self.signal)
        i = 0 if math.isnan(v) else bisect.bisect_right(self.thresholds, v)
        return Decision(self.rungs[i], {"signal": self.signal, "value": v, "rung": i})


class HysteresisScheduler(Scheduler):
    """Two trees: go aggressive when signal >= high, back to conservative when signal < low."""

    name = "hysteresis"
    needs_root = True

    def __init__(self, conservative: Tree, aggressive: Tree, low: float, high: float, signal: str = "root_prob"):
        if low > high:
            raise ValueError("hysteresis needs low <= high")
        self.conservative, self.aggressive, self.low, self.high, self.signal = conservative, aggressive, low, high, signal
        self.needs_draft = "draft" in signal
        self.tree = conservative
        self.state = False

    @property
    def trees(self) -> list[Tree]:
        return [self.conservative, self.aggressive]

    def fresh(self) -> "HysteresisScheduler":
        return HysteresisScheduler(self.conservative, self.aggressive, self.low, self.high, self.signal)

    def choose(self, s: StepSignals) -> Decision:
        v = _signal(s, self.signal)
        if not math.isnan(v):
            if not self.state and v >= self.high:
                self.state = True
            elif self.state and v < self.low:
                self.state = False
        return Decision(self.aggressive if self.state else self.conservative,
                        {"signal": self.signal, "value": v, "aggressive": self.state})


class EntropyBucketScheduler(Scheduler):
    """Bucket the root entropy (and optionally the first draft head's entropy); each bucket has a tree.

    edges: ascending bucket boundaries of root entropy (nats); table[i] is the tree name of
    bucket i (len(edges) + 1 buckets). With draft_edges, the table is 2-D: table[i][j].
    """

    name = "entropy"
    needs_root = True

    def __init__(self, trees: dict[str, Tree], edges: list[float], table: list, draft_edges: Optional[list[float]] = None,
                 meta: Optional[dict] = None):
        self.bank, self.edges, self.table = dict(trees), list(edges), table
        self.draft_edges = list(draft_edges) if draft_edges else None
        self.needs_draft = self.draft_edges is not None
        self.needs_root = bool(self.edges)  # skip signals the table ignores (a one-bucket bank: a static tree)
        self.meta = meta or {}
        names = [n for row in table for n in (row if isinstance(row, list) else [row])]
        missing = sorted(set(names) - set(self.bank))
        if missing:
            raise TreeError(f"entropy bank table names unknown trees: {', '.join(missing)}")
        if len(table) != len(edges) + 1:
            raise TreeError(f"entropy bank needs {len(edges) + 1} table rows for {len(edges)} edges, got {len(table)}")
        self.tree = self.bank[names[0]]

    @property
    def trees(self) -> list[Tree]:
        return list(self.bank.values())

    def bucket(self, root_entropy: float, draft_entropy: float = math.nan) -> tuple[int, Optional[int]]:
        """(root bucket, draft bucket or None without draft edges); an unknown (nan) signal takes
        the middle bucket."""
        i = len(self.edges) // 2 if math.isnan(root_entropy) else bisect.bisect_right(self.edges, root_entropy)
        if self.draft_edges is None:
            return i, None
        d = draft_entropy
        return i, len(self.draft_edges) // 2 if math.isnan(d) else bisect.bisect_right(self.draft_edges, d)

    def choose(self, s: StepSignals) -> Decision:
        i, j = self.bucket(s.root_entropy, s.draft_entropy)
        name = self.table[i] if j is None else self.table[i][j]
        reason = {"bucket": i if j is None else [i, j], "tree": name}
        return Decision(self.bank[name], reason)

    # ---- bank files -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"policy": "entropy", "signal": "root_entropy", "edges": self.edges, "draft_edges": self.draft_edges,
                "table": self.table, "trees": {n: [list(p) for p in t.paths] for n, t in self.bank.items()}, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(dumps_compact(self.to_json()))


def load_bank(path: str | Path) -> EntropyBucketScheduler:
    """Load an entropy bank JSON; every failure is a TreeError with a one-line message."""
    p = Path(path)
    d = read_json_file(p, "bank")
    if not isinstance(d, dict) or not isinstance(d.get("trees"), dict) or "edges" not in d or "table" not in d:
        raise TreeError(f"{p.name}: a bank needs 'trees', 'edges' and 'table'")
    trees = {n: tree_from_json(paths, n) for n, paths in d["trees"].items()}
    return EntropyBucketScheduler(trees, [float(x) for x in d["edges"]], d["table"], d.get("draft_edges"), d.get("meta"))


class DynamicScheduler(Scheduler):
    """EAGLE-2 style: each step's tree is grown from this step's draft probabilities.

    Per depth the `beam` best nodes by cumulative draft log-probability are expanded with
    `topk` children; the best `budget` nodes form the tree (see `HeadRunner.grow`).
    """

    name = "dynamic"
    needs_context = True

    def __init__(self, budget: int = 32, depth: int = 4, topk: int = 8, beam: int = 8):
        if min(budget, depth, topk, beam) < 1:
            raise ValueError("a dynamic tree needs budget, depth, topk and beam of at least 1")
        # A tree of `budget` nodes is never deeper than `budget`, never has more than `budget`
        # children under one node, and never holds more than `budget` nodes of one level, so
        # larger values only draft what can never be chosen (a CPU's 3-node budget with the
        # heads' 5 levels and 8 x 8 expansions drafted 5 levels of 8 rows a step).
        self.budget = budget
        self.depth, self.topk, self.beam = min(depth, budget), min(topk, budget), min(beam, budget)
        self._grown: dict = {}  # trees grown so far by node set: a shape seen again keeps its buffers
        self.tree = Tree.chain(self.depth)  # the deepest shape it can produce (for depth checks)

    @property
    def trees(self) -> list[Tree]:
        return [self.tree]

    def choose(self, s: StepSignals) -> Decision:
        ctx: DraftContext = s.context
        tree, draft = ctx.runner.grow(ctx.feature, ctx.root, self.depth, self.topk, self.beam, self.budget,
                                      with_stats=ctx.with_stats, trees=self._grown)
        return Decision(tree, {"nodes": tree.n_nodes, "depth": tree.depth}, draft=draft)


SCHEDULERS = ("static", "ladder", "hysteresis", "entropy", "dynamic")


def make_scheduler(name: str, *, engine=None, heads: Optional[str] = None, tree: Optional[Tree] = None,
                   bank: str | Path | EntropyBucketScheduler | None = None, **kw) -> Scheduler:
    """Build a scheduler by name: static, ladder, hysteresis, entropy, dynamic. bank: a bank file
    or a bank itself (e.g. the one tuned on this machine)."""
    if name == "static":
        if tree is None:
            raise ValueError("the static scheduler needs a tree")
        return Scheduler(tree)
    if name == "dynamic":
        opts = {k: v for k, v in kw.items() if k in ("budget", "depth", "topk", "beam")}
        if tree is not None and tree.n_nodes and "budget" not in opts:
            opts["budget"] = tree.n_nodes  # the same node budget as the calibrated static tree: a fair comparison
        if engine is not None and heads in getattr(engine, "runners", {}):
            # as deep as the heads draft unless asked for less
            num_heads = engine.runners[heads].config.num_heads
            opts["depth"] = min(opts.get("depth", num_heads), num_heads)
        return DynamicScheduler(**opts)
    if name == "entropy":
        if bank is None:
            bank = default_bank_path(engine, heads)
        return bank if isinstance(bank, EntropyBucketScheduler) else load_bank(bank)
    if name in ("ladder", "hysteresis"):
        # The seed's defaults: small / medium / large trees by the root's top-1 probability.
        if bank is not None:
            b = bank if isinstance(bank, EntropyBucketScheduler) else load_bank(bank)
            ordered = sorted(b.bank.values(), key=lambda t: t.n_nodes)
        else:
            ordered = [resolve_tree("chain_2"), resolve_tree("binary_2x2"), tree or resolve_tree("mc_sim_7b_63")]
        if name == "ladder":
            small, mid, big = ordered[0], ordered[len(ordered) // 2], ordered[-1]
            return LadderScheduler([small, mid, big], [0.5, 0.85])
        return HysteresisScheduler(ordered[0], ordered[-1], low=0.6, high=0.85)
    raise ValueError(f"unknown scheduler {name!r} (static, ladder, hysteresis, entropy, dynamic)")


def recorded_default(engine, heads: Optional[str], key: str) -> Optional[str]:
    """A file name recorded in the loaded heads' meta, the most specific first:
    `<key>_<dtype>@<hardware class>`, `<key>_<dtype>`, `<key>` (trees and banks are chosen by
    step times measured per dtype and hardware: `entmtp.hardware`)."""
    meta = {}
    if engine is not None and heads in getattr(engine, "runners", {}):
        meta = getattr(engine.runners[heads].heads, "meta", {}) or {}
    dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    hw = hardware_class(getattr(engine, "device", "cpu"))
    return meta.get(f"{key}_{dtype}@{hw}") or meta.get(f"{key}_{dtype}") or meta.get(key)


def default_bank_path(engine, heads: Optional[str]) -> Path:
    """The entropy bank recorded in the loaded heads' meta (`default_bank[_<dtype>]`, a shipped file in `TREES_DIR`)."""
    name = recorded_default(engine, heads, "default_bank")
    if not name or not (TREES_DIR / name).is_file():
        raise TreeError(f"no entropy bank recorded for the {heads or 'loaded'} heads; fit one with `entmtp search` or pass --bank")
    return TREES_DIR / name


def policy_label(p: Scheduler) -> str:
    """A tree policy in a few words: a one-tree policy names its tree (a one-bucket entropy bank,
    where the tune found no bank that beats the static tree, says so), others their scheduler."""
    if len(p.trees) == 1 and type(p) in (Scheduler, EntropyBucketScheduler):
        return p.trees[0].name + (" (entropy scheduler, one bucket)" if p.name == "entropy" else "")
    return f"{p.name} scheduler"


def as_scheduler(x) -> Optional[Scheduler]:
    if x is None or isinstance(x, Scheduler):
        return x
    return Scheduler(x)
