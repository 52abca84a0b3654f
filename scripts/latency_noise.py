"""How much the tuner's step-latency model moves between measurements on this machine. No asserts.

`--models N`: measures each head kind's latency model N times in turn, exactly as `entmtp tune`
does (`autotune.tune_trees`' grid, repeats and context), and prints its plain step and the step
cost, over a plain step, of a few trees. Where the same tree's cost moves by more than the kinds
differ, the kind and tree the tuner picks rest on the moment it measured.

`--alternate N`: N rounds of three short generations after the same 96 random tokens -- our plain
loop, Hydra with an empty tree (root-only steps), Hydra with a 6-node tree -- printing each one's
median step: whether the plain step and the tree step move together or apart over time.

`--by-emitted N`: each kind decodes N bench prompts (96 tokens) with its tuned tree, beside our plain
loop on the same prompt; prints the median step by the tokens a step emitted. The tuner times trees
on random tokens, where drafts are rarely accepted: if a step cost more when more of its tree is
accepted (more KV rows kept, more rows through a Hydra++ prefix layer), its latency model would
run low.

With `--warm yes,no` each model is measured both with the tuner's untimed warm step before each
timed one and without it (every step timed, each tree's first after another tree's): whether the
warm steps change what the tuner measures and chooses, and what they cost.

    python scripts/latency_noise.py --models 3 [--kinds hydra,hydra++] [--dtype bfloat16] [--warm yes,no]
    python scripts/latency_noise.py --alternate 8
    python scripts/latency_noise.py --by-emitted 4
"""

import argparse
import statistics
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp.autotune import CPU_SIZES, SHORT_CONTEXT  # noqa: E402
from entmtp.calibrate import measure_latency  # noqa: E402
from entmtp.decoding import DecodeConfig  # noqa: E402
from entmtp.models import load_engine  # noqa: E402
from entmtp.trees import Tree  # noqa: E402

SHOWN = ((4, 2), (6, 2), (8, 3), (16, 3), (32, 2))  # (nodes, depth) of the trees printed


def models(engine, kinds: list[str], rounds: int, warm_ways: list[bool]) -> None:
    """Each kind's latency model `rounds` times, in each of `warm_ways` (the order alternated
    between rounds); per model its seconds and the tree the tuner's search chooses from it."""
    from entmtp.autotune import choose_tree, shipped_stats
    from entmtp.search import search_trees

    print("| round | heads | untimed warm steps | s | plain step ms | " + " | ".join(f"{n} nodes d{d}" for n, d in SHOWN)
          + " | tuner's tree (predicted x plain) |")
    print("|---:|---|---|---:|---:|" + "---:|" * len(SHOWN) + "---|")
    for r in range(rounds):
        for kind in kinds:
            stats = shipped_stats(engine.runners[kind])
            K = min(engine.runners[kind].config.num_heads, stats.depth)
            for warm in (warm_ways if r % 2 == 0 else warm_ways[::-1]):
                t = time.perf_counter()
                lm = measure_latency(engine, kind, max_nodes=max(CPU_SIZES), sizes=CPU_SIZES, depths=range(1, K + 1),
                                     repeats=2, context_tokens=SHORT_CONTEXT, warm=warm)
                took = time.perf_counter() - t
                best = choose_tree(search_trees(stats, [max(CPU_SIZES)], lm, depths=range(1, K + 1)))
                b = lm.baseline_s
                print(f"| {r + 1} | {kind} | {'yes' if warm else 'no'} | {took:.2f} | {b * 1e3:.2f} | "
                      + " | ".join(f"{lm.cost(n, d) / b:.2f}x" for n, d in SHOWN)
                      + f" | {best.n_nodes} d{best.depth} ({best.predicted_speedup:.2f}x) |", flush=True)


def alternate(engine, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, engine.model.get_input_embeddings().weight.shape[0], (96,), generator=g).tolist()
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    cfg = DecodeConfig(max_new_tokens=40, eos_token_ids=())

    def median_step_ms(heads, t) -> float:
        gen = engine.generate(ids, config=cfg) if heads is None else engine.generate(ids, heads=heads, tree=t, config=cfg)
        return statistics.median([s.time_total for s in gen][2:14]) * 1e3  # past the first steps

    print("| round | plain loop ms | Hydra, root only ms | Hydra, 6 nodes ms | 6 nodes / plain |")
    print("|---:|---:|---:|---:|---:|")
    for r in range(rounds):
        p, h0, h6 = median_step_ms(None, None), median_step_ms("hydra", Tree.from_paths([])), median_step_ms("hydra", tree)
        print(f"| {r + 1} | {p:.2f} | {h0:.2f} | {h6:.2f} | {h6 / p:.2f}x |", flush=True)


def by_emitted(engine, kinds: list[str], n_prompts: int) -> None:
    from entmtp.autotune import tuned_trees
    from entmtp.bench import BenchConfig, load_bench_prompts
    from entmtp.calibrate import encode_prompts

    _, prompts = load_bench_prompts(BenchConfig(per_category=1))
    cfg = DecodeConfig(max_new_tokens=96)
    ms = lambda v: f"{statistics.median(v) * 1e3:.1f}" if v else "-"  # noqa: E731
    print("| heads | prompt | plain loop step ms | tree step ms, 1 token emitted | 2 | 3 | 4+ | steps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        tuned = tuned_trees(engine, kind)
        tree = tuned.tree if tuned is not None else Tree.from_paths([[0], [0, 0]])
        for p, (_, ids) in enumerate(encode_prompts(engine, prompts[:n_prompts])):
            plain = [s.time_total for s in engine.generate(ids, config=cfg)][2:]
            by: dict[int, list[float]] = {1: [], 2: [], 3: [], 4: []}
            steps = list(engine.generate(ids, heads=kind, tree=tree, config=cfg))[2:]
            for s in steps:
                by[min(4, max(1, len(s.emitted)))].append(s.time_total)
            print(f"| {kind} ({tree.name}) | {p + 1} | {ms(plain)} | " + " | ".join(ms(by[k]) for k in (1, 2, 3, 4))
                  + f" | {len(steps)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=0, help="rounds of latency models per kind")
    ap.add_argument("--alternate", type=int, default=0, help="rounds of plain / root-only / tree generations")
    ap.add_argument("--by-emitted", type=int, default=0, help="bench prompts decoded by each kind with its tuned tree")
    ap.add_argument("--kinds", default="hydra,hydra++")
    ap.add_argument("--warm", default="yes", help="--models: yes (the tuner's protocol), no (no untimed warm steps), or yes,no")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    if not (args.models or args.alternate or args.by_emitted):
        ap.error("give --models N, --alternate N or --by-emitted N")
    warm_ways = [w.strip() for w in args.warm.split(",") if w.strip()]
    if not warm_ways or set(warm_ways) - {"yes", "no"}:
        ap.error("--warm takes yes and/or no")
    asked = [k for k in args.kinds.split(",") if k]
    kinds = asked + (["hydra"] if args.alternate and "hydra" not in asked else [])
    engine = load_engine("default", {k: k for k in kinds}, dtype=args.dtype, progress=None)
    t = time.time()
    with torch.inference_mode():
        if args.models:
            models(engine, asked, args.models, [w == "yes" for w in warm_ways])
        if args.alternate:
            alternate(engine, args.alternate)
        if args.by_emitted:
            by_emitted(engine, asked, args.by_emitted)
    print(f"({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
