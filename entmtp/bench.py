"""Side-by-side benchmarks: `entmtp bench`.

Every method decodes the same prompts in one run, interleaved (the method order rotates per
prompt so drift in machine load hits every method alike), after a warm-up; each (prompt,
method) keeps the median of `--repeats` runs. Reported per method and per category:
tokens/s, tau (tokens per base forward, counted with a forward hook for transformers'
methods), speedup against `hf` (transformers' `generate`) and the share of prompts whose
output is token-identical to `hf`, and for our methods (with `baseline` in the run) to our own
plain loop on the same kernels -- the lossless claim, exact in bf16 too where the kernels compute
every row alike (`kernels.FusedAttention`).

Methods: hf (transformers greedy `generate`), pld (transformers prompt-lookup decoding),
baseline (our autoregressive loop), lookup (our prompt-lookup decoding: a chain copied from the
context, no heads), medusa, hydra, hydra++ (our heads with their best static tree), entmtp
(Hydra heads + the entropy-aware scheduler and its bank + a prompt-lookup branch grafted onto
each tree), dynamic (Hydra heads + EAGLE-2 style dynamic trees, for comparison).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ALL_METHODS = ("hf", "pld", "baseline", "lookup", "medusa", "hydra", "hydra++", "entmtp", "dynamic")


@dataclass
class Run:
    prompt_id: str
    category: str
    method: str
    repeat: int
    new_tokens: int
    seconds: float
    forwards: int
    tokens: list[int] = field(repr=False)
    bookkeeping_s: float = 0.0
    step_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0


class ForwardCounter:
    """Counts base-model forwards (a forward pre-hook), to get tau for transformers' methods."""

    def __init__(self, model):
        self.n = 0
        self._h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self._h.remove()


def _sync(engine):
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def make_runners(engine, methods: list[str], args) -> dict[str, Callable[[list[int]], tuple[list[int], int, float, float]]]:
    """method -> fn(ids) returning (new tokens, forwards, bookkeeping seconds, step seconds)."""
    import torch

    from .cli import build_scheduler, method_heads, method_lookup
    from .decoding import DecodeConfig

    n = args.max_new_tokens
    eos = engine.eos_ids()
    runners = {}

    def hf(extra):
        def run(ids):
            x = torch.tensor([ids], device=engine.device)
            c = ForwardCounter(engine.model)
            try:
                out = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                            eos_token_id=list(eos) or None, pad_token_id=(eos[0] if eos else None), **extra)
            finally:
                c.close()
            return out[0, len(ids):].tolist(), c.n, 0.0, 0.0
        return run

    for m in methods:
        if m == "hf":
            runners[m] = hf({})
        elif m == "pld":
            runners[m] = hf({"prompt_lookup_num_tokens": args.pld_tokens})
        else:
            heads = method_heads(m, args)
            sched = build_scheduler(engine, heads, argparse.Namespace(tree=args.tree, scheduler=args.scheduler if m == "entmtp" else None,
                                                                      bank=args.bank, method=m)) if heads else None

            def run(ids, heads=heads, sched=sched, cfg=DecodeConfig(max_new_tokens=n, **method_lookup(m, args, engine, heads))):
                r = engine.run(ids, heads=heads, scheduler=sched, config=cfg)
                step_s = sum(s.time_total for s in r.steps)
                return r.tokens, 1 + sum(1 for s in r.steps if s.time_verify > 0), sum(s.time_bookkeeping for s in r.steps), step_s
            runners[m] = run
    return runners


def recorded_trees(engine, methods: list[str], args) -> dict:
    """Per heads used: the tree and bank files their checkpoint records for this dtype and hardware
    class (what a method decodes with unless --tree / --bank override it)."""
    from .cli import method_heads
    from .scheduler import recorded_default

    used = sorted({method_heads(m, args) for m in methods if m not in ("hf", "pld")} - {None})
    return {h: {"tree": recorded_default(engine, h, "default_tree"), "bank": recorded_default(engine, h, "default_bank")}
            for h in used}


def run_bench(engine, prompts, methods: list[str], args, progress: Optional[Callable[[str], None]] = None) -> list[Run]:
    from .data import render_prompt

    runners = make_runners(engine, methods, args)
    rendered = [(p.id, p.category or "all", render_prompt(p, engine.tokenizer)) for p in prompts]
    # Warm-up: every method once on the first prompt (first-touch memory, lazy inits).
    for m in methods:
        runners[m](rendered[0][2][:64])
    runs: list[Run] = []
    for i, (pid, cat, ids) in enumerate(rendered):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for rep in range(args.repeats):
            for m in order:
                _sync(engine)
                t0 = time.perf_counter()
                toks, fwd, book, step = runners[m](ids)
                _sync(engine)
                dt = time.perf_counter() - t0
                runs.append(Run(pid, cat, m, rep, len(toks), dt, fwd, toks, book, step))
        if progress:
            progress(f"prompt {i + 1}/{len(rendered)}")
    return runs


