"""Where a decoding step's time goes, per method: mean ms a step in scheduling, drafting,
verification and bookkeeping, with tau and the verify rows, on a few bench prompts (greedy, the
tuned trees and kernels this machine's engine chose). No asserts.

Methods run interleaved, prompt by prompt and repeat by repeat (the method order rotated each
time), so that a shared machine's drift in speed hits every method alike: run one method after
another and the plain loop can look 25% faster or slower than it is beside the trees.

    python scripts/step_breakdown.py [--dtype bfloat16] [--methods baseline,medusa,hydra,hydra++,entmtp] [--n 3] [--repeats 2]
        [--draft-lm both]

--draft-lm both runs every heads method twice, interleaved on the same trees: drafts scored through
the lm_head slice in int8 ("<method> int8") and in the kernels' own dtype ("<method> own").
--draft-lm blocks: both with the slice in int8, the heads' residual blocks in int8 ("<method> int8
blocks") or in the kernels' own dtype ("<method> own blocks").
"""

import argparse
import copy

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp.bench import BenchConfig, load_bench_prompts  # noqa: E402
from entmtp.calibrate import encode_prompts  # noqa: E402
from entmtp.interleave import rotated  # noqa: E402
from entmtp.heads import HeadRunner  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for, make_runner, method_heads, parse_methods  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="baseline,medusa,hydra,hydra++,entmtp")
    ap.add_argument("--n", type=int, default=3, help="prompts")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every (method, prompt), interleaved")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-lm", choices=("auto", "both", "blocks"), default="auto",
                    help="auto: as measured at load; both: int8 and the kernels' own dtype side by side; "
                         "blocks: the heads' blocks in int8 and in the kernels' own dtype, the slice in int8")
    a = ap.parse_args()
    if a.n < 1 or a.repeats < 1:
        ap.error("--n and --repeats must be at least 1")
    methods = parse_methods(a.methods)
    engine = load_engine_for(ModelOptions(dtype=a.dtype), methods)
    _, prompts = load_bench_prompts(BenchConfig(per_category=1))
    ids = [i for _, i in encode_prompts(engine, prompts[: a.n])]
    runners = {m: make_runner(engine, m, a.max_new_tokens, progress=None) for m in methods}
    if a.draft_lm != "auto":
        variants = {}
        for int8 in (True, False):
            twin = copy.copy(engine)  # the same model, kernels and tuned trees; other head runners
            how = {"lm_int8": int8} if a.draft_lm == "both" else {"lm_int8": True, "int8_blocks": int8}
            twin.runners = {k: HeadRunner(r.heads, engine.model, kernels=engine.kernels, **how)
                            for k, r in engine.runners.items()}
            variants[int8] = twin
        tags = ("int8", "own") if a.draft_lm == "both" else ("int8 blocks", "own blocks")
        runners = {}
        for m in list(methods):
            if method_heads(m, engine=engine) is None:
                runners[m] = make_runner(engine, m, a.max_new_tokens, progress=None)
                continue
            for int8, tag in zip((True, False), tags):
                runners[f"{m} {tag}"] = make_runner(variants[int8], m, a.max_new_tokens, progress=None)
        methods = list(runners)
    for run in runners.values():
        run(ids[0])  # warm-up
    steps = {m: [] for m in methods}
    total = {m: 0.0 for m in methods}
    tokens = {m: 0 for m in methods}
    turn = 0
    for _ in range(a.repeats):
        for i in ids:
            order = rotated(methods, turn)
            turn += 1
            for m in order:
                r = runners[m](i).result
                steps[m] += r.steps
                tokens[m] += len(r.tokens)
                total[m] += r.time_total
    print("| method | tokens/s | tau | rows a step | schedule ms | draft ms | verify ms | bookkeeping ms | step ms | ms a token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        st = steps[m]
        n = len(st)
        emitted = sum(len(s.emitted) for s in st)
        mean = lambda k: sum(getattr(s, k) for s in st) / n * 1e3  # noqa: E731
        step = sum(s.time_total for s in st) / n * 1e3
        print(f"| {m} | {tokens[m] / total[m]:.1f} | {emitted / n:.2f} | {sum(s.n_nodes for s in st) / n:.1f} | "
              f"{mean('time_schedule'):.2f} | {mean('time_draft'):.2f} | {mean('time_verify'):.2f} | "
              f"{mean('time_bookkeeping'):.2f} | {step:.2f} | {step * n / emitted:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
