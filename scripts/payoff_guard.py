"""entmtp with and without its payoff guard, side by side with the plain loop, measured on-policy.

The guard (`scheduler.PayoffGuard`) pauses drafting in a generation whose tree steps emit fewer
tokens than their step time over a plain step's, and probes now and then. This decodes the same
prompts three ways -- our plain loop, entmtp as shipped, entmtp with the guard taken off (the same
heads, trees, bank and prompt lookup) -- interleaved prompt by prompt (the order alternates), after
one warm-up, and prints each one's tokens/s over the plain loop's, overall and for the prompts where
the two entmtp runs differ most, with the share of plain steps the guard took. Greedy, so all three
emit the same tokens where the kernels are row-invariant (the last column). Run it on an idle machine.

    python scripts/payoff_guard.py [--data bench|heldout_chat|FILE] [--per-category 2] [--repeats 2]
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import entmtp  # noqa: E402,F401  first: it sets the wait policy before torch loads OpenMP


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="bench", help="a bundled prompt set (bench, heldout_chat, ...) or a file")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--show", type=int, default=6, help="prompts listed, those whose two entmtp runs differ most")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--repeats and --max-new-tokens must be >= 1")

    from entmtp.bench import take_per_category
    from entmtp.data import DataError, bundled_prompts, load_prompts, render_prompt
    from entmtp.methods import HYDRA_FAMILY, ModelOptions, load_engine_for, make_runner
    from entmtp.scheduler import PayoffGuard

    try:
        source = bundled_prompts(args.data) if "/" not in args.data and "." not in args.data else args.data
        prompts = list(load_prompts(source).prompts)
    except (DataError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.per_category:
        prompts = take_per_category(prompts, args.per_category)
    engine = load_engine_for(ModelOptions(dtype=args.dtype), ["entmtp"] + list(HYDRA_FAMILY))
    guarded = make_runner(engine, "entmtp", args.max_new_tokens, progress=None)
    if not isinstance(guarded.scheduler, PayoffGuard):
        sys.exit("error: entmtp has no payoff guard here (its trees are not tuned on this machine: ENTMTP_TUNE=0?)")
    runners = {"plain loop": make_runner(engine, "baseline", args.max_new_tokens, progress=None),
               "entmtp": guarded,
               "entmtp, no guard": dataclasses.replace(guarded, scheduler=guarded.scheduler.inner)}
    encoded = [(p.id, render_prompt(p, engine.tokenizer)) for p in prompts]
    for r in runners.values():
        r(encoded[0][1])  # warm-up
    names = list(runners)
    seconds = {(pid, n): 0.0 for pid, _ in encoded for n in names}
    tokens, plain_steps, steps, same = {}, {n: 0 for n in names}, {n: 0 for n in names}, {n: 0 for n in names}
    k = 0
    for _ in range(args.repeats):
        for pid, ids in encoded:
            outs = {}
            for n in (names if k % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                out = runners[n](ids)
                seconds[pid, n] += time.perf_counter() - t0
                outs[n] = out.tokens
                tokens[pid] = len(out.tokens)
                decoded = [s for s in out.result.steps if s.time_verify > 0]
                steps[n] += len(decoded)
                plain_steps[n] += sum(1 for s in decoded if s.n_nodes == 0)
            for n in names:
                same[n] += outs[n] == outs["plain loop"]
            k += 1

    def rate(n, pids):
        return sum(tokens[p] for p in pids) * args.repeats / sum(seconds[p, n] for p in pids)

    pids = [pid for pid, _ in encoded]
    runs = len(pids) * args.repeats
    print(f"{len(pids)} prompts of {args.data}, {args.dtype}, {args.max_new_tokens} new tokens, {args.repeats} repeats; "
          f"entmtp: {guarded.label}\n")
    print("| method | tokens/s | x plain loop | plain steps | output = plain loop's |")
    print("|---|---:|---:|---:|---:|")
    base = rate("plain loop", pids)
    for n in names:
        share = f"{plain_steps[n] / max(steps[n], 1):.0%}" if n != "plain loop" else ""
        print(f"| {n} | {rate(n, pids):.1f} | {rate(n, pids) / base:.3f}x | {share} | {same[n]}/{runs} |")
    gain = {p: rate("entmtp", [p]) / rate("entmtp, no guard", [p]) for p in pids}
    print("\nthe prompts where the guard moved entmtp most (x plain loop):\n")
    print("| prompt | entmtp | no guard | guard's gain |")
    print("|---|---:|---:|---:|")
    for p in sorted(pids, key=lambda p: -abs(gain[p] - 1))[: args.show]:
        b = rate("plain loop", [p])
        print(f"| {p} | {rate('entmtp', [p]) / b:.2f}x | {rate('entmtp, no guard', [p]) / b:.2f}x | {gain[p]:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
