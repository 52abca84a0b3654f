"""The Topology lab view: search, score and download draft trees for your prompts.

The search reuses this machine's step-latency profile: the one the self-tuning measured at load
(`autotune.tuned_trees`), else the latency model cached by an earlier search; only when neither
exists is it measured, once, and the status says so.
"""

from __future__ import annotations

import html
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import gradio as gr

from . import viz
from .ui_common import (CACHE, HEAD_METHODS, LAB_BUDGETS, LAB_MAX_NEW_TOKENS, LAB_MAX_PROMPTS, LAB_RACE_MAX_DEPTH,
                        LAB_RACE_MAX_NODES, UPLOAD_MAX_BYTES, UPLOAD_TYPES, AppError, LoadedModel,
                        _error_md, _notice_md, check_model_key, error_message, session_state, tree_choices)


# ---- topology lab -----------------------------------------------------------------------------------

def _search_module():
    try:
        from . import search
    except ImportError as exc:
        return None, f"the topology lab is not available in this version (entmtp.search: {exc})"
    if not callable(getattr(search, "run_search", None)):
        return None, "the topology lab is not available in this version (entmtp.search has no run_search)"
    return search, None


def lab_heads_choices(entry: Optional[LoadedModel]) -> list[str]:
    if entry is None:
        return list(HEAD_METHODS)
    return [m for m in HEAD_METHODS if m in entry.engine.runners] or ["(no heads loaded)"]


def _first_heads(entry: Optional[LoadedModel]) -> Optional[str]:
    ch = lab_heads_choices(entry)
    return "hydra" if "hydra" in ch else ch[0]


def _upload_path(upload: Any, what: str, types: tuple[str, ...] = UPLOAD_TYPES) -> Path:
    """The temp path of an uploaded file, checked for type and size (5 MB)."""
    if upload is None:
        raise AppError(f"upload a {what} first")
    path = upload if isinstance(upload, (str, os.PathLike)) else (
        upload.get("path") if isinstance(upload, dict) else getattr(upload, "name", None))
    if not path:
        raise AppError(f"the {what} upload did not arrive; try again")
    p = Path(path)
    if p.suffix.lower() not in types:
        raise AppError(f"{p.name[:80]}: a {what} must be a {' / '.join(types)} file")
    if not p.is_file():
        raise AppError(f"the {what} upload did not arrive; try again")
    size = p.stat().st_size
    if size > UPLOAD_MAX_BYTES:
        raise AppError(f"{p.name[:80]} is {size / 1e6:.1f} MB; uploads are limited to {UPLOAD_MAX_BYTES // (1024 * 1024)} MB")
    return p


def _lab_prompts(upload, use_example: bool, limit: int, notes: list[str]):
    from .data import bundled_prompts, load_prompts

    if upload is not None:
        p = _upload_path(upload, "calibration file")
        ps = load_prompts(p, max_bytes=UPLOAD_MAX_BYTES, name=p.name)
    elif use_example:
        ps = load_prompts(bundled_prompts("calib_example"), name="calib_example.jsonl (bundled)")
    else:
        raise AppError("upload a calibration file or tick 'use the bundled example'")
    prompts = list(ps.prompts)
    if ps.skipped:
        notes.append(_skipped_line(ps))
    if len(prompts) > limit:
        notes.append(f"using the first {limit} of {len(prompts)} prompts (the lab's limit)")
        prompts = prompts[:limit]
    return prompts, ps


def _skipped_line(ps) -> str:
    """'<file>: skipped N of M rows: ...' (the loader's own line)."""
    return f"{ps.source}: {ps.skipped_note()}"


