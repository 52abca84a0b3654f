"""Pure drawing functions: trace `Step`s and `Tree`s -> plotly figures and HTML strings.

Nothing here touches a model or gradio; every function takes plain data (a `Step`, a list
of steps, a `Tree`, a list of row dicts) and returns a `plotly.graph_objects.Figure` or an
HTML string, so the app, notebooks and the CLI can share them.

Conventions
* Node 0 is the root (the base model's own token); parents[i] < i (canonical order).
* The accepted path is drawn in `ACCEPT_COLOR` (edges and node outlines); nodes off the path
  are dimmed to `DIM_OPACITY`.
* Node fill = draft probability (0..1) or draft entropy (nats), chosen by `color_by`.
* Every piece of model text is HTML-escaped before it reaches a figure or HTML string.
"""

from __future__ import annotations

import html
import math
from typing import Iterable, Optional, Sequence

import plotly.graph_objects as go

from .trace import Step
from .trees import Tree

ACCEPT_COLOR = "#16a34a"  # accepted path (edges + node outlines)
EDGE_COLOR = "#c4c9d4"  # edges off the accepted path
NAN_COLOR = "#b8bcc6"  # nodes without a statistic (the root's draft probability)
BONUS_COLOR = "#2563eb"  # the bonus token (the base model's next token after the path)
DIM_OPACITY = 0.35
ENTROPY_MAX = 5.0  # nats at the top of the entropy colour scales (clamped above)
COLOR_BY = ("draft_prob", "draft_entropy")
PROB_SCALE = "Viridis"
ENTROPY_SCALE = "YlOrRd"
FONT = "Inter, ui-sans-serif, system-ui, sans-serif"
METHOD_COLORS = {
    "hf generate": "#6b7280", "baseline": "#3b82f6", "medusa": "#f59e0b", "hydra": "#8b5cf6",
    "hydra++": "#ec4899", "entmtp": "#16a34a",
}


# ---- small helpers ------------------------------------------------------------------------------

def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _fmt(x, spec: str = ".3f") -> str:
    return format(x, spec) if _finite(x) else "–"


def display_token(text: Optional[str], limit: int = 14) -> str:
    """A token's text made visible and safe for plotly labels / HTML.

    Leading/trailing spaces become '␣', newlines '↵', tabs '⇥', other control characters
    '\\xNN'; long tokens are cut with '…'; the result is HTML-escaped.
    """
    if text is None:
        return "?"
    out = []
    for ch in text:
        if ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif ch == "\r":
            out.append("␍")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    s = "".join(out)
    if s.startswith(" "):
        s = "␣" + s[1:]
    if len(s) > 1 and s.endswith(" "):
        s = s[:-1] + "␣"
    if s == "":
        s = "∅"
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return html.escape(s, quote=True)


