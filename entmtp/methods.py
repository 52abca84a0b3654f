"""The decoding methods, written once: name -> label, heads, scheduler, prompt-lookup defaults,
and the runner that decodes with it. The CLI, the bench, the topology lab and the app all read
this registry, so a method means the same thing in every one of them.

A method's heads are a kind ("medusa", "hydra", "hydra++"), `FAMILY` (the Hydra-family heads
predicted fastest on this machine: `fastest_family`) or None (no drafting). With user-supplied heads (`--heads PATH`)
the engine holds one head set named "custom" and every method with heads decodes with it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from . import scheduler as sched
from .autotune import LOOKUP_LENGTH, compared_speedups, tune_all, tuned_bank, tuned_trees
from .decoding import DecodeConfig, Engine, GenerationResult
from .models import load_engine
from .threads import default_threads, torch_threads
from .trees import TREES_DIR, Tree, resolve_tree

FAMILY = "hydra-family"
HYDRA_FAMILY = ("hydra++", "hydra")  # best first: methods with FAMILY heads take the best one loaded
CUSTOM = "custom"  # the name of user-supplied heads (`--heads PATH_OR_ID`) in the engine


class MethodError(ValueError):
    """A method that does not exist or cannot run here (one-line message)."""


@dataclass(frozen=True)
class Method:
    """One decoding method.

    heads: None (no drafting), a heads kind, or FAMILY. scheduler: the tree policy of a method
    with heads ("static", "entropy", "dynamic"). lookup: (chain length, shortest grafted n-gram)
    of the prompt-lookup branch when no flag or checkpoint says otherwise (0: none).
    ours: decoded by entmtp's engine; False for transformers' `generate`.
    """

    name: str
    label: str
    heads: Optional[str] = None
    scheduler: Optional[str] = None
    lookup: tuple[int, int] = (0, 1)
    ours: bool = True
    about: str = ""


# Prompt lookup: entmtp grafts copied context spans onto its trees; "lookup" is our prompt-lookup
# decoding (no heads); the others are pure heads. entmtp: 4 tokens (4 -> 8 gained 1% tau for 17% more
# nodes). Whether the branch pays, and after how short a match, depends on what a tree row costs,
# so it is chosen per machine (`autotune.choose_lookup`: the shipped greedy continuations replayed
# with step times measured here); the registry's (4, 1) holds only where nothing was tuned.
_ALL = (
    Method("hf", "HF generate, greedy", ours=False, about="transformers' greedy `generate`"),
    Method("pld", "HF prompt-lookup decoding", ours=False, about="transformers' prompt-lookup decoding"),
    Method("baseline", "baseline (our plain loop)", about="our autoregressive loop, one token per forward"),
    Method("lookup", "prompt lookup (ours)", lookup=(8, 1), about="a chain copied from the context, no heads"),
    Method("medusa", "Medusa", "medusa", "static", about="Medusa heads, their best static tree"),
    Method("hydra", "Hydra", "hydra", "static", about="Hydra heads, their best static tree"),
    Method("hydra++", "Hydra++", "hydra++", "static", about="Hydra++ heads, their best static tree"),
    Method("entmtp", "entmtp", FAMILY, "entropy", lookup=(LOOKUP_LENGTH, 1),
           about="best Hydra-family heads + entropy-aware tree scheduler + a prompt-lookup branch"),
    Method("dynamic", "dynamic trees", FAMILY, "dynamic", about="best Hydra-family heads + EAGLE-2 style dynamic trees"),
)
METHODS: dict[str, Method] = {m.name: m for m in _ALL}
OUR_METHODS = tuple(m.name for m in _ALL if m.ours)  # what `entmtp generate --method` accepts
DEFAULT_LOOKUP = {m.name: m.lookup for m in _ALL if m.lookup[0]}


def get_method(name: str) -> Method:
    m = METHODS.get(name)
    if m is None:
        raise MethodError(f"unknown method {str(name)[:40]!r} (choose from {', '.join(METHODS)})")
    return m


def parse_methods(text: str | Iterable[str], allowed: Iterable[str] = tuple(METHODS)) -> list[str]:
    """'hf,baseline,entmtp' -> names, each checked against `allowed`."""
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    allowed = tuple(allowed)
    bad = [m for m in names if m not in allowed]
    if bad:
        raise MethodError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(allowed)}")
    if not names:
        raise MethodError("no methods given")
    return names


def best_hydra(available: Iterable[str]) -> Optional[str]:
    """The best Hydra-family heads among `available` names (Hydra++ first), or None."""
    have = set(available)
    return next((h for h in HYDRA_FAMILY if h in have), None)


def method_heads(method: str, runners: Optional[Iterable[str]] = None, engine: Optional[Engine] = None) -> Optional[str]:
    """Name of the heads `method` decodes with among the engine's loaded `runners` (None: no
    heads). Without `runners`: the embedded heads it would load. FAMILY takes, with `engine`, the
    loaded Hydra-family heads this machine's tuning predicts fastest (`fastest_family`), else
    the first of HYDRA_FAMILY loaded."""
    kind = get_method(method).heads
    if kind is None:
        return None
    if runners is None and engine is not None:
        runners = engine.runners
    have = set(runners) if runners is not None else set()
    if CUSTOM in have:
        return CUSTOM
    if kind == FAMILY:
        return (fastest_family(engine) if engine is not None else None) or best_hydra(have) or HYDRA_FAMILY[0]
    return kind


def fastest_family(engine: Engine) -> Optional[str]:
    """Among the Hydra-family heads loaded on `engine`, the one whose tuned trees predict the most
    tokens/s here (draft cost included: Hydra++'s extra layer pays on some machines and not on
    others), their step costs timed side by side (`autotune.compared_speedups`). None when fewer
    than two are loaded or nothing was tuned (ENTMTP_TUNE=0)."""
    loaded = [h for h in HYDRA_FAMILY if h in engine.runners]
    if len(loaded) < 2:
        return None
    tuned = tune_all(engine, loaded, progress=_stderr)
    if any(t is None for t in tuned.values()):
        return None
    predicted = compared_speedups(engine, tuned, progress=_stderr)
    return max(loaded, key=lambda h: predicted[h])


def heads_to_load(methods: Iterable[str]) -> list[str]:
    """The embedded head sets these methods need (every Hydra-family kind for a FAMILY method, so
    that the fastest here can be chosen)."""
    out = set()
    for m in methods:
        kind = get_method(m).heads
        if kind == FAMILY:
            out.update(HYDRA_FAMILY)
        elif kind is not None:
            out.add(kind)
    return sorted(out)


def method_lookup(method: str, engine=None, heads: Optional[str] = None, *, lookup: Optional[int] = None,
                  min_ngram: Optional[int] = None) -> dict:
    """A method's prompt-lookup fields of `DecodeConfig` ({"lookup": chain length, "lookup_min_ngram":
    shortest grafted n-gram}): `lookup` / `min_ngram` when given (the chain length for every method
    with heads), else the choice tuned for the method's `heads` on this machine (`autotune.choose_lookup`:
    none, or the shortest match that pays here), else what the heads record for their dtype and
    hardware, else the registry's default; baseline never looks up."""
    m = get_method(method)
    if not m.ours or method == "baseline":
        return {"lookup": 0, "lookup_min_ngram": 1}
    length, shortest = m.lookup
    tuned = tuned_trees(engine, heads, progress=_stderr) if engine is not None and heads and length else None
    recorded = sched.recorded_default(engine, heads, "default_lookup_min_ngram") if engine is not None and heads else None
    if tuned is not None and tuned.lookup_min_ngram is not None:  # scored with step times measured here
        length, shortest = (length, tuned.lookup_min_ngram) if tuned.lookup_min_ngram else (0, 1)
    elif recorded is not None:
        if type(recorded) is not int or not 1 <= recorded <= 3:
            raise ValueError(f"the {heads} heads record default_lookup_min_ngram {recorded!r}; it must be 1, 2 or 3")
        shortest = recorded
    if lookup is not None and method != "lookup":
        length = lookup
    if min_ngram is not None:
        shortest = min_ngram
    return {"lookup": length, "lookup_min_ngram": shortest}