def summarize(runs: list[Run], methods: list[str]) -> dict:
    """Medians per (prompt, method), then aggregates per method and per category."""
    by: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        by.setdefault((r.prompt_id, r.method), []).append(r)
    med: dict[tuple[str, str], Run] = {}
    for k, rs in by.items():
        rs = sorted(rs, key=lambda r: r.seconds)
        med[k] = rs[len(rs) // 2]
    prompts = sorted({k[0] for k in med})
    cats = {r.prompt_id: r.category for r in runs}

    def agg(ms: list[Run], ref: list[Run] | None, base: list[Run] | None = None) -> dict:
        toks = sum(r.new_tokens for r in ms)
        secs = sum(r.seconds for r in ms)
        fwd = sum(r.forwards for r in ms)
        out = {"prompts": len(ms), "new_tokens": toks, "seconds": secs,
               "tokens_per_s": toks / secs if secs else 0.0, "tau": toks / fwd if fwd else 0.0}
        step = sum(r.step_s for r in ms)
        if step:
            out["bookkeeping_share"] = sum(r.bookkeeping_s for r in ms) / step
        if ref is not None:
            rtoks, rsecs = sum(r.new_tokens for r in ref), sum(r.seconds for r in ref)
            out["speedup_vs_hf"] = out["tokens_per_s"] / (rtoks / rsecs) if rsecs and rtoks else None
            out["identical_to_hf"] = sum(a.tokens == b.tokens for a, b in zip(ms, ref)) / len(ms) if ms else None
        if base is not None and ms:  # lossless against our own plain loop (same kernels): exact in bf16 too
            out["identical_to_baseline"] = sum(a.tokens == b.tokens for a, b in zip(ms, base)) / len(ms)
        return out

    summary: dict = {"methods": {}, "categories": {}}
    has_hf = "hf" in methods
    for m in methods:
        ms = [med[(p, m)] for p in prompts]
        ref = [med[(p, "hf")] for p in prompts] if has_hf else None
        base = [med[(p, "baseline")] for p in prompts] if "baseline" in methods and m not in ("hf", "pld") else None
        summary["methods"][m] = agg(ms, ref, base)
    for c in sorted(set(cats.values())):
        ps = [p for p in prompts if cats[p] == c]
        summary["categories"][c] = {m: agg([med[(p, m)] for p in ps], [med[(p, "hf")] for p in ps] if has_hf else None)
                                    for m in methods}
    summary["headline"] = headline(summary)
    summary["per_prompt"] = {p: {m: {"tokens_per_s": med[(p, m)].tokens_per_s, "tau": med[(p, m)].tau,
                                     "new_tokens": med[(p, m)].new_tokens} for m in methods} for p in prompts}
    return summary


HYDRA_FAMILY = ("hydra", "hydra++")


def headline(summary: dict) -> dict:
    """The figures a speculative-decoding benchmark is judged by, from `summarize`'s output.

    entmtp_vs_hf: entmtp's tokens/s over `generate`'s; hydra_vs_medusa: the best Hydra-family
    method's tokens/s over Medusa's (with which method that was); identical_to_hf: each method's
    share of prompts whose output is token-identical to `generate`'s. A figure whose methods did
    not run is absent."""
    ms = summary["methods"]
    tps = {m: v["tokens_per_s"] for m, v in ms.items()}
    out: dict = {}
    if "entmtp" in tps and tps.get("hf"):
        out["entmtp_vs_hf"] = tps["entmtp"] / tps["hf"]
    family = [m for m in HYDRA_FAMILY if m in tps]
    if family and tps.get("medusa"):
        best = max(family, key=lambda m: tps[m])
        out["hydra_vs_medusa"] = {"ratio": tps[best] / tps["medusa"], "method": best}
    if "hf" in tps:
        out["identical_to_hf"] = {m: v.get("identical_to_hf") for m, v in ms.items() if m != "hf"}
    return out


def headline_lines(head: dict) -> list[str]:
    """`headline` as sentences for the terminal and report.md."""
    lines = []
    if "entmtp_vs_hf" in head:
        lines.append(f"entmtp / hf tokens/s: {head['entmtp_vs_hf']:.2f}x")
    if "hydra_vs_medusa" in head:
        h = head["hydra_vs_medusa"]
        lines.append(f"best Hydra-family ({h['method']}) / medusa tokens/s: {h['ratio']:.3f}x")
    if head.get("identical_to_hf"):
        lines.append("token-identical to hf: " + ", ".join(
            f"{m} {'n/a' if r is None else f'{r:.0%}'}" for m, r in head["identical_to_hf"].items()))
    return lines


def markdown_table(summary: dict, methods: list[str]) -> str:
    with_base = any("identical_to_baseline" in summary["methods"][m] for m in methods)
    pct = lambda x: "" if x is None else f"{x:.0%}"  # noqa: E731
    lines = ["| method | tokens/s | tau | speedup vs hf | identical to hf |" + (" identical to baseline |" if with_base else "")
             + " bookkeeping share |", "|---|---|---|---|---|" + ("---|" if with_base else "") + "---|"]
    for m in methods:
        s = summary["methods"][m]
        sp = s.get("speedup_vs_hf")
        book = s.get("bookkeeping_share")
        lines.append(f"| {m} | {s['tokens_per_s']:.1f} | {s['tau']:.2f} | {'' if sp is None else f'{sp:.2f}x'} | "
                     f"{pct(s.get('identical_to_hf'))} |" + (f" {pct(s.get('identical_to_baseline'))} |" if with_base else "")
                     + f" {'' if book is None else f'{book:.1%}'} |")
    return "\n".join(lines)


def write_reports(out: Path, runs: list[Run], summary: dict, methods: list[str], meta: dict) -> None:
    import plotly.graph_objects as go

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({**summary, "meta": meta}, indent=1) + "\n")
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt_id", "category", "method", "repeat", "new_tokens", "seconds", "tokens_per_s", "forwards", "tau",
                    "bookkeeping_s", "step_s"])
        for r in runs:
            w.writerow([r.prompt_id, r.category, r.method, r.repeat, r.new_tokens, f"{r.seconds:.5f}", f"{r.tokens_per_s:.3f}",
                        r.forwards, f"{r.tau:.4f}", f"{r.bookkeeping_s:.5f}", f"{r.step_s:.5f}"])
    table = markdown_table(summary, methods)
    cat_lines = []
    if len(summary["categories"]) > 1:
        cat_lines = ["", "Speedup vs hf per category:", "", "| category | " + " | ".join(methods) + " |",
                     "|---|" + "---|" * len(methods)]
        for c, ms in summary["categories"].items():
            cat_lines.append(f"| {c} | " + " | ".join(
                f"{ms[m].get('speedup_vs_hf') or 0:.2f}x" if "hf" in methods else f"{ms[m]['tokens_per_s']:.1f}" for m in methods) + " |")
    md = [f"# entmtp bench", "", f"`{meta['command']}`", "",
          f"Model: {meta['model'].get('name')} ({meta['dtype']}, {meta['device']}); {meta['prompts']} prompts, "
          f"{meta['max_new_tokens']} new tokens, {meta['repeats']} repeat(s), median per prompt; machine: {meta['machine']} ({meta.get('hardware', '?')}).",
          "Prompt-lookup branch (tokens): " + ", ".join(f"{m} {n}" for m, n in meta.get("lookup", {}).items())
          + ("; grafted after a match of at least " + ", ".join(f"{m} {k}" for m, k in meta["lookup_min_ngram"].items()) + " tokens"
             if meta.get("lookup_min_ngram") else "")
          + f"; our methods' greedy lm_head: {meta.get('greedy_lm_head', 'full')}; our methods' kernels: {meta.get('kernels', 'stock')}.",
          "Recorded trees / banks for this dtype and hardware: " + (", ".join(
              f"{h} {v['tree']} / {v['bank']}" for h, v in meta.get("recorded_trees", {}).items()) or "none")
          + "".join(f"; overridden by --{k} {v}" for k, v in (meta.get("overrides") or {}).items() if v) + ".", "",
          table, "", *[f"* {line}" for line in headline_lines(summary.get("headline", {}))], *cat_lines, ""]
    (out / "report.md").write_text("\n".join(md))
    fig = go.Figure(go.Bar(x=methods, y=[summary["methods"][m]["tokens_per_s"] for m in methods],
                           text=[f"{summary['methods'][m].get('speedup_vs_hf') or 0:.2f}x" for m in methods] if "hf" in methods else None))
    fig.update_layout(title="tokens/s (label: speedup vs hf)", yaxis_title="tokens/s")
    figs = [fig]
    if len(summary["categories"]) > 1 and "hf" in methods:
        cf = go.Figure()
        for m in methods:
            cf.add_bar(name=m, x=list(summary["categories"]), y=[summary["categories"][c][m].get("speedup_vs_hf") for c in summary["categories"]])
        cf.update_layout(title="speedup vs hf per category", barmode="group")
        figs.append(cf)
    html = "".join(f.to_html(full_html=False, include_plotlyjs=("cdn" if i else True)) for i, f in enumerate(figs))
    (out / "report.html").write_text(f"<html><body><h1>entmtp bench</h1><pre>{meta['command']}</pre>{html}</body></html>")