def _children(parents: Sequence[int]) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            ch[p].append(i)
    return ch


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node from a parent list (root -1, parents before children)."""
    d = [0] * len(parents)
    for i, p in enumerate(parents):
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def tree_layout(parents: Sequence[int], ranks: Optional[Sequence[int]] = None) -> dict[int, tuple[float, float]]:
    """Layered top-down layout: node -> (x, y), y = -depth.

    Leaves take consecutive x slots in depth-first order (children by rank, so the top-1
    chain is the leftmost); an inner node sits midway between its first and last child.
    Deterministic.
    """
    n = len(parents)
    if n == 0:
        return {}
    ch = _children(parents)
    if ranks is not None:
        ch = [sorted(c, key=lambda j: (ranks[j], j)) for c in ch]
    depth = node_depths(parents)
    pos: dict[int, tuple[float, float]] = {}
    slot = 0.0

    # Iterative post-order DFS (trees can be deep chains).
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        node, done = stack.pop()
        if not ch[node]:
            pos[node] = (slot, -float(depth[node]))
            slot += 1.0
        elif done:
            xs = [pos[c][0] for c in ch[node]]
            pos[node] = ((xs[0] + xs[-1]) / 2.0, -float(depth[node]))
        else:
            stack.append((node, True))
            for c in reversed(ch[node]):
                stack.append((c, False))
    for i in range(n):  # nodes unreachable from the root (malformed input): put them aside
        if i not in pos:
            pos[i] = (slot, -float(depth[i]))
            slot += 1.0
    return pos


def _base_layout(title: str, height: int) -> dict:
    return dict(
        title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)),
        height=height, margin=dict(l=10, r=10, t=44, b=10),
        plot_bgcolor="white", paper_bgcolor="white", font=dict(family=FONT, size=12),
        hoverlabel=dict(font=dict(family=FONT, size=12), align="left"),
    )


# ---- one step's draft tree -----------------------------------------------------------------------

def _scale_color(v: float, scale: str, cmin: float, cmax: float) -> str:
    """Colour of value v on a named plotly scale (NaN -> `NAN_COLOR`)."""
    if not _finite(v):
        return NAN_COLOR
    from plotly.colors import sample_colorscale

    t = min(max((v - cmin) / (cmax - cmin), 0.0), 1.0)
    return sample_colorscale(scale, [t])[0]


def _node_values(step: Step, color_by: str) -> list[float]:
    n = len(step.tokens)
    src = step.draft_probs if color_by == "draft_prob" else step.draft_entropies
    if src is None:
        return [float("nan")] * n
    return [float(v) if _finite(v) else float("nan") for v in src]


def node_hover(step: Step, i: int, accepted: set[int]) -> str:
    """Hover text of node i: token, depth, rank, draft/base probabilities and entropies."""
    def at(seq, k):
        return seq[k] if seq is not None and k < len(seq) else None

    texts = step.token_texts
    tok = display_token(at(texts, i), 40) if texts else str(step.tokens[i])
    depth = at(step.depths, i)
    rank = at(step.ranks, i)
    status = "accepted" if i in accepted else "rejected"
    if i == 0:
        status = "root (base model's token)"
    if step.lookup_nodes and i in step.lookup_nodes:
        status += " · copied from the context (prompt lookup)"
    lines = [
        f"<b>{tok}</b>  <span style='color:#888'>id {step.tokens[i]}</span>",
        f"node {i} · depth {depth if depth is not None else '–'} · rank {rank if rank is not None else '–'} · {status}",
        f"draft p = {_fmt(at(step.draft_probs, i))} · draft H = {_fmt(at(step.draft_entropies, i), '.2f')} nats",
        f"base p = {_fmt(at(step.base_probs, i))} · base H = {_fmt(at(step.base_entropies, i), '.2f')} nats",
    ]
    return "<br>".join(lines)


def step_tree_figure(step: Step, color_by: str = "draft_prob", *, bonus_text: Optional[str] = None,
                     title: Optional[str] = None, height: int = 420) -> go.Figure:
    """The draft tree of one step: labels = token texts, fill = draft probability or entropy,
    the accepted path in `ACCEPT_COLOR`, rejected subtrees dimmed, rich hover per node.

    Trace names (stable, used by tests): "edges", "accepted edges", "rejected", "accepted",
    and "bonus" when the step has a bonus token.
    """
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")
    parents = list(step.parents)
    n = len(parents)
    ranks = step.ranks or [0] * n
    pos = tree_layout(parents, ranks)
    accepted = set(step.accepted)
    lookup = set(step.lookup_nodes or ())  # drawn as triangles: copied from the context, not drafted by a head
    acc_edges = {(step.accepted[k - 1], step.accepted[k]) for k in range(1, len(step.accepted))}
    values = _node_values(step, color_by)
    is_prob = color_by == "draft_prob"
    cmin, cmax = (0.0, 1.0) if is_prob else (0.0, ENTROPY_MAX)
    scale = PROB_SCALE if is_prob else ENTROPY_SCALE
    label = "draft p" if is_prob else "draft H (nats)"

    fig = go.Figure()
    ex, ey, ax_, ay_ = [], [], [], []
    for i, p in enumerate(parents):
        if p < 0:
            continue
        (x0, y0), (x1, y1) = pos[p], pos[i]
        tx, ty = (ax_, ay_) if (p, i) in acc_edges else (ex, ey)
        tx += [x0, x1, None]
        ty += [y0, y1, None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", name="edges", hoverinfo="skip", showlegend=False,
                             line=dict(color=EDGE_COLOR, width=1.2)))
    fig.add_trace(go.Scatter(x=ax_, y=ay_, mode="lines", name="accepted edges", hoverinfo="skip", showlegend=False,
                             line=dict(color=ACCEPT_COLOR, width=4)))

    texts = step.token_texts
    labels = [display_token(texts[i], 9) if texts and i < len(texts) else str(step.tokens[i]) for i in range(n)]
    groups = (("rejected", [i for i in range(n) if i not in accepted]), ("accepted", sorted(accepted)))
    for name, idx in groups:
        is_acc = name == "accepted"
        fig.add_trace(go.Scatter(
            x=[pos[i][0] for i in idx], y=[pos[i][1] for i in idx], mode="markers+text", name=name,
            text=[labels[i] for i in idx], textposition="bottom center",
            textfont=dict(size=11 if is_acc else 10, color="#111827" if is_acc else "rgba(55,65,81,0.55)"),
            hovertext=[node_hover(step, i, accepted) for i in idx], hoverinfo="text",
            marker=dict(
                color=[_scale_color(values[i], scale, cmin, cmax) for i in idx],
                size=[22 if i == 0 else (18 if is_acc else 14) for i in idx],
                line=dict(color=ACCEPT_COLOR if is_acc else "#ffffff", width=3 if is_acc else 1),
                opacity=1.0 if is_acc else DIM_OPACITY,
                symbol=["square" if i == 0 else ("triangle-down" if i in lookup else "circle") for i in idx],
            ),
            showlegend=False, customdata=idx,
        ))
    # Node colours are mapped by hand (NaN -> grey); the colour bar lives on a dummy trace.
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip", name="scale",
                             marker=dict(color=[cmin], colorscale=scale, cmin=cmin, cmax=cmax, showscale=True,
                                         colorbar=dict(title=dict(text=label, side="right"), thickness=12, len=0.8))))
    if step.bonus is not None and step.accepted:
        last = step.accepted[-1]
        x0, y0 = pos[last]
        bx, by = x0 + 0.7, y0 - 0.5  # between the node rows, so it never sits on a drafted node
        btxt = display_token(bonus_text) if bonus_text is not None else f"id {step.bonus}"
        fig.add_trace(go.Scatter(x=[x0, bx], y=[y0, by], mode="lines", name="bonus edge", hoverinfo="skip",
                                 showlegend=False, line=dict(color=BONUS_COLOR, width=2, dash="dot")))
        fig.add_trace(go.Scatter(
            x=[bx], y=[by], mode="markers+text", name="bonus", text=[btxt], textposition="bottom center",
            textfont=dict(size=11, color=BONUS_COLOR), showlegend=False, hoverinfo="text",
            hovertext=[f"<b>{btxt}</b><br>bonus token: the base model's own next token after the accepted path "
                       f"(the next step's root)"],
            marker=dict(size=16, symbol="diamond", color="white", line=dict(color=BONUS_COLOR, width=2))))
    depth = max((-y for _, y in pos.values()), default=0)
    xs = [x for x, _ in pos.values()]
    if title is None:
        title = (f"step {step.index} · tree {html.escape(step.tree_name or '?')} ({step.n_nodes} draft nodes) · "
                 f"accepted {step.accept_length} draft token{'s' if step.accept_length != 1 else ''}")
    fig.update_layout(**_base_layout(title, height))
    fig.update_xaxes(visible=False, range=[min(xs, default=0) - 0.8, max(xs, default=0) + 0.8])
    fig.update_yaxes(visible=False, range=[-depth - 1.6, 0.6])
    return fig


def empty_figure(message: str = "", height: int = 300) -> go.Figure:
    """A blank figure with a centred note (placeholder before the first step)."""
    fig = go.Figure()
    fig.update_layout(**_base_layout("", height))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    if message:
        fig.add_annotation(text=html.escape(message), x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                           font=dict(size=14, color="#6b7280"))
    return fig


# ---- per-token entropies and the token strip ---------------------------------------------------------

def emitted_token_stats(steps: Sequence[Step]) -> list[list[dict]]:
    """For each step, one dict per emitted token: text, node, entropy, base_prob, drafted.

    entropy = entropy (nats) of the base model's distribution that produced the token: at the
    parent node for accepted drafts, at the previous step's last accepted node for the root
    (unknown, NaN, for the very first root unless the scheduler recorded it).
    """
    out: list[list[dict]] = []
    prev: Optional[Step] = None
    for s in steps:
        toks = []
        for k, node in enumerate(s.accepted[: len(s.emitted)]):
            text = s.token_texts[node] if s.token_texts and node < len(s.token_texts) else None
            ent = float("nan")
            if node == 0:
                sig = (s.scheduler or {}).get("signals") or {}
                if _finite(sig.get("root_entropy")):
                    ent = float(sig["root_entropy"])
                elif prev is not None and prev.base_entropies and prev.accepted:
                    ent = prev.base_entropies[prev.accepted[-1]]
            elif s.base_entropies:
                ent = s.base_entropies[s.parents[node]]
            bp = s.base_probs[node] if s.base_probs and node < len(s.base_probs) else float("nan")
            toks.append({"text": text, "node": node, "token": s.emitted[k], "entropy": ent, "base_prob": bp,
                         "drafted": node != 0})
        out.append(toks)
        prev = s
    return out


def entropy_color(h: float, alpha: float = 0.85) -> str:
    """Background colour of a token by entropy: pale green (sure) -> amber -> red (unsure)."""
    if not _finite(h):
        return "rgba(229,231,235,0.9)"
    t = min(max(h / ENTROPY_MAX, 0.0), 1.0)
    stops = [(0.0, (220, 252, 231)), (0.35, (254, 240, 138)), (0.7, (253, 186, 116)), (1.0, (248, 113, 113))]
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            u = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            r, g, b = (round(a + (bb - a) * u) for a, bb in zip(c0, c1))
            return f"rgba({r},{g},{b},{alpha})"
    return f"rgba(248,113,113,{alpha})"


def token_strip_html(steps: Sequence[Step], highlight: Optional[int] = None, max_steps: int = 4000) -> str:
    """The generated text as token chips coloured by entropy, grouped by step.

    Each step is a `<span class="entmtp-step" data-step=k>` holding one `<span class="entmtp-tok">`
    per emitted token; accepted draft tokens are underlined (the root is the base model's own
    token). `highlight` outlines one step (the replayed one). All text is HTML-escaped.
    """
    stats = emitted_token_stats(steps)
    parts = ['<div class="entmtp-strip" style="line-height:2.1;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;'
             'font-size:13px;white-space:normal;word-break:break-word">']
    shown = list(zip(steps, stats))[-max_steps:]
    for s, toks in shown:
        hl = highlight is not None and s.index == highlight
        tree = html.escape(str(s.tree_name or ""), quote=True)
        style = ("display:inline;padding:2px 1px;margin-right:3px;border-bottom:2px solid "
                 + ("#111827" if s.index % 2 else "#9ca3af")
                 + (";outline:2px solid #2563eb;outline-offset:1px;border-radius:3px" if hl else ""))
        parts.append(f'<span class="entmtp-step{" entmtp-hl" if hl else ""}" data-step="{s.index}" '
                     f'title="step {s.index} · {len(toks)} token{"s" if len(toks) != 1 else ""} · '
                     f'{s.accept_length} accepted draft{"s" if s.accept_length != 1 else ""} · tree {tree}" '
                     f'style="{style}">')
        for t in toks:
            raw = t["text"] if t["text"] is not None else f"<{t['token']}>"
            body = html.escape(raw, quote=True).replace("\n", "↵<br>").replace("\t", "⇥")
            if body == "":
                body = "∅"
            deco = "text-decoration:underline;text-decoration-color:#16a34a;text-decoration-thickness:2px;" if t["drafted"] else ""
            tip = (f"H = {_fmt(t['entropy'], '.2f')} nats · base p = {_fmt(t['base_prob'])} · "
                   + ("accepted draft" if t["drafted"] else "base token (root)"))
            parts.append(f'<span class="entmtp-tok" style="background:{entropy_color(t["entropy"])};'
                         f'border-radius:3px;padding:1px 0;white-space:pre-wrap;{deco}" title="{tip}">{body}</span>')
        parts.append("</span>")
    parts.append("</div>")
    legend = ('<div class="entmtp-legend" style="font-size:12px;color:#4b5563;margin-top:6px">'
              'token colour = base entropy: '
              + "".join(f'<span style="background:{entropy_color(h)};padding:0 6px;margin:0 1px;border-radius:2px">{h:g}</span>'
                        for h in (0, 1, 2, 3, 4, 5))
              + ' nats · <span style="text-decoration:underline;text-decoration-color:#16a34a;text-decoration-thickness:2px">'
                'underlined</span> = accepted draft token · steps alternate grey / black underline</div>')
    return "".join(parts) + legend


# ---- per-step chart ----------------------------------------------------------------------------------

def root_entropies(steps: Sequence[Step]) -> list[float]:
    """Base entropy of the distribution that chose each step's root (NaN when unknown)."""
    return [toks[0]["entropy"] if toks else float("nan") for toks in emitted_token_stats(steps)]


