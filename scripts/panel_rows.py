"""What a tree's extra rows cost in entmtp's own bf16 kernels on this CPU: one `panels_product`
(`entmtp.kernels`, the layout dispatch picks here) by input rows, for the embedded model's lm_head
shape (49152 x 576, streamed from memory) and an MLP projection (1536 x 576, cache-resident), with
the multiply-adds per second at the most rows. Where one row costs about as much as eight the
rows are nearly free and wide trees pay; where the cost grows with the rows, the CPU's bf16
arithmetic is the limit and the tuner picks small trees. Medians of --repeats; no asserts.

    python scripts/panel_rows.py [--rows 1,2,4,8,9,12,16] [--repeats 200]
"""

import argparse
import statistics
import sys
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp import kernels  # noqa: E402

SHAPES = ((49152, 576, "lm_head"), (1536, 576, "MLP projection"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,9,12,16")
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {a.rows!r}")
    if not rows or min(rows) < 1 or a.repeats < 1:
        ap.error("--rows must be positive and --repeats at least 1")
    why = kernels._panels_unavailable()
    if why is not None:
        print(f"entmtp's panel kernels do not run here: {why}", file=sys.stderr)
        return 1
    print(f"panel layout {kernels.panel_layout()}, {torch.get_num_threads()} threads; ms per product (x one row)\n")
    print("| weight | " + " | ".join(f"{r} rows" for r in rows) + f" | GMAC/s at {rows[-1]} rows |")
    print("|---|" + "---:|" * (len(rows) + 1))
    g = torch.Generator().manual_seed(0)
    for n, k, name in SHAPES:
        panels = kernels.pack_panels(torch.randn(n, k, generator=g).to(torch.bfloat16))
        ms = []
        for r in rows:
            x = torch.randn(r, k, generator=g).to(torch.bfloat16)
            for _ in range(5):
                kernels.panels_product(x, panels, n)
            ts = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                kernels.panels_product(x, panels, n)
                ts.append(time.perf_counter() - t)
            ms.append(statistics.median(ts) * 1e3)
        cells = " | ".join(f"{m:.3f} ({m / ms[0]:.2f}x)" for m in ms)
        print(f"| {name} {n} x {k} | {cells} | {rows[-1] * n * k / ms[-1] / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
