"""Where a decoding step's time goes, per method: mean ms a step in scheduling, drafting,
verification and bookkeeping, with tau and the verify rows, on a few bench prompts (greedy, the
tuned trees and kernels this machine's engine chose). No asserts.

    python scripts/step_breakdown.py [--dtype bfloat16] [--methods baseline,medusa,hydra,hydra++,entmtp] [--n 3]
"""

import argparse

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp.bench import BenchConfig, load_bench_prompts  # noqa: E402
from entmtp.calibrate import encode_prompts  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for, make_runner, parse_methods  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="baseline,medusa,hydra,hydra++,entmtp")
    ap.add_argument("--n", type=int, default=3, help="prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    methods = parse_methods(a.methods)
    engine = load_engine_for(ModelOptions(dtype=a.dtype), methods)
    _, prompts = load_bench_prompts(BenchConfig(per_category=1))
    ids = [i for _, i in encode_prompts(engine, prompts[: a.n])]
    print("| method | tokens/s | tau | rows a step | schedule ms | draft ms | verify ms | bookkeeping ms | step ms | ms a token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        run = make_runner(engine, m, a.max_new_tokens, progress=None)
        run(ids[0])  # warm-up
        steps, tokens, total = [], 0, 0.0
        for i in ids:
            r = run(i).result
            steps += r.steps
            tokens += len(r.tokens)
            total += r.time_total
        n = len(steps)
        mean = lambda k: sum(getattr(s, k) for s in steps) / n * 1e3
        rows = sum(s.n_nodes for s in steps) / n
        step = sum(s.time_total for s in steps) / n * 1e3
        print(f"| {m} | {tokens / total:.1f} | {sum(len(s.emitted) for s in steps) / n:.2f} | {rows:.1f} | "
              f"{mean('time_schedule'):.2f} | {mean('time_draft'):.2f} | {mean('time_verify'):.2f} | "
              f"{mean('time_bookkeeping'):.2f} | {step:.2f} | {step * n / sum(len(s.emitted) for s in steps):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
