"""Prompt-lookup settings side by side: chain length and shortest grafted n-gram, measured on-policy.

Each variant `LENGTH:MIN_NGRAM` (`0` = no lookup) decodes the same prompts with the same heads and
scheduling (default: the entmtp method's -- Hydra++ heads, the shipped entropy bank), greedy,
interleaved prompt by prompt (the order alternates), after one warm-up. Prints one markdown row per
variant: tokens/s and its ratio to the first variant, tau, lookup rows grafted and lookup tokens
accepted per step, and how many outputs equal the first variant's (greedy lookup is lossless, so
all of them should). Timing: run it on an idle machine.

    python scripts/compare_lookup.py --data runs/calib_prompts.jsonl --n 24 --seed 18 \
        --variants 0,4:1,4:2,4:3 [--heads hydra++ | --heads none] [--tree NAME]

The prompts are the last --n of the file after a seeded shuffle: held out from the first prompts
`entmtp search` takes statistics on. entmtp's AVX2 bf16 default (4 tokens after matches of
>= 2) was chosen with it (docs/calibration.md); `runs/calib_prompts.jsonl` is written by `scripts/reproduce_embedded.sh`.
"""

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_variant(text: str) -> tuple[int, int]:
    """"LENGTH[:MIN_NGRAM]" -> (length, min_ngram); "0" is no lookup."""
    length, _, min_ngram = text.partition(":")
    try:
        out = (int(length), int(min_ngram or 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}: write LENGTH:MIN_NGRAM, e.g. 4:2") from None
    if out[0] < 0 or not 1 <= out[1] <= 3:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}: LENGTH >= 0, MIN_NGRAM 1-3")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", default="hydra++", help="head set of the default model, or 'none' (lookup alone)")
    ap.add_argument("--tree", default=None, help="a static tree instead of the entmtp scheduler")
    ap.add_argument("--data", default="entmtp/prompts/calib_example.jsonl")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--variants", default="0,4:1,4:2,4:3")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if not variants or args.n < 1:
        ap.error("give at least one variant and --n >= 1")

    from entmtp.methods import ModelOptions, build_scheduler, load_engine_for
    from entmtp.data import load_prompts, render_prompt
    from entmtp.decoding import DecodeConfig

    heads = None if args.heads == "none" else args.heads
    eng = load_engine_for(ModelOptions(model=args.model, dtype=args.dtype), [heads] if heads else [])
    sched = None
    if heads:
        sched = build_scheduler(eng, heads, "hydra" if args.tree else "entmtp", tree=args.tree)
    prompts = list(load_prompts(args.data).prompts)
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[-args.n:]

    def config(v: tuple[int, int]) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=args.max_new_tokens, lookup=v[0], lookup_min_ngram=v[1] if v[0] else 1)

    eng.run(render_prompt(prompts[0], eng.tokenizer), heads=heads, scheduler=sched, config=config(variants[0]))  # warm-up
    totals = {v: {"tokens": 0, "seconds": 0.0, "steps": 0, "rows": 0, "copied": 0, "same": 0} for v in variants}
    for i, p in enumerate(prompts):
        ids = render_prompt(p, eng.tokenizer)
        outputs = {}
        for v in (variants if i % 2 == 0 else variants[::-1]):
            t0 = time.perf_counter()
            r = eng.run(ids, heads=heads, scheduler=sched, config=config(v))
            t = totals[v]
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(r.tokens)
            t["steps"] += sum(1 for s in r.steps if s.time_verify > 0)
            t["rows"] += sum(len(s.lookup_nodes or ()) for s in r.steps)
            t["copied"] += sum(s.lookup_accepted for s in r.steps)
            outputs[v] = r.tokens
        for v in variants:
            totals[v]["same"] += outputs[v] == outputs[variants[0]]
    ref = totals[variants[0]]["tokens"] / totals[variants[0]]["seconds"]
    label = lambda v: "no lookup" if v[0] == 0 else f"{v[0]} tokens after >= {v[1]}-token matches"  # noqa: E731
    print(f"{len(prompts)} prompts of {args.data} (seed {args.seed}), heads {args.heads}"
          f"{' tree ' + args.tree if args.tree else ''}, {args.dtype}, {args.max_new_tokens} new tokens\n")
    print("| lookup | tokens/s | vs first | tau | lookup rows / step | lookup tokens accepted / step | output = first's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v, t in totals.items():
        tps, steps = t["tokens"] / t["seconds"], max(t["steps"], 1)
        print(f"| {label(v)} | {tps:.2f} | {tps / ref:.3f}x | {t['tokens'] / steps:.2f} | {t['rows'] / steps:.2f} | "
              f"{t['copied'] / steps:.2f} | {t['same']}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