def _stderr(s: str) -> None:
    print(s, file=sys.stderr)


def tune_loaded(engine: Engine, progress: Optional[Callable[[str], object]] = _stderr) -> None:
    """Every loaded heads kind tuned here now, where several will decode (a bench): one
    `autotune.tune_all` prefills the measuring contexts once for all of them."""
    tune_all(engine, engine.runners, progress=progress)


def default_tree(engine, heads: str, progress: Optional[Callable[[str], object]] = _stderr) -> Tree:
    """The tree chosen for these heads on this machine (`autotune.tuned_trees`: shipped acceptance
    statistics scored with latencies measured here, cached), else the tree the heads record, else
    mc_sim_7b_63 cut to the heads' depth."""
    depth = engine.runners[heads].config.num_heads
    tuned = tuned_trees(engine, heads, progress=progress)
    if tuned is not None:
        return tuned.tree.truncated(depth)
    name = sched.recorded_default(engine, heads, "default_tree")
    if name and (TREES_DIR / name).is_file():
        return resolve_tree(str(TREES_DIR / name)).truncated(depth)
    return resolve_tree("mc_sim_7b_63").truncated(depth)


def build_scheduler(engine, heads: str, method: str = "hydra", *, tree: Optional[str] = None,
                    scheduler: Optional[str] = None, bank: Optional[str] = None,
                    progress: Optional[Callable[[str], object]] = _stderr) -> sched.Scheduler:
    """The tree policy `method` decodes `heads` with: `tree` (a file or name; default: the tree
    chosen for these heads here), `scheduler` (default: the method's), `bank` (entropy scheduler;
    default: tuned on this machine, else the bank the heads record)."""
    t = resolve_tree(tree) if tree else default_tree(engine, heads, progress)
    name = scheduler or get_method(method).scheduler or "static"
    long = None
    if tree is None and bank is None and name in ("static", "entropy", "dynamic"):
        tuned = tuned_trees(engine, heads, progress=progress)
        long = tuned.long if tuned is not None else None
    if name == "static":
        policy = sched.Scheduler(t)
    else:
        policy = sched.make_scheduler(name, engine=engine, heads=heads, tree=t,
                                      bank=tuned_bank(engine, heads) if bank is None and name == "entropy" else bank)
    if long is None:
        return policy
    # from the tuned switch on, the tree (bank, dynamic budget) tuned for long contexts
    lt = long.tree.truncated(engine.runners[heads].config.num_heads)
    if name == "static":
        other = sched.Scheduler(lt)
    elif name == "entropy":
        other = long.bank or sched.EntropyBucketScheduler({lt.name: lt}, [], [lt.name], meta={"fit": "long contexts"})
    else:
        other = sched.make_scheduler(name, engine=engine, heads=heads, tree=lt)
    return sched.ContextSwitch(policy, other, long.from_tokens)


