"""Side-by-side benchmarks: `entmtp bench`.

Every method decodes the same prompts in one run, interleaved (the method order rotates per
prompt so drift in machine load hits every method alike), after a warm-up; each (prompt,
method) keeps the median of `--repeats` runs. Reported per method and per category:
tokens/s, tau (tokens per base forward, counted with a forward hook for transformers'
methods), and two speedups kept apart: over our own plain loop on the same kernels (`baseline`:
what speculation alone buys) and over `hf` (transformers' `generate`: speculation times our
kernels); the share of prompts whose output is token-identical to `hf`, and for our methods to
our own plain loop -- the lossless claim, exact in bf16 too where the kernels compute every row
alike (`kernels.FusedAttention`). With >= 3 repeats the headline ratios carry their spread.

The methods are `entmtp.methods.METHODS` (each run by its `methods.Runner`).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .data import PromptSet, bundled_prompts, load_prompts, render_prompt
from .hardware import hardware_class, synchronize
from .interleave import rotated
from .methods import (HYDRA_FAMILY, METHODS, Runner, fit_stock_threads, make_runner, method_heads, method_lookup, parse_methods,
                      tune_loaded)
from .models import describe_model
from .scheduler import recorded_default
from .stock_process import where_stock_ran

ALL_METHODS = tuple(METHODS)


@dataclass
class BenchConfig:
    """What `entmtp bench` measures: which methods on which prompts, and how.

    prompts: a prompt file (any format the loader reads; None: the bundled bench set), cut to
    the first `per_category` prompts of each category and then the first `limit` (0: all).
    tree / bank override the static tree of methods with heads and entmtp's bank; scheduler
    overrides entmtp's. lookup / lookup_min_ngram: see `methods.method_lookup`. max_seconds: stop
    after the prompt during which this much time has passed (0: no limit), so a run with a wall-clock
    budget (a CI job, a rented GPU) still ends with every method on the same prompts."""

    methods: Sequence[str] = ("hf", "pld", "baseline", "medusa", "hydra", "entmtp")
    prompts: Optional[str] = None
    limit: int = 0
    per_category: int = 0
    max_new_tokens: int = 128
    repeats: int = 1
    tree: Optional[str] = None
    scheduler: Optional[str] = None
    bank: Optional[str] = None
    pld_tokens: int = 10
    lookup: Optional[int] = None
    lookup_min_ngram: Optional[int] = None
    max_seconds: float = 0.0

    def __post_init__(self):
        self.methods = tuple(parse_methods(self.methods))
        if self.max_seconds < 0:
            raise ValueError(f"max_seconds must be >= 0, got {self.max_seconds}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


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


def make_runners(engine, cfg: BenchConfig, stock_process=None) -> dict[str, Runner]:
    """method -> its `methods.Runner` on `engine` (greedy, `cfg.max_new_tokens`); transformers'
    methods in `stock_process` (a `stock_process.StockProcess`) when given."""
    if cfg.tree is None:  # every loaded kind tuned up front: their measuring contexts prefilled once
        tune_loaded(engine)
    return {m: make_runner(engine, m, cfg.max_new_tokens, tree=cfg.tree, scheduler=cfg.scheduler if m == "entmtp" else None,
                           bank=cfg.bank, lookup=cfg.lookup, lookup_min_ngram=cfg.lookup_min_ngram, pld_tokens=cfg.pld_tokens,
                           stock_process=stock_process)
            for m in cfg.methods}


def recorded_trees(engine, methods: Sequence[str]) -> dict:
    """Per heads used: the tree and bank files their checkpoint records for this dtype and hardware
    class (what a method decodes with unless --tree / --bank override it)."""
    used = sorted({method_heads(m, engine=engine) for m in methods} - {None})
    return {h: {"tree": recorded_default(engine, h, "default_tree"), "bank": recorded_default(engine, h, "default_bank")}
            for h in used}


def run_bench(engine, prompts, cfg: BenchConfig, progress: Optional[Callable[[str], None]] = None,
              runners: Optional[dict[str, Runner]] = None,
              on_prompt: Optional[Callable[[list[Run], int], None]] = None) -> list[Run]:
    """Every method on every prompt, `cfg.repeats` times, interleaved, after a warm-up; stops early
    after the prompt that passes `cfg.max_seconds`. runners: `make_runners(engine, cfg)` when the
    caller already has them. on_prompt(runs so far, prompts done): called after each whole prompt, so
    a caller can keep partial reports that an interrupt or a killed job does not lose."""
    start = time.perf_counter()
    methods = list(cfg.methods)
    runners = runners or make_runners(engine, cfg)
    rendered = [(p.id, p.category or "all", render_prompt(p, engine.tokenizer)) for p in prompts]
    # Warm-up: every method once on the first prompt (first-touch memory, lazy inits); transformers'
    # methods then get the thread count they run fastest with, not the one measured for our kernels.
    for m in methods:
        runners[m](rendered[0][2][:64])
        fit_stock_threads(runners[m], rendered[0][2][:64])
    runs: list[Run] = []
    for i, (pid, cat, ids) in enumerate(rendered):
        order = rotated(methods, i)
        for rep in range(cfg.repeats):
            for m in order:
                synchronize(engine.device)
                t0 = time.perf_counter()
                o = runners[m](ids)
                synchronize(engine.device)
                dt = time.perf_counter() - t0
                runs.append(Run(pid, cat, m, rep, len(o.tokens), dt, o.forwards, o.tokens, o.bookkeeping_s, o.step_s))
        elapsed = time.perf_counter() - start
        if progress:
            progress(f"prompt {i + 1}/{len(rendered)} ({elapsed:.0f} s)")
        if on_prompt:
            on_prompt(runs, i + 1)
        if cfg.max_seconds and elapsed > cfg.max_seconds and i + 1 < len(rendered):
            if progress:
                progress(f"stopped after {i + 1} of {len(rendered)} prompts: {elapsed:.0f} s > max_seconds {cfg.max_seconds:g}")
            break
    return runs


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if a and b else None


def summarize(runs: list[Run], methods: list[str]) -> dict:
    """Medians per (prompt, method), then aggregates per method and per category.

    Per method: tokens/s, tau, speedup over `generate` (speedup_vs_hf) and, for our methods,
    over our own plain loop on the same kernels (speedup_vs_baseline: speculation alone), the
    share of token-identical outputs, and tokens/s of every repeat (over all prompts) for the
    spread of the headline figures."""
    by: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        by.setdefault((r.prompt_id, r.method), []).append(r)
    med: dict[tuple[str, str], Run] = {}
    for k, rs in by.items():
        rs = sorted(rs, key=lambda r: r.seconds)
        med[k] = rs[len(rs) // 2]
    prompts = sorted({k[0] for k in med})
    cats = {r.prompt_id: r.category for r in runs}
    has_hf, has_base = "hf" in methods, "baseline" in methods

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
            out["speedup_vs_hf"] = _ratio(out["tokens_per_s"], rtoks / rsecs if rsecs else 0.0)
            out["identical_to_hf"] = sum(a.tokens == b.tokens for a, b in zip(ms, ref)) / len(ms) if ms else None
        if base is not None and ms:  # speculation alone, and lossless against our own plain loop (same kernels)
            btoks, bsecs = sum(r.new_tokens for r in base), sum(r.seconds for r in base)
            out["speedup_vs_baseline"] = _ratio(out["tokens_per_s"], btoks / bsecs if bsecs else 0.0)
            out["identical_to_baseline"] = sum(a.tokens == b.tokens for a, b in zip(ms, base)) / len(ms)
        return out

    def per_repeat(m: str) -> list[float]:
        rep: dict[int, list[Run]] = {}
        for r in runs:
            if r.method == m:
                rep.setdefault(r.repeat, []).append(r)
        return [sum(r.new_tokens for r in rs) / max(sum(r.seconds for r in rs), 1e-12) for _, rs in sorted(rep.items())]

    summary: dict = {"methods": {}, "categories": {}}
    for m in methods:
        ms = [med[(p, m)] for p in prompts]
        ref = [med[(p, "hf")] for p in prompts] if has_hf else None
        base = [med[(p, "baseline")] for p in prompts] if has_base and METHODS[m].ours else None
        summary["methods"][m] = {**agg(ms, ref, base), "tokens_per_s_by_repeat": per_repeat(m)}
    for c in sorted(set(cats.values())):
        ps = [p for p in prompts if cats[p] == c]
        summary["categories"][c] = {m: agg([med[(p, m)] for p in ps], [med[(p, "hf")] for p in ps] if has_hf else None,
                                           [med[(p, "baseline")] for p in ps] if has_base and METHODS[m].ours else None)
                                    for m in methods}
    summary["headline"] = headline(summary)
    summary["per_prompt"] = {p: {m: {"tokens_per_s": med[(p, m)].tokens_per_s, "tau": med[(p, m)].tau,
                                     "new_tokens": med[(p, m)].new_tokens} for m in methods} for p in prompts}
    return summary


MIN_REPEATS_FOR_SPREAD = 3


def spread(values: Sequence[float]) -> Optional[dict]:
    """min, max and sample standard deviation of >= MIN_REPEATS_FOR_SPREAD values, else None."""
    v = [float(x) for x in values if x is not None]
    if len(v) < MIN_REPEATS_FOR_SPREAD:
        return None
    return {"min": min(v), "max": max(v), "stdev": statistics.stdev(v), "repeats": len(v)}


def headline(summary: dict) -> dict:
    """The figures a speculative-decoding benchmark is judged by, from `summarize`'s output.

    Two separate speedups, speculation first: entmtp_vs_baseline (entmtp's tokens/s over our own
    plain loop on the same kernels: what speculation alone buys) and entmtp_vs_hf (over
    transformers' `generate`: speculation times our kernels, whose share is baseline_vs_hf).
    hydra_vs_medusa: the best Hydra-family method's tokens/s over Medusa's (with which method
    that was); identical_to_hf: each method's share of prompts whose output is token-identical to
    `generate`'s. spread: per ratio, its min, max and stdev over the repeats (tokens/s of every
    repeat over all prompts) when there were at least 3. A figure whose methods did not run is
    absent."""
    ms = summary["methods"]
    tps = {m: v["tokens_per_s"] for m, v in ms.items()}
    out: dict = {}
    pairs = {}
    for key, (num, den) in (("entmtp_vs_baseline", ("entmtp", "baseline")), ("entmtp_vs_hf", ("entmtp", "hf")),
                            ("baseline_vs_hf", ("baseline", "hf"))):
        if num in tps and tps.get(den):
            out[key] = tps[num] / tps[den]
            pairs[key] = (num, den)
    family = [m for m in HYDRA_FAMILY if m in tps]
    if family and tps.get("medusa"):
        best = max(family, key=lambda m: tps[m])
        out["hydra_vs_medusa"] = {"ratio": tps[best] / tps["medusa"], "method": best}
        pairs["hydra_vs_medusa"] = (best, "medusa")
    if "hf" in tps:
        out["identical_to_hf"] = {m: v.get("identical_to_hf") for m, v in ms.items() if m != "hf"}
    spreads = {}
    for key, (num, den) in pairs.items():
        a, b = ms[num].get("tokens_per_s_by_repeat") or [], ms[den].get("tokens_per_s_by_repeat") or []
        sp = spread([x / y for x, y in zip(a, b) if y])
        if sp is not None:
            spreads[key] = sp
    if spreads:
        out["spread"] = spreads
    return out


def _with_spread(x: float, sp: Optional[dict], fmt: str = ".2f") -> str:
    if sp is None:
        return f"{x:{fmt}}x"
    # the headline is over per-prompt medians, the spread over whole repeats: two aggregates, so the
    # headline may sit just outside the spread, which is why the spread says what it ranges over
    return (f"{x:{fmt}}x (each repeat over all prompts: {sp['min']:{fmt}}-{sp['max']:{fmt}}x, sd {sp['stdev']:.3f} "
            f"over {sp['repeats']} repeats)")


def headline_lines(head: dict) -> list[str]:
    """`headline` as sentences for the terminal and report.md: speculation over our own loop
    first, then over `generate`."""
    sp = head.get("spread", {})
    lines = []
    if "entmtp_vs_baseline" in head:
        lines.append("speculation: entmtp / our plain loop (same kernels) tokens/s: "
                     + _with_spread(head["entmtp_vs_baseline"], sp.get("entmtp_vs_baseline")))
    if "entmtp_vs_hf" in head:
        lines.append("entmtp / hf generate tokens/s: " + _with_spread(head["entmtp_vs_hf"], sp.get("entmtp_vs_hf")))
    if "baseline_vs_hf" in head:
        lines.append("kernels: our plain loop / hf generate tokens/s: " + _with_spread(head["baseline_vs_hf"], sp.get("baseline_vs_hf")))
    if "hydra_vs_medusa" in head:
        h = head["hydra_vs_medusa"]
        lines.append(f"best Hydra-family ({h['method']}) / medusa tokens/s: " + _with_spread(h["ratio"], sp.get("hydra_vs_medusa"), ".3f"))
    if head.get("identical_to_hf"):
        lines.append("token-identical to hf: " + ", ".join(
            f"{m} {'n/a' if r is None else f'{r:.0%}'}" for m, r in head["identical_to_hf"].items()))
    return lines


def markdown_table(summary: dict, methods: list[str]) -> str:
    """One row per method: tokens/s, tau, speedup over our plain loop (speculation alone) and over
    `generate`, identity, bookkeeping share."""
    with_base = any("identical_to_baseline" in summary["methods"][m] for m in methods)
    pct = lambda x: "" if x is None else f"{x:.0%}"  # noqa: E731
    times = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
    head = "| method | tokens/s | tau |" + (" speedup vs baseline |" if with_base else "") + " speedup vs hf | identical to hf |"
    head += (" identical to baseline |" if with_base else "") + " bookkeeping share |"
    lines = [head, "|" + "---|" * head.count(" |")]
    for m in methods:
        s = summary["methods"][m]
        book = s.get("bookkeeping_share")
        lines.append(f"| {m} | {s['tokens_per_s']:.1f} | {s['tau']:.2f} |" + (f" {times(s.get('speedup_vs_baseline'))} |" if with_base else "")
                     + f" {times(s.get('speedup_vs_hf'))} | {pct(s.get('identical_to_hf'))} |"
                     + (f" {pct(s.get('identical_to_baseline'))} |" if with_base else "")
                     + f" {'' if book is None else f'{book:.1%}'} |")
    return "\n".join(lines)


def write_reports(out: Path, runs: list[Run], summary: dict, methods: list[str], meta: dict, html: bool = True) -> None:
    """summary.json, runs.csv, report.md and (html) report.html under `out`. A run that stopped
    early has meta["planned_prompts"] > meta["prompts"] and says so in the report."""
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
    md = ["# entmtp bench", "", f"`{meta['command']}`" + (f" ({meta['date']})" if meta.get("date") else ""), "",
          f"Model: {meta['model'].get('name')} ({meta['dtype']}, {meta['device']}); {_prompt_count(meta)}, "
          f"{meta['max_new_tokens']} new tokens, {meta['repeats']} repeat(s), median per prompt; machine: {meta['machine']} ({meta.get('hardware', '?')}).",
          "Prompt-lookup branch (tokens): " + ", ".join(f"{m} {n}" for m, n in meta.get("lookup", {}).items())
          + ("; grafted after a match of at least " + ", ".join(f"{m} {k}" for m, k in meta["lookup_min_ngram"].items()) + " tokens"
             if meta.get("lookup_min_ngram") else "")
          + f"; our methods' greedy lm_head: {meta.get('greedy_lm_head', 'full')}; our methods' kernels: {meta.get('kernels', 'stock')}.",
          "Decoded with: " + ("; ".join(f"{m}: {label}" for m, label in meta.get("decoded_with", {}).items()) or "-")
          + "".join(f"; overridden by --{k} {v}" for k, v in (meta.get("overrides") or {}).items() if v) + ".", "",
          *[f"* {line}" for line in headline_lines(summary.get("headline", {}))], "",
          "Speedup vs baseline: over our own plain loop on the same kernels (speculation alone); "
          "speedup vs hf: over transformers' `generate` (speculation and kernels).", "", table, *cat_lines, ""]
    (out / "report.md").write_text("\n".join(md))
    if html:
        _write_html(out, summary, methods, meta)


class Reports:
    """A bench run's reports under `out`, kept current: `keep` after every whole prompt (so an
    interrupt or a killed job leaves the prompts done on disk), `final` at the end (with the html).
    done: prompts whose reports are on disk."""

    def __init__(self, out: Path, meta: dict, methods: Sequence[str], planned: int):
        self.out, self.meta, self.methods, self.planned, self.done = out, meta, list(methods), planned, 0

    def _write(self, runs: list[Run], done: int, html: bool, stopped: str) -> dict:
        summary = summarize(runs, self.methods)
        write_reports(self.out, runs, summary, self.methods,
                      {**self.meta, "prompts": done, "planned_prompts": self.planned, "stopped": stopped}, html=html)
        return summary

    def keep(self, runs: list[Run], done: int) -> None:
        """`run_bench`'s on_prompt: the reports so far, marked as stopped early until `final`."""
        self._write(runs, done, html=False, stopped="interrupted")
        self.done = done  # only once its reports are on disk

    def final(self, runs: list[Run], stopped: str = "") -> dict:
        """The whole run's reports, html included; returns the summary."""
        return self._write(runs, self.done, html=True, stopped=stopped if self.done < self.planned else "")


