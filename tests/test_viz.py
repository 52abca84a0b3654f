"""Figure and HTML builders of entmtp.viz, on real steps from a tiny engine run."""

from __future__ import annotations

import dataclasses
import math

import plotly.graph_objects as go
import pytest

from conftest import random_heads, tiny_model, tiny_tokenizer
from entmtp import viz
from entmtp.decoding import DecodeConfig, Engine
from entmtp.heads import Draft
from entmtp.trees import Tree, resolve_tree


@pytest.fixture(scope="module")
def traced():
    """Steps of a full-trace Hydra run whose drafts put the true continuation on the top-1
    chain (an oracle), so accepted paths are long and other branches are rejected."""
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=3)
    eng = Engine(model, tok, {"hydra": random_heads(model, "hydra", num_heads=3, seed=1)})
    prompt = tok("hello world, how are you")["input_ids"]
    n = 24
    ref = eng.run(prompt, config=DecodeConfig(max_new_tokens=n, eos_token_ids=())).tokens
    tree = resolve_tree("binary_2x2")
    g = eng.generate(prompt, heads="hydra", tree=tree,
                     config=DecodeConfig(max_new_tokens=n, eos_token_ids=(), trace="full"))
    runner = eng.runners["hydra"]
    real = runner.draft
    chain = [0, 1, 3]  # root, [0], [0, 0] in canonical order

    class Oracle:
        def __getattr__(self, name):
            return getattr(runner, name)

        def draft(self, tr, feature, root, with_stats=False, **kw):
            d = real(tr, feature, root, with_stats)
            toks = d.tokens.clone()
            pos = len(g.tokens)
            for depth, node in enumerate(chain[1:], start=1):
                if pos + depth < len(ref):
                    toks[node] = ref[pos + depth]
            return Draft(toks, d.probs, d.entropies)

    g.runner = Oracle()
    steps = list(g)
    assert g.tokens == ref
    return steps, tree


def _trace(fig: go.Figure, name: str):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, f"no single trace named {name!r}: {[t.name for t in fig.data]}"
    return found[0]


def test_layout_is_layered_and_deterministic():
    tree = resolve_tree("mc_sim_7b_63")
    pos = viz.tree_layout(tree.parent_list, [p[-1] if p else 0 for p in tree.node_paths])
    assert pos == viz.tree_layout(tree.parent_list, [p[-1] if p else 0 for p in tree.node_paths])
    assert len(pos) == tree.size
    for i, p in enumerate(tree.node_paths):
        assert pos[i][1] == -len(p)
    for i, kids in enumerate(tree.children):
        if kids:
            assert pos[i][0] == pytest.approx((pos[kids[0]][0] + pos[kids[-1]][0]) / 2)
            assert [pos[c][0] for c in kids] == sorted(pos[c][0] for c in kids)  # rank order, left to right
    leaf_x = [pos[i][0] for i in tree.leaves]
    assert len(set(leaf_x)) == len(leaf_x)
    # the top-1 chain is the leftmost path
    assert pos[tree.index[(0,)]][0] == min(x for i, (x, y) in pos.items() if y == -1)


def test_step_tree_figure_highlights_the_accepted_path(traced):
    steps, tree = traced
    step = max(steps, key=lambda s: s.accept_length)
    assert step.accept_length >= 2 and len(step.tokens) == tree.size
    fig = viz.step_tree_figure(step, "draft_prob", bonus_text="!")
    acc, rej = _trace(fig, "accepted"), _trace(fig, "rejected")
    assert len(acc.x) + len(rej.x) == tree.size == len(step.tokens)
    assert list(acc.customdata) == sorted(step.accepted)
    assert acc.marker.line.color == viz.ACCEPT_COLOR
    assert rej.marker.line.color != viz.ACCEPT_COLOR
    assert acc.marker.opacity == 1.0 and rej.marker.opacity == viz.DIM_OPACITY
    edges = _trace(fig, "accepted edges")
    assert edges.line.color == viz.ACCEPT_COLOR
    assert list(edges.x).count(None) == step.accept_length  # one segment per accepted draft
    assert _trace(fig, "edges").line.color != viz.ACCEPT_COLOR
    assert list(_trace(fig, "edges").x).count(None) == tree.n_nodes - step.accept_length
    assert "step" in fig.layout.title.text and f"accepted {step.accept_length}" in fig.layout.title.text
    # the bonus token hangs off the last accepted node
    bonus = _trace(fig, "bonus")
    assert bonus.text[0] == "!"


