"""Where a decoding forward's time goes, op by op: torch's profiler over forwards of the engine's
decoding twin (the kernel set this machine's profile chose) for chains of 1, 8, ... tree rows
after a cache of --context tokens. Prints, per row count, the wall ms a forward, the ms inside
ops (self time, summed) and the rest (Python and dispatch between ops), then the ops taking most
time with their ms a forward and calls a forward. The row counts run interleaved. No asserts.

    python scripts/forward_ops.py [--dtype bfloat16] [--rows 1,8] [--context 96] [--forwards 30] [--top 12]

Run it with another checkout's package first on PYTHONPATH to compare two builds op by op.
"""

import argparse
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp.hardware import synchronize  # noqa: E402
from entmtp.kernels import tree_mask_dtype  # noqa: E402
from entmtp.kvcache import decoding_cache  # noqa: E402
from entmtp.models import load_engine  # noqa: E402
from entmtp.tuning import chain_mask  # noqa: E402
from entmtp.verify import forward  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--forwards", type=int, default=30)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {a.rows!r}")
    if not rows or min(rows) < 1 or a.context < 1 or a.forwards < 1:
        ap.error("--rows, --context and --forwards must be positive")
    engine = load_engine(a.model, heads={}, dtype=a.dtype, progress=None)
    twin = engine.decode_model
    print(f"kernels: {engine.kernels}; {torch.get_num_threads()} threads; {a.forwards} forwards of each row count "
          f"after {a.context} cached tokens\n")
    g = torch.Generator().manual_seed(0)
    vocab = twin.get_input_embeddings().weight.shape[0]
    dev = twin.device
    rand = lambda n: torch.randint(min(3, vocab - 1), vocab, (1, n), generator=g).to(dev)  # noqa: E731
    cache = decoding_cache(twin)
    stats = {}
    with torch.inference_mode():
        forward(twin, rand(a.context), cache)
        inputs = {r: (rand(r), (a.context + torch.arange(r, device=dev))[None], chain_mask(r, a.context, tree_mask_dtype(twin), dev)) for r in rows}
        profs = {r: torch.profiler.profile(acc_events=True) for r in rows}
        wall = {r: 0.0 for r in rows}
        for k in range(a.forwards + 3):  # 3 untimed rounds first; row counts interleaved
            for r, (ids, pos, mask) in inputs.items():
                timed = k >= 3
                if timed:
                    profs[r].start()
                t = time.perf_counter()
                forward(twin, ids, cache, mask=mask, position_ids=pos)
                synchronize(dev)
                if timed:
                    wall[r] += time.perf_counter() - t
                    profs[r].stop()
                cache.crop(-r)
        for r in rows:
            ev = profs[r].key_averages()
            stats[r] = {e.key: (e.self_cpu_time_total / a.forwards / 1e3, e.count / a.forwards) for e in ev}
    print("| rows | wall ms a forward | in ops | outside ops |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        ops = sum(ms for ms, _ in stats[r].values())
        w = wall[r] / a.forwards * 1e3
        print(f"| {r} | {w:.2f} | {ops:.2f} | {w - ops:.2f} |")
    top = sorted({k for r in rows for k in stats[r]}, key=lambda k: -max(stats[r].get(k, (0, 0))[0] for r in rows))[:a.top]
    print("\n| op | " + " | ".join(f"{r} rows: ms (calls)" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for k in top:
        cells = [f"{stats[r].get(k, (0, 0))[0]:.3f} ({stats[r].get(k, (0, 0))[1]:.0f})" for r in rows]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("\n(profiled: the profiler adds its own cost to each op, so wall times run above unprofiled ones)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
