"""Race small draft trees on-policy, interleaved, on held-out calibration prompts; pick the fastest.

`entmtp search` ranks trees by predicted tokens/s = exact replayed tau / a measured step time. On
a small noisy VM the step-time medians of neighbouring tree sizes differ by less than their noise
(once a 3-node tree timed faster than a 1-node one, and the chosen 5-node depth-1 tree ran
19% below its prediction), so among the few trees that can pay on such a CPU the ranking is a
coin toss. This script lets the decoding itself decide: the statistics of an earlier search
propose, for every (size, depth) up to --max-nodes / --max-depth, the tree with the highest
replayed tau; every proposal (plus any --trees) then decodes the same held-out prompts of the
search's split, on-policy, prompt by prompt with the order rotated (`search.evaluate_trees`), so
load drift hits all alike. Prints tokens/s, tau and speedup vs plain decoding; --save writes the
winner, with the race in its provenance, as a tree file.

    python scripts/race_trees.py --heads hydra --stats runs/search-hydra-bf16 --dtype bfloat16 \
        [--max-nodes 6] [--max-depth 3] [--prompts 24] [--skip 0] [--save entmtp/trees/NAME.json [--record]]

`entmtp search ... --race N` runs the same race as step 6 of a search (with `--stats DIR` on an
earlier search's statistics); this script adds `--trees`, `--skip` and `--record`.

The prompts are the search's own held-out split of --data (fraction --held-out, seed --seed):
never the bench prompts, never the statistics' calibration prompts.
"""

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", required=True, help="embedded heads: medusa, hydra or hydra++")
    ap.add_argument("--stats", required=True, help="an earlier `entmtp search` output directory (its statistics propose)")
    ap.add_argument("--data", default="runs/calib_prompts.jsonl")
    ap.add_argument("--held-out", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-nodes", type=int, default=6)
    ap.add_argument("--max-depth", type=int, default=3)
    ap.add_argument("--min-nodes", type=int, default=2)
    ap.add_argument("--trees", default="", help="more trees to race, comma separated (files or names of shipped trees)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--skip", type=int, default=0, help="skip this many held-out prompts first")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--save", default=None, help="write the fastest tree here (tree JSON with the race's figures)")
    ap.add_argument("--record", action="store_true",
                    help="with --save into entmtp/trees/: make it the embedded heads' default tree for this dtype and hardware "
                         "class (meta.default_tree_<dtype>@<class> in assets/heads/<name>-<kind>/config.json)")
    args = ap.parse_args()

    from entmtp.calibrate import CalibrationStats
    from entmtp.methods import ModelOptions, load_engine_for
    from entmtp.data import load_prompts, split_prompts
    from entmtp.search import race_proposals, race_trees
    from entmtp.trees import Tree, resolve_tree

    stats = CalibrationStats.load(Path(args.stats) / "stats.json")
    if stats.meta.get("dtype") != args.dtype:
        print(f"error: {args.stats} holds {stats.meta.get('dtype')} statistics, not {args.dtype}", file=sys.stderr)
        return 2
    proposals = race_proposals(stats, args.max_nodes, args.max_depth, args.min_nodes)
    trees = [Tree(c.tree.paths, f"n{c.n_nodes}-d{c.depth}") for c in proposals]
    predicted = {t.key(): c.predicted_tau for t, c in zip(trees, proposals)}
    for spec in filter(None, args.trees.split(",")):
        t = resolve_tree(spec)
        if t.key() not in predicted:
            trees.append(t)
            predicted[t.key()] = stats.predict_tau(t)

    engine = load_engine_for(ModelOptions(model=args.model, dtype=args.dtype), [args.heads])
    _, held = split_prompts(load_prompts(args.data).prompts, args.held_out, args.seed)
    held = held[args.skip: args.skip + args.prompts]
    t0 = time.perf_counter()
    race = race_trees(engine, args.heads, trees, held, max_new_tokens=args.max_new_tokens)
    print(f"# {len(held)} held-out prompts of {args.data} (skip {args.skip}), {args.max_new_tokens} new tokens, "
          f"{args.dtype}, {len(trees)} trees + plain decoding, interleaved; {time.perf_counter() - t0:.0f} s")
    print("| tree | nodes | depth | paths | replayed tau (calibration) | on-policy tau | tokens/s | speedup vs plain |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    rows = race["results"]
    for m in rows:
        m["predicted_tau"] = predicted[Tree.from_paths(m["paths"]).key()]
        print(f"| {m['name']} | {m['n_nodes']} | {m['depth']} | `{m['paths']}` | {m['predicted_tau']:.3f} | {m['tau']:.3f} | "
              f"{m['tokens_per_s']:.1f} | {m['speedup']:.3f}x |")
    print(f"| plain decoding | 0 | 0 | | 1.000 | 1.000 | {race['baseline_tokens_per_s']:.1f} | 1.000x |")
    if race["identical_outputs"] is False:
        print("error: a tree's output differed from plain decoding", file=sys.stderr)
        return 1
    if args.save:
        win = rows[0]
        extra = {"chosen_by": "on-policy race (scripts/race_trees.py)",
                 "predicted_tau": win["predicted_tau"], "held_out_tau": win["tau"],
                 "held_out_tokens_per_s": win["tokens_per_s"], "held_out_speedup": win["speedup"],
                 "race": {"command": "python scripts/race_trees.py " + " ".join(sys.argv[1:]), "prompts": len(held),
                          "skip": args.skip, "data": args.data, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                          "stats": str(args.stats),
                          "results": [{"paths": m["paths"], "tau": m["tau"], "tokens_per_s": m["tokens_per_s"]}
                                      for m in rows] + [{"paths": [], "tau": 1.0, "tokens_per_s": race["baseline_tokens_per_s"]}]}}
        Tree.from_paths(win["paths"], Path(args.save).stem).save(args.save, extra=extra)
        print(f"saved {args.save}")
        if args.record:
            from entmtp.hardware import hardware_class

            root = Path(__file__).resolve().parents[1]
            if Path(args.save).resolve().parent != root / "entmtp" / "trees":
                print("error: --record needs --save entmtp/trees/NAME.json", file=sys.stderr)
                return 2
            cfg_file = root / "assets" / "heads" / f"smollm2-135m-{args.heads.replace('++', 'pp')}" / "config.json"
            cfg = json.loads(cfg_file.read_text())
            key = f"default_tree_{args.dtype}@{hardware_class('cpu')}"
            cfg.setdefault("meta", {})[key] = Path(args.save).name
            cfg_file.write_text(json.dumps(cfg, indent=1) + "\n")
            print(f"recorded {key} = {Path(args.save).name} in {cfg_file.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
