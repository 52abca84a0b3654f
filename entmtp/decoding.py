"""The decoding loop: baseline, Medusa, Hydra and Hydra++ speculative decoding.

`Engine` binds a transformers causal LM (shared, read-only; usable from several threads)
and its draft heads. `Engine.generate` returns a `Generation`: one request's state (its own
KV cache, random generator, scheduler instance) and an iterator that yields one `Step` per
decoding step.

A step: the root (the base model's next token, already decided) plus the heads' drafts form
the tree; one forward verifies all of it; the acceptance rule walks the tree; the cache keeps
the accepted nodes; the bonus token becomes the next root. Baseline decoding is the same loop
with a root-only tree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from transformers.cache_utils import DynamicLayer

from .acceptance import AcceptanceRule, GreedyRule, Sampling, make_rule
from .hardware import synchronize
from .heads import DraftHeads, HeadRunner
from .kernels import decode_model, tree_mask_dtype
from .threads import ThreadGovernor, adaptive_threads_possible
from .tuning import apply_threads, kernel_profile
from .kvcache import GrowingLayer, decoding_cache
from .lookup import NgramIndex, graft_chain
from .scheduler import DraftContext, Scheduler, StepSignals, as_scheduler
from .trace import GenerationResult, Step
from .trees import Tree
from .verify import (NO_LOGITS, ScreenedGreedyHead, check_tree_support, forward, keep_cache_entries, max_context,
                     missing_layers, tree_mask)

ROOT_ONLY = Tree.from_paths([], "root_only")


class ContextError(ValueError):
    """The prompt does not fit the model's context."""


@dataclass
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    rule: str = "auto"  # auto | greedy | sampling | typical
    typical_epsilon: float = 0.09
    typical_alpha: Optional[float] = 0.3
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: Optional[tuple[int, ...]] = None  # None: from the model / tokenizer
    trace: str = "summary"  # "summary" (fast) or "full" (per-node texts and statistics)
    seed: Optional[int] = None
    on_long_prompt: str = "truncate"  # "truncate" (keep the end, add a notice) or "error"
    lookup: int = 0  # prompt lookup: graft up to this many context-copied tokens onto each tree (0 = off)
    lookup_ngram: int = 3  # longest n-gram matched against the context
    lookup_min_ngram: int = 1  # shortest n-gram whose match is grafted

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.trace not in ("summary", "full"):
            raise ValueError("trace must be 'summary' or 'full'")
        if self.on_long_prompt not in ("truncate", "error"):
            raise ValueError("on_long_prompt must be 'truncate' or 'error'")
        if self.lookup < 0 or self.lookup_ngram < 1:
            raise ValueError("lookup must be >= 0 and lookup_ngram >= 1")
        if not 1 <= self.lookup_min_ngram <= self.lookup_ngram:
            raise ValueError("lookup_min_ngram must be between 1 and lookup_ngram")


def _entropy_prob(logits: torch.Tensor, token: int) -> tuple[float, float]:
    lp = torch.log_softmax(logits.float(), -1)
    return float(-(lp.exp() * lp).sum()), float(lp[token].exp())


@dataclass
class Prefill:
    """A prompt's prefill, kept so that many generations start from it without computing it again
    (`Engine.prefill`): the tuner times hundreds of steps after the same context, and at 1,536
    cached tokens a prefill of the embedded model cost ~2 s on a 2-core CPU where a step costs
    ~25 ms. Each start crops the cache back to the prompt (`GrowingLayer`: a length; transformers'
    `DynamicLayer`: a slice), so one generation at a time decodes from it."""

    prompt: list[int]
    cache: Any  # the decoding cache (`kvcache.decoding_cache`) after the prompt
    logits: torch.Tensor  # [V] after the last prompt token
    hidden: Optional[torch.Tensor]  # [T, F] the heads' features of the prompt (`verify.base_features`); None: no heads
    layers: tuple[int, ...]  # the base layers `hidden` holds besides the last hidden state
    owner: Optional[object] = None  # the generation decoding from it now

    @property
    def rewindable(self) -> bool:
        """Whether every cache layer can be cropped back to the prompt exactly (sliding-window
        layers drop early positions, so a model with them prefills each generation)."""
        layers = getattr(self.cache, "layers", None)
        return layers is not None and all(type(layer) in (GrowingLayer, DynamicLayer) for layer in layers)

    def fits(self, runner: Optional[HeadRunner]) -> bool:
        """Whether a generation with `runner` (None: plain decoding) can start from it."""
        return runner is None or (self.hidden is not None and tuple(runner.feature_layers) == self.layers)

    def start(self, owner: object) -> None:
        """Hand the prefill to `owner`: the cache cropped back to the prompt."""
        extra = self.cache.get_seq_length() - len(self.prompt)
        if extra:
            if not self.rewindable:
                raise ValueError("this prefill's cache cannot be cropped back to its prompt (sliding-window layers); prefill again")
            self.cache.crop(-extra)
        self.owner = owner


