"""Which yardstick makes the tuner's step ratios match decoding's. No asserts.

The tuner prices a tree's step as its ratio to plain steps (`calibrate.measure_latency`): each tree's
steps over the plain steps timed just before and after its generation ("around", the tuner's way).
Where the one-row step switches between two speeds for seconds while tree steps hold theirs, that
ratio follows whichever speed the plain steps around it had. The alternative read here divides by
the median of every plain step of the same measurement ("whole": the mix of speeds over its ~2 s).

Each round measures a small grid of one kind's trees the tuner's way, keeping every raw timing, and
then decodes: for each tree a generation with it as the static tree beside a plain generation, on
the same random context (the order alternated), whose median steps give the ratio decoding paid.
Prints per tree the three ratios' means over the rounds and each yardstick's mean absolute error
against decoding.

    python scripts/latency_yardstick.py [--rounds 6] [--heads hydra++] [--dtype bfloat16]
"""

import argparse
import statistics

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI does

import torch  # noqa: E402

from entmtp.autotune import SHORT_CONTEXT, decoding_threads  # noqa: E402
from entmtp.calibrate import (_cycle_times, _trees_per_generation, context_prefill, ratios_to_plain_around,  # noqa: E402
                              representative_tree)
from entmtp.decoding import DecodeConfig  # noqa: E402
from entmtp.methods import ModelOptions, load_engine_for  # noqa: E402
from entmtp.threads import torch_threads  # noqa: E402
from entmtp.trees import Tree  # noqa: E402

SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 2), (16, 2))


def grid_round(engine, heads, bank, ctx, pre) -> tuple[dict[int, float], dict[int, float]]:
    """One round of the tuner's protocol over `bank`: {tree: ratio to the plain steps around it},
    {tree: ratio to the median of every plain step of the round}."""
    plain_tree = [Tree.from_paths([])]
    per_gen = _trees_per_generation(engine, bank, ctx)
    plain: list[float] = []

    def plain_step() -> float:
        ts = _cycle_times(engine, None, plain_tree, [0] * 3, ctx, lambda k=1: None, pre).get(0, [])
        plain.extend(ts)
        return statistics.median(ts)

    around: dict[int, list[float]] = {}
    raw: dict[int, list[float]] = {}
    before = plain_step()
    for c in range(0, len(bank), per_gen):
        times = _cycle_times(engine, heads, bank, list(range(c, min(len(bank), c + per_gen))), ctx, lambda k=1: None, pre)
        after = plain_step()
        for j, ts in times.items():
            around.setdefault(j, []).extend(ratios_to_plain_around(ts, before, after))
            raw.setdefault(j, []).extend(ts)
        before = after
    whole = statistics.median(plain)
    return ({j: statistics.median(v) for j, v in around.items()},
            {j: statistics.median(v) / whole for j, v in raw.items()})


def decoding_ratio(engine, heads, tree, ctx, flip: bool) -> float:
    cfg = DecodeConfig(max_new_tokens=48, eos_token_ids=())

    def median_step(h):
        gen = engine.generate(ctx, config=cfg) if h is None else engine.generate(ctx, heads=h, tree=tree, config=cfg)
        return statistics.median([s.time_total for s in gen][2:])

    if flip:
        t = median_step(heads)
        return t / median_step(None)
    p = median_step(None)
    return median_step(heads) / p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--heads", default="hydra++")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    engine = load_engine_for(ModelOptions(dtype=a.dtype), [a.heads])
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    ctx = torch.randint(2, vocab, (SHORT_CONTEXT,), generator=g).tolist()
    bank = [representative_tree(n, d) for n, d in SHAPES]
    got = {w: {j: [] for j in range(len(bank))} for w in ("around", "whole", "decoding")}
    with torch.inference_mode(), torch_threads(decoding_threads(engine)):
        pre = context_prefill(engine, ctx, a.heads)
        for r in range(a.rounds):
            around, whole = grid_round(engine, a.heads, bank, ctx, pre)
            for j in range(len(bank)):
                got["around"][j].append(around[j])
                got["whole"][j].append(whole[j])
                got["decoding"][j].append(decoding_ratio(engine, a.heads, bank[j], ctx, flip=(r + j) % 2 == 1))
            print(f"round {r + 1}: " + ", ".join(f"{n}/d{d} {around[j]:.2f}|{whole[j]:.2f}|{got['decoding'][j][-1]:.2f}"
                                                for j, (n, d) in enumerate(SHAPES)), flush=True)
    print(f"\n{a.heads}, {a.rounds} rounds; step over plain step (mean over rounds):\n")
    print("| tree | around (the tuner's) | whole | decoding |")
    print("|---|---:|---:|---:|")
    for j, (n, d) in enumerate(SHAPES):
        print(f"| {n} nodes, depth {d} | " + " | ".join(f"{statistics.mean(got[w][j]):.3f}" for w in ("around", "whole", "decoding"))
              + " |")
    for w in ("around", "whole"):
        err = [abs(x - y) for j in range(len(bank)) for x, y in zip(got[w][j], got["decoding"][j])]
        bias = [x - y for j in range(len(bank)) for x, y in zip(got[w][j], got["decoding"][j])]
        print(f"{w}: mean absolute error against decoding {statistics.mean(err):.3f}, mean signed {statistics.mean(bias):+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
