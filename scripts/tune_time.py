"""Where the trees stage of a tune spends its time, what sharing the measuring contexts'
prefills across head kinds saves, and which trees each tune chose. No asserts.

Each round tunes every loaded kind twice, on this process's engine, without reading or writing
the tuning cache (`ENTMTP_CACHE` is pointed at a scratch directory): once as `entmtp tune` does
(`autotune.tune_all`: the contexts prefilled once for all kinds) and once each kind on its own
(`autotune.tuned_trees` per kind, as before), the order alternated between rounds so that a
drift of a shared machine's speed hits both alike. Prints per round and way the seconds of the
whole stage, of the prefills, and how many prefills ran, and per kind the tree chosen and its
predicted speedup over plain decoding.

    python scripts/tune_time.py [--rounds 2] [--dtype bfloat16] [--kinds hydra,hydra++,medusa] [--ways shared,alone]
"""

import argparse
import os
import statistics
import tempfile
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp import autotune  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kinds", default="hydra,hydra++,medusa")
    ap.add_argument("--ways", default="shared,alone", help="shared (as `entmtp tune`), alone (each kind on its own)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    chosen_ways = [w for w in a.ways.split(",") if w]
    if not chosen_ways or set(chosen_ways) - {"shared", "alone"}:
        ap.error("--ways takes shared and/or alone")
    kinds = [k for k in a.kinds.split(",") if k]
    engine = load_engine_for(ModelOptions(dtype=a.dtype), kinds)  # kernels from this machine's cache
    os.environ["ENTMTP_TUNE"] = "refresh"  # the trees measured every time, never read from a cache
    os.environ["ENTMTP_CACHE"] = tempfile.mkdtemp(prefix="entmtp-tune-time-")
    prefills: list[float] = []
    own_prefill = engine.prefill

    def timed_prefill(ids, heads=None):
        t = time.perf_counter()
        out = own_prefill(ids, heads=heads)
        prefills.append(time.perf_counter() - t)
        return out

    engine.prefill = timed_prefill
    every = {"shared": ("shared prefills (tune_all)", lambda: autotune.tune_all(engine, kinds)),
             "alone": ("each kind alone", lambda: {k: autotune.tuned_trees(engine, k) for k in kinds})}
    ways = dict(every[w] for w in chosen_ways)
    totals: dict[str, list[float]] = {w: [] for w in ways}
    print("| round | way | stage s | prefill s | prefills | trees (nodes/depth, predicted x plain decoding) |")
    print("|---:|---|---:|---:|---:|---|")
    for r in range(a.rounds):
        for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            prefills.clear()
            engine.held_tunes.clear()  # a tune held for the process (measured while busy) would be reused
            t = time.perf_counter()
            tuned = ways[w]()
            s = time.perf_counter() - t
            totals[w].append(s)
            trees = "; ".join(f"{k} {v.tree.n_nodes}/d{v.tree.depth} {v.predicted_speedup:.2f}x"
                              for k, v in tuned.items() if v is not None)
            print(f"| {r + 1} | {w} | {s:.1f} | {sum(prefills):.1f} | {len(prefills)} | {trees} |", flush=True)
    for w, v in totals.items():
        print(f"{w}: median {statistics.median(v):.1f} s over {len(v)} round(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
