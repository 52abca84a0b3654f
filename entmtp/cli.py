"""Command line: `entmtp generate | tune | train | search | score | bench` (also `python -m entmtp`).

This module only parses arguments, builds the library's configs from them and prints what
the library returns. Every expected failure (bad file, unknown tree, missing heads,
unreachable model) prints one line `error: ...` on stderr and exits with status 2 -- never a
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from . import bench, search, train
from .acceptance import Sampling
from .autotune import format_profile, machine_profile
from .calibrate import RuleSpec
from .checkpoints import CheckpointError
from .data import DataError, Prompt, render_prompt
from .decoding import ContextError, DecodeConfig
from .hardware import dispatch_env
from .kernels import KERNELS
from .methods import (DEFAULT_LOOKUP, HYDRA_FAMILY, METHODS, OUR_METHODS, MethodError, ModelOptions, build_scheduler,
                      load_engine_for, method_heads, method_lookup, parse_methods)
from .models import ModelLoadError, describe_model
from .stock_process import StockProcess, StockProcessError
from .trees import TreeError, resolve_tree
from .verify import UnsupportedModelError


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


USER_ERRORS = (CLIError, CheckpointError, DataError, ContextError, ModelLoadError, TreeError, UnsupportedModelError,
               MethodError, StockProcessError, train.TrainError, FileNotFoundError, ValueError)


def _say(s: str) -> None:
    print(s, file=sys.stderr)


def _command(name: str) -> str:
    """The command line as typed after `entmtp`, for reports, after the dispatch settings of the
    environment (`hardware.dispatch_env`) so that it reproduces the run."""
    line = f"entmtp {name} " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 and sys.argv[1] == name else f"entmtp {name}"
    env = dispatch_env()
    return f"{env} {line}" if env else line


# ---- shared options -------------------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct + our heads), a local path or a Hugging Face repo id")
    p.add_argument("--base", default=None, help="base model path or id (alias of --model, for use with --heads)")
    p.add_argument("--heads", default=None, help="head checkpoint: directory or repo id (ours, or the published Medusa/Hydra formats)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--device-map", default=None, help="e.g. 'auto' to shard a large base across GPUs (accelerate)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = measured on this machine, or ENTMTP_THREADS)")
    p.add_argument("--kernels", default="auto", choices=list(KERNELS),
                   help="our decoding's kernels: auto = measured on this machine once (the fastest row-invariant set "
                        "no slower than stock, else the fastest; `entmtp tune` shows it); stock = transformers'; "
                        "onednn = linears prepacked for oneDNN (onednn-trees: for tree rows only, float32); panels = entmtp's own "
                        "row-invariant bf16 and float32 kernels; "
                        "packed = the first packed set available")


def model_options(args) -> ModelOptions:
    return ModelOptions(model=args.base or args.model, heads=args.heads, dtype=args.dtype, device=args.device,
                        device_map=args.device_map, threads=args.threads, kernels=args.kernels)


def add_lookup_args(p: argparse.ArgumentParser, help_length: str) -> None:
    p.add_argument("--lookup", type=int, default=None, metavar="N", help=help_length)
    p.add_argument("--lookup-min-ngram", type=int, default=None, metavar="N", choices=range(1, 4),
                   help="graft a context copy only after a match of at least N tokens (1-3); default: what "
                        "the heads record for this dtype and hardware, else 1")


_LOOKUP_DEFAULTS = ", ".join(f"{k} {v[0]}" for k, v in DEFAULT_LOOKUP.items())


# ---- generate ---------------------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    p.add_argument("--method", default="hydra", choices=OUR_METHODS)
    p.add_argument("--tree", default=None, help="tree JSON file or the name of a shipped tree, e.g. mc_sim_7b_63 (default: the tree chosen for the heads here)")
    p.add_argument("--scheduler", default=None, help="tree scheduler (static, ladder, hysteresis, entropy, dynamic); "
                                                     "default: the method's")
    p.add_argument("--bank", default=None, help="tree bank JSON for adaptive schedulers")
    p.add_argument("--rule", default="auto", choices=["auto", "greedy", "sampling", "typical"],
                   help="acceptance rule: auto = greedy at temperature 0, lossless speculative sampling otherwise")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_lookup_args(p, "graft up to N tokens copied from the context (prompt lookup) onto each draft tree; "
                       f"0 = off; default: {_LOOKUP_DEFAULTS}, others 0")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print the whole trace as JSON")


def render_user_prompt(engine, text: str, raw: bool = False) -> list[int]:
    if raw or engine.tokenizer is None:
        return engine.tokenizer(text)["input_ids"]
    return render_prompt(Prompt.from_text(text), engine.tokenizer)


def cmd_generate(args) -> int:
    """generate an answer and print per-step statistics"""
    engine = load_engine_for(model_options(args), [args.method])
    heads = method_heads(args.method, engine=engine)
    sched = build_scheduler(engine, heads, args.method, tree=args.tree, scheduler=args.scheduler, bank=args.bank) if heads else None
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=Sampling(args.temperature, args.top_p, args.top_k),
                       rule=args.rule, stop_strings=tuple(args.stop), seed=args.seed, trace="full" if args.json else "summary",
                       **method_lookup(args.method, engine, heads, lookup=args.lookup, min_ngram=args.lookup_min_ngram))
    ids = render_user_prompt(engine, args.prompt, args.raw)
    t0 = time.perf_counter()
    gen = engine.generate(ids, heads=heads, scheduler=sched, config=cfg)
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
    tree_desc = sched.describe() if sched is not None else "none"
    print()
    copied = ""
    if cfg.lookup:
        n = sum(st.lookup_accepted for st in res.steps)
        copied = f", prompt lookup (up to {cfg.lookup}): {n} tokens accepted"
    _say(f"-- {args.method}: {s['new_tokens']} tokens in {s['steps']} steps, tau {s['tau']:.2f}, "
         f"{s['new_tokens'] / wall:.1f} tokens/s, stop: {s['stop_reason']}, tree: {tree_desc}{copied}")
    for n in res.notices:
        _say(f"-- notice: {n}")
    return 0


# ---- tune -------------------------------------------------------------------------------------

def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--methods", default="medusa,hydra,hydra++", help="heads to choose trees for (comma separated)")
    p.add_argument("--refresh", action="store_true", help="measure again instead of reading this machine's cached profile")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def cmd_tune(args) -> int:
    """measure this machine once: fastest lossless kernels, threads, step latency and trees per heads"""
    if args.refresh:
        os.environ["ENTMTP_TUNE"] = "refresh"
    methods = parse_methods(args.methods, OUR_METHODS)
    engine = load_engine_for(model_options(args), methods)
    profile = machine_profile(engine, progress=_say, family=HYDRA_FAMILY)
    print(json.dumps(profile, indent=1) if args.json else format_profile(profile))
    return 0


# ---- train ------------------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and heads")
    g.add_argument("--model", default="default",
                   help="base model: 'default' (SmolLM2-135M-Instruct), a local directory, or a repo id")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the frozen base for generation and feature extraction "
                        "(bfloat16 is 2-3x faster on CPUs with AMX)")
    g.add_argument("--heads", default="medusa,hydra,hydra++",
                   help="comma-separated head kinds trained jointly: medusa, hydra, hydra++, eagle "
                        "(an EAGLE-style draft layer autoregressive over the base's features)")
    g.add_argument("--num-heads", type=int, default=4, help="heads per kind (draft depth)")
    g.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from trained heads (fine-tune): a heads directory, or a directory of "
                        "<name>-<medusa|hydra|hydrapp> heads as --out writes them; keeps their draft vocabulary; "
                        "a larger --num-layers adds blocks that start as the identity")
    g.add_argument("--draft-vocab", type=int, default=0,
                   help="0 = full vocabulary; N = the N most frequent training answer tokens plus EOS")
    g.add_argument("--feature-layers", type=_int_list, default=(), metavar="I,J,...",
                   help="EAGLE heads only (EAGLE-3's multi-layer features): base hidden states they read beside "
                        "the last one, as indices of transformers' hidden_states (0 = embeddings, i = layer i's "
                        "output), e.g. 3,15,27 for a 30-layer base")

    g = parser.add_argument_group("data")
    g.add_argument("--data", required=True, help="prompt / conversation file (any format load_prompts reads)")
    g.add_argument("--self-distill", action="store_true",
                   help="answer every prompt with the base model itself and train on those answers")
    g.add_argument("--gen-max-new-tokens", type=int, default=160)
    g.add_argument("--gen-batch-size", type=int, default=32)
    g.add_argument("--gen-temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--gen-time-budget-min", type=float, default=0.0,
                   help="stop generating after this many minutes (0 = no limit); prompts left "
                        "unanswered are skipped in this run and answered by a later run")
    g.add_argument("--held-out", type=float, default=0.05, help="held-out fraction (seeded split)")
    g.add_argument("--max-prompts", type=int, default=0,
                   help="use at most this many training prompts (seeded sample; 0 = all)")
    g.add_argument("--max-len", type=int, default=512, help="truncate sequences to this many tokens")

    g = parser.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=3.0)
    g.add_argument("--max-steps", type=int, default=0, help="cap on the planned steps (0 = epochs decide)")
    g.add_argument("--time-budget-min", type=float, default=0.0,
                   help="wall-clock budget of the whole command in minutes (0 = none); training "
                        "stops cleanly when it is spent")
    g.add_argument("--fit-schedule", action=argparse.BooleanOptionalAction, default=True,
                   help="with --time-budget-min: shrink the planned steps (once, after measuring "
                        "the step time) so the LR schedule completes within the budget")
    g.add_argument("--stop-after", type=int, default=0,
                   help="stop (checkpoint and export) after this many steps of this invocation, "
                        "keeping the planned schedule; continue later with --resume")
    g.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step (global)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--final-lr-mult", type=float, default=0.1)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="per-kind gradient clipping (0 = off)")
    g.add_argument("--lm-loss-weight", type=float, default=0.1)
    g.add_argument("--teacher-loss-weight", type=float, default=1.0)
    g.add_argument("--teacher-topk", type=int, default=16)
    g.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"],
                   help="autocast for the heads (fp32 master weights)")
    g.add_argument("--cache-features", action=argparse.BooleanOptionalAction, default=None,
                   help="cache base features on disk (default: when training for more than one epoch)")
    g.add_argument("--feature-batch-tokens", type=int, default=4096,
                   help="padded tokens per base forward when extracting features")
    g.add_argument("--feature-shard-size", type=int, default=128, help="sequences per feature-cache shard")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu", action="store_true", help="force CPU even if an accelerator is available")
    g.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = torch default)")

    g = parser.add_argument_group("evaluation, checkpoints, output")
    g.add_argument("--eval-every", type=int, default=200, help="evaluate every N steps (0 = only at the end)")
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--work-dir", default="runs/train-work",
                   help="self-distillation cache, feature cache, checkpoints (ckpt/) and logs")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in WORK_DIR/ckpt")
    g.add_argument("--out", default="runs/heads", help="output directory for the trained heads and the report")
    g.add_argument("--name", default=None,
                   help="checkpoint name prefix (default: smollm2-135m for the default model, else the model dir name)")
    g.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "int8"],
                   help="weights of the exported heads; int8: large matrices per-row int8 (half of bfloat16)")


def train_config(args) -> train.TrainConfig:
    """The `TrainConfig` of parsed `entmtp train` arguments."""
    names = train.TrainConfig.__dataclass_fields__
    return train.TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def cmd_train(args) -> int:
    """train Medusa / Hydra / Hydra++ heads on a frozen base"""
    return train.main(train_config(args))


# ---- search, score ----------------------------------------------------------------------------

def add_lab_args(p: argparse.ArgumentParser) -> None:
    """Options `search` and `score` share."""
    add_model_args(p)
    p.add_argument("--data", default="calib_example",
                   help="prompt file (JSON, JSONL or text; any format the loader reads) or a bundled set name (default: calib_example)")
    p.add_argument("--rule", default="greedy", choices=["greedy", "typical", "sampling"], help="acceptance rule the statistics are for")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (typical / sampling rules)")
    p.add_argument("--typical-epsilon", type=float, default=0.09)
    p.add_argument("--typical-alpha", type=float, default=0.3)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per prompt (statistics and held-out)")
    p.add_argument("--stats-method", default="auto", choices=["auto", "trace", "rollout"],
                   help="statistics pass: trace (greedy / sampling: one continuation per prompt, every position recorded, "
                        "exact replay) or rollout (decode with a union tree; needed for typical); auto picks")
    p.add_argument("--max-rank", type=int, default=32, help="trace statistics: ranks up to this (exclusive) are covered")
    p.add_argument("--batch-size", type=int, default=16, help="trace statistics: prompts continued together")
    p.add_argument("--union-nodes", type=int, default=128, help="rollout statistics: size of the union tree (+ mc_sim_7b_63)")
    p.add_argument("--union", default=None, help="rollout statistics: use this tree file as the union tree")
    p.add_argument("--remeasure", action="store_true", help="measure the latency model again instead of using the cache")
    p.add_argument("--latency-repeats", type=int, default=5, help="timed steps per tree size in the latency model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_search_args(p: argparse.ArgumentParser) -> None:
    add_lab_args(p)
    p.add_argument("--budgets", default="4,8,16,32,64", help="node budgets, comma separated")
    p.add_argument("--out", default="runs/search", help="output directory")
    p.add_argument("--max-prompts", type=int, default=200, help="at most this many calibration prompts")
    p.add_argument("--held-out", type=float, default=0.25, help="fraction of prompts held out for the on-policy check (0 = none)")
    p.add_argument("--eval-prompts", type=int, default=6, help="held-out prompts decoded on-policy by every chosen tree (slow on CPU)")
    p.add_argument("--held-out-prompts", type=int, default=48, help="at most this many held-out prompts in the held-out statistics (replay)")
    p.add_argument("--depths", default=None, help="depth limits to search, e.g. 2,3,4 (default: 1..number of heads)")
    p.add_argument("--methods", default="greedy,dp", help="search methods: greedy, dp")
    p.add_argument("--no-decompose", action="store_true", help="rollout statistics: skip the union pass over the held-out prompts "
                                                                 "(which splits prediction gaps into prompt and on-policy parts)")
    p.add_argument("--stats", default=None, help="reuse an earlier search's statistics (its output directory) instead of a "
                                                 "statistics pass -- checked to be for the same model, heads, data, rule, dtype "
                                                 "and --max-new-tokens; for re-searching after a kernel or latency change")
    p.add_argument("--race", type=int, default=0, metavar="N",
                   help="also race small trees on-policy on N further held-out prompts and save the fastest as "
                        "<model>-<heads>-race.json (for CPUs whose step times are too noisy to rank small trees)")
    p.add_argument("--race-max-nodes", type=int, default=6, help="--race: largest proposed tree")
    p.add_argument("--race-max-depth", type=int, default=3, help="--race: deepest proposed tree")
    p.add_argument("--save-trees-to", default=None, help="also copy the chosen trees here (e.g. assets/search/trees/)")
    p.add_argument("--tag", default="", help="tag in the saved tree and bank names, e.g. fp32 -> MODEL-HEADS-fp32-b8.json")


def add_score_args(p: argparse.ArgumentParser) -> None:
    add_lab_args(p)
    p.add_argument("--tree", required=True, help="tree JSON file or the name of a shipped tree")
    p.add_argument("--stats", default=None, help="statistics: a search output directory, its search.json, or a stats.json "
                                                 "(default: a statistics pass over --data now)")
    p.add_argument("--max-prompts", type=int, default=24, help="at most this many prompts")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the result JSON to this file")


def _ints(text, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{what} must be comma-separated integers, got {text!r}") from None


def _rule(args) -> RuleSpec:
    return RuleSpec(args.rule, temperature=args.temperature, typical_epsilon=args.typical_epsilon,
                    typical_alpha=args.typical_alpha, seed=args.seed)


# SearchConfig field -> the flag that sets it (its errors name the field; the user typed the flag)
_SEARCH_FLAGS = {"max_new_tokens": "--max-new-tokens", "held_out": "--held-out", "max_calibration": "--max-prompts",
                 "max_eval": "--eval-prompts", "max_held_out": "--held-out-prompts", "race_prompts": "--race",
                 "race_max_nodes": "--race-max-nodes", "race_max_depth": "--race-max-depth"}


def search_config(args) -> search.SearchConfig:
    """The checked `SearchConfig` of parsed `entmtp search` arguments."""
    try:
        return _search_config(args).check()
    except ValueError as e:
        raise CLIError(re.sub(r"\b(" + "|".join(_SEARCH_FLAGS) + r")\b", lambda m: _SEARCH_FLAGS[m.group(1)], str(e))) from None


def _search_config(args) -> search.SearchConfig:
    return search.SearchConfig(
        budgets=_ints(args.budgets, "--budgets") or (), rule=_rule(args), max_new_tokens=args.max_new_tokens,
        union=resolve_tree(args.union) if args.union else None, union_nodes=args.union_nodes,
        depths=_ints(args.depths, "--depths"), methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        held_out=args.held_out, seed=args.seed, max_calibration=args.max_prompts, max_eval=args.eval_prompts,
        max_held_out=args.held_out_prompts, decompose=not args.no_decompose, remeasure=args.remeasure,
        latency_repeats=args.latency_repeats, stats_method=args.stats_method, max_rank=args.max_rank,
        batch_size=args.batch_size, reuse_stats=args.stats, race_prompts=args.race, race_max_nodes=args.race_max_nodes,
        race_max_depth=args.race_max_depth, command=_command("search"))


def cmd_search(args) -> int:
    """search draft trees for node budgets from one statistics pass; held-out check, frontiers, reports"""
    cfg = search_config(args)
    ps = search.load_data(args.data)
    state = search.accelerate_state(args.device)
    opts = model_options(args)
    if state is not None and opts.device.startswith("cuda"):
        opts.device = str(state.device)
    main_process = state is None or state.is_main_process
    engine = load_engine_for(opts, ["hydra"])
    if main_process:
        _say(f"# {ps.summary()}")
    bars = search.ProgressBars(not args.no_progress, position=getattr(state, "process_index", 0) if state else 0)
    report = search.run_search(engine, method_heads("hydra", engine.runners), ps, cfg, progress=bars, state=state)
    if state is not None:
        search.end_distributed()
    if report is None:
        return 0
    if args.tag:
        report.provenance["tag"] = args.tag
    files = report.write(args.out, save_trees_to=args.save_trees_to)
    print(search.summary_table(report))
    for w in report.warnings:
        _say(f"warning: {w}")
    print(f"outputs: {files['search']}, {files['report']}, {files['frontier']}, {files['trees']}/"
          + (f"; trees copied to {files['saved_trees']}/" if "saved_trees" in files else ""))
    return 0


def cmd_score(args) -> int:
    """score one draft tree: predicted (from statistics) and measured on-policy tau and tokens/s"""
    if not 1 <= args.max_new_tokens <= search.MAX_NEW_TOKENS:
        raise CLIError(f"--max-new-tokens must be in 1..{search.MAX_NEW_TOKENS}")
    if args.max_prompts < 1:
        raise CLIError("--max-prompts must be >= 1")
    tree = resolve_tree(args.tree)
    ps = search.load_data(args.data)
    if ps.skipped:
        _say(ps.skipped_note())
    stats = search.load_stats_any(args.stats) if args.stats else None
    engine = load_engine_for(model_options(args), ["hydra"])
    heads = method_heads("hydra", engine.runners)
    res = search.score(engine, heads, tree, ps.prompts[: args.max_prompts], stats, rule=_rule(args),
                       max_new_tokens=args.max_new_tokens, union_nodes=args.union_nodes, remeasure=args.remeasure,
                       latency_repeats=args.latency_repeats, stats_method=args.stats_method, max_rank=args.max_rank,
                       batch_size=args.batch_size, progress=search.ProgressBars(not args.no_progress))
    res["provenance"] = {"model": describe_model(engine.model).get("name"), "heads": engine.runners[heads].label, "data": ps.source,
                         "data_sha256": ps.sha256, "dtype": args.dtype, "device": str(engine.device),
                         "machine": search.machine_info()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res))
        return 0
    print("\n".join(search.score_lines(res, args.tree)))
    return 0


# ---- bench ------------------------------------------------------------------------------------

def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompts", default=None, help="prompt file (any format the loader reads); default: the bundled bench set")
    p.add_argument("--methods", default=",".join(bench.BenchConfig.methods),
                   help=f"comma separated, from {', '.join(bench.ALL_METHODS)}")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="use only the first N prompts of each category (0 = all)")
    p.add_argument("--repeats", type=int, default=1, help="runs per (prompt, method); the median is kept")
    p.add_argument("--tree", default=None, help="override the static tree of medusa / hydra")
    p.add_argument("--scheduler", default=None, help="override entmtp's scheduler")
    p.add_argument("--bank", default=None, help="tree bank for entmtp's scheduler")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for pld")
    add_lookup_args(p, f"prompt-lookup chain length for every method with heads (default: {_LOOKUP_DEFAULTS}, others 0)")
    p.add_argument("--stock-process", action=argparse.BooleanOptionalAction, default=None,
                   help="time hf and pld in a process of their own with OpenMP's default waiting, as a user runs "
                        "generate (default: on a CPU); --no-stock-process runs them in this process")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop after the prompt during which this many seconds have passed (0 = no limit)")
    p.add_argument("--out", default="runs/bench")


def cmd_bench(args) -> int:
    """benchmark hf / pld / baseline / medusa / hydra / entmtp side by side"""
    cfg = bench.BenchConfig(methods=args.methods, prompts=args.prompts, limit=args.limit, per_category=args.per_category,
                            max_new_tokens=args.max_new_tokens, repeats=args.repeats, tree=args.tree,
                            scheduler=args.scheduler, bank=args.bank, pld_tokens=args.pld_tokens, lookup=args.lookup,
                            lookup_min_ngram=args.lookup_min_ngram, max_seconds=args.max_seconds)
    ps, prompts = bench.load_bench_prompts(cfg)
    if ps.skipped:
        _say(ps.skipped_note())
    engine = load_engine_for(model_options(args), cfg.methods)
    command = _command("bench")
    _say(f"# {command}")
    with contextlib.ExitStack() as stack:
        stock = None
        own = args.stock_process if args.stock_process is not None else engine.device.type == "cpu"
        if own and any(not METHODS[m].ours for m in cfg.methods):
            _say("starting transformers' methods in a process of their own")
            stock = stack.enter_context(StockProcess(model_options(args)))
        return _run_bench(args, cfg, ps, prompts, engine, command, bench.make_runners(engine, cfg, stock_process=stock))


def _run_bench(args, cfg, ps, prompts, engine, command, runners) -> int:
    out = Path(args.out)
    reports = bench.Reports(out, bench.bench_meta(engine, cfg, ps, prompts, command, runners), cfg.methods, len(prompts))
    try:
        runs = bench.run_bench(engine, prompts, cfg, progress=lambda s: print(s, file=sys.stderr, end="\r"),
                               runners=runners, on_prompt=reports.keep)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        if reports.done:
            _say(f"interrupted after {reports.done} of {len(prompts)} prompts; their reports are in {out}/")
        else:
            _say("interrupted before the first prompt finished; no report written")
        return 130
    summary = reports.final(runs, stopped=f"--max-seconds {cfg.max_seconds:g}")
    print(file=sys.stderr)
    print(bench.terminal_report(summary, cfg.methods))
    if reports.done < len(prompts):
        print(f"stopped early (--max-seconds {cfg.max_seconds:g}): {reports.done} of {len(prompts)} prompts")
    print(f"reports: {out}/summary.json, runs.csv, report.md, report.html")
    return 0


# ---- entry point -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="entmtp", description="Tree speculative decoding with Medusa / Hydra / Hydra++ heads.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, add, run, extra in (
            ("generate", add_generate_args, cmd_generate, {}),
            ("tune", add_tune_args, cmd_tune, {"help": "measure this machine once: kernels, threads, latency and trees (cached)"}),
            ("train", add_train_args, cmd_train, {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}),
            ("search", add_search_args, cmd_search, {}),
            ("score", add_score_args, cmd_score, {}),
            ("bench", add_bench_args, cmd_bench, {})):
        sp = sub.add_parser(name, **{"help": run.__doc__.strip().splitlines()[0], **extra})
        add(sp)
        sp.set_defaults(func=run)
    from .space import add_space_parser

    add_space_parser(sub)  # `entmtp space build DIR` / `entmtp space push OWNER/NAME`
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _say(f"error: {msg}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
