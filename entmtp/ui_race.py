"""The Race view: one prompt through every method, timed alike in the worker, interleaved.

Each method is the bench's runner (`methods.make_runner`, what `entmtp bench` times), called in
the worker with no UI update inside its timed window: the clock is read right around the call,
after a warm-up of every method, and the page is updated only between runs. With repeats, the
methods run in rotated order per round (machine-load drift hits every method alike) and each
method reports the median run and the spread.
"""

from __future__ import annotations

import html
import time
from typing import Optional

import gradio as gr

from . import viz
from .hardware import synchronize
from .interleave import rotated
from .ui_common import (CACHE, MAX_MESSAGE_CHARS, RACE_MAX_NEW_TOKENS, AppError, _error_md, _notice_md,
                        check_model_key, error_message, method_status, registry, waiting_note)

RACE_METHODS = ("hf", "baseline", "medusa", "hydra", "hydra++", "entmtp")
RACE_MAX_REPEATS = 5
RACE_HEADERS = ["method", "new tokens", "tok/s (median run)", "tok/s range", "τ", "× our loop", "× generate",
                "= generate", "= our loop"]


def timed(runner, ids: list[int]) -> tuple[object, float]:
    """(output, seconds) of one run: nothing but the run between the two clock reads."""
    synchronize(runner.engine.device)
    t0 = time.perf_counter()
    out = runner(ids)
    synchronize(runner.engine.device)
    return out, time.perf_counter() - t0


def race_plan(entry) -> tuple[list[str], list[str]]:
    """(methods that can run on this model, notes on those that cannot)."""
    st = method_status(entry)
    plan, notes = [], []
    for m in RACE_METHODS:
        if m == "hf" or st.get(m) is None:
            plan.append(m)
        elif m != "hydra++" or "hydra" not in entry.engine.runners:
            notes.append(f"{m} is not in the race: {st[m]}")
    return plan, notes


