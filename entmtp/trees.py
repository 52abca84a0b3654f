"""Draft trees: a tree of rank paths, validated, canonically ordered, with its buffers.

A tree is given as a list of *rank paths* -- the ``medusa_choices`` / ``hydra_choices``
format. ``[0, 2]`` is "the top-1 token of the first draft head, then the 3rd-ranked token
of the next head under it". The root (the base model's own next token) is implicit.

Node order is canonical: the root is node 0, then the paths sorted by (length, ranks).
Any prefix-closed set of paths is a valid tree: ranks need not be contiguous, siblings with
children need not be the lowest ranked, widths need not be 10 (seed-code G.11). Buffers are
built once per tree and device, so switching trees during decoding is a reference swap.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

Path_ = tuple[int, ...]


class TreeError(ValueError):
    """An invalid tree specification (one-line message naming the offending path)."""


def _as_path(raw: Any, where: str) -> Path_:
    if not isinstance(raw, (list, tuple)) or len(raw) == 0:
        raise TreeError(f"{where}: a path must be a non-empty list of ranks, got {raw!r}")
    out = []
    for r in raw:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise TreeError(f"{where}: ranks must be non-negative integers, got {list(raw)!r}")
        out.append(int(r))
    return tuple(out)


def canonical_paths(paths: Iterable[Sequence[int]]) -> tuple[Path_, ...]:
    """Validate rank paths and return them in canonical (length, lexicographic) order.

    Raises TreeError naming the first offending path (not a list, negative rank,
    duplicate, or a missing ancestor, i.e. the set is not prefix-closed).
    """
    seen: set[Path_] = set()
    for i, raw in enumerate(paths):
        p = _as_path(raw, f"path #{i}")
        if p in seen:
            raise TreeError(f"path {list(p)} appears twice")
        seen.add(p)
    for p in sorted(seen, key=lambda q: (len(q), q)):
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"path {list(p)} has no parent {list(p[:-1])}: the tree must be prefix-closed")
    return tuple(sorted(seen, key=lambda q: (len(q), q)))


@dataclass(frozen=True)
class TreeBuffers:
    """Tensors of one tree on one device. n = number of draft nodes; node 0 is the root.

    depths:    [n+1] long, depth of each node (root 0) -> position ids = past + depths
    parents:   [n+1] long, parent node index (root -1)
    ancestor:  [n+1, n+1] bool, ancestor[i, j] = j is i or an ancestor of i
    retrieve:  [leaves, max_depth+1] long, root-to-leaf node indices, padded with -1
    level_nodes[d]:  [m_d] long, node indices at depth d (d >= 1), canonical order
    level_parent_row[d]: [m_d] long, row of each node's parent among level_expand[d-1]
    level_ranks[d]:  [m_d] long, rank of each node under its parent
    level_expand[d]: [e_d] long, positions within level_nodes[d] of nodes that have children
                      (level_expand[0] = [0]: the root is expanded when n > 0)
    level_topk[d]:   int, max rank at depth d + 1 (how many candidates to take per parent)
    """

    depths: torch.Tensor
    parents: torch.Tensor
    ancestor: torch.Tensor
    retrieve: torch.Tensor
    level_nodes: tuple[torch.Tensor, ...]
    level_parent_row: tuple[torch.Tensor, ...]
    level_ranks: tuple[torch.Tensor, ...]
    level_expand: tuple[torch.Tensor, ...]
    level_topk: tuple[int, ...]
    _bias: dict = field(default_factory=dict, compare=False, repr=False)

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[n+1, n+1] additive mask in `dtype`: 0 where a node may attend, finfo.min elsewhere.

        Additive float, never bool: eager attention adds a bool mask as 0/1 silently.
        """
        b = self._bias.get(dtype)
        if b is None:
            b = torch.zeros(self.ancestor.shape, dtype=dtype, device=self.ancestor.device)
            b.masked_fill_(~self.ancestor, torch.finfo(dtype).min)
            self._bias[dtype] = b
        return b


