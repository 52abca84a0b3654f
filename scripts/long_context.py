"""Speculation on long contexts, side by side in one run: each method with the trees tuned for this
machine switching to its long-context tree where the tuning says (`autotune.tune_long_context`),
against the same method keeping its first tree throughout, and our plain loop. The prompts are long
documents of this repository (its docs, cut to --chars characters) each followed by a question, so
decoding runs after ~1,000-1,500 cached tokens; the variants run interleaved, rotated each round.
Prints tokens/s, the ratios, and whether every output equals the plain loop's. No asserts.

    python scripts/long_context.py [--methods hydra++,entmtp] [--dtype bfloat16] [--chars 5000]
                                   [--max-new-tokens 64] [--repeats 2]
"""

import argparse
import time
from pathlib import Path

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("architecture.md", "calibration.md", "performance.md", "space.md")
QUESTIONS = ("Summarise the document above in five bullet points.",
             "What are the three most important ideas in the document above? Explain each briefly.",
             "Write a short FAQ (four questions and answers) about the document above.",
             "Explain the document above to a new user in one paragraph.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="hydra++,entmtp")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chars", type=int, default=5000, help="characters of each document kept")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.chars < 1 or a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--chars, --max-new-tokens and --repeats must be positive")

    from entmtp import scheduler as sched
    from entmtp.data import Prompt, render_prompt
    from entmtp.interleave import rotated
    from entmtp.methods import MethodError, ModelOptions, load_engine_for, make_runner, parse_methods

    try:
        methods = parse_methods(a.methods)
    except (MethodError, ValueError) as e:
        ap.error(str(e))
    engine = load_engine_for(ModelOptions(dtype=a.dtype), methods)
    prompts = []
    for doc, question in zip(DOCS, QUESTIONS):
        text = (ROOT / "docs" / doc).read_text(encoding="utf-8")[:a.chars]
        msg = [{"role": "user", "content": f"{text}\n\n{question}"}]
        prompts.append(render_prompt(Prompt(id=doc, messages=msg), engine.tokenizer))
    print(f"kernels: {engine.kernels}; prompts of {', '.join(str(len(p)) for p in prompts)} tokens; "
          f"{a.max_new_tokens} new tokens; {a.repeats} rounds")

    variants = {"baseline": make_runner(engine, "baseline", a.max_new_tokens, progress=None)}
    for m in methods:
        if m == "baseline":
            continue
        by_context = make_runner(engine, m, a.max_new_tokens, progress=None)
        if not isinstance(by_context.scheduler, sched.ContextSwitch):
            print(f"{m}: no long-context tree was tuned here ({by_context.label}); timed as it is")
            variants[m] = by_context
            continue
        first = make_runner(engine, m, a.max_new_tokens, progress=None)
        first.scheduler = by_context.scheduler.short
        variants[f"{m}, by context"], variants[f"{m}, first tree"] = by_context, first
        print(f"{m}: {by_context.label}")
    names = list(variants)
    for p in prompts:  # untimed: per-shape kernel set-up
        variants["baseline"](p)
    seconds = {n: 0.0 for n in names}  # whole calls, the prompt's prefill included
    steps = {n: 0.0 for n in names}  # decoding steps only
    tokens = {n: 0 for n in names}
    same = {n: 0 for n in names}
    runs = 0
    for r in range(a.repeats):
        for i, p in enumerate(prompts):
            outs = {}
            for n in rotated(names, r * len(prompts) + i):
                t = time.perf_counter()
                out = variants[n](p)
                seconds[n] += time.perf_counter() - t
                steps[n] += out.step_s
                outs[n] = out.tokens
                tokens[n] += len(outs[n])
            runs += 1
            for n in names:
                same[n] += outs[n] == outs["baseline"]
    base, base_steps = tokens["baseline"] / seconds["baseline"], tokens["baseline"] / steps["baseline"]
    print("\n| variant | tokens/s | over our plain loop | decoding steps only: tokens/s | over our plain loop | "
          "identical to the plain loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        tps, sps = tokens[n] / seconds[n], tokens[n] / steps[n]
        print(f"| {n} | {tps:.1f} | {tps / base:.2f}x | {sps:.1f} | {sps / base_steps:.2f}x | {same[n]}/{runs} |")
    for m in methods:
        by, first = f"{m}, by context", f"{m}, first tree"
        if by in tokens:
            print(f"{m}: by context / first tree throughout: {(tokens[by] / seconds[by]) / (tokens[first] / seconds[first]):.3f}x "
                  f"(decoding steps only: {(tokens[by] / steps[by]) / (tokens[first] / steps[first]):.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
