"""Per-step trace records: the one currency of the CLI, benchmarks, topology lab and app.

A `Step` describes one decoding step: the draft tree, per-node draft and base statistics,
the accepted path, the emitted tokens and the step's wall time split into draft / verify /
bookkeeping. `GenerationResult` sums a whole generation. Both serialise to JSON.

Per-node statistics (index 0 is the root, the base model's own token):
* draft_probs[i]: probability of node i's token under the head that proposed it
  (at node i's parent); draft_entropies[i]: entropy (nats) of that head distribution.
* base_probs[i]: probability of node i's token under the base model at its parent
  (the root's under the previous step's last accepted node).
* base_entropies[i]: entropy of the base model's next-token distribution *at* node i
  (the distribution that decides node i's children).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Step:
    index: int
    tree_name: str
    n_nodes: int
    tokens: list[int]  # drafted tree tokens, root first (canonical node order)
    parents: list[int]
    accepted: list[int]  # accepted node indices, root first
    emitted: list[int]  # tokens committed this step (root + accepted drafts, after stops)
    bonus: Optional[int]  # the next step's root (None when generation ended here)
    time_draft: float
    time_verify: float
    time_bookkeeping: float
    # Filled when the generation is traced in full (trace="full"):
    token_texts: Optional[list[str]] = None
    ranks: Optional[list[int]] = None
    depths: Optional[list[int]] = None
    draft_probs: Optional[list[float]] = None
    draft_entropies: Optional[list[float]] = None
    base_probs: Optional[list[float]] = None
    base_entropies: Optional[list[float]] = None
    scheduler: Optional[dict[str, Any]] = None  # tree chosen and why (signals, bucket)
    time_schedule: float = 0.0  # the scheduler's decision (signals + choice), before drafting
    lookup_nodes: Optional[list[int]] = None  # nodes copied from the context (prompt lookup), not the heads

    @property
    def accept_length(self) -> int:
        """Draft tokens accepted (the root is not counted)."""
        return len(self.accepted) - 1

    @property
    def lookup_accepted(self) -> int:
        """Accepted nodes that prompt lookup copied from the context (not drafted by a head)."""
        return len(set(self.lookup_nodes) & set(self.accepted)) if self.lookup_nodes else 0

    @property
    def n_emitted(self) -> int:
        return len(self.emitted)

    @property
    def time_total(self) -> float:
        return self.time_schedule + self.time_draft + self.time_verify + self.time_bookkeeping

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        return _clean(d)


@dataclass
class GenerationResult:
    method: str
    prompt_tokens: int
    tokens: list[int]
    text: str
    steps: list[Step] = field(default_factory=list)
    stop_reason: str = ""  # eos | stop_string | max_new_tokens | context
    time_prefill: float = 0.0
    time_total: float = 0.0
    notices: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per base forward, bonus token included (exactly 1.0 for plain decoding).

        Forwards = the prefill (which yields the first token) + one per step that verified.
        """
        forwards = 1 + sum(1 for s in self.steps if s.time_verify > 0)
        return len(self.tokens) / forwards if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.time_total if self.time_total > 0 else 0.0

    def summary(self) -> dict:
        steps = self.steps
        tot = lambda k: sum(getattr(s, k) for s in steps)
        step_time = sum(s.time_total for s in steps)
        return _clean({
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "steps": len(steps),
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "time_total_s": self.time_total,
            "time_prefill_s": self.time_prefill,
            "time_draft_s": tot("time_draft"),
            "time_verify_s": tot("time_verify"),
            "time_bookkeeping_s": tot("time_bookkeeping"),
            "time_schedule_s": tot("time_schedule"),
            "bookkeeping_share": tot("time_bookkeeping") / step_time if step_time else 0.0,
            "schedule_share": tot("time_schedule") / step_time if step_time else 0.0,
            "stop_reason": self.stop_reason,
            "accept_histogram": _histogram([s.accept_length for s in steps if s.time_verify > 0]),
            "notices": self.notices,
        })

    def to_dict(self, steps: bool = True) -> dict:
        d = {"summary": self.summary(), "text": self.text, "tokens": self.tokens}
        if steps:
            d["steps"] = [s.to_dict() for s in self.steps]
        return d


def _histogram(values: list[int]) -> list[int]:
    if not values:
        return []
    h = [0] * (max(values) + 1)
    for v in values:
        h[v] += 1
    return h


def _clean(x):
    """JSON-safe: NaN/inf become None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