def run_prefill(model, prompt: list[int], cache, device, layers: Optional[Sequence[int]]) -> Prefill:
    """The prompt through `model` into `cache`. layers: the base layers the heads read besides the
    last hidden state (None: no heads, no features kept)."""
    ids = torch.tensor([prompt], device=device)
    logits, hidden = forward(model, ids, cache, hidden=layers is not None, layers=layers or (), logits_to_keep=1)
    return Prefill(list(prompt), cache, logits[-1], hidden, tuple(layers or ()))


class Engine:
    """A base model plus named draft heads ("medusa", "hydra", "hydra++", ...)."""

    def __init__(self, model, tokenizer=None, heads: Optional[dict[str, DraftHeads]] = None,
                 screened_head: bool = True, kernels: str = "auto"):
        """screened_head: on a CPU with bf16 units, verify float32 greedy steps with the exact
        screened lm_head (`verify.ScreenedGreedyHead`) where it applies to this model.
        kernels: the decoding twin's kernel set (`kernels.KERNELS`): "auto" = measured on this
        machine once and cached (`tuning.kernel_profile`: the fastest row-invariant set no slower
        than stock, else the fastest); `self.model` itself stays stock (transformers'
        `generate`, training and calibration use it)."""
        check_tree_support(model)
        self.model = model.eval()
        self.kernel_profile = kernel_profile(model) if kernels == "auto" else None
        # decoding with more than one CPU thread follows the load of the cores (`threads.ThreadGovernor`)
        self.governor: Optional[ThreadGovernor] = None
        if self.kernel_profile is not None and self.device_type(model) == "cpu":
            n = apply_threads(self.kernel_profile)  # process-wide: the measured count (ENTMTP_THREADS overrides)
            if n and n > 1 and adaptive_threads_possible():
                self.governor = ThreadGovernor(n)
        chosen = self.kernel_profile.choice if self.kernel_profile is not None else kernels
        built = self.kernel_profile.built if self.kernel_profile is not None else None
        if built is not None and built[1] == chosen:  # the probe's own twin of the chosen set
            self.kernel_profile.built = None
        else:
            built = decode_model(self.model, chosen)
        self.decode_model, self.kernels, self.kernels_reason = built
        self.mask_dtype = tree_mask_dtype(self.decode_model)  # what its attention reads without a conversion
        if self.kernel_profile is not None:
            self.kernels_reason = f"{self.kernels_reason}; {self.kernel_profile.why}"
        # tree rows computed exactly as one-row steps: greedy speculation = the plain loop's tokens
        self.row_invariant = bool(self.kernel_profile.row_invariant) if self.kernel_profile is not None else None
        self.tokenizer = tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_context = max_context(model)
        self.screened = ScreenedGreedyHead.for_model(model) if screened_head else None
        self.runners: dict[str, HeadRunner] = {}
        # tuned trees measured while other processes used the cores: this engine's, never cached (`autotune.tuned_trees`)
        self.held_tunes: dict[str, object] = {}
        for name, h in (heads or {}).items():
            self.add_heads(name, h)

    @staticmethod
    def device_type(model) -> str:
        return next(model.parameters()).device.type

    def add_heads(self, name: str, heads: DraftHeads) -> None:
        cfg = heads.config
        emb = self.model.get_input_embeddings().weight
        if cfg.hidden_size != emb.shape[1]:
            raise ValueError(f"heads {name!r} were built for hidden size {cfg.hidden_size}, the model has {emb.shape[1]}")
        if cfg.vocab_size != self.model.get_output_embeddings().weight.shape[0]:
            raise ValueError(f"heads {name!r} were built for vocab size {cfg.vocab_size}, the model has {self.model.get_output_embeddings().weight.shape[0]}")
        bad, n_layers = missing_layers(cfg.feature_layers, self.model.config)
        if bad:
            raise ValueError(f"heads {name!r} read base layers {bad}; the model's hidden states are 0..{n_layers}")
        self.runners[name] = HeadRunner(heads, self.model, kernels=self.kernels)

    def eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            if v is None:
                continue
            ids.extend(v if isinstance(v, (list, tuple)) else [v])
            break
        return tuple(int(i) for i in ids)

    def runner(self, heads: Optional[str]) -> Optional[HeadRunner]:
        """The loaded heads named `heads` (None: none, plain decoding); ValueError for a name not loaded."""
        if heads is None:
            return None
        if heads not in self.runners:
            raise ValueError(f"no heads named {heads!r} loaded (have: {', '.join(self.runners) or 'none'})")
        return self.runners[heads]

    def generate(self, input_ids: Sequence[int] | torch.Tensor, *, heads: Optional[str] = None,
                 tree: Optional[Tree] = None, scheduler: Optional[Scheduler] = None,
                 config: Optional[DecodeConfig] = None, rule: Optional[AcceptanceRule] = None,
                 prefill: Optional[Prefill] = None) -> "Generation":
        """Start one generation. heads=None means baseline (root-only tree, no drafting).
        prefill: this prompt's `Engine.prefill`, started from instead of computing the prompt again."""
        runner = self.runner(heads)
        sched = as_scheduler(scheduler if scheduler is not None else tree)
        if runner is None:
            sched = None
        elif sched is None:
            raise ValueError("speculative decoding needs a tree or a scheduler")
        return Generation(self, input_ids, runner, sched, config or DecodeConfig(), rule, prefill)

    @torch.inference_mode()
    def prefill(self, input_ids: Sequence[int] | torch.Tensor, *, heads: Optional[str] = None) -> Prefill:
        """The prompt's prefill, for `generate(..., prefill=)` to start from as often as wanted
        (one generation at a time): plain decoding, and `heads` or any heads reading the same base
        layers. The prompt must fit the context as it is."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().tolist()
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_context:
            raise ContextError(f"the prompt has {len(ids)} tokens but the model's context is {self.max_context}")
        runner = self.runner(heads)
        layers = runner.feature_layers if runner is not None else None
        out = run_prefill(self.decode_model, ids, decoding_cache(self.decode_model), self.device, layers)
        synchronize(self.device)
        return out

    def run(self, *args, **kw) -> GenerationResult:
        g = self.generate(*args, **kw)
        for _ in g:
            pass
        return g.result


class Generation:
    """One request: owns its KV cache and state; iterate it to get `Step` records."""

    def __init__(self, engine: Engine, input_ids, runner: Optional[HeadRunner], scheduler: Optional[Scheduler],
                 config: DecodeConfig, rule: Optional[AcceptanceRule], prefill: Optional[Prefill] = None):
        self.engine, self.runner, self.config = engine, runner, config
        self.scheduler = scheduler.fresh() if scheduler is not None else None
        if self.scheduler is not None and runner is not None:
            deep = self.scheduler.max_depth
            if deep > runner.config.num_heads:
                raise ValueError(f"tree depth {deep} exceeds the {runner.config.num_heads} draft heads")
        self.rule = rule or make_rule(config.rule, config.sampling, config.typical_epsilon, config.typical_alpha)
        # greedy targets from the screened lm_head: exact, but no full logits (so not for full traces)
        self.screened = (engine.screened if isinstance(self.rule, GreedyRule) and config.trace == "summary" else None)
        self.device = engine.device
        self.rng = None
        if not config.sampling.greedy:
            self.rng = torch.Generator(device=self.device)
            self.rng.manual_seed(config.seed if config.seed is not None else int(torch.seed() % (1 << 62)))
        self.eos = set(config.eos_token_ids if config.eos_token_ids is not None else engine.eos_ids())
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().tolist()
        if not ids:
            raise ValueError("empty prompt")
        self.notices: list[str] = []
        ids = self._fit_prompt(ids)
        self.prompt = ids
        if prefill is not None:
            if prefill.prompt != ids:
                raise ValueError("the prefill given is of another prompt")
            if not prefill.fits(runner):
                raise ValueError(f"the prefill given has no features for these heads (base layers {tuple(runner.feature_layers)})")
        self._from_prefill = prefill
        self.tokens: list[int] = []
        self.ngrams = None
        if config.lookup:
            self.ngrams = NgramIndex(config.lookup_ngram)
            self.ngrams.extend(ids)
        self.steps: list[Step] = []
        self.stop_reason = ""
        self.done = False
        self._text_cache = ("", 0)
        self._first_logits = None
        self._started = False
        self._t_start = 0.0
        self.time_prefill = 0.0
        self.method = runner.label if runner is not None else "baseline"

    # ---- prompt and context ---------------------------------------------------------------
    def _fit_prompt(self, ids: list[int]) -> list[int]:
        ctx = self.engine.max_context
        if len(ids) < ctx:
            return ids
        if self.config.on_long_prompt == "error":
            raise ContextError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}")
        keep = max(1, ctx - min(self.config.max_new_tokens, ctx // 4))
        self.notices.append(f"prompt truncated from {len(ids)} to its last {keep} tokens to fit the context of {ctx}")
        return ids[-keep:]

    # ---- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self) -> None:
        t0 = time.perf_counter()
        self._t_start = t0
        p = self._from_prefill
        if p is None:
            m = self.engine.decode_model
            p = run_prefill(m, self.prompt, decoding_cache(m), self.device,
                            self.runner.feature_layers if self.runner is not None else None)
        p.start(self)
        self.cache = p.cache
        self.past = len(self.prompt)
        self.root = self.rule.first_token(p.logits, self.rng)
        self.root_logits = p.logits
        if self.runner is not None:
            self.prefix_state, self.feature = self.runner.start(p.hidden, torch.tensor(self.prompt, device=self.device))
        synchronize(self.device)
        self.time_prefill = time.perf_counter() - t0
        self._started = True

    # ---- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        if self.done:
            raise StopIteration
        if self.engine.governor is not None:
            self.engine.governor.apply()
        if not self._started:
            self._prefill()
        with torch.inference_mode():
            step = self._step()
        self.steps.append(step)
        return step

    def _emit(self, toks: list[int]) -> list[int]:
        out = []
        for t in toks:
            if len(self.tokens) >= self.config.max_new_tokens:
                break
            self.tokens.append(t)
            out.append(t)
            if t in self.eos:
                self._finish("eos")
                return out
        if self.config.stop_strings and self.engine.tokenizer is not None and out:
            # Only the tail can hold a new match: every token is at least one character.
            window = len(out) + max(len(s) for s in self.config.stop_strings)
            tail = self.engine.tokenizer.decode(self.tokens[-window:], skip_special_tokens=True)
            if any(s in tail for s in self.config.stop_strings):
                self._finish("stop_string")
                return out
        if len(self.tokens) >= self.config.max_new_tokens:
            self._finish("max_new_tokens")
        return out

    def _finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.stop_reason = reason

    def _choose_tree(self):
        """(tree, reason, draft or None) for this step, from the scheduler and this step's signals."""
        self._first_logits = None
        self._t_first_level = 0.0
        if self.runner is None or self.scheduler is None:
            return ROOT_ONLY, None, None
        s = self.scheduler
        sig = StepSignals(step=len(self.steps), history=tuple(st.accept_length for st in self.steps[-16:]), past=self.past)
        root_t = torch.tensor(self.root, device=self.device)
        if s.needs_root:
            sig.root_entropy, sig.root_prob = _entropy_prob(self.root_logits, self.root)
        if s.needs_draft:
            t = time.perf_counter()
            lg = self._first_logits = self.runner.first_level(self.feature, root_t)  # reused as the draft's level 1
            self._t_first_level = time.perf_counter() - t
            sig.draft_entropy, sig.draft_top1 = _entropy_prob(lg, int(lg.argmax()))
        if s.needs_context:
            sig.context = DraftContext(self.runner, self.feature, root_t, with_stats=self.config.trace == "full")
        d = s.choose(sig)
        reason = {"scheduler": s.name, "tree": d.tree.name, **d.reason}
        if s.needs_root or s.needs_draft:
            reason["signals"] = {k: v for k, v in vars(sig).items()
                                 if isinstance(v, float) and not math.isnan(v)}
        return d.tree, reason, d.draft

    def _step(self) -> Step:
        cfg, dev, m = self.config, self.device, self.engine.decode_model
        if self._from_prefill is not None and self._from_prefill.owner is not self:
            raise RuntimeError("another generation started from this generation's prefill and took its cache")
        t0 = time.perf_counter()
        remaining = cfg.max_new_tokens - len(self.tokens)
        room = self.engine.max_context - self.past
        if remaining <= 1 or self.root in self.eos or room < 1:
            # The root is already decided: emitting it needs no forward.
            if room < 1 and remaining > 1 and self.root not in self.eos:
                self.notices.append(f"stopped at the model's context length ({self.engine.max_context} tokens)")
                emitted = self._emit([self.root])
                self._finish("context")
            else:
                emitted = self._emit([self.root])
            self._finish(self.stop_reason or "max_new_tokens")
            return Step(len(self.steps), "emit_only", 0, [self.root], [-1], [0], emitted, None, 0.0, 0.0,
                        time.perf_counter() - t0)
        tree, reason, ready = self._choose_tree()
        # head 0's logits, computed early as a signal, are the draft's first level: drafting time
        t_sched = time.perf_counter() - t0 - self._t_first_level
        t0 = time.perf_counter() - self._t_first_level
        if tree.size > room:
            self.notices.append(f"step {len(self.steps)}: tree of {tree.size} tokens does not fit the {room} positions left; drafting skipped")
            tree, ready = ROOT_ONLY, None
        full = cfg.trace == "full"
        root_t = torch.tensor(self.root, device=dev)

        # -- draft
        draft = None
        if tree.n_nodes:
            draft = ready if ready is not None else self.runner.draft(tree, self.feature, root_t, with_stats=full,
                                                                      first_logits=self._first_logits)
            tree_tokens = draft.tokens
        else:
            tree_tokens = root_t.view(1)
        tokens = tree_tokens.tolist()
        drafted_tree, lookup_nodes = tree, None
        if self.ngrams is not None:
            chain = self.ngrams.continuation([self.root], min(cfg.lookup, room - tree.size, remaining - 1), cfg.lookup_min_ngram)
            if chain:
                tree, tokens, lookup_nodes = graft_chain(tree, tokens, chain)
                if lookup_nodes:
                    tree_tokens = torch.tensor(tokens, dtype=torch.long, device=dev)
        synchronize(dev)
        t1 = time.perf_counter()

        # -- verify: one forward over the whole tree
        screened = self.screened
        need_hidden = self.runner is not None or screened is not None
        layers = self.runner.feature_layers if self.runner is not None else ()
        keep = NO_LOGITS if screened is not None else 0
        if tree.n_nodes:
            buf = tree.buffers(dev)
            mask = tree_mask(buf.attention_bias(self.engine.mask_dtype), self.past)
            logits, hidden = forward(m, tree_tokens[None], self.cache, mask=mask,
                                     position_ids=(buf.depths + self.past)[None], hidden=need_hidden, layers=layers,
                                     logits_to_keep=keep)
        else:
            logits, hidden = forward(m, tree_tokens[None], self.cache, hidden=need_hidden, layers=layers,
                                     logits_to_keep=keep)
        if screened is not None:  # the last hidden state: the last h columns of the heads' features
            targets, logits = screened.targets(hidden[:, -screened.weight.shape[1]:])  # logits: the bf16 screen (signals only)
        synchronize(dev)
        t2 = time.perf_counter()

        # -- accept and keep the accepted nodes
        if screened is not None:
            acc = self.rule.accept_targets(tree, tokens, targets)
        else:
            acc = self.rule.accept(tree, tokens, logits, self.rng)
        keep_cache_entries(self.cache, self.past, acc.path, tree.size)
        self.past += len(acc.path)
        if self.runner is not None:
            path = torch.tensor(acc.path, device=dev)
            h = hidden.index_select(0, path)
            self.feature = self.runner.advance(self.prefix_state, h, h[-1], tree_tokens.index_select(0, path))
        prev_root_logits = self.root_logits
        self.root_logits = logits[acc.path[-1]]
        emitted = self._emit([tokens[i] for i in acc.path])
        if self.ngrams is not None:
            self.ngrams.extend(emitted)
        if self.scheduler is not None:
            self.scheduler.update(len(acc.path) - 1)
        bonus = acc.bonus
        self.root = bonus
        step = Step(len(self.steps), drafted_tree.name or f"{drafted_tree.n_nodes}-node", tree.n_nodes, tokens,
                    tree.parent_list, acc.path, emitted, None if self.done else bonus, t1 - t0, t2 - t1, 0.0,
                    scheduler=reason, time_schedule=t_sched, lookup_nodes=lookup_nodes or None)
        if full:
            self._fill_full_trace(step, tree, drafted_tree, draft, logits, prev_root_logits)
        synchronize(dev)
        step.time_bookkeeping = time.perf_counter() - t2
        return step

    def _fill_full_trace(self, step: Step, tree: Tree, drafted_tree: Tree, draft, logits, prev_root_logits) -> None:
        tok = self.engine.tokenizer
        toks = step.tokens
        lp = torch.log_softmax(logits.float(), -1)
        ent = -(lp.exp() * lp).sum(-1)
        par = torch.tensor([max(p, 0) for p in step.parents], device=logits.device)
        bp = lp[par, torch.tensor(toks, device=logits.device)].exp()
        root_lp = torch.log_softmax(prev_root_logits.float(), -1)
        bp[0] = root_lp[toks[0]].exp()
        step.base_probs = bp.tolist()
        step.base_entropies = ent.tolist()
        step.depths = [len(p) for p in tree.node_paths]
        step.ranks = [p[-1] if p else 0 for p in tree.node_paths]
        if draft is not None and draft.probs is not None:
            step.draft_probs = draft.probs.tolist()
            step.draft_entropies = draft.entropies.tolist()
            if tree is not drafted_tree:  # lookup nodes have no head distribution
                src = [drafted_tree.index.get(p, -1) for p in tree.node_paths]
                step.draft_probs = [step.draft_probs[j] if j >= 0 else float("nan") for j in src]
                step.draft_entropies = [step.draft_entropies[j] if j >= 0 else float("nan") for j in src]
        else:
            step.draft_probs = [float("nan")] * len(toks)
            step.draft_entropies = [float("nan")] * len(toks)
        if tok is not None:
            step.token_texts = tok.batch_decode([[t] for t in toks])

    # ---- results ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return ""
        text, n = self._text_cache
        if n != len(self.tokens):
            text = tok.decode(self.tokens, skip_special_tokens=True)
            self._text_cache = (text, len(self.tokens))
        return text

    def final_text(self) -> str:
        text = self.text
        for s in self.config.stop_strings:
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        return text

    @property
    def result(self) -> GenerationResult:
        end = time.perf_counter()
        total = (end - self._t_start) if self._started else 0.0
        if self.steps:
            total = self.time_prefill + sum(s.time_total for s in self.steps)
        return GenerationResult(self.method, len(self.prompt), list(self.tokens), self.final_text(),
                                list(self.steps), self.stop_reason, self.time_prefill, total, list(self.notices))