def test_hover_text_has_rank_probabilities_and_entropies(traced):
    steps, _ = traced
    step = max(steps, key=lambda s: s.accept_length)
    fig = viz.step_tree_figure(step)
    hover = {i: h for t in (_trace(fig, "accepted"), _trace(fig, "rejected")) for i, h in zip(t.customdata, t.hovertext)}
    assert set(hover) == set(range(len(step.tokens)))
    for i, h in hover.items():
        assert f"rank {step.ranks[i]}" in h and f"depth {step.depths[i]}" in h
        assert f"base p = {step.base_probs[i]:.3f}" in h
        assert f"base H = {step.base_entropies[i]:.2f} nats" in h
        if i > 0:
            assert f"draft p = {step.draft_probs[i]:.3f}" in h
            assert f"draft H = {step.draft_entropies[i]:.2f} nats" in h
        assert ("accepted" in h) == (i in step.accepted and i != 0) or i == 0
    assert "root" in hover[0] and "draft p = –" in hover[0]  # the root has no draft probability


def test_colour_by_entropy_and_bad_option(traced):
    steps, _ = traced
    step = steps[1]
    by_p = _trace(viz.step_tree_figure(step, "draft_prob"), "rejected").marker.color
    by_h = _trace(viz.step_tree_figure(step, "draft_entropy"), "rejected").marker.color
    assert list(by_p) != list(by_h)
    scale = _trace(viz.step_tree_figure(step, "draft_entropy"), "scale")
    assert scale.marker.cmax == viz.ENTROPY_MAX and "H" in scale.marker.colorbar.title.text
    # the root (no draft probability) is grey
    acc = _trace(viz.step_tree_figure(step, "draft_prob"), "accepted")
    assert acc.marker.color[list(acc.customdata).index(0)] == viz.NAN_COLOR
    with pytest.raises(ValueError):
        viz.step_tree_figure(step, "nope")


def test_summary_trace_steps_still_draw():
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=3)
    eng = Engine(model, tok, {"hydra": random_heads(model, "hydra", num_heads=2, seed=1)})
    r = eng.run(tok("the cat")["input_ids"], heads="hydra", tree=resolve_tree("binary_2x2"),
                config=DecodeConfig(max_new_tokens=6, eos_token_ids=()))
    fig = viz.step_tree_figure(r.steps[0])
    assert len(_trace(fig, "accepted").x) + len(_trace(fig, "rejected").x) == 7
    assert "rank –" in _trace(fig, "rejected").hovertext[0]


def test_token_strip_groups_by_step_and_colours_by_entropy(traced):
    steps, _ = traced
    out = viz.token_strip_html(steps)
    assert out.count('class="entmtp-step') == len(steps)
    assert out.count('class="entmtp-tok"') == sum(len(s.emitted) for s in steps)
    for s in steps:
        assert f'data-step="{s.index}"' in out
    stats = viz.emitted_token_stats(steps)
    assert [len(t) for t in stats] == [len(s.emitted) for s in steps]
    assert [[t["token"] for t in ts] for ts in stats] == [s.emitted for s in steps]
    # entropy of a token = the base entropy where it was chosen (previous step's last node for a root)
    for k in range(1, len(steps)):
        prev = steps[k - 1]
        assert stats[k][0]["entropy"] == pytest.approx(prev.base_entropies[prev.accepted[-1]])
        for t in stats[k][1:]:
            assert t["drafted"] and t["entropy"] == pytest.approx(steps[k].base_entropies[steps[k].parents[t["node"]]])
    assert math.isnan(stats[0][0]["entropy"])
    # accepted drafts are underlined, roots are not
    assert out.count("text-decoration:underline") == sum(s.accept_length for s in steps) + 1  # + the legend
    hl = viz.token_strip_html(steps, highlight=2)
    assert hl.count("entmtp-hl") == 1 and 'entmtp-step entmtp-hl" data-step="2"' in hl
    assert viz.entropy_color(0.0) != viz.entropy_color(4.0)


