"""Whether an additive fit of the tuner's latency grid chooses better trees than its per-point
medians. No asserts.

The tuner times each (tree size, depth) point of a grid in two rounds (`autotune.tune_trees`) and
reads a tree's cost from that point's own median (`calibrate.LatencyModel`): on a noisy machine one
lucky timing makes a shape look cheap, and the tuner chooses it. An additive fit, step(n, d) =
rows(n) + drafting(d), each non-decreasing (`additive_points`), reads every point's cost
from all the points of its size and all those of its depth.

Per kind this measures `--models` latency models as the tuner does, in turn, then for each model
and each way of reading it (per point, additive) chooses a tree from the heads' shipped statistics
(`autotune.choose_tree`) and scores that choice on a reference: the per-point median of the
step ratios of all the *other* models (leave one out, so a model's own noise cannot flatter it).
Prints per kind and way the mean and spread of the reference speedup of the trees chosen, how far the
predictions overshot it, and how many distinct trees were chosen. A third way, staged, reads each model
as the tuner does since the grid is timed in stages (`autotune.staged_latency`): only the points its
stages would have timed, the trees priced from those; it prints how often that chose the per-point
way's tree and what share of the grid it timed.

    python scripts/latency_fit.py [--models 6] [--kinds hydra,hydra++,medusa] [--dtype bfloat16]
"""

import argparse
import statistics
import time
from typing import Optional, Sequence

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp.autotune import (CPU_SIZES, SHORT_CONTEXT, choose_tree, decoding_threads, priced,  # noqa: E402
                             shipped_stats, staged_grid)
from entmtp.calibrate import LatencyModel, latency_jobs, measure_latency  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for  # noqa: E402
from entmtp.search import price_candidates, search_trees  # noqa: E402
from entmtp.threads import torch_threads  # noqa: E402


def isotonic(y: Sequence[float], w: Optional[Sequence[float]] = None) -> list[float]:
    """Non-decreasing (weighted) least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, values pooled]
    for v, u in zip(y, w or [1.0] * len(y)):
        blocks.append([float(v) * u, float(u), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c, k = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
            blocks[-1][2] += k
    out: list[float] = []
    for s, c, k in blocks:
        out += [s / c] * k
    return out


def additive_points(points: dict[int, list[tuple[int, float]]], sweeps: int = 50) -> dict[int, list[tuple[int, float]]]:
    """The same (size, depth) points with the least-squares fit step(n, d) = rows(n) + drafting(d),
    each non-decreasing (backfitting with `isotonic`): a point's cost read from every point of its
    size and every point of its depth, not from its own few timings alone."""
    cells = {(int(n), int(d)): float(t) for d, pts in points.items() for n, t in pts}
    if not cells:
        return {}
    sizes, depths = sorted({n for n, _ in cells}), sorted({d for _, d in cells})
    f, g = dict.fromkeys(sizes, 0.0), dict.fromkeys(depths, 0.0)

    def fit(keys, axis, other):
        groups = [[t - other[c[1 - axis]] for c, t in cells.items() if c[axis] == k] for k in keys]
        return dict(zip(keys, isotonic([sum(v) / len(v) for v in groups], [len(v) for v in groups])))

    for _ in range(sweeps):
        f = fit(sizes, 0, g)
        g = fit(depths, 1, f)
        c = g[depths[0]]  # the constant lives in rows(n)
        f, g = {n: v + c for n, v in f.items()}, {d: v - c for d, v in g.items()}
    out: dict[int, list[tuple[int, float]]] = {}
    for (n, d) in sorted(cells, key=lambda c: (c[1], c[0])):
        out.setdefault(d, []).append((n, f[n] + g[d]))
    return out


def ratios(lm: LatencyModel) -> dict[tuple[int, int], float]:
    return {(n, d): t / lm.baseline_s for d, pts in lm.points.items() for n, t in pts}


def model_of(points: dict[tuple[int, int], float], additive: bool) -> LatencyModel:
    by_depth: dict[int, list[tuple[int, float]]] = {}
    for (n, d), r in points.items():
        by_depth.setdefault(d, []).append((n, r))
    return LatencyModel(1.0, additive_points(by_depth) if additive else by_depth)


def tuner_choice(cands, lm: LatencyModel):
    """`autotune.choose_tree` over `cands` with each one's step cost and tokens/s read from `lm`."""
    return choose_tree(price_candidates(cands, lm))


def staged_model(own: dict[tuple[int, int], float], cands, depth: int) -> LatencyModel:
    """The model `autotune.staged_latency` would build had its stages timed what `own` holds."""
    return staged_grid(cands, latency_jobs(CPU_SIZES, range(1, depth + 1)),
                       lambda jobs: model_of({p: own[p] for p in jobs}, False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=6)
    ap.add_argument("--kinds", default="hydra,hydra++,medusa")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    if a.models < 3:
        ap.error("--models must be at least 3 (each is scored on the others)")
    kinds = [k for k in a.kinds.split(",") if k]
    engine = load_engine_for(ModelOptions(dtype=a.dtype), kinds)
    t0 = time.time()
    measured: dict[str, list[dict]] = {k: [] for k in kinds}
    with torch.inference_mode(), torch_threads(decoding_threads(engine)):
        for _ in range(a.models):
            for k in kinds:  # kinds in turn, so a slow minute hits each
                K = min(engine.runners[k].config.num_heads, shipped_stats(engine.runners[k]).depth)
                lm = measure_latency(engine, k, max_nodes=max(CPU_SIZES), sizes=CPU_SIZES, depths=range(1, K + 1),
                                     repeats=2, context_tokens=SHORT_CONTEXT)
                measured[k].append(ratios(lm))
    print(f"{a.models} latency models per kind in {time.time() - t0:.0f} s\n")
    print("| heads | way | reference speedup of the tree chosen, mean (min-max) | predicted over reference | trees chosen "
          "| same tree as per point |")
    print("|---|---|---:|---:|---|---:|")
    for k in kinds:
        stats = shipped_stats(engine.runners[k])
        K = min(engine.runners[k].config.num_heads, stats.depth)
        cands = search_trees(stats, [max(CPU_SIZES)], model_of(measured[k][0], False), depths=range(1, K + 1))
        timed: list[float] = []
        for way in ("per point", "additive", "staged"):
            true, over, chosen = [], [], []
            for i, own in enumerate(measured[k]):
                others = [m for j, m in enumerate(measured[k]) if j != i]
                ref = model_of({p: statistics.median(m[p] for m in others) for p in own}, False)
                if way == "staged":
                    staged = staged_model(own, cands, K)
                    best = choose_tree(priced(cands, staged))
                    timed.append(sum(len(v) for v in staged.points.values()) / len(own))
                else:
                    best = tuner_choice(cands, model_of(own, way == "additive"))
                predicted = best.predicted_speedup  # the model's baseline is 1: tokens/s over plain decoding
                real = best.predicted_tau / ref.cost(best.n_nodes, best.depth)
                true.append(real)
                over.append(predicted / real)
                chosen.append(f"{best.n_nodes} d{best.depth}")
            if way == "per point":
                per_point = chosen
            same = sum(a == b for a, b in zip(chosen, per_point))
            print(f"| {k} | {way} | {statistics.mean(true):.3f}x "
                  f"({min(true):.2f}-{max(true):.2f}) | {statistics.mean(over):.3f} | "
                  f"{len(set(chosen))}: {', '.join(chosen)} | {same} of {len(chosen)} |", flush=True)
        print(f"| {k} | staged: share of the grid's points timed | {statistics.mean(timed):.0%} | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
