"""The Machine view: what the self-tuning measured and chose on this machine (`autotune.machine_profile`).

Kernel sets tried and their latency by tree rows, bitwise row invariance, the chosen kernels,
threads and dtype and why, and per loaded heads the tree chosen from the shipped acceptance
statistics with the step latency measured here. With ENTMTP_TUNE=0 nothing is measured and the
view says so. The CLI prints the same profile: `entmtp tune`.
"""

from __future__ import annotations

import html

import gradio as gr
import plotly.graph_objects as go

from . import viz
from .autotune import draft_lm_words, long_context_words
from .ui_common import CACHE, _error_md, check_model_key, error_message, machine_profile_of, tuning_off

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
PALETTE = ("#64748b", "#3b82f6", "#16a34a", "#f59e0b", "#8b5cf6", "#ec4899")


def latency_figure(profile: dict, height: int = 360) -> go.Figure:
    """ms per forward of a chain of R tree rows for each kernel set tried (solid), and per loaded
    heads a decoding step by tree nodes from its tuned latency model (dashed).

    The two are timed at different moments, and a shared machine's speed moves between them (a
    heads' whole step had been drawn below the chosen set's one-row forward). What the latency model
    measures robustly is a step's ratio to a plain step, so the heads' curves are drawn as that ratio
    times the chosen set's one-row forward (the ratio in the hover); without kernel trials, in ms."""
    trials = [t for t in profile.get("kernel_trials") or [] if t.get("ran") and t.get("ms_by_rows")]
    heads = {k: v for k, v in (profile.get("heads") or {}).items() if v and v.get("step_ms_by_nodes_depth1")}
    if not trials and not heads:
        return viz.empty_figure("not measured: tuning off (ENTMTP_TUNE=0), so no latency curve", height)
    fig = go.Figure()
    for k, t in enumerate(trials):
        pts = sorted((int(r), float(ms)) for r, ms in t["ms_by_rows"].items())
        chosen = t["name"] == profile.get("kernels")
        fig.add_trace(go.Scatter(x=[r for r, _ in pts], y=[ms for _, ms in pts], mode="lines+markers",
                                 name=f"{t['name']} kernels: one forward" + (" (chosen)" if chosen else ""),
                                 line=dict(color=PALETTE[k % len(PALETTE)], width=3 if chosen else 1.5),
                                 hovertemplate="%{x} rows<br>%{y:.2f} ms<extra>" + html.escape(t["name"]) + "</extra>"))
    chosen = next((t for t in trials if t["name"] == profile.get("kernels")), None)
    one_row = float(chosen["ms_by_rows"]["1"]) if chosen and "1" in chosen["ms_by_rows"] else None
    for k, (name, h) in enumerate(heads.items()):
        pts = sorted((int(n), float(ms)) for n, ms in h["step_ms_by_nodes_depth1"].items())
        plain = float(h.get("plain_step_ms") or 0)
        ratios = [ms / plain if plain > 0 else float("nan") for _, ms in pts]
        relative = one_row is not None and plain > 0
        y = [r * one_row for r in ratios] if relative else [ms for _, ms in pts]
        label = f"{name} heads: whole step (draft + verify)" + (", relative to a plain step" if relative else "")
        fig.add_trace(go.Scatter(x=[n for n, _ in pts], y=y, customdata=ratios, mode="lines+markers", name=label,
                                 line=dict(color=PALETTE[(k + 3) % len(PALETTE)], dash="dash", width=1.5),
                                 hovertemplate="%{x} nodes<br>×%{customdata:.2f} a plain step<extra>"
                                 + html.escape(name) + "</extra>"))
    fig.update_layout(**viz._base_layout("latency vs tree rows, measured on this machine", height))
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.28, x=0.0), margin=dict(l=50, r=10, t=44, b=110))
    fig.update_xaxes(title="tree rows (nodes verified in one forward)", type="log", dtick=0.30103, gridcolor="#f1f5f9")
    fig.update_yaxes(title="ms", rangemode="tozero", gridcolor="#f1f5f9")
    return fig


