"""Forward time of the embedded model by rows (a plain step, trees) for each CPU thread count, under
the OpenMP wait policy of the environment: what a second thread buys a tree's extra rows.

    python scripts/rows_by_threads.py                            # entmtp's default: passive waiting
    OMP_WAIT_POLICY=ACTIVE python scripts/rows_by_threads.py     # spinning threads
    python scripts/rows_by_threads.py --threads 1,2 --dtype bfloat16 --kernels panels

Interleaved row counts, fastest of the repeats (`tuning.measure_set`, as `entmtp tune` times them).
"""

import argparse
import os

import entmtp  # noqa: F401  first: it sets the wait policy before torch loads OpenMP

import torch  # noqa: E402

from entmtp.models import load_engine  # noqa: E402
from entmtp.threads import default_threads  # noqa: E402
from entmtp.tuning import CPU_ROWS, measure_set  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{default_threads()}", help="comma-separated thread counts")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--kernels", default="panels", help="kernel set to time (see `entmtp tune`)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("ENTMTP_TUNE", "0")  # the set asked for, nothing else measured
    engine = load_engine("default", {}, dtype=args.dtype, progress=None)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(OpenMP default)')}, {args.dtype}, kernels {args.kernels}")
    print("| threads | " + " | ".join(f"{r} rows" for r in CPU_ROWS) + " |")
    print("|---:|" + "---:|" * len(CPU_ROWS))
    for n in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(n)
        t = measure_set(engine.model, args.kernels, rows=CPU_ROWS, repeats=args.repeats, check_rows=())
        if not t.ran:
            raise SystemExit(f"error: kernel set {args.kernels} cannot run here ({t.why})")
        print(f"| {n} | " + " | ".join(f"{t.ms_by_rows[r]:.1f}" for r in CPU_ROWS) + " |", flush=True)


if __name__ == "__main__":
    main()