@dataclass(frozen=True)
class Tree:
    """An immutable draft tree. Build with `Tree.from_paths` (validates) or `load_tree`."""

    paths: tuple[Path_, ...]
    name: str = ""
    _buffers: dict = field(default_factory=dict, compare=False, repr=False, hash=False)
    _lock: Any = field(default_factory=threading.Lock, compare=False, repr=False, hash=False)
    _derived: dict = field(default_factory=dict, compare=False, repr=False, hash=False)  # e.g. lookup grafts

    @staticmethod
    def from_paths(paths: Iterable[Sequence[int]], name: str = "") -> "Tree":
        return Tree(canonical_paths(paths), name or "")

    @staticmethod
    def chain(length: int, name: str = "") -> "Tree":
        """A single top-1 chain of `length` draft nodes (length 0 = root only)."""
        return Tree.from_paths([[0] * k for k in range(1, length + 1)], name or f"chain_{length}")

    # ---- structure (plain Python, computed once; treat the returned lists as read-only) -
    @property
    def n_nodes(self) -> int:
        """Number of draft nodes (the root is not counted)."""
        return len(self.paths)

    @property
    def size(self) -> int:
        """Tokens verified per step: draft nodes + root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @cached_property
    def node_paths(self) -> list[Path_]:
        """Path of every node, root (empty path) first."""
        return [()] + list(self.paths)

    @cached_property
    def index(self) -> dict[Path_, int]:
        return {p: i for i, p in enumerate(self.node_paths)}

    @cached_property
    def parent_list(self) -> list[int]:
        idx = self.index
        return [-1] + [idx[p[:-1]] for p in self.paths]

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i] = node indices whose parent is i, in canonical (rank) order."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i, par in enumerate(self.parent_list):
            if par >= 0:
                out[par].append(i)
        return out

    @property
    def depth_counts(self) -> list[int]:
        counts = [0] * self.depth
        for p in self.paths:
            counts[len(p) - 1] += 1
        return counts

    @cached_property
    def leaves(self) -> list[int]:
        ch = self.children
        return [i for i in range(self.size) if not ch[i]]

    def truncated(self, max_depth: int) -> "Tree":
        """The same tree without nodes deeper than `max_depth` (still prefix-closed)."""
        if self.depth <= max_depth:
            return self
        return Tree(tuple(p for p in self.paths if len(p) <= max_depth), f"{self.name}@d{max_depth}")

    def key(self) -> tuple[Path_, ...]:
        """Identity of the topology (independent of the name)."""
        return self.paths

    def describe(self) -> str:
        return f"{self.name or 'tree'}: {self.n_nodes} nodes, depth {self.depth}, per depth {self.depth_counts}"

    # ---- buffers ------------------------------------------------------------------------
    def buffers(self, device: torch.device | str = "cpu") -> TreeBuffers:
        """The tree's tensors on `device`, built once and cached on this tree."""
        key = str(torch.device(device))
        buf = self._buffers.get(key)
        if buf is None:
            with self._lock:
                buf = self._buffers.get(key)
                if buf is None:
                    buf = _build_buffers(self, torch.device(device))
                    self._buffers[key] = buf
        return buf

    # ---- export -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"name": self.name, "paths": [list(p) for p in self.paths],
                "n_nodes": self.n_nodes, "depth": self.depth}

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        data = self.to_json()
        if extra:
            data.update(extra)
        Path(path).write_text(dumps_compact(data))

    def to_networkx(self):
        """A networkx DiGraph: node i has attributes path, depth, rank; edges parent -> child."""
        import networkx as nx

        g = nx.DiGraph(name=self.name)
        for i, p in enumerate(self.node_paths):
            g.add_node(i, path=p, depth=len(p), rank=(p[-1] if p else -1))
        for i, par in enumerate(self.parent_list):
            if par >= 0:
                g.add_edge(par, i)
        return g