def kernel_table(profile: dict) -> str:
    """The kernel sets tried: whether they run here, ms by rows, bitwise row invariance."""
    trials = profile.get("kernel_trials") or []
    if not trials:
        return ""
    rows = sorted({int(r) for t in trials for r in (t.get("ms_by_rows") or {})})
    head = "".join(f"<th>{r} row{'s' if r > 1 else ''}</th>" for r in rows)
    body = []
    for t in trials:
        ms = t.get("ms_by_rows") or {}
        inv = t.get("invariant_rows") or {}
        invariant = "–" if not inv else ("✓ bitwise" if all(inv.values()) else
                                         "✗ at " + ", ".join(f"{r} rows" for r, ok in inv.items() if not ok))
        ran = "yes" if t.get("ran") else f"no: {html.escape(t.get('why', ''))}"
        cells = "".join(f"<td>{float(ms[str(r)]):.2f}</td>" if str(r) in ms else "<td>–</td>" for r in rows)
        chosen = " <b>(chosen)</b>" if t["name"] == profile.get("kernels") else ""
        body.append(f"<tr><td>{html.escape(t['name'])}{chosen}</td><td>{ran}</td>{cells}<td>{invariant}</td></tr>")
    return ('<table class="entmtp-score"><tr><th>kernel set</th><th>runs here</th>' + head
            + "<th>row-invariant</th></tr>" + "".join(body) + "</table>"
            "<div class='entmtp-muted'>ms per forward of a chain of that many tree rows after 96 cached tokens; "
            "row-invariant: the rows' logits are bitwise those of one-row steps</div>")


def profile_html(profile: dict, dtype_why: str = "") -> str:
    """The profile in words: machine, dtype, kernels, threads, row invariance, trees and why."""
    if profile.get("error"):
        return _error_md(f"the machine profile could not be read: {profile['error']}")
    fp = profile.get("fingerprint") or {}
    what = fp.get("gpu") or f"{fp.get('cpu', '?')} ({fp.get('isa', '?')}, {fp.get('cores', '?')} cores)"
    measured = bool(profile.get("kernel_trials"))
    e = html.escape
    lines = [f"<b>machine</b>: {e(str(what))} · torch {e(str(fp.get('torch', '?')))}"
             + (f" · OpenMP waiting {e(fp['wait_policy'])}" if fp.get("wait_policy") else ""),
             f"<b>dtype</b>: {e(profile.get('dtype', '?'))}" + (f" — {e(dtype_why)}" if dtype_why else ""),
             f"<b>kernels</b>: {e(str(profile.get('kernels')))} — {e(str(profile.get('kernels_why')))}"]
    if not measured:
        lines.insert(0, '<div class="entmtp-notice">ℹ️ not measured: tuning off (ENTMTP_TUNE=0). The kernels, '
                        "threads and trees are the unmeasured defaults; unset ENTMTP_TUNE (or run <code>entmtp tune"
                        "</code>) to measure this machine once.</div>")
    if profile.get("threads"):
        lines.append(f"<b>threads</b>: {profile['threads']}"
                     + (" (measured: the count that decodes fastest here)" if measured else "")
                     + ("; one while other processes use the cores (governor)" if profile.get("threads_governed") else ""))
    if measured:
        lines.append("<b>lossless</b>: " + ("tree rows are bitwise one-row steps: speculation emits exactly the "
                                            "plain loop's tokens" if profile.get("row_invariant") else
                                            "not row-invariant here: speculation matches plain decoding up to "
                                            "rounding (the race shows identity per method)"))
        lines.append(f"<b>probe</b>: {float(profile.get('probe_s') or 0):.1f} s, once; cached in "
                     f"<code>{e(str(profile.get('cache_file') or 'this process only'))}</code>")
    for name, h in (profile.get("heads") or {}).items():
        if h is None:
            why = "not measured: tuning off" if tuning_off() else "no shipped acceptance statistics"
            lines.append(f"<b>{e(name)} tree</b>: the heads' recorded tree ({why})")
            continue
        bank = f"; entropy bank {h['bank_speedup']:.2f}× plain decoding" if h.get("bank_speedup") else ""
        lines.append(f"<b>{e(name)} tree</b>: {e(h['tree'])} — {h['nodes']} nodes, depth {h['depth']}, predicted "
                     f"τ {h['predicted_tau']:.2f}, {h['predicted_speedup']:.2f}× plain decoding{bank}; plain step "
                     f"{h['plain_step_ms']:.1f} ms. Why: {e(h['why'])}")
        if h.get("long_context"):
            lines.append(f"<b>{e(name)} tree, long contexts</b>: {e(long_context_words(h['long_context']))}")
        if h.get("draft_lm"):
            lines.append(f"<b>{e(name)} drafting</b>: {e(draft_lm_words(h['draft_lm']))}")
    if profile.get("family"):
        f = profile["family"]
        lines.append(f"<b>entmtp drafts with {e(f['heads'])}</b>: the Hydra-family trees timed side by side predict "
                     + e(", ".join(f"{h} {v:.2f}x" for h, v in f["speedups"].items())) + " plain decoding")
    return '<div class="entmtp-model">' + "<br>".join(lines) + "</div>" + kernel_table(profile)


def machine_view(model_key):
    """Outputs: the profile in words and tables, the latency figure."""
    try:
        entry = CACHE.get(check_model_key(model_key))
        if not entry.profile:
            entry.profile = machine_profile_of(entry)
        return profile_html(entry.profile, entry.dtype_why), latency_figure(entry.profile)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        return _error_md(msg), gr.skip()
