"""Does the tree `entmtp tune` chose beat its neighbours on this machine? Races the tuned tree of
one head kind against hand-made trees of 3-12 nodes and our plain loop, on the bench prompts,
interleaved prompt by prompt (the order rotated each prompt, so a shared machine's drift hits every
tree alike); greedy, no prompt lookup. Prints tokens/s, the ratio to our plain loop and tau per
tree. No asserts: a check of the tuner's latency model against decoding itself.

    python scripts/tuned_tree_check.py [--heads hydra] [--dtype bfloat16] [--per-category 2] [--max-new-tokens 96]
"""

import argparse

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp.bench import BenchConfig, load_bench_prompts  # noqa: E402
from entmtp.calibrate import encode_prompts  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for, make_runner  # noqa: E402
from entmtp.paths import HEAD_KINDS  # noqa: E402
from entmtp.trees import Tree  # noqa: E402

# rank paths: top-k children of the root, then of the likeliest nodes, by depth
NEIGHBOURS = {
    "3 nodes, depth 2": [[0], [1], [0, 0]],
    "6 nodes, depth 2": [[0], [1], [2], [0, 0], [0, 1], [1, 0]],
    "5 nodes, depth 3": [[0], [1], [0, 0], [1, 0], [0, 0, 0]],
    "8 nodes, depth 3": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]],
    "12 nodes, depth 4": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
                          [0, 0, 0, 0]],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="hydra", choices=sorted(HEAD_KINDS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=2, help="bench prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    if a.per_category < 1 or a.max_new_tokens < 1:
        ap.error("--per-category and --max-new-tokens must be at least 1")
    engine = load_engine_for(ModelOptions(dtype=a.dtype), ["baseline", a.heads])
    _, prompts = load_bench_prompts(BenchConfig(per_category=a.per_category))
    ids = [i for _, i in encode_prompts(engine, prompts)]
    runners = {"plain loop": make_runner(engine, "baseline", a.max_new_tokens, progress=None),
               "tuned": make_runner(engine, a.heads, a.max_new_tokens, lookup=0, progress=None)}
    for name, paths in NEIGHBOURS.items():
        runners[name] = make_runner(engine, a.heads, a.max_new_tokens, tree=Tree.from_paths(paths, name), lookup=0,
                                    progress=None)
    for run in runners.values():
        run(ids[0])  # warm-up
    names = list(runners)
    tokens = dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    forwards = dict.fromkeys(names, 0)
    for j, i in enumerate(ids):
        for name in names[j % len(names):] + names[:j % len(names)]:
            out = runners[name](i)
            tokens[name] += len(out.tokens)
            seconds[name] += out.result.time_total
            forwards[name] += out.forwards
    plain = tokens["plain loop"] / seconds["plain loop"]
    print(f"{a.heads}, {a.dtype}, {len(ids)} bench prompts, {a.max_new_tokens} new tokens; tuned: "
          f"{runners['tuned'].label}\n")
    print("| tree | tokens/s | x plain loop | tau |")
    print("|---|---:|---:|---:|")
    for name in names:
        tps = tokens[name] / seconds[name]
        print(f"| {name} | {tps:.1f} | {tps / plain:.2f}x | {tokens[name] / forwards[name]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