def step_chart_figure(steps: Sequence[Step], height: int = 300, highlight: Optional[int] = None) -> go.Figure:
    """Accepted draft length per step (bars, coloured by the tree used), root entropy (line, right axis)."""
    fig = go.Figure()
    by_tree: dict[str, list[Step]] = {}
    for s in steps:
        if s.time_verify > 0:  # steps that only emitted an already decided token have no tree
            by_tree.setdefault(str(s.tree_name or "?"), []).append(s)
    palette = ["#8b5cf6", "#f59e0b", "#3b82f6", "#ec4899", "#14b8a6", "#ef4444", "#84cc16", "#6b7280"]
    for k, (name, ss) in enumerate(by_tree.items()):
        # one bar per step, one step wide (plotly sizes a lone bar of a trace to the whole axis otherwise)
        fig.add_trace(go.Bar(x=[s.index for s in ss], y=[s.accept_length for s in ss], name=html.escape(name),
                             marker=dict(color=palette[k % len(palette)]), width=[0.8] * len(ss),
                             hovertemplate="step %{x}<br>accepted %{y}<br>tree " + html.escape(name) + "<extra></extra>"))
    ents = root_entropies(steps)
    fig.add_trace(go.Scatter(x=[s.index for s in steps], y=[e if _finite(e) else None for e in ents],
                             name="root entropy", yaxis="y2", mode="lines+markers",
                             line=dict(color="#ef4444", width=1.5), marker=dict(size=4),
                             hovertemplate="step %{x}<br>root H %{y:.2f} nats<extra></extra>"))
    fig.update_layout(**_base_layout("accepted draft tokens per step · root entropy", height))
    fig.update_layout(
        barmode="overlay", bargap=0.15,
        # below the plot: above it, several tree names overprinted the title
        legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0.0, font=dict(size=11)),
        xaxis=dict(title="step", gridcolor="#f1f5f9", zeroline=False),
        yaxis=dict(title="accepted", rangemode="tozero", gridcolor="#f1f5f9", dtick=1),
        yaxis2=dict(title="root H (nats)", overlaying="y", side="right", rangemode="tozero", showgrid=False),
        margin=dict(l=50, r=50, t=44, b=100),
    )
    if highlight is not None:
        fig.add_vline(x=highlight, line=dict(color="#2563eb", width=2, dash="dot"))
    return fig