def _build_buffers(tree: Tree, device: torch.device) -> TreeBuffers:
    paths = tree.node_paths
    n1 = len(paths)
    parents = tree.parent_list
    depths = [len(p) for p in paths]
    ancestor = torch.zeros(n1, n1, dtype=torch.bool)
    for i in range(n1):
        j = i
        while j >= 0:
            ancestor[i, j] = True
            j = parents[j]
    children = tree.children
    leaves = [i for i in range(n1) if not children[i]]
    D = tree.depth
    retrieve = torch.full((len(leaves), D + 1), -1, dtype=torch.long)
    for r, leaf in enumerate(leaves):
        chain = []
        j = leaf
        while j >= 0:
            chain.append(j)
            j = parents[j]
        chain.reverse()
        retrieve[r, : len(chain)] = torch.tensor(chain)

    # Per-depth maps. Level 0 is the root; level_expand[d] lists the nodes of level d that
    # have children -- their rows are the inputs of the head that drafts level d+1.
    levels: list[list[int]] = [[0]] + [[i for i in range(n1) if depths[i] == d] for d in range(1, D + 1)]
    expand: list[list[int]] = []
    for d, nodes in enumerate(levels):
        expand.append([pos for pos, i in enumerate(nodes) if children[i]])
    level_nodes, level_parent_row, level_ranks, level_topk = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)], [1]
    for d in range(1, D + 1):
        prev_rows = {levels[d - 1][pos]: row for row, pos in enumerate(expand[d - 1])}
        nodes = levels[d]
        level_nodes.append(torch.tensor(nodes, dtype=torch.long))
        level_parent_row.append(torch.tensor([prev_rows[parents[i]] for i in nodes], dtype=torch.long))
        ranks = [paths[i][-1] for i in nodes]
        level_ranks.append(torch.tensor(ranks, dtype=torch.long))
        level_topk.append(max(ranks) + 1)
    to = lambda t: t.to(device)
    return TreeBuffers(
        depths=to(torch.tensor(depths, dtype=torch.long)),
        parents=to(torch.tensor(parents, dtype=torch.long)),
        ancestor=to(ancestor),
        retrieve=to(retrieve),
        level_nodes=tuple(map(to, level_nodes)),
        level_parent_row=tuple(map(to, level_parent_row)),
        level_ranks=tuple(map(to, level_ranks)),
        level_expand=tuple(to(torch.tensor(e, dtype=torch.long)) for e in expand),
        level_topk=tuple(level_topk),
    )


# ---- files ----------------------------------------------------------------------------------

def tree_from_json(data: Any, name: str = "") -> Tree:
    """Accepts a bare path list, or an object with `paths` / `tree` / `choices`."""
    if isinstance(data, dict):
        for key in ("paths", "tree", "choices", "medusa_choices", "hydra_choices"):
            if key in data:
                return Tree.from_paths(_check_list(data[key]), str(data.get("name") or name))
        raise TreeError("tree JSON object has no 'paths' list")
    return Tree.from_paths(_check_list(data), name)


def _check_list(x: Any) -> list:
    if not isinstance(x, list):
        raise TreeError(f"tree paths must be a list of rank lists, got {type(x).__name__}")
    return x


def dumps_compact(data: dict) -> str:
    """JSON with one key per line and each value (e.g. the path list) on a single line."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items())
    return "{\n" + body + "\n}\n"


def read_json_file(path: str | Path, what: str = "tree") -> Any:
    """Parse a JSON file; a missing, non-UTF-8 or malformed file is a one-line TreeError."""
    p = Path(path)
    if not p.is_file():
        raise TreeError(f"{what} file not found: {p}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TreeError(f"{p.name}: not a UTF-8 JSON file") from None
    except json.JSONDecodeError as e:
        raise TreeError(f"{p.name}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def load_tree(path: str | Path) -> Tree:
    """Load a tree JSON file; every failure is a TreeError with a one-line message."""
    p = Path(path)
    data = read_json_file(p)
    try:
        return tree_from_json(data, name=p.stem)
    except TreeError as e:
        raise TreeError(f"{p.name}: {e}") from None


# the trees shipped with the package: reference topologies (chain_N, mc_sim_7b_63, ...) and the trees
# and entropy banks the embedded heads record as their defaults; search outputs go where the lab writes
TREES_DIR = Path(__file__).resolve().parent / "trees"


def resolve_tree(spec: str | Tree | Sequence[Sequence[int]]) -> Tree:
    """A Tree from a Tree, a rank-path list, a file path, or the name of a shipped tree (`TREES_DIR`)."""
    if isinstance(spec, Tree):
        return spec
    if not isinstance(spec, str):
        return Tree.from_paths(spec)
    p = Path(spec)
    if p.is_file():
        return load_tree(p)
    for cand in (TREES_DIR / spec, TREES_DIR / f"{spec}.json"):
        if cand.is_file():
            return load_tree(cand)
    if spec.startswith("chain_") and spec[6:].isdigit():
        return Tree.chain(int(spec[6:]))
    raise TreeError(f"unknown tree {spec!r}: give a JSON file path or the name of a shipped tree ({TREES_DIR})")
