"""Acceptance rules: which drafted path the base model keeps, and the next (bonus) token.

Every rule sees the tree, the drafted tokens and the base model's logits after every node
(one verification forward), and walks from the root. Walking the tree -- "at this node the
base model emits x; descend into the child drafted as x, else x is the bonus token" --
picks the winning path among *clamped* lengths by construction (no padded slots that can
match by luck, seed-code G.12).

* `GreedyRule`: x = argmax. Lossless: the output equals plain greedy decoding.
* `SpeculativeSamplingRule`: x ~ the base model's warped distribution (temperature, top-k,
  top-p). Since Medusa/Hydra drafts are deterministic top-k candidates, sampling x from the
  base distribution and descending when a child matches is exactly tree rejection sampling
  with point-mass drafts: every emitted token is distributed as the base model's.
* `TypicalRule`: Medusa/Hydra typical acceptance (a child is accepted when its base
  probability exceeds min(epsilon, alpha * exp(-entropy))); the longest accepted path wins,
  ties broken by the summed log-probability. Not distribution-preserving; kept to compare
  with published numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from .kernels import first_argmax
from .trees import Tree


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, root (0) first
    bonus: int  # the token the base model emits after the path: the next step's root


@dataclass(frozen=True)
class Sampling:
    """Warping of the base distribution; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k, then top-p.

    Same order and tie rules as transformers' warpers: top-p keeps the smallest set of
    most likely tokens whose mass reaches top_p (at least one token).
    """
    x = logits.float() / max(s.temperature, 1e-6)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=False)
        cum = sx.softmax(-1).cumsum(-1)
        remove = cum <= (1 - s.top_p)
        remove[..., -1] = False
        x = x.masked_fill(remove.scatter(-1, si, remove), float("-inf"))
    return x.softmax(-1)


class AcceptanceRule(Protocol):
    name: str
    lossless: bool

    def first_token(self, logits: torch.Tensor, rng: Optional[torch.Generator]) -> int:
        """The token after the prompt. logits [V]."""

    def accept(self, tree: Tree, tokens: list[int], logits: torch.Tensor,
               rng: Optional[torch.Generator]) -> Acceptance:
        """tokens: the n+1 drafted tokens (root first); logits [n+1, V] after each node."""


def _walk(tree: Tree, tokens: list[int], emit) -> Acceptance:
    """Descend while the token the base emits at a node was drafted as one of its children."""
    children = tree.children
    node, path = 0, [0]
    while True:
        x = emit(node)
        nxt = next((c for c in children[node] if tokens[c] == x), None)
        if nxt is None:
            return Acceptance(path, x)
        path.append(nxt)
        node = nxt


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim. On CPU, aten's argmax is not vectorised: float32 and bf16 logits
    go through entmtp's `first_argmax` op where it is loaded (the same indices at ~a tenth of the
    cost; bf16 read in place), fp16 ones converted to fp32 first (exact)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float16:
        logits = logits.float()
    fast = first_argmax(logits)
    return fast if fast is not None else logits.argmax(-1)


class GreedyRule:
    name = "greedy"
    lossless = True

    def first_token(self, logits, rng=None) -> int:
        return int(argmax(logits))

    def accept(self, tree, tokens, logits, rng=None) -> Acceptance:
        targets = argmax(logits).tolist()  # one device->host copy for the whole tree
        return self.accept_targets(tree, tokens, targets)

    def accept_targets(self, tree, tokens, targets: list[int]) -> Acceptance:
        """The same walk from precomputed argmax tokens, one per node (see verify.ScreenedGreedyHead)."""
        return _walk(tree, tokens, targets.__getitem__)


class SpeculativeSamplingRule:
    name = "sampling"
    lossless = True

    def __init__(self, sampling: Sampling):
        if sampling.greedy:
            raise ValueError("speculative sampling needs temperature > 0 (use GreedyRule)")
        self.sampling = sampling

    def _sample(self, row: torch.Tensor, rng) -> int:
        return int(torch.multinomial(warp(row, self.sampling), 1, generator=rng))

    def first_token(self, logits, rng=None) -> int:
        return self._sample(logits, rng)

    def accept(self, tree, tokens, logits, rng=None) -> Acceptance:
        return _walk(tree, tokens, lambda node: self._sample(logits[node], rng))


class TypicalRule:
    name = "typical"
    lossless = False

    def __init__(self, sampling: Sampling = Sampling(temperature=0.7), epsilon: float = 0.09,
                 alpha: Optional[float] = 0.3):
        self.sampling = sampling
        self.epsilon = epsilon
        self.alpha = alpha if alpha is not None else epsilon ** 0.5

    def _probs(self, logits):
        t = self.sampling.temperature or 1.0
        return torch.softmax(logits.float() / t, dim=-1)

    def first_token(self, logits, rng=None) -> int:
        if self.sampling.greedy:
            return int(logits.argmax(-1))
        return int(torch.multinomial(warp(logits, self.sampling), 1, generator=rng))

    def accept(self, tree, tokens, logits, rng=None) -> Acceptance:
        p = self._probs(logits)  # [n+1, V]
        ent = -(p * torch.log(p + 1e-9)).sum(-1)
        thresh = torch.minimum(torch.full_like(ent, self.epsilon), self.alpha * torch.exp(-ent))
        parents = tree.parent_list
        tok = torch.tensor(tokens, device=logits.device)
        par = torch.tensor([max(q, 0) for q in parents], device=logits.device)
        q = p[par, tok]  # base probability of each node's token under its parent
        ok = (q > thresh[par]).tolist()
        logq = torch.log(q + 1e-12).tolist()
        children = tree.children

        # Longest accepted root-to-node path; ties: largest summed log-probability.
        best = ([0], 0.0)
        stack = [([0], 0.0)]
        while stack:
            path, score = stack.pop()
            if len(path) > len(best[0]) or (len(path) == len(best[0]) and score > best[1]):
                best = (path, score)
            for c in children[path[-1]]:
                if ok[c]:
                    stack.append((path + [c], score + logq[c]))
        path = best[0]
        last = logits[path[-1]]
        bonus = int(last.argmax()) if self.sampling.greedy else int(torch.multinomial(warp(last, self.sampling), 1, generator=rng))
        return Acceptance(path, bonus)


def make_rule(name: str = "auto", sampling: Sampling = Sampling(), epsilon: float = 0.09,
              alpha: Optional[float] = 0.3) -> AcceptanceRule:
    """'auto' = greedy at temperature 0, lossless speculative sampling otherwise."""
    if name == "auto":
        name = "greedy" if sampling.greedy else "sampling"
    if name == "greedy":
        return GreedyRule()
    if name == "sampling":
        return SpeculativeSamplingRule(sampling)
    if name == "typical":
        return TypicalRule(sampling, epsilon, alpha)
    raise ValueError(f"unknown acceptance rule {name!r} (greedy, sampling, typical)")
