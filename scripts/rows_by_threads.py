"""Forward time of the embedded model by rows (a plain step, trees) for each CPU thread count, under
the OpenMP wait policy of the environment: what a second thread buys a tree's extra rows.

    python scripts/rows_by_threads.py                            # entmtp's default: passive waiting
    OMP_WAIT_POLICY=ACTIVE python scripts/rows_by_threads.py     # spinning threads
    python scripts/rows_by_threads.py --threads 1,2 --dtype bfloat16 --kernels panels

Interleaved row counts, fastest of the repeats (`tuning.measure_set`, as `entmtp tune` times them).
With --bandwidth it also prints, for each thread count, the bytes of weights a one-row step reads
per second and what the same threads stream from memory (a sum over a 1 GiB tensor): where the
two match, the step is bound by memory bandwidth, and one thread's share of the cores' bandwidth
bounds what it can decode while another process holds the other cores.
"""

import argparse
import os
import time

import entmtp  # noqa: F401  first: it sets the wait policy before torch loads OpenMP

import torch  # noqa: E402

from entmtp.kernels import linear_bytes  # noqa: E402
from entmtp.models import load_engine  # noqa: E402
from entmtp.threads import default_threads  # noqa: E402
from entmtp.tuning import CPU_ROWS, measure_set  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{default_threads()}", help="comma-separated thread counts")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--kernels", default="panels", help="kernel set to time (see `entmtp tune`)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth", action="store_true", help="also weights read per second against streaming reads")
    args = ap.parse_args()
    os.environ.setdefault("ENTMTP_TUNE", "0")  # the set asked for, nothing else measured
    engine = load_engine("default", {}, dtype=args.dtype, progress=None)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(OpenMP default)')}, {args.dtype}, kernels {args.kernels}")
    print("| threads | " + " | ".join(f"{r} rows" for r in CPU_ROWS) + " |")
    print("|---:|" + "---:|" * len(CPU_ROWS))
    one_row = {}
    for n in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(n)
        t = measure_set(engine.model, args.kernels, rows=CPU_ROWS, repeats=args.repeats, check_rows=())
        if not t.ran:
            raise SystemExit(f"error: kernel set {args.kernels} cannot run here ({t.why})")
        one_row[n] = t.ms_by_rows[1]
        print(f"| {n} | " + " | ".join(f"{t.ms_by_rows[r]:.1f}" for r in CPU_ROWS) + " |", flush=True)
    if args.bandwidth:
        print_bandwidth(engine.model, one_row, args.repeats)


def stream_gbs(threads: int, repeats: int, nbytes: int = 1 << 30) -> float:
    """GB/s that `threads` threads read from memory: the fastest of `repeats` sums of a float32
    tensor of `nbytes` (far larger than any cache)."""
    torch.set_num_threads(threads)
    x = torch.ones(nbytes // 4)
    x.sum()  # fault the pages in and warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def print_bandwidth(model, one_row_ms: dict[int, float], repeats: int) -> None:
    """For each thread count: the one-row step's weight bytes per second beside streaming reads."""
    weights = linear_bytes(model)
    print(f"\none-row step: {weights / 1e6:.0f} MB of weights read per step")
    print("| threads | one-row step ms | weights read GB/s | streaming read GB/s | step / stream |")
    print("|---:|---:|---:|---:|---:|")
    for n, ms in one_row_ms.items():
        step, stream = weights / ms / 1e6, stream_gbs(n, repeats)
        print(f"| {n} | {ms:.1f} | {step:.1f} | {stream:.1f} | {step / stream:.2f} |", flush=True)


if __name__ == "__main__":
    main()
