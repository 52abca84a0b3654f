"""Command line: `entmtp generate | train | search | score | bench` (also `python -m entmtp`).

Every expected failure (bad file, unknown tree, missing heads, unreachable model) prints one
line `error: ...` on stderr and exits with status 2 -- never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

METHODS = ("baseline", "lookup", "medusa", "hydra", "hydra++", "entmtp", "dynamic")
# Prompt lookup per method when --lookup / --lookup-min-ngram are not given: (chain length, shortest
# n-gram whose match is grafted). entmtp grafts copied context spans onto its trees; "lookup" is our
# prompt-lookup decoding (no heads); the others are pure heads. entmtp: 4 tokens (4 -> 8 gained 1% tau
# for 17% more nodes) after any match. Where a tree row is dear the heads' checkpoint records a longer
# shortest match per dtype and hardware class (`default_lookup_min_ngram_<dtype>@<class>`, like its
# trees): bf16 on an AVX2 CPU without bf16 units grafts after >= 2-token matches, since a one-token
# match grafted a branch on most steps for ~2% more tau and decoded 4-7% slower; in float32 there,
# where rows are nearly free, it did not (measured on the 2-core AVX2 EPYC: `python scripts/compare_lookup.py`,
# docs/bench/HISTORY.md).
DEFAULT_LOOKUP = {"entmtp": (4, 1), "lookup": (8, 1)}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from .checkpoints import CheckpointError
    from .data import DataError
    from .decoding import ContextError
    from .models import ModelLoadError
    from .trees import TreeError
    from .verify import UnsupportedModelError

    errs = [CLIError, CheckpointError, DataError, ContextError, ModelLoadError, TreeError, UnsupportedModelError,
            FileNotFoundError, ValueError]
    try:
        from .train import TrainError

        errs.append(TrainError)
    except ImportError:
        pass
    return tuple(errs)


# ---- shared options -------------------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct + our heads), a local path or a Hugging Face repo id")
    p.add_argument("--base", default=None, help="base model path or id (alias of --model, for use with --heads)")
    p.add_argument("--heads", default=None, help="head checkpoint: directory or repo id (ours, or the published Medusa/Hydra formats)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--device-map", default=None, help="e.g. 'auto' to shard a large base across GPUs (accelerate)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = measured on this machine, or ENTMTP_THREADS)")
    p.add_argument("--kernels", default="auto", choices=["auto", "packed", "stock", "onednn", "panels"],
                   help="our decoding's kernels: auto = measured on this machine once (the fastest row-invariant set "
                        "no slower than stock, else the fastest; `entmtp tune` shows it); stock = transformers'; "
                        "onednn = linears prepacked for oneDNN; panels = entmtp's own row-invariant bf16 kernels; "
                        "packed = the first packed set available")


HYDRA_FAMILY = ("hydra++", "hydra")  # best first: entmtp and dynamic use the best one available


def best_hydra(available) -> str | None:
    return next((h for h in HYDRA_FAMILY if h in available), None)


def method_heads(method: str, args) -> str | None:
    """Name of the loaded heads a method uses (None = baseline)."""
    if method in ("baseline", "lookup"):
        return None
    if args.heads:
        return "custom"
    # entmtp and dynamic use the best Hydra-family heads of the embedded model: Hydra++
    return {"medusa": "medusa", "hydra": "hydra", "hydra++": "hydra++", "entmtp": "hydra++", "dynamic": "hydra++"}[method]


def method_lookup(method: str, args=None, engine=None, heads: str | None = None) -> dict:
    """A method's prompt-lookup fields of `DecodeConfig` ({"lookup": chain length, "lookup_min_ngram":
    shortest grafted n-gram}): --lookup / --lookup-min-ngram for every method with heads, else what
    the method's `heads` on `engine` record for its dtype and hardware, else `DEFAULT_LOOKUP`;
    baseline never looks up."""
    from .scheduler import recorded_default

    if method == "baseline":
        return {"lookup": 0, "lookup_min_ngram": 1}
    length, min_ngram = DEFAULT_LOOKUP.get(method, (0, 1))
    recorded = recorded_default(engine, heads, "default_lookup_min_ngram") if engine is not None and heads else None
    if recorded is not None:
        if type(recorded) is not int or not 1 <= recorded <= 3:
            raise ValueError(f"the {heads} heads record default_lookup_min_ngram {recorded!r}; it must be 1, 2 or 3")
        min_ngram = recorded
    given, given_min = getattr(args, "lookup", None), getattr(args, "lookup_min_ngram", None)
    if given is not None and method != "lookup":
        length = given
    if given_min is not None:
        min_ngram = given_min
    return {"lookup": length, "lookup_min_ngram": min_ngram}


def add_lookup_min_ngram_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup-min-ngram", type=int, default=None, metavar="N", choices=range(1, 4),
                   help="graft a context copy only after a match of at least N tokens (1-3); default: what "
                        "the heads record for this dtype and hardware, else 1")


def load_engine_for(args, methods: list[str]):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()

    from .models import load_engine

    if args.threads:
        os.environ["ENTMTP_THREADS"] = str(args.threads)  # the engine's tuning keeps it instead of measuring
        torch.set_num_threads(args.threads)
    base = args.base or args.model
    if args.heads:
        heads = {"custom": args.heads}
    else:
        wanted = {method_heads(m, args) for m in methods} - {None}
        if wanted and base != "default":
            raise CLIError(f"--model {base} has no embedded heads: pass --heads PATH_OR_ID")
        heads = {h: h for h in sorted(wanted)}
    # a refused --kernels packed is a ValueError: one `error:` line like every user error
    return load_engine(base, heads, dtype=args.dtype, device=args.device, device_map=args.device_map,
                       kernels=getattr(args, "kernels", "auto"), progress=lambda s: print(s, file=sys.stderr))


def default_tree(engine, heads_name: str):
    """The tree chosen for these heads on this machine (`autotune.tuned_trees`: shipped acceptance
    statistics scored with latencies measured here, cached), else the tree the heads record, else
    mc_sim_7b_63 cut to the heads' depth."""
    from .autotune import tuned_trees
    from .scheduler import recorded_default
    from .trees import TREES_DIR, resolve_tree

    runner = engine.runners[heads_name]
    tuned = tuned_trees(engine, heads_name, progress=lambda s: print(s, file=sys.stderr))
    if tuned is not None:
        return tuned.tree.truncated(runner.config.num_heads)
    name = recorded_default(engine, heads_name, "default_tree")
    if name and (TREES_DIR / name).is_file():
        return resolve_tree(str(TREES_DIR / name)).truncated(runner.config.num_heads)
    return resolve_tree("mc_sim_7b_63").truncated(runner.config.num_heads)


