"""Time one layer's attention of SmolLM2-135M (9 query heads, 3 key/value heads, head dim 64) in
bf16: transformers' sdpa path (torch's bf16 kernel) against entmtp's float32 attention
(`entmtp.attention.fp32_sdpa_attention`: casts, grouped-query sdpa in fp32, cast back).

    python scripts/bench_attention.py [--dtype bfloat16] [--threads N]

Prints a markdown table: rows x cached keys, microseconds per call (median), and each one's
largest difference from a float64 reference (the exact attention of the same bf16 inputs).
"""

import argparse
import math
import time
import types

import torch


def median_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from entmtp.attention import fp32_sdpa_attention
    from entmtp.hardware import hardware_class

    dt = getattr(torch, a.dtype)
    layer = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    print(f"{hardware_class('cpu')}, {torch.get_num_threads()} threads, {a.dtype}\n")
    print("| rows | keys | torch sdpa (us) | float32 attention (us) | ratio | max err torch | max err fp32 |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for rows, past in ((1, 300), (5, 300), (9, 300), (1, 1000), (9, 1000)):
        keys = past + rows
        q = torch.randn(1, 9, rows, 64, generator=g).to(dt)
        k, v = (torch.randn(1, 3, keys, 64, generator=g).to(dt) for _ in range(2))
        mask = torch.zeros(1, 1, rows, keys, dtype=dt) if rows > 1 else None
        with torch.no_grad():
            stock = lambda: sdpa_attention_forward(layer, q, k, v, mask, scaling=0.125)[0]  # noqa: E731
            ours = lambda: fp32_sdpa_attention(layer, q, k, v, mask, scaling=0.125)[0]  # noqa: E731
            t_stock, t_ours = median_us(stock), median_us(ours)
            kk, vv = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
            ref = (torch.softmax(q.double() @ kk.transpose(-1, -2) / math.sqrt(64), -1) @ vv).transpose(1, 2)
            e_stock = (stock().double() - ref).abs().max().item()
            e_ours = (ours().double() - ref).abs().max().item()
        print(f"| {rows} | {keys} | {t_stock:.0f} | {t_ours:.0f} | {t_stock / t_ours:.2f}x | {e_stock:.1e} | {e_ours:.1e} |")


if __name__ == "__main__":
    main()
