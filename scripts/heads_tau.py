"""Tau of each head kind on real-conversation prompts beside the calibration distribution.

    python scripts/heads_tau.py                         # the shipped heads
    python scripts/heads_tau.py --heads-root runs/heads-v7 --kinds hydra,hydra++
    python scripts/heads_tau.py --heads-dir runs/heads-eagle/smollm2-135m-eagle   # any trained heads beside them

Greedy decoding, bfloat16, the papers' 63-node tree (`mc_sim_7b_63`) for every kind so that tree
size does not hide head quality, no prompt lookup; tau = tokens per base forward, the bonus token
included. Two prompt sets:

* held-out: `entmtp/prompts/heldout_chat.jsonl`, real-user-style prompts no heads were trained
  on (built by `scripts/build_chat_prompts.py heldout`; sources and licences there), also shown
  by source (written requests, chitchat conversations, chatterbot dialogues);
* calibration: the first prompts of `runs/calib_prompts.jsonl`, the distribution the trees were
  searched on (`scripts/reproduce_embedded.sh` step 1 builds it).

Prints one markdown row per kind: tau on each set, the gap, the share of held-out steps whose first
draft token was accepted, the heads' drafting time per step and the held-out decoding speed with that
tree over our plain loop's, measured in the same run (kinds compared at equal draft cost, not only at
equal tau; wall-clock figures, so read them on a quiet machine), and whether every output equals our
plain loop's (speculation is lossless). Run under the project's environment (`bash run.sh install`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import entmtp  # noqa: E402,F401  (sets the OpenMP wait policy before torch loads)
from entmtp.data import load_prompts, render_prompt  # noqa: E402
from entmtp.heads import with_draft_vocab  # noqa: E402
from entmtp.methods import CUSTOM, make_runner  # noqa: E402
from entmtp.models import load_engine  # noqa: E402
from entmtp.paths import DEFAULT_HEADS_DIR, HEAD_KINDS  # noqa: E402

# Spec-Bench (Medusa, Hydra) and the Hydra paper (Hydra++), Vicuna-7B, greedy
PAPERS = {"medusa": "2.31", "hydra": "3.26", "hydra++": "3.70", "eagle": "3.57"}  # EAGLE: Spec-Bench


def tau_on(engine, method: str, prompts: list, args) -> tuple[list[float], list[list[int]], list, float]:
    # with user-supplied heads loaded (CUSTOM), every method with heads drafts with them
    """Per prompt: tau and the tokens; every decoding step (draft timing, acceptance); and the
    tokens per second of the whole set (the engine's step times)."""
    runner = make_runner(engine, method, args.max_new_tokens, tree=args.tree if method != "baseline" else None,
                         lookup=0, progress=None)
    taus, outs, steps, seconds = [], [], [], 0.0
    for p in prompts:
        o = runner(render_prompt(p, engine.tokenizer))
        taus.append(len(o.tokens) / o.forwards if o.forwards else 0.0)
        outs.append(list(o.tokens))
        steps += [s for s in (o.result.steps if o.result is not None else []) if s.n_nodes > 1]
        seconds += o.step_s
    return taus, outs, steps, sum(map(len, outs)) / max(seconds, 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads-root", type=Path, default=DEFAULT_HEADS_DIR,
                    help="directory of smollm2-135m-<kind> heads (default: the shipped ones)")
    ap.add_argument("--kinds", default="medusa,hydra,hydra++", help="shipped-style kinds under --heads-root ('' for none)")
    ap.add_argument("--heads-dir", type=Path, action="append", default=[],
                    help="a trained heads directory of any kind (e.g. EAGLE heads from `entmtp train --heads eagle`), "
                         "measured beside the kinds; repeatable")
    ap.add_argument("--heldout", type=Path, default=ROOT / "entmtp" / "prompts" / "heldout_chat.jsonl")
    ap.add_argument("--calib", type=Path, default=ROOT / "runs" / "calib_prompts.jsonl")
    ap.add_argument("--n-calib", type=int, default=36, help="first N calibration prompts")
    ap.add_argument("--tree", default="mc_sim_7b_63")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--full-vocab", action="store_true",
                    help="draft over the whole vocabulary with the same weights (is the draft vocabulary what limits tau?)")
    args = ap.parse_args(argv)

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in HEAD_KINDS]
    if unknown:
        ap.error(f"unknown head kind {unknown[0]!r}; use {', '.join(HEAD_KINDS)}")
    missing = [k for k in kinds if not (args.heads_root / HEAD_KINDS[k]).is_dir()]
    if missing:
        ap.error(f"no {missing[0]} heads under {args.heads_root} (expected {args.heads_root / HEAD_KINDS[missing[0]]})")
    for d in args.heads_dir:
        if not (d / "config.json").is_file():
            ap.error(f"not a heads directory (no config.json): {d}")
    sets = {"held-out": args.heldout, "calibration": args.calib}
    for name, path in sets.items():
        if not path.is_file():
            ap.error(f"{name} prompts not found: {path}")
    prompts = {"held-out": load_prompts(args.heldout).prompts, "calibration": load_prompts(args.calib).prompts[:args.n_calib]}

    engine = load_engine("default", {k: str(args.heads_root / HEAD_KINDS[k]) for k in kinds}, dtype=args.dtype,
                         progress=None)
    if args.full_vocab:
        for k in kinds:
            engine.add_heads(k, with_draft_vocab(engine.runners[k].heads, None))
    # (label, engine, method): a kind by its own method, other heads as the engine's custom heads
    measured = [(k, engine, k) for k in kinds]
    for d in args.heads_dir:
        extra = load_engine("default", {CUSTOM: str(d)}, dtype=args.dtype, progress=None)
        if args.full_vocab:
            extra.add_heads(CUSTOM, with_draft_vocab(extra.runners[CUSTOM].heads, None))
        measured.append((f"{extra.runners[CUSTOM].label} ({d.name})", extra, "hydra"))
    t0 = time.perf_counter()
    plain_runs = {s: tau_on(engine, "baseline", ps, args) for s, ps in prompts.items()}
    plain = {s: r[1] for s, r in plain_runs.items()}
    plain_speed = plain_runs["held-out"][3]
    rows, by_source = [], {}
    for k, eng, method in measured:
        cells, same = {}, True
        for s, ps in prompts.items():
            taus, outs, steps, speed = tau_on(eng, method, ps, args)
            cells[s] = statistics.mean(taus)
            same &= outs == plain[s]
            if s == "held-out":  # draft cost, first-draft acceptance and tau by source, held-out only
                cells["draft_ms"] = 1e3 * statistics.mean(st.time_draft for st in steps)
                cells["first"] = statistics.mean(st.accept_length >= 1 for st in steps)
                cells["speed"] = speed / plain_speed
                for p, t in zip(ps, taus):
                    by_source.setdefault(p.id.split("-")[0], {}).setdefault(k, []).append(t)
        rows.append((k, cells, same))
    vocab = "the whole vocabulary" if args.full_vocab else "their draft vocabulary"
    print(f"heads: {args.heads_root}{''.join(f', {d}' for d in args.heads_dir)}, drafting over {vocab}; tree {args.tree}, greedy, {args.dtype}, {args.max_new_tokens} new tokens, "
          f"no lookup; held-out {len(prompts['held-out'])} prompts ({args.heldout.name}), calibration "
          f"{len(prompts['calibration'])} ({args.calib.name}); {time.perf_counter() - t0:.0f} s\n")
    print(f"our plain loop on the held-out prompts: {plain_speed:.1f} tokens/s\n")
    print("| heads | tau held-out | tau calibration | gap | first draft accepted (held-out steps) | draft ms a step "
          "| held-out tokens/s, x plain loop | identical to plain loop | papers, Vicuna-7B |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for k, c, same in rows:
        gap = c["held-out"] / c["calibration"] - 1.0
        print(f"| {k} | {c['held-out']:.2f} | {c['calibration']:.2f} | {gap:+.0%} | {c['first']:.0%} | "
              f"{c['draft_ms']:.1f} | {c['speed']:.2f}x | {'yes' if same else 'NO'} | {PAPERS.get(k.split(' ')[0], '–')} |")
    print("\nheld-out tau by source (prompts): " + "; ".join(
        f"{src} ({len(next(iter(per.values())))}): " + ", ".join(f"{k} {statistics.mean(v):.2f}" for k, v in per.items())
        for src, per in by_source.items()))
    return 0 if all(same for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