def summarize_runs(runs: dict[str, list[tuple[list[int], int, float]]]) -> dict[str, dict]:
    """Per method, from its runs [(tokens, forwards, seconds)]: the median run by time (as the
    bench keeps it), tokens/s of that run, the lowest and highest tokens/s, tau, and whether its
    tokens equal `generate`'s ("hf") and our plain loop's ("baseline")."""
    out = {}
    for m, rs in runs.items():
        med = sorted(rs, key=lambda r: r[2])[len(rs) // 2]
        tps = [len(t) / s if s > 0 else 0.0 for t, _, s in rs]
        out[m] = {"tokens": med[0], "n_tokens": len(med[0]), "seconds": med[2],
                  "tokens_per_s": len(med[0]) / med[2] if med[2] > 0 else 0.0, "tau": len(med[0]) / med[1] if med[1] else 0.0,
                  "tokens_per_s_range": (min(tps), max(tps)) if len(rs) > 1 else None, "runs": len(rs)}
    for m, r in out.items():
        for ref, key, speed in (("hf", "identical", "speedup"), ("baseline", "identical_ours", "speedup_ours")):
            if ref in out:
                r[key] = r["tokens"] == out[ref]["tokens"]
                r[speed] = r["tokens_per_s"] / out[ref]["tokens_per_s"] if out[ref]["tokens_per_s"] else None
    return out


def _race_badge(r: dict) -> str:
    """What a card says about the output: a speculative method against what it claims to be
    lossless to (our plain loop, same kernels), our plain loop against `generate`. In bf16 the plain
    loop's kernels may round otherwise than transformers', so "≠ generate" alone is no loss."""
    ok, diff, muted = "entmtp-ok", "entmtp-diff", "entmtp-muted"
    gen, ours = r.get("identical"), r.get("identical_ours")

    def span(cls: str, text: str) -> str:
        return f'<span class="{cls}">{text}</span>'

    if r["method"] == "hf":
        return span(muted, "the reference")
    if r["method"] == "baseline" or ours is None:
        if gen is None:
            return ""
        return span(ok, "✓ identical to generate") if gen else span(diff, "≠ generate (kernel rounding)")
    if not ours:
        return span(diff, "✗ differs from our plain loop")
    if gen:
        return span(ok, "✓ identical to generate and to our plain loop")
    return span(ok, "✓ identical to our plain loop") + " " + span(muted, "(≠ generate, as our loop)")


def _race_cards(rows: list[dict]) -> str:
    cards = []
    for r in rows:
        badge = _race_badge(r)
        body = html.escape(r.get("text") or "")
        if r.get("error"):
            body = f'<span class="entmtp-muted">{html.escape(r["error"])}</span>'
        speed = ""
        if r.get("tokens_per_s") is not None:
            speed = f'{r["tokens_per_s"]:.1f} tok/s · τ {r["tau"]:.2f}'
            if r.get("speedup") is not None:
                speed += f' · ×{r["speedup"]:.2f} generate'
            if r.get("speedup_ours") is not None and r["method"] not in ("hf", "baseline"):
                speed += f' · ×{r["speedup_ours"]:.2f} our loop'
        figures = "".join(f' data-{k.replace("_", "-")}="{r[k]:.4f}"' for k in ("tokens_per_s", "speedup", "speedup_ours")
                          if r.get(k) is not None)  # the row's figures, for scripts reading the page
        cards.append(f'<div class="entmtp-card" data-method="{html.escape(r["method"], quote=True)}"{figures}>'
                     f'<div class="entmtp-card-h"><b>{html.escape(r["label"])}</b><br>'
                     f'<small>{speed}</small> {badge}</div><div class="entmtp-card-b">{body}</div></div>')
    return '<div class="entmtp-race">' + "".join(cards) + "</div>"


def _ratio(x: Optional[float]) -> str:
    return f"×{x:.2f}" if x else "–"


def _mark(x: Optional[bool]) -> str:
    return "–" if x is None else ("✓" if x else "✗")


def _race_table(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        if r.get("tokens_per_s") is None:
            out.append([r["label"], "–", "–", "–", "–", "–", "–", "–", r.get("error") or "–"])
            continue
        lo_hi = r.get("tokens_per_s_range")
        spread = f"{lo_hi[0]:.1f}–{lo_hi[1]:.1f}" if lo_hi else "–"
        ours = r.get("method") not in ("hf",)
        out.append([r["label"], r["n_tokens"], f"{r['tokens_per_s']:.1f}", spread, f"{r['tau']:.2f}",
                    _ratio(r.get("speedup_ours")), _ratio(r.get("speedup")), _mark(r.get("identical")),
                    _mark(r.get("identical_ours")) if ours else "–"])
    return out


def machine_line(engine, stock_threads: Optional[int] = None, stock_info: Optional[dict] = None) -> str:
    """Where the race ran: CPU or GPU, dtype, kernels, threads; where generate ran (`stock_info`: its
    worker's, None when in this process; `stock_threads`: its own), in the bench report's words."""
    import torch

    from .hardware import fingerprint, hardware_class
    from .stock_process import where_stock_ran

    fp = fingerprint(engine.device)
    what = fp.get("gpu") or f"{fp.get('cpu', '?')} ({hardware_class(engine.device)}, {fp.get('cores', '?')} cores)"
    cpu = engine.device.type == "cpu"
    n = torch.get_num_threads()
    threads = f", {n} thread{'s' if n != 1 else ''}" if cpu else ""
    where = where_stock_ran(stock_info, stock_threads if cpu else None)
    return (f"{what} · {str(engine.dtype).removeprefix('torch.')} · our loop on {engine.kernels} kernels{threads} · "
            f"generate on transformers' own, {where}")


def _runner(engine, method: str, n_new: int, notes: list[str], stock=None):
    """The bench's runner for `method` (transformers' methods in `stock`, a worker process, when
    given); entmtp without an entropy bank runs its static tree (said)."""
    try:
        return registry.make_runner(engine, method, n_new, progress=None, stock_process=stock)
    except Exception as exc:  # noqa: BLE001
        if method != "entmtp":
            raise
        notes.append(f"entmtp runs its static tree: {error_message(exc)}")
        return registry.make_runner(engine, method, n_new, scheduler="static", progress=None)


def race_waiting(what: str) -> tuple:
    """The race's outputs while it waits for another handler on the model thread: its status only."""
    skip = gr.skip()
    return skip, skip, skip, _notice_md([waiting_note(what)])


def race(prompt, model_key, max_new_tokens, repeats=1):
    """One prompt through generate, our plain loop and every speculative method, interleaved.
    Outputs: table, bar chart, side-by-side texts, status."""
    from .data import Prompt, render_prompt
    from .decoding import DecodeConfig

    skip = gr.skip()
    try:
        text = prompt if isinstance(prompt, str) else ""
        if not text.strip():
            raise AppError("type a prompt first")
        text = text[:MAX_MESSAGE_CHARS]
        entry = CACHE.get(check_model_key(model_key))
        engine = entry.engine
        n_new = int(min(max(int(max_new_tokens or 1), 1), RACE_MAX_NEW_TOKENS))
        n_rep = int(min(max(int(repeats or 1), 1), RACE_MAX_REPEATS))
        ids = render_prompt(Prompt.from_text(text, id="race"), engine.tokenizer)
        probe = engine.generate(ids, config=DecodeConfig(max_new_tokens=n_new))  # a too-long prompt: cut like every method
        ids = probe.prompt
        notices = list(probe.notices)
        plan, why_not = race_plan(entry)
        notices += why_not
        stock = entry.stock_process() if "hf" in plan else None  # generate as a user runs it: its own process
        runners = {m: _runner(engine, m, n_new, notices, stock) for m in plan}
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        yield skip, skip, skip, _error_md(msg)
        return

    rows = [{"method": m, "label": runners[m].label} for m in plan]
    yield [], viz.race_bar_figure([]), _race_cards([]), _notice_md(notices) + "<div>warming up every method (untimed)…</div>"
    try:
        for m in plan:  # first touches, lazy initialisation, per-shape kernel set-up: not timed
            runners[m](ids[-64:])
            registry.fit_stock_threads(runners[m], ids[-64:], repeats=1)  # generate: its own fastest thread count
        runs: dict[str, list] = {m: [] for m in plan}
        texts: dict[str, str] = {}
        total = n_rep * len(plan)
        for rep in range(n_rep):
            order = rotated(plan, rep)
            for m in order:
                done = sum(len(v) for v in runs.values())
                yield skip, skip, skip, f"<div>run {done + 1} of {total}: {html.escape(runners[m].label)}…</div>"
                out, dt = timed(runners[m], ids)
                runs[m].append((list(out.tokens), max(out.forwards, 1), dt))
                texts.setdefault(m, engine.tokenizer.decode(out.tokens, skip_special_tokens=True))
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        yield skip, skip, skip, _error_md(msg)
        return
    summary = summarize_runs(runs)
    for r in rows:
        r.update(summary[r["method"]], text=texts.get(r["method"], ""))
    same = sum(1 for r in rows if r.get("identical") and r["method"] != "hf")
    same_ours = sum(1 for r in rows if r.get("identical_ours") and r["method"] not in ("hf", "baseline"))
    n_spec = sum(1 for r in rows if r["method"] not in ("hf", "baseline"))
    status = (f'<div class="entmtp-stats">done: {len(rows)} methods × {n_rep} run{"s" if n_rep > 1 else ""}, '
              f"interleaved after a warm-up; {same} of {len(rows) - 1} token-identical to generate, {same_ours} of "
              f"{n_spec} speculative methods identical to our plain loop · {html.escape(machine_line(engine, runners['hf'].threads if 'hf' in runners else None, stock.info if stock is not None else None))}</div>")
    yield (_race_table(rows), viz.race_bar_figure(rows), _race_cards(rows), _notice_md(notices) + status)