# ---- loading --------------------------------------------------------------------------------------

@dataclass
class ModelOptions:
    """Which base and heads to load, and how (the CLI's model flags)."""

    model: str = "default"  # "default" (embedded SmolLM2 + our heads), a local path or a repo id
    heads: Optional[str] = None  # user-supplied heads (directory or repo id), loaded as CUSTOM
    dtype: str = "float32"
    device: str = "cpu"
    device_map: Optional[str] = None
    threads: int = 0  # 0: measured on this machine (or ENTMTP_THREADS)
    kernels: str = "auto"


def load_engine_for(opts: ModelOptions, methods: Iterable[str],
                    progress: Optional[Callable[[str], object]] = _stderr) -> Engine:
    """An engine holding the base and the heads `methods` decode with."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    if opts.threads:
        os.environ["ENTMTP_THREADS"] = str(opts.threads)  # the engine's tuning keeps it instead of measuring
        torch.set_num_threads(opts.threads)
    if opts.heads:
        heads = {CUSTOM: opts.heads}
    else:
        wanted = heads_to_load(methods)
        if wanted and opts.model != "default":
            raise MethodError(f"--model {opts.model} has no embedded heads: pass --heads PATH_OR_ID")
        heads = {h: h for h in wanted}
    # a refused kernels="packed" is a ValueError: one line like every user error
    return load_engine(opts.model, heads, dtype=opts.dtype, device=opts.device, device_map=opts.device_map,
                       kernels=opts.kernels, progress=progress)


# ---- runners ----------------------------------------------------------------------------------------

@dataclass
class Output:
    """What one decoding produced: the new tokens, base forwards, seconds of engine bookkeeping
    and of whole steps (0 for transformers' methods) and, for ours, the engine's trace."""

    tokens: list[int]
    forwards: int
    bookkeeping_s: float = 0.0
    step_s: float = 0.0
    result: Optional[GenerationResult] = None


class ForwardCounter:
    """Counts base-model forwards (a forward pre-hook), to get tau for transformers' methods."""

    def __init__(self, model):
        self.n = 0
        self._h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self._h.remove()


def hf_generate(engine, ids: list[int], max_new_tokens: int, **extra) -> Output:
    """transformers' greedy `generate` on the engine's model (extra: e.g. prompt_lookup_num_tokens)."""
    eos = engine.eos_ids()
    x = torch.tensor([ids], device=engine.device)
    c = ForwardCounter(engine.model)
    try:
        with torch.inference_mode():
            out = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                        eos_token_id=list(eos) or None, pad_token_id=(eos[0] if eos else None), **extra)
    finally:
        c.close()
    return Output(out[0, len(ids):].tolist(), c.n)


