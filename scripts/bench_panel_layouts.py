"""entmtp's bf16 panel layouts side by side on the embedded model's shapes (entmtp.kernels.panel_layout).

For each layout this CPU can run ("avx2": 16-column FMA panels, "avx512": 32-column FMA panels,
"avx512_bf16": k-pair panels for vdpbf16ps, "amx": the k-pairs as AMX tiles) and each weight shape of SmolLM2-135M (lm_head, the
fused gate|up, down, the fused q|k|v), times one product of 1, 4, 9 and 16 rows, interleaved,
fastest of the repeats, one thread; and checks that each layout is row-invariant (every row of a
block equals that row alone, bitwise). Prints milliseconds and the k-row / 1-row ratio; no asserts.

    python scripts/bench_panel_layouts.py [--rows 1,4,9,16] [--repeats 15] [--threads 1]
"""

import argparse
import time

import torch

from entmtp import kernels
from entmtp.hardware import isa_at_least

SHAPES = {"lm_head": (49152, 576), "gate|up": (3072, 576), "down": (576, 1536), "q|k|v": (960, 576)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,9,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    why = kernels.kernel_options(torch.bfloat16)["panels"]
    if why:
        print(f"error: {why}")
        return 2
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    layouts = [name for name in kernels.PANEL_LAYOUTS if isa_at_least(name)]
    op = torch.ops.entmtp_cpu.bf16_panels_linear
    g = torch.Generator().manual_seed(0)
    print(f"layouts here: {', '.join(layouts)}; {args.threads} thread(s); ms per product, fastest of {args.repeats}")
    print("| weight | rows | " + " | ".join(layouts) + " | " + " | ".join(f"{n} / 1 row" for n in layouts) + " |")
    print("|---|---:|" + "---:|" * (2 * len(layouts)))
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = {name: kernels.pack_panels(w, name) for name in layouts}
        one: dict[str, float] = {}
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            times = {name: [] for name in layouts}
            for rep in range(args.repeats + 1):
                for name, p in packed.items():
                    t = time.perf_counter()
                    op(x, p, n, None, False)
                    if rep:
                        times[name].append(time.perf_counter() - t)
            best = {name: min(ts) * 1e3 for name, ts in times.items()}
            for name, p in packed.items():
                alone = torch.cat([op(x[i:i + 1], p, n, None, True) for i in range(m)])
                if not torch.equal(alone, op(x, p, n, None, True)):
                    print(f"warning: {name} is not row-invariant for {label} at {m} rows")
            if m == 1:
                one = best
            ratios = [f"{best[name] / one[name]:.2f}" if one else "" for name in layouts]
            print(f"| {label} | {m} | " + " | ".join(f"{best[name]:.3f}" for name in layouts) + " | " + " | ".join(ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
