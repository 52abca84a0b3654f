"""Acceptance statistics shipped with the embedded heads (`<heads dir>/acceptance.json.gz`).

Which draft nodes a base model accepts depends on the model and the heads, not on the machine;
`entmtp tune` combines these statistics with step latencies measured on each machine to choose
the static trees and the entropy bank there (`entmtp.autotune`). Greedy, trace statistics (every
position of each continuation, ranks < 16), over the bundled calibration prompts only (never the
bench prompts), decoded in bfloat16 like the heads were trained.

    python scripts/ship_acceptance.py [--kinds medusa,hydra,hydra++] [--max-new-tokens 96]
"""

import argparse
import gzip
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="medusa,hydra,hydra++")
    ap.add_argument("--data", default="calib_example")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import entmtp  # noqa: F401 - thread policy before torch
    from entmtp.autotune import ACCEPTANCE_FILE
    from entmtp.calibrate import collect_stats
    from entmtp.data import bundled_prompts, load_prompts
    from entmtp.models import default_heads_path, load_engine

    kinds = args.kinds.split(",")
    engine = load_engine("default", {k: k for k in kinds}, dtype=args.dtype, progress=None)
    source = bundled_prompts(args.data) if "/" not in args.data and "." not in args.data else args.data
    prompts = load_prompts(source).prompts
    for kind in kinds:
        stats = collect_stats(engine, kind, prompts, max_new_tokens=args.max_new_tokens, max_rank=args.max_rank,
                              meta={"data": args.data, "command": " ".join(["python scripts/ship_acceptance.py", *sys.argv[1:]])})
        out = default_heads_path(kind) / ACCEPTANCE_FILE
        with gzip.open(out, "wt", compresslevel=9) as f:
            json.dump(stats.to_json(), f, separators=(",", ":"))
        print(f"{kind}: {stats.n_steps} steps over {len(prompts)} prompts -> {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