def test_token_strip_escapes_html(traced):
    steps, _ = traced
    evil = dataclasses.replace(steps[0], token_texts=['<script>alert("x")</script>'] + list(steps[0].token_texts[1:]),
                               tree_name='<img src=x onerror=alert(1)>')
    out = viz.token_strip_html([evil])
    assert "<script>" not in out and "<img" not in out
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in out
    newline = dataclasses.replace(steps[0], token_texts=["a\nb"] + list(steps[0].token_texts[1:]))
    assert "a↵<br>b" in viz.token_strip_html([newline])
    fig = viz.step_tree_figure(evil)
    labels = list(_trace(fig, "accepted").text) + list(_trace(fig, "rejected").text)
    assert all("<" not in t for t in labels)
    assert "<img" not in fig.layout.title.text


def test_display_token():
    assert viz.display_token(" the") == "␣the"
    assert viz.display_token("\n") == "↵"
    assert viz.display_token("a<b>&") == "a&lt;b&gt;&amp;"
    assert viz.display_token("\x01") == "\\x01"
    assert viz.display_token("") == "∅" and viz.display_token(None) == "?"
    assert viz.display_token("x" * 40).endswith("…") and len(viz.display_token("x" * 40)) == 14


def test_step_chart_race_and_tree_figures(traced):
    steps, tree = traced
    fig = viz.step_chart_figure(steps, highlight=1)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["binary_2x2"]
    verified = [s for s in steps if s.time_verify > 0]  # a final emit-only step has no tree
    assert list(bars[0].y) == [s.accept_length for s in verified] and len(verified) >= len(steps) - 1
    line = _trace(fig, "root entropy")
    assert line.yaxis == "y2" and len(line.y) == len(steps)
    assert viz.step_chart_figure([]).data  # empty trace list still draws

    rows = [{"method": "hf generate", "tokens_per_s": 10.0, "speedup": 1.0},
            {"method": "hydra · x", "tokens_per_s": 25.0, "speedup": 2.5},
            {"method": "medusa", "tokens_per_s": None}]
    race = viz.race_bar_figure(rows)
    assert list(race.data[0].y) == [10.0, 25.0] and list(race.data[0].text) == ["×1.00", "×2.50"]
    blank = viz.race_bar_figure([{"method": "medusa", "tokens_per_s": None}])  # nothing timed: a note, no axes
    assert not blank.data and "after a race" in blank.layout.annotations[0].text

    tf = viz.tree_figure(tree)
    assert len(_trace(tf, "nodes").x) == tree.size
    assert "binary_2x2" in tf.layout.title.text
    assert viz.empty_figure("<b>hi</b>").layout.annotations[0].text == "&lt;b&gt;hi&lt;/b&gt;"
    fr = viz.frontier_figure([{"n_nodes": 4, "tau": 1.5, "series": "pred"}, {"n_nodes": 8, "tau": 1.7, "series": "pred"}])
    assert list(fr.data[0].x) == [4, 8]


def test_figures_serialise(traced):
    steps, tree = traced
    for fig in (viz.step_tree_figure(steps[0]), viz.step_chart_figure(steps), viz.tree_figure(Tree.chain(3))):
        assert fig.to_json()


def test_lookup_nodes_are_drawn_as_triangles_and_explained():
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=3)
    eng = Engine(model, tok, {"hydra": random_heads(model, "hydra", num_heads=3, seed=1)})
    prompt = tok("hello world hello world hello world")["input_ids"]
    g = eng.generate(prompt, heads="hydra", tree=resolve_tree("binary_2x2"),
                     config=DecodeConfig(max_new_tokens=40, eos_token_ids=(), trace="full", lookup=5))
    step = next(s for s in g if s.lookup_nodes)
    fig = viz.step_tree_figure(step)
    for name in ("accepted", "rejected"):
        t = _trace(fig, name)
        for node, symbol, hover in zip(t.customdata, t.marker.symbol, t.hovertext):
            is_lookup = node in step.lookup_nodes
            assert (symbol == "triangle-down") == is_lookup
            assert ("prompt lookup" in hover) == is_lookup
