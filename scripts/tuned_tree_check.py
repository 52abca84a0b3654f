"""Does the tree `entmtp tune` chose beat its neighbours on this machine? Races the tuned tree of
one head kind against hand-made trees of 3-12 nodes and our plain loop, on the bench prompts,
interleaved prompt by prompt (the order rotated each prompt, so a shared machine's drift hits every
tree alike; `search.evaluate_trees`); greedy, no prompt lookup. Prints tokens/s (step time, prefill
excluded), the ratio to our plain loop, tau and identity per tree. No asserts: a check of the
tuner's latency model against decoding itself.

    python scripts/tuned_tree_check.py [--heads hydra] [--dtype bfloat16] [--per-category 2] [--max-new-tokens 96]
"""

import argparse

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

from entmtp.bench import BenchConfig, load_bench_prompts  # noqa: E402
from entmtp.methods import ModelOptions, default_tree, load_engine_for  # noqa: E402
from entmtp.paths import HEAD_KINDS  # noqa: E402
from entmtp.search import evaluate_trees  # noqa: E402
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
    tuned = default_tree(engine, a.heads, progress=None)
    trees = [Tree(tuned.paths, f"tuned ({tuned.name})")] + [Tree.from_paths(p, n) for n, p in NEIGHBOURS.items()]
    # every tree and plain decoding on every prompt, the order rotated per prompt (`search.evaluate_trees`)
    res = evaluate_trees(engine, a.heads, trees, prompts, max_new_tokens=a.max_new_tokens)
    plain = res[-1].tokens_per_s
    print(f"{a.heads}, {a.dtype}, {len(prompts)} bench prompts, {a.max_new_tokens} new tokens\n")
    print("| tree | tokens/s | x plain loop | tau | identical to plain loop |")
    print("|---|---:|---:|---:|---|")
    for m in res:
        same = "" if m.identical_to_baseline is None else ("yes" if m.identical_to_baseline else "NO")
        print(f"| {'plain loop' if m.tree is None else m.name} | {m.tokens_per_s:.1f} | {m.tokens_per_s / plain:.2f}x | "
              f"{m.tau:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
