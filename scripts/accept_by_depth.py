"""On-policy acceptance by depth: how often each draft level is accepted, per head kind and prompt set.

Every prompt decodes with a top-1 chain of --depth draft nodes (`chain_<depth>`), greedy, on-policy;
a step's accepted length a counts toward P(accept >= d) for every d <= a. Unlike the training
report's teacher-forced top-1 (every position of a fixed answer), these are measured where steps
start, i.e. after a rejection -- harder positions -- so they are lower, and they are what a tree's
tau is made of (tau of the chain = 1 + sum_d P(accept >= d)). No timing: safe on a busy machine.

    python scripts/accept_by_depth.py --heads medusa,hydra,hydra++ \
        --data entmtp/prompts/bench.jsonl --per-category 2 [--max-new-tokens 128] [--depth 5]

--data takes several files (comma separated); --per-category k keeps k prompts of each category
(files without categories: the first 6k prompts); --held-out F takes the held-out split (fraction
F, seed 0) of a file instead, as `entmtp search` splits it.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", default="medusa,hydra,hydra++")
    ap.add_argument("--data", default="entmtp/prompts/bench.jsonl", help="prompt files, comma separated")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--held-out", type=float, default=0.0, help="use the held-out split of this fraction (seed 0)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from entmtp.bench import take_per_category
    from entmtp.methods import ModelOptions, load_engine_for
    from entmtp.data import load_prompts, render_prompt, split_prompts
    from entmtp.decoding import DecodeConfig
    from entmtp.scheduler import Scheduler
    from entmtp.trees import Tree

    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    engine = load_engine_for(ModelOptions(model=args.model, dtype=args.dtype), heads)
    D = args.depth
    print("| prompts | heads | steps | " + " | ".join(f"P(accept >= {d})" for d in range(1, D + 1)) + f" | tau of chain_{D} |")
    print("|---|---|---:|" + "---:|" * (D + 1))
    for path in [p.strip() for p in args.data.split(",") if p.strip()]:
        prompts = load_prompts(path).prompts
        if args.held_out > 0:
            prompts = split_prompts(prompts, args.held_out, 0)[1]
        prompts = (take_per_category(prompts, args.per_category) if any(p.category for p in prompts)
                   else prompts[: 6 * args.per_category])
        for h in heads:
            counts, steps = [0] * (D + 1), 0
            for p in prompts:
                r = engine.run(render_prompt(p, engine.tokenizer), heads=h, scheduler=Scheduler(Tree.chain(D)),
                               config=DecodeConfig(max_new_tokens=args.max_new_tokens, lookup=0))
                for s in r.steps:
                    if s.time_verify > 0 and s.bonus is not None:  # a verified step that was not cut by a stop
                        steps += 1
                        counts[s.accept_length] += 1
            surv = [sum(counts[d:]) / max(steps, 1) for d in range(1, D + 1)]
            print(f"| {Path(path).name} ({len(prompts)}) | {h} | {steps} | " + " | ".join(f"{x:.3f}" for x in surv)
                  + f" | {1 + sum(surv):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
