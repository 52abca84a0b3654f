"""Prompt lookup: a draft branch copied from the context, grafted onto the heads' tree.

Summaries, answers about a given text, code edits and translations of names repeat spans of
their context. Where the last few tokens occurred before, the tokens that followed them are a
cheap draft (transformers' prompt-lookup decoding). Here that copy is one more branch of the
step's tree: it is merged into the heads' tree as a trie (shared prefixes reuse the heads'
nodes), so one forward verifies both and the acceptance rule keeps whichever the base model
agrees with. The drafted tokens are deterministic, so every acceptance rule stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .trees import Path_, Tree


@dataclass
class NgramIndex:
    """Most recent position of every n-gram (n = 1..max_ngram) of one growing token list.

    Incremental: `extend` registers only the n-grams that gained a continuation, so a step
    costs O(new tokens x max_ngram) whatever the context length.
    """

    max_ngram: int = 3
    tokens: list[int] = field(default_factory=list)
    _last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index of its last token
    _registered: int = 0  # n-grams ending before this index are registered

    def extend(self, new: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in new)
        toks, last = self.tokens, self._last_end
        # an n-gram ending at e is useful once tokens[e + 1] exists
        for e in range(self._registered, len(toks) - 1):
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                last[tuple(toks[e - n + 1: e + 1])] = e
        self._registered = max(self._registered, len(toks) - 1)

    def continuation(self, suffix: Sequence[int], length: int, min_ngram: int = 1) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest
        n-gram (min_ngram <= n <= max_ngram) ending `tokens + suffix`; [] when none occurs."""
        if length <= 0:
            return []
        ctx = self.tokens + [int(t) for t in suffix]
        for n in range(min(self.max_ngram, len(ctx)), min_ngram - 1, -1):
            key = ctx[-n:]
            # occurrences ending at the last indexed token or inside the suffix are not indexed
            # yet (they are later than every indexed one, so they win)
            e = next((e for e in range(len(ctx) - 2, self._registered - 1, -1)
                      if e - n + 1 >= 0 and ctx[e - n + 1: e + 1] == key), None)
            if e is None:
                e = self._last_end.get(tuple(key))
            if e is not None:
                return ctx[e + 1: e + 1 + length]
        return []


def graft_chain(tree: Tree, tokens: Sequence[int], chain: Sequence[int]) -> tuple[Tree, list[int], list[int]]:
    """Merge a token chain (the continuation after the root) into a drafted tree as a trie.

    tree: the step's tree; tokens: its n+1 drafted tokens in canonical order (root first);
    chain: tokens proposed after the root. The chain follows existing nodes while their tokens
    agree and continues as a new branch (next free rank under its parent, then rank 0).
    Returns (merged tree, its tokens in canonical order, indices of the nodes the chain added).
    When the chain adds nothing, the input tree and tokens come back unchanged.
    """
    node, i = 0, 0
    children = tree.children
    while i < len(chain):
        nxt = next((c for c in children[node] if tokens[c] == chain[i]), None)
        if nxt is None:
            break
        node, i = nxt, i + 1
    rest = list(chain[i:])
    if not rest:
        return tree, list(tokens), []
    at: Path_ = tree.node_paths[node]
    free = 1 + max((tree.node_paths[c][-1] for c in children[node]), default=-1)
    new_paths = [at + (free,) + (0,) * k for k in range(len(rest))]
    merged = _grafted(tree, at, free, len(rest))
    by_path = dict(zip(tree.node_paths, tokens))
    by_path.update(zip(new_paths, rest))
    added = [merged.index[p] for p in new_paths]
    return merged, [by_path[p] for p in merged.node_paths], added


def _grafted(tree: Tree, at: Path_, rank: int, length: int) -> Tree:
    """The tree plus a rank-0 chain of `length` nodes under `at + (rank,)`; memoised on the tree
    so its buffers are built once per graft point and length."""
    key = (at, rank, length)
    cache = tree._derived
    t = cache.get(key)
    if t is None:
        extra = [at + (rank,) + (0,) * k for k in range(length)]
        name = f"{tree.name or f'{tree.n_nodes}-node'}+lookup{length}"
        t = Tree.from_paths(list(tree.paths) + extra, name)
        cache[key] = t
    return t


def chain_outcomes(prompt_ids: Sequence[int], answer_ids: Sequence[int], positions: int, length: int,
                   min_ngram: int = 1, max_ngram: int = 3) -> list[tuple[int, int]]:
    """What the prompt-lookup branch proposes and the base accepts at each decoding position of a
    known greedy continuation, as the engine drafts it.

    A step starting at position o (o answer tokens emitted before it, answer_ids[o] its root)
    looks up the context prompt_ids + answer_ids[:o + 1] and proposes up to `length` tokens;
    greedy verification accepts them while they equal answer_ids[o + 1], answer_ids[o + 2], ...
    Returns [(proposed, accepted)] for o = 0 .. positions - 1 (proposed 0: no match).
    Only the tokens matter, not the machine: `autotune.choose_lookup` scores these with step times
    measured here."""
    index = NgramIndex(max_ngram)
    index.extend(prompt_ids)
    out = []
    for o in range(min(positions, len(answer_ids))):
        chain = index.continuation([answer_ids[o]], length, min_ngram)
        truth = answer_ids[o + 1: o + 1 + len(chain)]
        accepted = next((i for i, (a, b) in enumerate(zip(chain, truth)) if a != b), min(len(chain), len(truth)))
        out.append((len(chain), accepted))
        index.extend([answer_ids[o]])
    return out