def take_per_category(prompts, k: int) -> list:
    """The first k prompts of each category, in file order."""
    count: dict[str, int] = {}
    out = []
    for p in prompts:
        c = p.category or "all"
        if count.get(c, 0) < k:
            count[c] = count.get(c, 0) + 1
            out.append(p)
    return out


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import DEFAULT_LOOKUP, add_lookup_min_ngram_argument, add_model_args

    add_model_args(p)
    p.add_argument("--prompts", default=None, help="prompt file (any format the loader reads); default: the bundled bench set")
    p.add_argument("--methods", default="hf,pld,baseline,medusa,hydra,entmtp")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="use only the first N prompts of each category (0 = all)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tree", default=None, help="override the static tree of medusa / hydra")
    p.add_argument("--scheduler", default=None, help="override entmtp's scheduler")
    p.add_argument("--bank", default=None, help="tree bank for entmtp's scheduler")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for pld")
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="prompt-lookup chain length for every method with heads (default: "
                        + ", ".join(f"{k} {v[0]}" for k, v in DEFAULT_LOOKUP.items()) + ", others 0)")
    add_lookup_min_ngram_argument(p)
    p.add_argument("--out", default="runs/bench")


def cmd_bench(args) -> int:
    """benchmark hf / pld / baseline / medusa / hydra / entmtp side by side"""
    from .cli import CLIError, load_engine_for, method_heads, method_lookup
    from .data import bundled_prompts, load_prompts
    from .hardware import hardware_class
    from .models import describe_model

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise CLIError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(ALL_METHODS)}")
    ps = load_prompts(args.prompts or bundled_prompts("bench"))
    prompts = ps.prompts
    if args.per_category:
        prompts = take_per_category(prompts, args.per_category)
    if args.limit:
        prompts = prompts[: args.limit]
    for e in ps.skipped[:5]:
        print(f"skipped {e}", file=sys.stderr)
    engine = load_engine_for(args, [m for m in methods if m not in ("hf", "pld")])
    command = "entmtp bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "entmtp bench"
    print(f"# {command}", file=sys.stderr)
    runs = run_bench(engine, prompts, methods, args, progress=lambda s: print(s, file=sys.stderr, end="\r"))
    summary = summarize(runs, methods)
    looks = {m: method_lookup(m, args, engine, method_heads(m, args)) for m in methods if m not in ("hf", "pld")}
    meta = {"command": command, "model": describe_model(engine.model), "dtype": args.dtype, "device": str(engine.device),
            "prompts": len(prompts), "prompt_file_sha256": ps.sha256, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
            "hardware": hardware_class(engine.device),
            "threads": __import__("torch").get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "lookup": {m: looks[m]["lookup"] for m in looks},
            "lookup_min_ngram": {m: looks[m]["lookup_min_ngram"] for m in looks if looks[m]["lookup"]},
            "greedy_lm_head": "screened (bf16 screen + exact fp32 recheck)" if engine.screened is not None else "full",
            "kernels": f"{engine.kernels}: {engine.kernels_reason} (hf and pld: stock transformers)",
            "recorded_trees": recorded_trees(engine, methods, args),
            "overrides": {"tree": args.tree, "bank": args.bank}}
    write_reports(Path(args.out), runs, summary, methods, meta)
    print(file=sys.stderr)
    print(markdown_table(summary, methods))
    if "baseline" in methods and "hf" in methods:
        b = summary["methods"]["baseline"]
        print(f"\nbaseline / hf tokens/s ratio: {b['speedup_vs_hf']:.3f}; "
              f"engine bookkeeping share of step time: {b.get('bookkeeping_share', 0):.1%} (baseline), " + ", ".join(
                  f"{m} {summary['methods'][m].get('bookkeeping_share', 0):.1%}" for m in methods if m not in ("hf", "pld", "baseline")))
    for line in headline_lines(summary["headline"]):
        print(line)
    print(f"reports: {args.out}/summary.json, runs.csv, report.md, report.html")
    return 0