def lab_latency(entry: LoadedModel, heads: str, budgets: list[int], progress) -> tuple[Any, str]:
    """(latency model, where it came from) for a search: this machine's tuned profile, else the
    cached latency model, else measured now (once: later searches read the cache)."""
    from .autotune import tuned_trees
    from .calibrate import latency_cache_path, load_or_measure_latency

    tuned = tuned_trees(entry.engine, heads)
    if tuned is not None:
        return tuned.latency, "this machine's tuned latency profile (measured at load, cached)"
    cached = latency_cache_path(entry.engine, heads).is_file()
    if not cached:
        progress(0.0, desc="measuring this machine's step latency once (later searches reuse it)")
    t0 = time.perf_counter()
    lm = load_or_measure_latency(entry.engine, heads, max_nodes=max(budgets), repeats=2,
                                 progress=_progress_adapter(progress))
    if lm.meta.get("cached"):
        return lm, "the latency model cached by an earlier search"
    return lm, f"measured now in {time.perf_counter() - t0:.0f} s, once: later searches reuse it"


def _progress_adapter(progress) -> Callable[..., None]:
    """A callback that accepts (fraction), (done, total), (message) or mixes of them."""
    def cb(*args, **kw):
        nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        texts = [str(a) for a in args if isinstance(a, str)] + [str(v) for v in kw.values() if isinstance(v, str)]
        frac = None
        if len(nums) >= 2 and nums[1]:
            frac = nums[0] / nums[1]
        elif len(nums) == 1:
            frac = nums[0]
        try:
            if frac is not None and math.isfinite(frac):
                progress(min(max(float(frac), 0.0), 1.0), desc=texts[0] if texts else None)
            elif texts:
                progress(None, desc=texts[0])
        except Exception:  # noqa: BLE001 - progress must never break the search
            pass
    return cb