# ---- race and lab -----------------------------------------------------------------------------------

def race_bar_figure(rows: Sequence[dict], height: int = 320) -> go.Figure:
    """Tokens/s per method (bars) annotated with the speedup against HF generate.

    rows: dicts with "method", "tokens_per_s" and optionally "speedup" (None = unavailable) and
    "tokens_per_s_range" ((lowest, highest) of repeated runs: drawn as the bar's spread).
    """
    ok = [r for r in rows if _finite(r.get("tokens_per_s"))]
    if not ok:  # before a race (or when none finished): a note, not empty axes
        return empty_figure("each method's tokens/s appears here after a race", height)
    spread = None
    if any(r.get("tokens_per_s_range") for r in ok):
        lo_hi = [r.get("tokens_per_s_range") or (r["tokens_per_s"], r["tokens_per_s"]) for r in ok]
        spread = dict(type="data", symmetric=False, color="#334155", thickness=1.5, width=6,
                      array=[max(hi - r["tokens_per_s"], 0.0) for r, (_, hi) in zip(ok, lo_hi)],
                      arrayminus=[max(r["tokens_per_s"] - lo, 0.0) for r, (lo, _) in zip(ok, lo_hi)])
    fig = go.Figure(go.Bar(error_y=spread,
        x=[html.escape(str(r["method"])) for r in ok], y=[r["tokens_per_s"] for r in ok],
        marker=dict(color=[METHOD_COLORS.get(str(r["method"]).split(" ")[0], "#64748b") for r in ok]),
        text=[f"×{r['speedup']:.2f}" if _finite(r.get("speedup")) else "" for r in ok], textposition="outside",
        hovertemplate="%{x}<br>%{y:.1f} tokens/s<extra></extra>", name="tokens/s"))
    fig.update_layout(**_base_layout("tokens/s (label: speedup vs HF generate)", height))
    top = max(((r.get("tokens_per_s_range") or (0, r["tokens_per_s"]))[1] for r in ok), default=1.0)
    fig.update_yaxes(title="tokens/s", range=[0, top * 1.2 if top > 0 else 1.0], gridcolor="#f1f5f9")
    fig.update_layout(margin=dict(l=50, r=10, t=44, b=40))
    return fig


