"""Drafting time of each heads' tuned tree with the shared lm_head slice in int8 against the kernels'
own dtype, interleaved call by call (the order alternated), median ms a draft. No asserts.

Drafts are verified token by token, so the int8 slice changes which tokens are proposed at near-ties,
never what is emitted; the engine picks int8 where `heads.draft_lm_timings` measures it faster.

    python scripts/draft_lm.py [--dtype bfloat16] [--methods medusa,hydra,hydra++] [--calls 300]
"""

import argparse
import statistics
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp.heads import HeadRunner  # noqa: E402
from entmtp.methods import ModelOptions, default_tree, load_engine_for, parse_methods  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="medusa,hydra,hydra++")
    ap.add_argument("--calls", type=int, default=300, help="timed drafts of each variant")
    a = ap.parse_args()
    if a.calls < 1:
        ap.error("--calls must be at least 1")
    engine = load_engine_for(ModelOptions(dtype=a.dtype), parse_methods(a.methods))
    print("| heads | tree | int8 ms | own dtype ms | int8 / own |")
    print("|---|---|---:|---:|---:|")
    for name, runner in engine.runners.items():
        tree = default_tree(engine, name, progress=None)
        runners = {v: HeadRunner(runner.heads, engine.model, kernels=engine.kernels, lm_int8=v) for v in (True, False)}
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(40, engine.model.config.hidden_size, generator=g).to(engine.dtype)
        times = {True: [], False: []}
        with torch.inference_mode():
            features = {v: r.start(hidden, torch.arange(40))[1] for v, r in runners.items()}
            for call in range(a.calls):
                for v in ((True, False) if call % 2 else (False, True)):
                    t0 = time.perf_counter()
                    runners[v].draft(tree, features[v], torch.tensor(17))
                    times[v].append(time.perf_counter() - t0)
        i8, own = (statistics.median(times[v]) * 1e3 for v in (True, False))
        print(f"| {name} | {tree.name} | {i8:.3f} | {own:.3f} | {i8 / own:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
