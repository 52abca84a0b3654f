"""Stock vs prepacked linears on the embedded model, side by side (entmtp.kernels).

Times, interleaved and as medians: (1) every linear layer of the model (30 layers' q/k/v/o and
MLP projections, then the lm_head) on inputs of 1, 4, 9, 16 and 32 rows, stock vs packed one by
one; (2) a whole model forward of that many tokens after a 200-token cache (with a tree-shaped
mask for > 1 token), stock model vs the engine's decoding twin (`kernels.decode_model`: packed
linears, and on AVX2 bf16 also fused norms / MLPs and float32 attention); and compares the outputs (bfloat16 on oneDNN: bit-identical; float32, and
bfloat16 on entmtp's AVX2 panels: the largest difference relative to the output scale). Prints
ratios; no asserts.

    python scripts/bench_kernels.py [--model default] [--dtype bfloat16] [--rows 1,4,9,16,32] [--repeats 15]
"""

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,4,9,16,32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--past", type=int, default=200, help="cached tokens before the timed forward")
    args = ap.parse_args()

    from entmtp.kernels import PackedLinear, PanelLinear, can_pack, decode_model, pack_method
    from entmtp.models import load_base
    from entmtp.verify import tree_mask

    model, _ = load_base(args.model, dtype=args.dtype, progress=None)
    dt = model.dtype
    why = can_pack(model)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    twin, _, twin_why = decode_model(model, "packed")
    method = pack_method(dt)[0]
    bitwise = dt == torch.bfloat16 and method == "onednn"
    stock_lin = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed_lin = [(PackedLinear if method == "onednn" else PanelLinear)(m) for m in stock_lin]
    print(f"{len(stock_lin)} linear layers, {sum(m.weight.numel() * m.weight.element_size() for m in stock_lin) / 2**20:.0f} MiB of {args.dtype} weights "
          f"(the lm_head shares the embedding); packed: {method}; torch {torch.__version__}, {torch.get_num_threads()} threads\n"
          f"decoding twin: {twin_why}")
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    print("\nrows | all linears: stock ms | packed ms | stock/packed | whole forward: stock ms | twin ms | stock/twin | "
          + ("identical" if bitwise else "max |diff| / max |logit|"))
    print("---|---|---|---|---|---|---|---")
    with torch.inference_mode():
        for r in rows:
            xs = {n: torch.randn(r, n, generator=g).to(dt) for n in {m.in_features for m in stock_lin}}

            def run(layers):
                return [m(xs[m.in_features]) for m in layers]

            same = all(torch.equal(a, b) for a, b in zip(run(stock_lin), run(packed_lin)))
            lin = {"stock": [], "packed": []}
            for _ in range(3):  # interleaved rounds
                lin["stock"].append(median_ms(lambda: run(stock_lin), max(3, args.repeats // 3)))
                lin["packed"].append(median_ms(lambda: run(packed_lin), max(3, args.repeats // 3)))
            prompt = torch.randint(10, 40000, (1, args.past), generator=g)
            ids = torch.randint(10, 40000, (1, r), generator=g)
            bias = torch.full((r, r), float("-inf")).triu(1).nan_to_num(neginf=torch.finfo(dt).min)
            mask = tree_mask(bias.to(dt), args.past) if r > 1 else None
            pos = (args.past + torch.arange(r))[None]
            fwd, outs = {}, {}
            for name, m in (("stock", model), ("packed", twin)):
                cache = DynamicCache(config=model.config)
                m(input_ids=prompt, cache=cache, use_cache=True)

                def step(m=m, cache=cache):
                    out = m(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                    cache.crop(-r)
                    return out.logits

                outs[name] = step()
                fwd[name] = median_ms(step, args.repeats)
            same = same and torch.equal(outs["stock"], outs["packed"])
            rel = ((outs["stock"] - outs["packed"]).abs().max() / outs["stock"].abs().max()).item()
            ls, lp = statistics.median(lin["stock"]), statistics.median(lin["packed"])
            print(f"{r} | {ls:.1f} | {lp:.1f} | {ls / lp:.2f}x | {fwd['stock']:.1f} | {fwd['packed']:.1f} | "
                  f"{fwd['stock'] / fwd['packed']:.2f}x | " + (('yes' if same else 'NO') if bitwise else f"{rel:.1e}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