def tree_figure(tree: Tree, title: Optional[str] = None, height: int = 380) -> go.Figure:
    """A static drawing of a tree topology: node label = its rank, colour = depth."""
    parents = tree.parent_list
    ranks = [p[-1] if p else 0 for p in tree.node_paths]
    pos = tree_layout(parents, ranks)
    fig = go.Figure()
    ex, ey = [], []
    for i, p in enumerate(parents):
        if p >= 0:
            ex += [pos[p][0], pos[i][0], None]
            ey += [pos[p][1], pos[i][1], None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", hoverinfo="skip", showlegend=False, name="edges",
                             line=dict(color="#94a3b8", width=1.2)))
    depth = [len(p) for p in tree.node_paths]
    fig.add_trace(go.Scatter(
        x=[pos[i][0] for i in range(tree.size)], y=[pos[i][1] for i in range(tree.size)], mode="markers+text",
        text=["root" if i == 0 else str(ranks[i]) for i in range(tree.size)], textposition="middle center",
        # dark labels on the pale shallow levels (the root is the palest), white on the deep ones
        textfont=dict(size=9, color=["#111827" if 2 * depth[i] < max(tree.depth, 1) else "white"
                                     for i in range(tree.size)]), name="nodes", showlegend=False, hoverinfo="text",
        hovertext=[f"node {i}<br>path {list(tree.node_paths[i])}<br>depth {depth[i]}" for i in range(tree.size)],
        marker=dict(size=[26 if i == 0 else 18 for i in range(tree.size)], color=depth, colorscale="Tealgrn",
                    cmin=0, cmax=max(tree.depth, 1), line=dict(color="white", width=1),
                    symbol=["square" if i == 0 else "circle" for i in range(tree.size)])))
    if title is None:
        title = f"{html.escape(tree.name or 'tree')}: {tree.n_nodes} nodes, depth {tree.depth}, per depth {tree.depth_counts}"
    fig.update_layout(**_base_layout(title, height))
    xs = [x for x, _ in pos.values()]
    fig.update_xaxes(visible=False, range=[min(xs) - 0.8, max(xs) + 0.8])
    fig.update_yaxes(visible=False, range=[-tree.depth - 0.6, 0.6])
    return fig


def frontier_figure(points: Iterable[dict], title: str = "expected τ vs tree size", height: int = 360) -> go.Figure:
    """Generic frontier plot: dicts with "n_nodes", "tau" and optionally "series", "name"."""
    fig = go.Figure()
    series: dict[str, list[dict]] = {}
    for p in points:
        series.setdefault(str(p.get("series", "tau")), []).append(p)
    for name, ps in series.items():
        ps = sorted(ps, key=lambda q: q["n_nodes"])
        fig.add_trace(go.Scatter(x=[q["n_nodes"] for q in ps], y=[q["tau"] for q in ps], mode="lines+markers",
                                 name=html.escape(name),
                                 text=[html.escape(str(q.get("name", ""))) for q in ps],
                                 hovertemplate="%{text}<br>%{x} nodes<br>τ %{y:.3f}<extra></extra>"))
    fig.update_layout(**_base_layout(title, height))
    fig.update_xaxes(title="draft nodes", gridcolor="#f1f5f9")
    fig.update_yaxes(title="τ (tokens / forward)", gridcolor="#f1f5f9")
    return fig
