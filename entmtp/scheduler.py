"""Tree schedulers: choose each step's draft tree.

A scheduler sees this step's signals before drafting (the base model's entropy and top-1
probability of the distribution that produced the root, the first draft head's entropy at
the root, the recent acceptance history) and picks a tree from a bank of pre-built trees
(buffers built once; a switch is a reference swap). After verification it is told the
accepted length. One scheduler object per generation: `fresh()` returns a new instance
that shares the (immutable) trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .trees import Tree


@dataclass
class StepSignals:
    step: int
    root_entropy: float = float("nan")  # base entropy (nats) of the distribution that chose the root
    root_prob: float = float("nan")  # base probability of the root token
    draft_entropy: float = float("nan")  # first draft head's entropy at the root (this step)
    draft_top1: float = float("nan")  # first draft head's top-1 probability at the root
    history: tuple[int, ...] = ()  # accepted lengths of the previous steps (most recent last)


@dataclass
class Decision:
    tree: Tree
    reason: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    """Base class: a static scheduler over one tree. Subclasses override `choose`."""

    name = "static"
    needs_root = False  # compute root entropy/probability before choosing
    needs_draft = False  # compute the first head level's entropy before choosing

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

    def choose(self, signals: StepSignals) -> Decision:
        return Decision(self.tree)

    def update(self, accepted_length: int) -> None:
        pass


StaticScheduler = Scheduler


def as_scheduler(x: Optional[Scheduler | Tree]) -> Optional[Scheduler]:
    if x is None or isinstance(x, Scheduler):
        return x
    return Scheduler(x)
