"""How a forward's cost grows with the rows of a draft tree on this machine, per dtype.

The shape of this curve decides which trees pay (entmtp.hardware): where a 9-row forward costs
about one 1-row step, deep wide trees are nearly free; where it costs 4, only tiny trees or none
pay. Times a whole model forward of r tokens (tree-shaped mask for r > 1) after a 200-token cache,
medians, for float32 and bfloat16 (the decoding model: prepacked bf16 kernels where `auto` packs).
Prints ms and the ratio to a 1-row step; no asserts.

    python scripts/step_rows.py [--model default] [--rows 1,2,3,5,9,17,33] [--repeats 9]
"""

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", default="1,2,3,5,9,17,33")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--past", type=int, default=200, help="cached tokens before the timed forward")
    args = ap.parse_args()

    from entmtp.hardware import hardware_class
    from entmtp.kernels import decode_model
    from entmtp.models import load_base
    from entmtp.verify import tree_mask

    rows = [int(r) for r in args.rows.split(",")]
    print(f"hardware class {hardware_class('cpu')}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.past} cached tokens")
    print("\ndtype | kernels | " + " | ".join(f"{r} rows" for r in rows))
    print("---|---|" + "---|" * len(rows))
    g = torch.Generator().manual_seed(0)
    for dtype in args.dtypes.split(","):
        base, _ = load_base(args.model, dtype=dtype, progress=None)
        model, kernels, _ = decode_model(base, "auto")
        prompt = torch.randint(10, 40000, (1, args.past), generator=g)
        cache = DynamicCache(config=base.config)
        ms = []
        with torch.inference_mode():
            model(input_ids=prompt, cache=cache, use_cache=True)
            for r in rows:
                ids = torch.randint(10, 40000, (1, r), generator=g)
                bias = torch.full((r, r), float("-inf")).triu(1).nan_to_num(neginf=torch.finfo(base.dtype).min)
                mask = tree_mask(bias.to(base.dtype), args.past) if r > 1 else None
                pos = (args.past + torch.arange(r))[None]
                ts = []
                for _ in range(args.repeats + 1):  # the first, untimed: per-shape kernel setup
                    t = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                    ts.append(time.perf_counter() - t)
                    cache.crop(-r)
                ms.append(statistics.median(ts[1:]) * 1e3)
        print(f"{dtype} | {kernels} | " + " | ".join(f"{m:.1f} ms ({m / ms[0]:.2f}x)" for m in ms))
        del base, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