def _num(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else "–"


def _short(text: str, limit: int = 90) -> str:
    """The first clause of an explanation, for a table cell (the whole text is shown below the table)."""
    first = re.split(r"(?<=[.;|])\s", text.strip(), maxsplit=1)[0].rstrip(" |")
    return first if len(first) <= limit else first[: limit - 1] + "…"


def lab_rows(report: Any) -> list[dict]:
    """One row per chosen tree (per budget: best by tokens/s, and by τ where different) plus
    the reference tree: predicted and held-out numbers side by side. The held-out τ is the one
    the explanation quotes: decoded on-policy where the tree was run, else replayed on the
    held-out statistics (marked "replay")."""
    held = {r["id"]: r for r in ((report.evaluation or {}).get("comparisons") or [])}
    rows: list[dict] = []
    seen: set[str] = set()
    race = getattr(report, "race", None)
    if race and race.get("results"):
        from .trees import Tree

        w = race["results"][0]
        tree = Tree.from_paths(w["paths"], "lab-race")
        why = (f"fastest of {len(race['results'])} small trees ({w['name']}), each decoding {race['n_prompts']} "
               "further held-out prompts; τ held-out is its on-policy τ there")
        rows.append({"key": "lab-race", "tree": tree, "candidate": None, "race": w, "why": why,
                     "cells": ["lab-race", "–", "on-policy race", w["n_nodes"], w["depth"], _num(w.get("predicted_tau")),
                               _num(w["tau"]), "–", _num(w["tokens_per_s"], ".1f"), _num(w["speedup"], ".2f"),
                               _short(why)]})
        seen.add("lab-race")
    chosen = [(f"b{r['budget']}" + ("" if r["role"] == "tokens_per_s" else "-tau"), r["budget"], r["role"], r["candidate"])
              for r in report.chosen()]
    ref = report.reference()
    if ref is not None:
        chosen.append((ref.tree.name or "reference", None, "reference", ref))
    for name, budget, role, c in chosen:
        key = f"lab-{_safe_name(name)}"
        if key in seen:
            continue
        seen.add(key)
        h = held.get(c.id, {})
        tau_held = _num(h.get("held_out_tau"))
        if tau_held == "–" and h.get("held_out_replay_tau") is not None:
            tau_held = _num(h.get("held_out_replay_tau")) + " (replay)"
        why = h.get("explanation") or ""
        rows.append({"key": key, "tree": c.tree, "candidate": c, "why": why,
                     "cells": [key, budget if budget is not None else "–",
                               {"tokens_per_s": "tokens/s", "tau": "τ"}.get(role, role), c.n_nodes, c.depth,
                               _num(c.predicted_tau), tau_held,
                               _num(c.predicted_tokens_per_s, ".1f"), _num(h.get("held_out_tokens_per_s"), ".1f"),
                               _num(h.get("held_out_speedup"), ".2f"), _short(why) if why else "–"]})
    return rows


def why_html(rows: list[dict]) -> str:
    """The full "why they differ" of each tree, one foldable paragraph per tree."""
    parts = [f"<details><summary><b>{html.escape(r['key'])}</b>: {html.escape(_short(r['why']))}</summary>"
             f"<div class='entmtp-muted'>{html.escape(r['why']).replace(' | ', '<br>')}</div></details>"
             for r in rows if r.get("why")]
    return '<div class="entmtp-why">' + "".join(parts) + "</div>" if parts else ""


LAB_HEADERS = ["tree", "budget", "best by", "nodes", "depth", "τ pred.", "τ held-out", "tok/s pred.",
               "tok/s held-out", "speedup", "why they differ (in full below)"]


def _safe_name(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("._") or "tree"
    return s[:60]


def _tree_download(tree, filename: str, extra: Optional[dict] = None) -> str:
    """Write a tree JSON into a fresh temp dir (gradio serves it); returns the path."""
    d = Path(tempfile.mkdtemp(prefix="entmtp-tree-"))
    p = d / f"{_safe_name(filename)}.json"
    tree.save(p, extra=extra)
    return str(p)


def _download_for(key: str, info: dict) -> str:
    from .trees import Tree

    tree = Tree.from_paths(info["paths"], info.get("file") or key)
    return _tree_download(tree, info.get("file") or key, info.get("extra"))


def lab_search(calib_file, use_example, model_key, heads_name, budgets, max_prompts, max_new_tokens, race,
               request: gr.Request = None,
               progress=gr.Progress()):
    """Run the tree search. Outputs: status, τ frontier, tokens/s frontier, table of chosen
    trees, tree picker, tree drawing, tree download, chat tree picker (the trees join the session's state).

    race: also race small trees on-policy (`run_search`'s step 6): half the prompts are held
    out, one checks the predictions, the others race; the winner heads the table."""
    from .trees import Tree

    state = session_state(request)
    skip = gr.skip()
    notes: list[str] = []
    try:
        search, why = _search_module()
        if search is None:
            raise AppError(why)
        entry = CACHE.get(check_model_key(model_key))
        if heads_name not in entry.engine.runners:
            raise AppError(f"no {str(heads_name)[:20]} heads loaded for this model; pick loaded heads")
        picked = sorted({int(b) for b in (budgets or []) if str(b).isdigit() and int(b) in LAB_BUDGETS})
        if not picked:
            raise AppError(f"pick at least one node budget from {list(LAB_BUDGETS)}")
        n_prompts = int(min(max(int(max_prompts or 2), 2), LAB_MAX_PROMPTS))
        n_new = int(min(max(int(max_new_tokens or 1), 1), LAB_MAX_NEW_TOKENS))
        prompts, ps = _lab_prompts(calib_file, bool(use_example), n_prompts, notes)
        kw = dict(held_out=0.25)
        if race:
            from .data import split_prompts

            n_held = len(split_prompts(prompts, 0.5, 0)[1])
            if n_held < 2:
                raise AppError("racing needs at least 4 distinct prompts (half are held out, one checks, the rest race)")
            kw = dict(held_out=0.5, max_eval=1, race_prompts=n_held - 1, race_max_nodes=LAB_RACE_MAX_NODES,
                      race_max_depth=LAB_RACE_MAX_DEPTH)
        latency, latency_from = lab_latency(entry, heads_name, picked, progress)
        progress(0.0, desc="statistics pass")
        report = search.run_search(entry.engine, heads_name, prompts, picked, max_new_tokens=n_new, seed=0,
                                   progress=_progress_adapter(progress), latency=latency, **kw)
        rows = lab_rows(report)
        if not rows:
            raise AppError("the search returned no trees")
        figs = report.figures() or {}
        # unique download names: never a shipped tree's name, never an earlier search's
        prefix = f"{report.tree_prefix()}-lab-{time.strftime('%Y%m%d-%H%M%S')}"
        trees = dict(state["trees"])
        lab = {}
        for r in rows:
            c = r["candidate"]
            trees[r["key"]] = [list(p) for p in r["tree"].paths]
            extra = {"source": "entmtp topology lab (app)",
                     "data_sha256": (report.provenance.get("data") or {}).get("sha256")}
            if c is not None:
                extra.update(predicted_tau=c.predicted_tau, predicted_tokens_per_s=c.predicted_tokens_per_s)
            else:  # the race winner
                w = r["race"]
                extra.update(chosen_by="on-policy race", predicted_tau=w.get("predicted_tau"), held_out_tau=w["tau"],
                             held_out_tokens_per_s=w["tokens_per_s"], held_out_speedup=w["speedup"])
            lab[r["key"]] = {"paths": trees[r["key"]], "file": f"{prefix}-{r['key'].removeprefix('lab-')}", "extra": extra}
        state["lab_prefix"] = prefix
        state["trees"], state["lab"] = trees, lab
        first = rows[0]["key"]
        ev = report.evaluation or {}
        status = (f'<div class="entmtp-stats">{len(prompts)} prompts from {html.escape(ps.source)}: '
                  f"{(report.provenance.get('data') or {}).get('n_calibration')} for the statistics, "
                  f"{ev.get('n_prompts', 0) + (report.race or {}).get('n_prompts', 0)} held out · budgets {picked} · {n_new} new tokens per prompt · "
                  f"{html.escape(str(heads_name))} heads · {len(report.candidates)} candidates searched in "
                  f"{report.timings.get('total_s', 0.0):.1f} s · step latency: {html.escape(latency_from)}</div>")
        status += _notice_md(notes + list(report.warnings)) + why_html(rows)
        tree0 = Tree.from_paths(lab[first]["paths"], first)
        return (status, figs.get("tau") or viz.empty_figure("no τ frontier"),
                figs.get("tokens_per_s") or viz.empty_figure("no latency model: no tokens/s frontier"),
                {"headers": LAB_HEADERS, "data": [r["cells"] for r in rows]},
                gr.Dropdown(choices=[r["key"] for r in rows], value=first), viz.tree_figure(tree0),
                _download_for(first, lab[first]), gr.Dropdown(choices=tree_choices(trees, entry)))
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return (_error_md(msg) + _notice_md(notes), skip, skip, skip, skip, skip, skip, skip)


def lab_select(name, request: gr.Request = None):
    """Draw a tree of this session's search and offer its JSON. Outputs: tree drawing, download."""
    from .trees import Tree

    state = session_state(request)
    try:
        info = (state.get("lab") or {}).get(name or "")
        if info is None:
            raise AppError("pick a tree from this session's search results")
        return viz.tree_figure(Tree.from_paths(info["paths"], name)), _download_for(name, info)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return viz.empty_figure(msg), None


def lab_score(tree_file, calib_file, use_example, model_key, heads_name, max_prompts, max_new_tokens,
              request: gr.Request = None,
              progress=gr.Progress()):
    """Score an uploaded tree JSON on the calibration prompts: predicted (statistics pass) and
    measured τ and tokens/s, and plain decoding. Outputs: result, tree drawing, chat tree
    picker (the tree joins the session's state)."""
    from .trees import Tree, load_tree

    state = session_state(request)
    skip = gr.skip()
    notes: list[str] = []
    try:
        p = _upload_path(tree_file, "tree file", (".json",))
        tree = load_tree(p)
        search, why = _search_module()
        if search is None or not callable(getattr(search, "score", None)):
            raise AppError(why or "tree scoring is not available in this version")
        entry = CACHE.get(check_model_key(model_key))
        if heads_name not in entry.engine.runners:
            raise AppError(f"no {str(heads_name)[:20]} heads loaded for this model; pick loaded heads")
        name = f"upload-{_safe_name(tree.name or p.stem)}"
        depth = entry.engine.runners[heads_name].config.num_heads
        if tree.depth > depth:
            notes.append(f"the tree has depth {tree.depth}; cut to the {depth} levels the heads draft")
            tree = tree.truncated(depth)
        tree = Tree.from_paths(tree.paths, name)
        n_prompts = int(min(max(int(max_prompts or 2), 1), LAB_MAX_PROMPTS))  # the search's own limit
        prompts, ps = _lab_prompts(calib_file, bool(use_example), n_prompts, notes)
        n_new = int(min(max(int(max_new_tokens or 1), 1), LAB_MAX_NEW_TOKENS))
        progress(0.0, desc="statistics pass")
        res = search.score(entry.engine, heads_name, tree, prompts, max_new_tokens=n_new,
                           progress=_progress_adapter(progress),
                           latency=lab_latency(entry, heads_name, [max(tree.n_nodes, 1)], progress)[0])
        trees = dict(state["trees"])
        trees[name] = [list(q) for q in tree.paths]
        state["trees"] = trees
        pr, me, ba = res.get("predicted") or {}, res.get("measured") or {}, res.get("baseline") or {}
        table = (f"<tr><td>predicted ({html.escape(str(res.get('statistics', '')))})</td><td>{_num(pr.get('tau'))}</td>"
                 f"<td>{_num(pr.get('tokens_per_s'), '.1f')}</td><td>{_num(pr.get('speedup'), '.2f')}</td></tr>"
                 f"<tr><td>measured</td><td>{_num(me.get('tau'))}</td><td>{_num(me.get('tokens_per_s'), '.1f')}</td>"
                 f"<td>{_num(res.get('measured_speedup'), '.2f')}</td></tr>"
                 f"<tr><td>plain decoding</td><td>{_num(ba.get('tau'))}</td><td>{_num(ba.get('tokens_per_s'), '.1f')}</td>"
                 "<td>1.00</td></tr>")
        expl = res.get("explanation") or ""
        out = (f'<div class="entmtp-stats"><b>{html.escape(name)}</b>: {tree.n_nodes} nodes, depth {tree.depth} · '
               f"{len(prompts)} prompts from {html.escape(ps.source)}, {n_new} new tokens each · "
               f"heads {html.escape(str(heads_name))}</div>"
               '<table class="entmtp-score"><tr><th></th><th>τ</th><th>tokens/s</th><th>speedup</th></tr>'
               f"{table}</table>" + (f"<div class='entmtp-muted'>{html.escape(expl)}</div>" if expl else "")
               + f"<div>the tree is now in the chat tab's tree list as <b>{html.escape(name)}</b></div>"
               + _notice_md(notes))
        return out, viz.tree_figure(tree), gr.Dropdown(choices=tree_choices(trees, entry))
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return _error_md(msg) + _notice_md(notes), skip, skip


def lab_check_upload(calib_file):
    """Check a calibration upload at once. A refused file stays in place and the search refuses
    it too (it never falls back to the bundled example behind the user's back)."""
    if calib_file is None:
        return ""
    notes: list[str] = []
    try:
        prompts, ps = _lab_prompts(calib_file, False, LAB_MAX_PROMPTS, notes)
    except Exception as exc:  # noqa: BLE001
        return _error_md(f"{error_message(exc)} (the search refuses this file: remove it or upload another)")
    return (f'<div class="entmtp-stats">{html.escape(ps.source)}: {len(ps.prompts)} prompts ready</div>'
            + _notice_md(notes))
