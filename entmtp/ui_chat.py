"""The Chat view: a streamed reply with each step's draft tree, token strip and step chart; replay.

Stop and Clear reach the running reply through `RUNS` (one entry per browser session): the reply
ends at its next step, Stop with a final update (stats, replay of the partial reply), Clear with
an empty one. The browser draws each event's updates in order but two events' updates in any
order, so a streamed update still being drawn could land after Clear's own output; the reply's
own empty last update cannot be overtaken by its earlier ones.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import gradio as gr

from . import viz
from .ui_common import (CACHE, CHAT_MAX_NEW_TOKENS, MAX_MESSAGE_CHARS, STREAM_EVERY_S, AppError, _error_md,
                        _notice_md, build_decoding, check_model_key, error_message, registry, session_state, waiting_note)

EMPTY_TREE = "the draft tree of each step appears here"
STOP_WAIT_S = 10.0  # how long Stop / Clear wait for the reply to reach its next step


@dataclass
class ChatRun:
    """One streaming reply: Stop / Clear set `why` and `stop`; the reply sets `done` when it ends."""

    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    why: str = ""


class ChatRuns:
    """The running reply of each browser session (by gradio's session hash)."""

    def __init__(self):
        self._runs: dict[str, ChatRun] = {}
        self._lock = threading.Lock()

    def start(self, session: Optional[str]) -> ChatRun:
        run = ChatRun()
        if session:
            with self._lock:
                self._runs[session] = run
        return run

    def end(self, session: Optional[str], run: ChatRun) -> None:
        run.done.set()
        if session:
            with self._lock:
                if self._runs.get(session) is run:
                    del self._runs[session]

    def signal(self, session: Optional[str], why: str, wait_s: float = STOP_WAIT_S) -> bool:
        """Ask the session's running reply to end (`why`: "stopped" or "cleared") and wait until
        it has. False when none was running."""
        with self._lock:
            run = self._runs.get(session) if session else None
        if run is None:
            return False
        run.why = why
        run.stop.set()
        run.done.wait(wait_s)
        return True


RUNS = ChatRuns()


def _session(request: Optional[gr.Request]) -> Optional[str]:
    return getattr(request, "session_hash", None) if request is not None else None


def _tree_now(step) -> str:
    """A step's tree: its name, head-drafted nodes and prompt-lookup nodes apart."""
    n_look = len(step.lookup_nodes or ())
    look = f" + {n_look} lookup" if n_look else ""
    return f"{step.tree_name} ({step.n_nodes - n_look} nodes{look})"


def _stats_md(res, wall: float, label: str, running: bool, stopped: str = "") -> str:
    n = len(res.tokens)
    tps = n / wall if wall > 0 else 0.0
    last = next((s for s in reversed(res.steps) if s.n_nodes > 0), None)
    parts = [f"<b>τ {res.tau:.2f}</b>", f"{tps:.1f} tokens/s", f"{n} tokens", f"{len(res.steps)} steps",
             html.escape(label)]
    if last is not None and last.tree_name and last.tree_name != "emit_only":
        parts.append(f"tree now: {html.escape(_tree_now(last))}")
    copied = sum(s.lookup_accepted for s in res.steps)
    if any(s.lookup_nodes for s in res.steps):
        parts.append(f"{copied} tokens accepted from prompt lookup (▼)")
    if running:
        parts.append("generating…")
    else:
        parts.append(f"stop: {html.escape(stopped or res.stop_reason or '–')}")
    return '<div class="entmtp-stats">' + " · ".join(parts) + "</div>"


def _flatten_content(content: Any) -> str:
    """Gradio 6 history content: a string, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(_flatten_content(c) for c in content)
    return ""


def history_messages(history: Optional[list]) -> list[dict]:
    out = []
    for m in history or []:
        if isinstance(m, dict) and m.get("role") in ("user", "assistant", "system"):
            text = _flatten_content(m.get("content"))
            if text.strip():
                out.append({"role": m["role"], "content": text})
    return out


def _bonus_text(steps: list, k: int, tokenizer=None) -> Optional[str]:
    if k + 1 < len(steps) and steps[k + 1].token_texts:
        return steps[k + 1].token_texts[0]
    s = steps[k]
    if s.bonus is not None and tokenizer is not None:
        return tokenizer.decode([s.bonus])
    return None


def display_index(steps: list) -> int:
    """The step to draw after generation: the last one that verified a tree (the final step
    often only emits an already decided token)."""
    for k in range(len(steps) - 1, -1, -1):
        if steps[k].n_nodes > 0:
            return k
    return max(len(steps) - 1, 0)


def _slider(n_steps: int, value: Optional[int] = None):
    top = max(n_steps - 1, 0)
    return gr.Slider(minimum=0, maximum=max(top, 1), value=top if value is None else value, step=1,
                     interactive=n_steps > 1, label=f"replay step (0–{top}): drag, or type a number")


def _tree_fig(steps: list, k: int, color_by: str, tokenizer=None):
    if not steps:
        return viz.empty_figure(EMPTY_TREE)
    k = min(max(int(k), 0), len(steps) - 1)
    s = steps[k]
    title = (f"step {s.index} · tree {html.escape(_tree_now(s))} · accepted {s.accept_length} draft "
             f"token{'s' if s.accept_length != 1 else ''}")
    return viz.step_tree_figure(s, color_by if color_by in viz.COLOR_BY else "draft_prob",
                                bonus_text=_bonus_text(steps, k, tokenizer), title=title)


def chat_waiting(what: str) -> tuple:
    """The chat's outputs while it waits for another handler on the model thread: a notice only."""
    skip = gr.skip()
    return (skip, skip, skip, skip, skip, skip, _notice_md([waiting_note(what)]), skip)


def chat(message, history, model_key, method, tree_name, sched_name, temperature, top_p, max_new_tokens,
         color_by, request: gr.Request = None):
    """Stream one reply. Outputs: chatbot, textbox, tree plot, token strip, step chart, stats,
    notices, replay slider (the session's state keeps the steps for replay)."""
    from .acceptance import Sampling
    from .data import Prompt, render_prompt
    from .decoding import DecodeConfig

    state = session_state(request)
    history = list(history or [])
    skip = gr.skip()
    notes: list[str] = []
    try:
        text = message if isinstance(message, str) else _flatten_content(message)
        if not text or not text.strip():
            raise AppError("type a message first")
        if len(text) > MAX_MESSAGE_CHARS:
            notes.append(f"message cut to its first {MAX_MESSAGE_CHARS:,} characters (it had {len(text):,})")
            text = text[:MAX_MESSAGE_CHARS]
        entry = CACHE.get(check_model_key(model_key))
        engine = entry.engine
        heads, sched, label = build_decoding(entry, method, tree_name, sched_name, state["trees"], notes)
        n_new = int(min(max(int(max_new_tokens or 1), 1), CHAT_MAX_NEW_TOKENS))
        temp = float(temperature or 0.0)
        cfg = DecodeConfig(max_new_tokens=n_new, sampling=Sampling(max(temp, 0.0), float(top_p or 1.0)),
                           trace="full", **registry.method_lookup(method, engine, heads))
        if cfg.lookup:
            label += f" + prompt lookup (up to {cfg.lookup})"
        msgs = history_messages(history) + [{"role": "user", "content": text}]
        ids = render_prompt(Prompt(id="chat", messages=msgs), engine.tokenizer)
        gen = engine.generate(ids, heads=heads, scheduler=sched, config=cfg)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        yield (skip, skip, skip, skip, skip, skip, _error_md(msg) + _notice_md(notes), skip)
        return

    session = _session(request)
    run = RUNS.start(session)
    history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    state["steps"] = []
    state["label"] = label
    t0 = time.perf_counter()
    last_yield = 0.0
    steps: list = []
    tok = engine.tokenizer
    try:
        yield (history, "", skip, skip, skip, _stats_md(gen.result, 0.0, label, True), _notice_md(notes), skip)
        for step in gen:
            if step.token_texts is None and tok is not None:  # emit-only steps carry no full trace
                step.token_texts = tok.batch_decode([[t] for t in step.tokens])
            steps.append(step)
            if run.stop.is_set():
                break
            now = time.perf_counter()
            if now - last_yield < STREAM_EVERY_S and not gen.done:
                continue
            last_yield = now
            reply = gen.text.rstrip("\ufffd")
            history[-1] = {"role": "assistant", "content": reply}
            state["steps"] = steps
            yield (history, skip, _tree_fig(steps, display_index(steps), color_by, tok), viz.token_strip_html(steps),
                   viz.step_chart_figure(steps), _stats_md(gen.result, now - t0, label, True),
                   _notice_md(notes + gen.notices), skip)
        if run.why == "cleared":
            chat_box, *rest = _empty_chat()
            yield (chat_box, skip, *rest)  # (skip the message box: it may hold the next message already)
            return
        wall = time.perf_counter() - t0
        res = gen.result
        # a stop that lands after the last step ends nothing: the reply is whole and keeps its own reason
        stopped = "stopped by you (partial reply)" if run.stop.is_set() and not gen.done else ""
        reply = (gen.final_text() if gen.done else gen.text.rstrip("\ufffd")) or "(empty reply)"
        history[-1] = {"role": "assistant", "content": reply}
        state["steps"] = steps
        shown = display_index(steps)
        yield (history, "", _tree_fig(steps, shown, color_by, tok), viz.token_strip_html(steps, highlight=shown),
               viz.step_chart_figure(steps, highlight=shown), _stats_md(res, wall, label, False, stopped),
               _notice_md(notes + res.notices), _slider(len(steps), shown))
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        state["steps"] = steps
        yield (history, skip, skip, skip, skip, skip, _error_md(msg) + _notice_md(notes), _slider(len(steps)))
    finally:
        RUNS.end(session, run)


def stop_chat(request: gr.Request = None) -> None:
    """Stop this session's running reply at its next step; the reply then shows its partial
    result and enables replay."""
    RUNS.signal(_session(request), "stopped")


def replay(step_index, color_by, request: gr.Request = None):
    """Redraw a finished generation at one step: tree, token strip (step outlined), step chart."""
    steps = session_state(request).get("steps") or []
    try:
        if not steps:
            return viz.empty_figure("no generation to replay yet: send a message first"), "", viz.step_chart_figure([])
        k = min(max(int(step_index or 0), 0), len(steps) - 1)
        return (_tree_fig(steps, k, color_by), viz.token_strip_html(steps, highlight=k),
                viz.step_chart_figure(steps, highlight=k))
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return gr.skip(), _error_md(msg), gr.skip()


def clear_chat(request: gr.Request = None):
    """Cancel this session's running reply (it ends with this same empty update) and empty the chat."""
    RUNS.signal(_session(request), "cleared")
    session_state(request)["steps"] = []
    return _empty_chat()


def _empty_chat() -> tuple:
    """Chat, tree plot, token strip, step chart, stats, notices and replay slider, emptied."""
    return ([], viz.empty_figure(EMPTY_TREE), "", viz.step_chart_figure([]), "", "", _slider(0))