def _prompt_count(meta: dict) -> str:
    done, planned = meta["prompts"], meta.get("planned_prompts", meta["prompts"])
    return f"{done} prompts" if done == planned else f"{done} of {planned} prompts (stopped early: {meta.get('stopped', 'interrupted')})"


def _write_html(out: Path, summary: dict, methods: list[str], meta: dict) -> None:
    import plotly.graph_objects as go

    def label(m: str) -> str:
        s = summary["methods"][m]
        parts = [f"{s[k]:.2f}x {name}" for k, name in (("speedup_vs_baseline", "our loop"), ("speedup_vs_hf", "hf"))
                 if s.get(k) is not None]
        return " · ".join(parts)

    fig = go.Figure(go.Bar(x=methods, y=[summary["methods"][m]["tokens_per_s"] for m in methods], text=[label(m) for m in methods]))
    fig.update_layout(title="tokens/s (label: speedup over our plain loop and over hf generate)", yaxis_title="tokens/s")
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


def load_bench_prompts(cfg: BenchConfig) -> tuple[PromptSet, list]:
    """The prompt set and the prompts `cfg` selects from it."""
    ps = load_prompts(cfg.prompts or bundled_prompts("bench"))
    prompts = ps.prompts
    if cfg.per_category:
        prompts = take_per_category(prompts, cfg.per_category)
    if cfg.limit:
        prompts = prompts[: cfg.limit]
    return ps, prompts