def render_user_prompt(engine, text: str, raw: bool = False) -> list[int]:
    from .data import Prompt, render_prompt

    if raw or engine.tokenizer is None:
        return engine.tokenizer(text)["input_ids"]
    return render_prompt(Prompt.from_text(text), engine.tokenizer)


# ---- generate ---------------------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    p.add_argument("--method", default="hydra", choices=METHODS)
    p.add_argument("--tree", default=None, help="tree JSON file or name in trees/ (default: the heads' calibrated tree)")
    p.add_argument("--scheduler", default=None, help="tree scheduler (see `entmtp generate --help`); default static")
    p.add_argument("--bank", default=None, help="tree bank JSON for adaptive schedulers")
    p.add_argument("--rule", default="auto", choices=["auto", "greedy", "sampling", "typical"],
                   help="acceptance rule: auto = greedy at temperature 0, lossless speculative sampling otherwise")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="graft up to N tokens copied from the context (prompt lookup) onto each draft tree; "
                        f"0 = off; default: {', '.join(f'{k} {v[0]}' for k, v in DEFAULT_LOOKUP.items())}, others 0")
    add_lookup_min_ngram_argument(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print the whole trace as JSON")


def build_scheduler(engine, heads_name, args):
    """A tree or scheduler for `heads_name` from --tree / --scheduler / --bank."""
    from . import scheduler as sched
    from .trees import resolve_tree

    tree = resolve_tree(args.tree) if args.tree else default_tree(engine, heads_name)
    method = getattr(args, "method", "")
    name = getattr(args, "scheduler", None) or {"entmtp": "entropy", "dynamic": "dynamic"}.get(method, "static")
    if name == "static":
        return sched.Scheduler(tree)
    bank = args.bank
    if bank is None and name == "entropy":
        from .autotune import bank_file

        bank = bank_file(engine, heads_name)  # tuned on this machine; None: the bank the heads record
    return sched.make_scheduler(name, engine=engine, heads=heads_name, tree=tree, bank=bank)


def cmd_generate(args) -> int:
    from .acceptance import Sampling
    from .decoding import DecodeConfig

    engine = load_engine_for(args, [args.method])
    heads_name = method_heads(args.method, args)
    sched = build_scheduler(engine, heads_name, args) if heads_name else None
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=Sampling(args.temperature, args.top_p, args.top_k),
                       rule=args.rule, stop_strings=tuple(args.stop), seed=args.seed,
                       trace="full" if args.json else "summary", **method_lookup(args.method, args, engine, heads_name))
    ids = render_user_prompt(engine, args.prompt, args.raw)
    t0 = time.perf_counter()
    gen = engine.generate(ids, heads=heads_name, scheduler=sched, config=cfg)
    printed = 0
    for _ in gen:
        if not args.json:
            text = gen.final_text() if gen.done else gen.text
            # Stream whole characters only; the tail may still be an incomplete byte sequence.
            safe = text if gen.done else text.rstrip("\ufffd")
            if len(safe) > printed:
                sys.stdout.write(safe[printed:])
                sys.stdout.flush()
                printed = len(safe)
    wall = time.perf_counter() - t0
    res = gen.result
    if args.json:
        d = res.to_dict()
        d["summary"]["wall_s"] = wall
        print(json.dumps(d, ensure_ascii=False))
        return 0
    s = res.summary()
    tree_desc = sched.trees[0].describe() if sched is not None and len(sched.trees) == 1 else (sched.name if sched else "none")
    print()
    copied = ""
    if cfg.lookup:
        n = sum(st.lookup_accepted for st in res.steps)
        copied = f", prompt lookup (up to {cfg.lookup}): {n} tokens accepted"
    print(f"-- {args.method}: {s['new_tokens']} tokens in {s['steps']} steps, tau {s['tau']:.2f}, "
          f"{s['new_tokens'] / wall:.1f} tokens/s, stop: {s['stop_reason']}, tree: {tree_desc}{copied}", file=sys.stderr)
    for n in res.notices:
        print(f"-- notice: {n}", file=sys.stderr)
    return 0


