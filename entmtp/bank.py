"""Fit an entropy bank: per bucket of this step's entropy, the tree with the best tokens/s.

From one statistics pass (`entmtp.calibrate.CalibrationStats`: per record the accepted rank
paths and the step's signals) and a measured latency model, choose for each bucket of the
root entropy (optionally crossed with the first draft head's entropy) one tree from the
candidates, so that the *overall* expected tokens/s -- total tokens over total time, a ratio
of sums -- is maximal. A per-bucket argmax of tau/cost is not optimal for a ratio of sums;
Dinkelbach's iteration (choose per bucket to maximise tau - lambda * cost, set lambda to the
resulting ratio, repeat) reaches the exact optimum over per-bucket choices in a few rounds.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .scheduler import EntropyBucketScheduler
from .trees import Tree


def _ratio(x: tuple[float, float, int]) -> float:
    return x[0] / x[1] if x[1] else 0.0


def quantile_edges(values: np.ndarray, n_buckets: int) -> list[float]:
    """Ascending, distinct interior quantile edges splitting `values` into ~equal buckets."""
    v = values[np.isfinite(values)]
    if len(v) == 0 or n_buckets <= 1:
        return []
    qs = np.quantile(v, [i / n_buckets for i in range(1, n_buckets)])
    return sorted({round(float(q), 4) for q in qs})


def _bucket(values: np.ndarray, edges: list[float]) -> np.ndarray:
    idx = np.searchsorted(np.array(edges), np.nan_to_num(values, nan=np.nanmedian(values) if np.isfinite(values).any() else 0.0),
                          side="right")
    return idx


def replay_assignment(stats, acc: np.ndarray, cost: np.ndarray, cell: np.ndarray, assign: np.ndarray) -> tuple[float, float, int]:
    """Trace statistics: replay decoding (`CalibrationStats.replay`) where each step uses
    the tree of its start record's cell.

    acc [T, R] accepted drafts of each candidate at each record; cost [T] seconds per step;
    cell [R] bucket of each record; assign [C] candidate index per bucket. Returns (tokens, seconds, steps).
    """
    tree_at = assign[cell]  # [R] candidate used by a step starting at each record
    _, starts, _, emitted = stats.replay(acc[tree_at, np.arange(acc.shape[1])])
    return float(emitted.sum()), float(cost[tree_at[starts]].sum()), len(starts)


def fit_entropy_bank(stats, candidates: Sequence[Tree], latency, n_buckets: int = 4, draft_buckets: int = 0,
                     min_records: int = 30, max_rounds: int = 20) -> tuple[EntropyBucketScheduler, dict]:
    """Fit the bucket -> tree table. Returns (scheduler, report).

    report: edges, per-bucket records / chosen tree / predicted tau, and the predicted tokens/s
    of the bank beside the best single static tree among the same candidates (same records,
    same latency model).
    """
    recs = stats.records
    if not recs:
        raise ValueError("no calibration records to fit an entropy bank")
    cands = list(dict.fromkeys(candidates))  # unique, order kept
    if not cands:
        raise ValueError("no candidate trees to fit an entropy bank")
    ent = np.array([r.root_entropy for r in recs], dtype=float)
    edges = quantile_edges(ent, n_buckets)
    b1 = _bucket(ent, edges)
    d_edges: Optional[list[float]] = None
    cell = b1
    n_d = 1
    if draft_buckets > 1:
        dent = np.array([r.draft_entropy for r in recs], dtype=float)
        if np.isfinite(dent).any():
            d_edges = quantile_edges(dent, draft_buckets)
            n_d = len(d_edges) + 1
            cell = b1 * n_d + _bucket(dent, d_edges)
    n_cells = (len(edges) + 1) * n_d
    acc = np.stack([stats.accepted_lengths(t).astype(float) for t in cands])  # [T, R]
    cost = np.array([latency.cost(t.n_nodes, t.depth) for t in cands])  # [T]
    w = np.array([(cell == c).sum() for c in range(n_cells)], dtype=float)  # records per cell
    tau = np.stack([(1 + acc[:, cell == c].mean(1)) if w[c] else np.ones(len(cands)) for c in range(n_cells)], 1)  # [T, C]

    # the best static tree over all records (same objective)
    static_tps = (1 + acc.mean(1)) / cost
    best_static = int(np.argmax(static_tps))
    # sparse cells fall back to the static choice
    lam = float(static_tps[best_static])
    choice = np.full(n_cells, best_static)
    for _ in range(max_rounds):
        new = np.where(w >= min_records, np.argmax(tau - lam * cost[:, None], axis=0), best_static)
        num = float((w * tau[new, np.arange(n_cells)]).sum())
        den = float((w * cost[new]).sum())
        new_lam = num / den
        if np.array_equal(new, choice) and math.isclose(new_lam, lam, rel_tol=1e-12):
            break
        choice, lam = new, new_lam

    method = "dinkelbach over records"
    static_tau = float(1 + acc[best_static].mean())
    if getattr(stats, "mode", "") == "trace" and stats.prompts:
        # Exact on-policy objective: replay decoding with the bucket -> tree table and improve
        # the table one bucket at a time (coordinate ascent from the best static tree).
        method = "coordinate ascent on exact replay"
        best_static = max(range(len(cands)), key=lambda t: _ratio(replay_assignment(stats, acc, cost, cell, np.full(n_cells, t))))
        choice = np.full(n_cells, best_static)
        tok, sec, steps = replay_assignment(stats, acc, cost, cell, choice)
        lam = static_tps[best_static] = tok / sec
        static_tau = tok / steps if steps else 1.0
        for _ in range(3):
            improved = False
            for c in range(n_cells):
                if w[c] < min_records:
                    continue
                for t in range(len(cands)):
                    if t == choice[c]:
                        continue
                    trial = choice.copy()
                    trial[c] = t
                    v = _ratio(replay_assignment(stats, acc, cost, cell, trial))
                    if v > lam * (1 + 1e-12):
                        choice, lam, improved = trial, v, True
            if not improved:
                break
    names = {}
    for i in sorted(set(choice.tolist())):
        t = cands[i]
        names[i] = t.name or f"tree{i}_{t.n_nodes}n_d{t.depth}"
    table = [names[int(choice[c])] for c in range(n_cells)]
    if d_edges is not None:
        table = [table[i * n_d:(i + 1) * n_d] for i in range(len(edges) + 1)]
    report = {
        "signal": "root_entropy", "edges": edges, "draft_edges": d_edges, "records": int(len(recs)),
        "cells": [{"records": int(w[c]), "tree": names[int(choice[c])], "predicted_tau": float(tau[choice[c], c]),
                   "cost_s": float(cost[choice[c]])} for c in range(n_cells)],
        "predicted_tokens_per_s": lam,
        "best_static": {"tree": cands[best_static].name, "n_nodes": cands[best_static].n_nodes,
                        "predicted_tokens_per_s": float(static_tps[best_static]), "predicted_tau": float(static_tau)},
        "predicted_gain_vs_static": lam / float(static_tps[best_static]) - 1,
        "method": method,
    }
    trees = {names[i]: Tree(cands[i].paths, names[i]) for i in names}
    sched = EntropyBucketScheduler(trees, edges, table, d_edges, meta={"fit": report})
    return sched, report


def bank_cells(bank: EntropyBucketScheduler, stats) -> np.ndarray:
    """Each record's cell of `bank` (row-major over root x draft buckets), as its `choose` picks
    the bucket (`EntropyBucketScheduler.bucket`). -> [R] int"""
    n_d = len(bank.draft_edges) + 1 if bank.draft_edges is not None else 1
    cells = [bank.bucket(r.root_entropy, r.draft_entropy) for r in stats.records]
    return np.array([i * n_d + (j or 0) for i, j in cells], dtype=int)


def compare_on(stats, bank: EntropyBucketScheduler, static: Tree, latency) -> tuple[float, float]:
    """Predicted tokens/s of `bank` and of the `static` tree on `stats` -- records neither was
    chosen on, so that a bank's gain is not its fit to noise. Trace statistics replay decoding
    exactly (`replay_assignment`); rollout statistics sum over records. Returns (bank, static)."""
    names = list(bank.bank)
    cands = [bank.bank[n] for n in names] + [static]
    acc = np.stack([stats.accepted_lengths(t).astype(float) for t in cands])  # [T, R]
    cost = np.array([latency.cost(t.n_nodes, t.depth) for t in cands])  # [T]
    flat = [n for row in bank.table for n in (row if isinstance(row, list) else [row])]
    assign = np.array([names.index(n) for n in flat])  # [C]
    cell = bank_cells(bank, stats)  # [R]
    fixed = np.full(len(flat), len(cands) - 1)
    if getattr(stats, "mode", "") == "trace" and stats.prompts:
        return (_ratio(replay_assignment(stats, acc, cost, cell, assign)),
                _ratio(replay_assignment(stats, acc, cost, cell, fixed)))
    idx = np.arange(acc.shape[1])

    def tps(a: np.ndarray) -> float:
        t = a[cell]
        return float((1 + acc[t, idx]).sum() / cost[t].sum()) if len(t) else 0.0

    return tps(assign), tps(fixed)