@dataclass
class Runner:
    """A method made ready on one engine: call it with prompt ids to decode them.

    heads / scheduler / config: what our engine decodes with (None for transformers' methods)."""

    method: Method
    engine: Engine
    max_new_tokens: int
    heads: Optional[str] = None
    scheduler: Optional[sched.Scheduler] = None
    config: Optional[DecodeConfig] = None
    pld_tokens: int = 10
    threads: Optional[int] = None  # torch CPU threads this method decodes with (None: the process's)
    stock: Optional[Any] = None  # transformers' methods: a `stock_process.StockProcess` decoding them in its own process

    @property
    def label(self) -> str:
        """The method's label, with the tree or scheduler it decodes with."""
        s = self.scheduler
        if s is None:
            return self.method.label

        what = sched.policy_label(s)
        if isinstance(s, sched.ContextSwitch):
            what = f"{sched.policy_label(s.short)}, from {s.from_tokens} cached tokens {sched.policy_label(s.long)}"
        extra = " + prompt lookup" if self.config is not None and self.config.lookup and self.method.name != "lookup" else ""
        return f"{self.method.label} · {what}{extra}"

    def __call__(self, ids: list[int]) -> Output:
        if self.stock is not None:  # the worker keeps its own thread count
            return self._decode(ids)
        with torch_threads(self.threads):
            return self._decode(ids)

    def _decode(self, ids: list[int]) -> Output:
        if self.stock is not None:
            return self.stock.decode(self.method.name, ids, self.max_new_tokens, self.pld_tokens)
        if not self.method.ours:
            extra = {"prompt_lookup_num_tokens": self.pld_tokens} if self.method.name == "pld" else {}
            return hf_generate(self.engine, ids, self.max_new_tokens, **extra)
        r = self.engine.run(ids, heads=self.heads, scheduler=self.scheduler, config=self.config)
        return Output(list(r.tokens), 1 + sum(1 for s in r.steps if s.time_verify > 0),
                      sum(s.time_bookkeeping for s in r.steps), sum(s.time_total for s in r.steps), r)


def fit_stock_threads(runner: Runner, ids: list[int], repeats: int = 2) -> Optional[int]:
    """Give a transformers method (`generate`, prompt lookup) the CPU thread count it decodes `ids`
    fastest with: 1 or all cores, the faster of `repeats` timed runs each. entmtp's measured count
    is for its own kernels (often 1 on 2 cores); transformers' kernels may want all, and a bench
    must not time `generate` with a count chosen for us. Returns the count (None: ours, or a GPU)."""
    if runner.method.ours or runner.engine.device.type != "cpu":
        return None
    if runner.stock is not None:  # timed in the worker, with the worker's OpenMP
        runner.threads = runner.stock.fit_threads(runner.method.name, ids, runner.max_new_tokens, runner.pld_tokens)
        return runner.threads
    best: dict[int, float] = {}
    counts = sorted({1, default_threads()})
    for k in range(repeats):  # the counts in turns, the order alternated: drift hits both alike
        for n in (counts if k % 2 == 0 else counts[::-1]):
            with torch_threads(n):
                t0 = time.perf_counter()
                runner._decode(ids)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
    runner.threads = min(best, key=lambda n: (best[n], n))
    return runner.threads


def make_runner(engine, method: str, max_new_tokens: int = 128, *, tree: Optional[str] = None,
                scheduler: Optional[str] = None, bank: Optional[str] = None, lookup: Optional[int] = None,
                lookup_min_ngram: Optional[int] = None, pld_tokens: int = 10, config: Optional[DecodeConfig] = None,
                progress: Optional[Callable[[str], object]] = _stderr, stock_process: Optional[Any] = None) -> Runner:
    """`method` ready to decode on `engine` (greedy unless `config` says otherwise; its
    max_new_tokens and lookup fields are set here). tree / scheduler / bank: see `build_scheduler`.
    stock_process: a `stock_process.StockProcess` that decodes transformers' methods in a process of
    their own (None: in this one)."""
    m = get_method(method)
    if not m.ours:
        return Runner(m, engine, max_new_tokens, pld_tokens=pld_tokens, stock=stock_process)
    heads = method_heads(method, engine=engine)
    if heads is not None and heads not in engine.runners:
        raise MethodError(f"{method} needs {heads} heads, which are not loaded (have: {', '.join(engine.runners) or 'none'})")
    s = build_scheduler(engine, heads, method, tree=tree, scheduler=scheduler, bank=bank, progress=progress) if heads else None
    look = method_lookup(method, engine, heads, lookup=lookup, min_ngram=lookup_min_ngram)
    cfg = dataclasses.replace(config or DecodeConfig(), max_new_tokens=max_new_tokens, **look)
    return Runner(m, engine, max_new_tokens, heads, s, cfg, pld_tokens)


__all__ = ["FAMILY", "HYDRA_FAMILY", "CUSTOM", "MethodError", "Method", "METHODS", "OUR_METHODS",
           "DEFAULT_LOOKUP", "get_method", "parse_methods", "best_hydra", "method_heads", "fastest_family", "heads_to_load", "method_lookup",
           "default_tree", "build_scheduler", "ModelOptions", "load_engine_for", "Output", "ForwardCounter", "hf_generate",
           "Runner", "fit_stock_threads", "make_runner", "tune_loaded"]
