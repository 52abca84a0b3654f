"""Time entmtp's float32 attention op `attend` (entmtp/csrc/bf16_panels.cpp) against torch's float32
sdpa on one layer of SmolLM2-135M's shape (9 query heads, 3 key/value heads, head dim 64), for tree
rows x cached keys, the two calls interleaved call by call.

    python scripts/bench_attend.py [--threads N]

Prints a markdown table of medians (microseconds per call) and attend / sdpa. Needs the panel
kernels (an AVX2 CPU and a C++ compiler; built on first use).
"""

import argparse
import statistics
import time

import torch


def interleaved_medians(f, g, n: int = 400) -> tuple[float, float]:
    for _ in range(20):
        f(), g()
    a, b = [], []
    for _ in range(n):
        t = time.perf_counter(); f(); a.append(time.perf_counter() - t)  # noqa: E702
        t = time.perf_counter(); g(); b.append(time.perf_counter() - t)  # noqa: E702
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from entmtp import kernels
    from entmtp.attention import fp32_sdpa
    from entmtp.hardware import hardware_class

    why = kernels._panels_unavailable()
    if why:
        raise SystemExit(f"error: {why}")
    attend = torch.ops.entmtp_cpu.attend
    print(f"{hardware_class('cpu')}, {torch.get_num_threads()} threads, float32\n")
    print("| rows | keys | attend (us) | torch sdpa (us) | attend / sdpa |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for keys in (300, 600):
        for rows in (1, 4, 8, 16, 32):
            q = torch.randn(1, 9, rows, 64, generator=g)
            k, v = (torch.randn(1, 3, keys, 64, generator=g) for _ in range(2))
            mask = torch.zeros(1, 1, rows, keys)  # the last `rows` keys causal among themselves, as a chain
            mask[..., -rows:] = torch.full((rows, rows), float("-inf")).triu(1)
            m = mask if rows > 1 else None
            with torch.no_grad():
                ours, theirs = interleaved_medians(lambda: attend(q, k, v, m, False, 0.125),
                                                   lambda: fp32_sdpa(q, k, v, m, scale=0.125).transpose(1, 2).contiguous())
            print(f"| {rows} | {keys} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