def bench_meta(engine, cfg: BenchConfig, ps: PromptSet, prompts: list, command: str,
               runners: Optional[dict[str, Runner]] = None) -> dict:
    """What ran where: model, dtype, machine, kernels, lookup and trees per method (`runners`: the
    ones that ran, else made again)."""
    runners = runners or make_runners(engine, cfg)
    ours = [m for m in cfg.methods if METHODS[m].ours]
    looks = {m: method_lookup(m, engine, method_heads(m, engine=engine), lookup=cfg.lookup, min_ngram=cfg.lookup_min_ngram)
             for m in ours}
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "model": describe_model(engine.model), "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device), "prompts": len(prompts), "prompt_file_sha256": ps.sha256,
            "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
            "hardware": hardware_class(engine.device),
            "threads": torch.get_num_threads(),
            "threads_stock": {m: r.threads for m, r in runners.items() if r.threads},  # hf / pld: their fastest count
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "lookup": {m: looks[m]["lookup"] for m in looks},
            "lookup_min_ngram": {m: looks[m]["lookup_min_ngram"] for m in looks if looks[m]["lookup"]},
            "greedy_lm_head": "screened (bf16 screen + exact fp32 recheck)" if engine.screened is not None else "full",
            "kernels": f"{engine.kernels}: {engine.kernels_reason} (hf and pld: stock transformers{_where_stock(runners)})",
            "stock_process": next((r.stock.info for r in runners.values() if r.stock is not None), None),
            "recorded_trees": recorded_trees(engine, cfg.methods),
            # what each method ran: its heads and the tree or scheduler (tuned on this machine unless overridden)
            "decoded_with": {m: (f"{r.label} ({r.heads} heads)" if r.heads else r.label)
                             for m, r in runners.items()},
            "overrides": {"tree": cfg.tree, "bank": cfg.bank}}


def _where_stock(runners: dict[str, Runner]) -> str:
    """Where transformers' methods ran, for the report."""
    stock = next((r for r in runners.values() if r.stock is not None), None)
    return ", " + (where_stock_ran(None) if stock is None else where_stock_ran(stock.stock.info, stock.threads))


def terminal_report(summary: dict, methods: Sequence[str]) -> str:
    """The table and headline `entmtp bench` prints."""
    lines = [markdown_table(summary, list(methods)), ""]
    ours = [m for m in methods if METHODS[m].ours]
    if ours:
        lines.append("engine bookkeeping share of step time: " + ", ".join(
            f"{m} {summary['methods'][m].get('bookkeeping_share', 0):.1%}" for m in ours))
    lines += headline_lines(summary["headline"])
    return "\n".join(lines)


__all__ = ["ALL_METHODS", "BenchConfig", "Run", "make_runners", "recorded_trees", "run_bench", "summarize", "headline",
           "headline_lines", "spread", "markdown_table", "write_reports", "Reports", "take_per_category", "load_bench_prompts", "bench_meta",
           "terminal_report"]