# ---- entry point -------------------------------------------------------------------------------

def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--methods", default="medusa,hydra,hydra++", help="heads to choose trees for (comma separated)")
    p.add_argument("--refresh", action="store_true", help="measure again instead of reading this machine's cached profile")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def cmd_tune(args) -> int:
    """measure this machine once: fastest lossless kernels, threads, step latency and trees per heads"""
    from .autotune import format_profile, machine_profile

    if args.refresh:
        os.environ["ENTMTP_TUNE"] = "refresh"
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise CLIError(f"unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    engine = load_engine_for(args, methods)
    profile = machine_profile(engine, progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(profile, indent=1) if args.json else format_profile(profile))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="entmtp", description="Tree speculative decoding with Medusa / Hydra / Hydra++ heads.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer and print per-step statistics")
    add_generate_args(g)
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("tune", help="measure this machine once: kernels, threads, latency and trees (cached)")
    add_tune_args(t)
    t.set_defaults(func=cmd_tune)
    try:
        from . import train
    except ImportError:
        train = None
    if train is not None and hasattr(train, "add_arguments"):
        t = sub.add_parser("train", help="train Medusa / Hydra / Hydra++ heads on a frozen base")
        train.add_arguments(t)
        t.set_defaults(func=train.main)
    for modname, cmds in (("search", ("search", "score")), ("bench", ("bench",))):
        try:
            mod = __import__(f"entmtp.{modname}", fromlist=["x"])
        except ImportError:
            continue
        for c in cmds:
            adder = getattr(mod, f"add_{c}_arguments", None)
            runner = getattr(mod, f"cmd_{c}", None)
            if adder and runner:
                sp = sub.add_parser(c, help=(runner.__doc__ or "").strip().splitlines()[0] if runner.__doc__ else None)
                adder(sp)
                sp.set_defaults(func=runner)
    from .space import add_space_parser

    add_space_parser(sub)  # `entmtp space build DIR` / `entmtp space push OWNER/NAME`
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = _user_errors()
    try:
        return int(args.func(args) or 0)
    except errors as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
