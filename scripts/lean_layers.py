"""What the decoding twin's lean decoder layers (`kernels.lean_decoder_layers`) gain: the same engine
decodes bench prompts with the layers' lean forward and with their own (transformers'), switched
in place and interleaved prompt by prompt (the order alternated), per method; prints tokens/s of
each, their ratio, and whether every output is the same. No asserts.

    python scripts/lean_layers.py [--dtype bfloat16] [--methods baseline,entmtp] [--n 4] [--repeats 2]
"""

import argparse
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp.bench import BenchConfig, load_bench_prompts  # noqa: E402
from entmtp.calibrate import encode_prompts  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for, make_runner, parse_methods  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="baseline,entmtp")
    ap.add_argument("--n", type=int, default=4, help="prompts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    if a.n < 1 or a.repeats < 1:
        ap.error("--n and --repeats must be at least 1")
    methods = parse_methods(a.methods)
    engine = load_engine_for(ModelOptions(dtype=a.dtype), methods)
    layers = [m for m in engine.decode_model.modules() if type(m).__name__.startswith("Lean")]
    if not layers:
        print(f"no lean decoder layers on this engine (kernels: {engine.kernels})")
        return 0
    lean_class = type(layers[0])
    variants = {"lean": lean_class, "own": lean_class.__mro__[1]}
    _, prompts = load_bench_prompts(BenchConfig(per_category=1))
    ids = [i for _, i in encode_prompts(engine, prompts[: a.n])]
    runners = {m: make_runner(engine, m, a.max_new_tokens, progress=None) for m in methods}
    for run in runners.values():
        run(ids[0])  # warm-up
    seconds = {(m, v): 0.0 for m in methods for v in variants}
    tokens = {(m, v): 0 for m in methods for v in variants}
    same = True
    turn = 0
    try:
        for _ in range(a.repeats):
            for i in ids:
                outs = {}
                for v in (("lean", "own") if turn % 2 == 0 else ("own", "lean")):
                    for layer in layers:
                        layer.__class__ = variants[v]
                    for m in methods:
                        t0 = time.perf_counter()
                        out = runners[m](i)
                        seconds[(m, v)] += time.perf_counter() - t0
                        tokens[(m, v)] += len(out.tokens)
                        outs[(m, v)] = out.tokens
                turn += 1
                same = same and all(outs[(m, "lean")] == outs[(m, "own")] for m in methods)
    finally:
        for layer in layers:
            layer.__class__ = lean_class
    print(f"{len(layers)} lean decoder layers ({lean_class.__name__}), {a.dtype}, kernels {engine.kernels}")
    print("| method | lean: tok/s | own forward: tok/s | lean / own |")
    print("|---|---:|---:|---:|")
    for m in methods:
        lean, own = (tokens[(m, v)] / seconds[(m, v)] for v in ("lean", "own"))
        print(f"| {m} | {lean:.1f} | {own:.1f} | {lean / own:.3f}x |")
    print(f"every output the same both ways: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
