"""`entmtp train`: train Medusa / Hydra / Hydra++ draft heads on a frozen base model.

Pipeline (every stage runs unchanged on CPU, one GPU, or many processes under
``accelerate launch``; each process handles its shard of the sequences and only the main
process writes checkpoints, reports and logs):

1. **Data.** ``--data FILE`` is read with :func:`entmtp.data.load_prompts` and split with the
   seeded :func:`entmtp.data.split_prompts` (``--held-out``; the held-out split is never
   trained on).  Rows with an assistant answer train on that answer; with ``--self-distill``
   the base model answers every prompt itself (batched greedy ``generate``, left padding),
   and the answers are cached as JSONL in ``--work-dir`` so an interrupted run resumes
   generation where it stopped (held-out prompts are answered first, so evaluation always
   has data even when ``--gen-time-budget-min`` cuts generation short).
2. **Draft vocabulary** (``--draft-vocab N``): the N most frequent answer tokens of the
   training split plus EOS.  Heads score only these ids (5-7x cheaper on CPU); targets
   outside it are ignored by the loss and count as misses in evaluation.
3. **Features.** The base model's post-norm last hidden state and the teacher's top-k
   next-token distribution (softmax renormalized over the draft vocab, fp16 probs + ids)
   plus its full-vocab greedy token, for every position.  Cached once on disk (safetensors
   shards + a manifest keyed by model fingerprint, token sequences, draft vocab and top-k)
   when training runs for more than one epoch, else computed on the fly.
4. **Training.** All kinds train jointly on the same features, each with its own parameter
   group, loss and gradient clipping.  Per head k (predicting x_{t+k+2} at position t), on
   answer positions of the target only::

       loss_k = lm_w * CE(head_k, x_{t+k+2}) + teacher_w * softCE(head_k, teacher top-k at t+k+1)

   AdamW, linear warm-up then cosine to ``--final-lr-mult`` over the planned steps; the data
   order is a seeded permutation per epoch indexed by the global step, so ``--resume`` from
   a checkpoint continues with exactly the batch that would have come next.
   ``--init-from DIR`` starts from trained heads instead of fresh ones (fine-tuning on new
   data); their draft vocabulary and shapes are kept.
5. **Evaluation** on the held-out split: each head's top-1 / top-5 agreement with the base
   model's greedy token, and the teacher-forced chain tau
   ``1 + sum_k prod_{j<=k} top1_correct_j`` averaged over positions.
6. **Output.** ``--out DIR/{name}-{medusa|hydra|hydrapp}`` in our checkpoint format
   (:func:`entmtp.checkpoints.save_heads`) plus ``DIR/train_report.json`` / ``.md``.

Public API: :class:`TrainConfig`, :func:`run_training` (returns a :class:`TrainResult` with the
trained heads; raises :class:`TrainError` with a one-line message for bad input) and :func:`main`
(the same, spreading over CPU processes when ``accelerate launch --cpu`` asked for several).

Several processes: ``accelerate launch --cpu --num_processes 2 -m entmtp train ...`` runs two
CPU processes with gloo. accelerate 1.15 itself starts a *single* process for that command (its
CPU launcher only fans out through ``--mpirun_hostfile``); ``entmtp train`` reads the requested
count from the launching command and starts the processes through ``torch.distributed.run``.
``accelerate launch --multi_gpu --num_processes 2 -m entmtp train --cpu ...`` and ``torchrun
--nproc_per_node 2 -m entmtp train --cpu ...`` work too. The data order and the loss
normalization are global, so N processes give the same heads as one (up to float summation order).

On a shared 2-core CPU use ``--threads 1``: OpenMP spin-waiting makes small matmuls many
times slower when another process competes for the cores.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoints import CONFIG_FILE, CheckpointError, load_heads, save_heads
from .data import DataError, PromptSet, load_prompts, render_conversation, render_prompt, split_prompts
from .heads import DraftHeads, HeadsConfig, count_parameters
from .models import ModelLoadError, load_base
from .paths import write_json_atomic
from .verify import base_features, last_positions, left_padded, missing_layers

__all__ = ["TrainError", "TrainConfig", "TrainResult", "main", "run_training",
           "KINDS", "lr_multiplier", "head_inputs"]

# kind label -> (HeadsConfig.kind, prefix_layer, directory suffix)
KINDS = {"medusa": ("medusa", False, "medusa"), "hydra": ("hydra", False, "hydra"),
         "hydra++": ("hydra", True, "hydrapp"), "eagle": ("eagle", False, "eagle")}
_KIND_ALIASES = {"hydrapp": "hydra++", "hydra_pp": "hydra++", "hydra-pp": "hydra++", "hydraplusplus": "hydra++"}
FEATURE_FORMAT = "entmtp-features/1"
SELFDISTILL_FORMAT = 1
CKPT_FORMAT = "entmtp-train-ckpt/1"
REPORT_JSON = "train_report.json"
REPORT_MD = "train_report.md"
_IGNORE = -100


class TrainError(ValueError):
    """Unusable input or settings for training; the message is one human-readable line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# ======================================================================================
# configuration
# ======================================================================================
@dataclass
class TrainConfig:
    """Everything one training run needs (`entmtp train` builds it from its flags)."""

    data: str  # prompt / conversation file (any format `load_prompts` reads)
    # model and heads
    model: str = "default"  # 'default' (SmolLM2-135M-Instruct), a local directory, or a repo id
    dtype: str = "float32"  # of the frozen base, for generation and feature extraction
    heads: str = "medusa,hydra,hydra++"  # comma-separated kinds trained jointly (recorded as given)
    num_heads: int = 4  # heads per kind (draft depth)
    num_layers: int = 1  # residual blocks per head
    init_from: Optional[str] = None  # trained heads to fine-tune (see `_init_heads`)
    draft_vocab: int = 0  # 0: full vocabulary; N: the N most frequent training answer tokens plus EOS
    feature_layers: tuple = ()  # EAGLE only: base layers read beside the last hidden state (HeadsConfig.feature_layers)
    # data
    self_distill: bool = False  # answer every prompt with the base model and train on those answers
    gen_max_new_tokens: int = 160
    gen_batch_size: int = 32
    gen_temperature: float = 0.0  # 0: greedy
    gen_time_budget_min: float = 0.0  # stop generating after this many minutes (0: no limit)
    held_out: float = 0.05  # held-out fraction (seeded split)
    max_prompts: int = 0  # at most this many training prompts (seeded sample; 0: all)
    max_len: int = 512  # truncate sequences to this many tokens
    # training
    epochs: float = 3.0
    max_steps: int = 0  # cap on the planned steps (0: epochs decide)
    time_budget_min: float = 0.0  # wall-clock budget of the whole run (0: none)
    fit_schedule: bool = True  # with a time budget: shrink the planned steps so the LR schedule completes
    stop_after: int = 0  # stop (checkpoint and export) after this many steps of this invocation
    batch_size: int = 4  # sequences per optimizer step (global)
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    final_lr_mult: float = 0.1
    max_grad_norm: float = 1.0  # per-kind gradient clipping (0: off)
    lm_loss_weight: float = 0.1
    teacher_loss_weight: float = 1.0
    teacher_topk: int = 16
    mixed_precision: str = "no"  # no | bf16 | fp16: autocast for the heads (fp32 master weights)
    cache_features: Optional[bool] = None  # None: cache when training for more than one epoch
    feature_batch_tokens: int = 4096  # padded tokens per base forward when extracting features
    feature_shard_size: int = 128  # sequences per feature-cache shard
    seed: int = 0
    cpu: bool = False  # force CPU even if an accelerator is available
    threads: int = 0  # torch threads per process (0: torch default)
    # evaluation, checkpoints, output
    eval_every: int = 200  # 0: only at the end
    log_every: int = 20
    save_every: int = 200  # 0: only at the end
    work_dir: str = "runs/train-work"  # self-distillation cache, feature cache, checkpoints (ckpt/) and logs
    resume: bool = False  # continue from the checkpoint in work_dir/ckpt
    out: str = "runs/heads"  # the trained heads and the report
    name: Optional[str] = None  # checkpoint name prefix (default: from the model)
    save_dtype: str = "float32"


def parse_kinds(text: str) -> list[str]:
    kinds: list[str] = []
    for raw in str(text).split(","):
        k = raw.strip().lower()
        if not k:
            continue
        k = _KIND_ALIASES.get(k, k)
        if k not in KINDS:
            raise TrainError(f"unknown head kind {raw.strip()!r} in --heads; use medusa, hydra, hydra++, eagle (comma-separated)")
        if k not in kinds:
            kinds.append(k)
    if not kinds:
        raise TrainError("--heads is empty; use medusa, hydra, hydra++, eagle (comma-separated)")
    return kinds


def _validate(args: TrainConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise TrainError(msg)

    need(args.num_heads >= 1, f"--num-heads must be >= 1, got {args.num_heads}")
    need(args.num_layers >= 1, f"--num-layers must be >= 1, got {args.num_layers}")
    need(args.draft_vocab >= 0, f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    need(0.0 <= args.held_out < 1.0, f"--held-out must be in [0, 1), got {args.held_out}")
    need(args.max_len >= args.num_heads + 3, f"--max-len must be >= {args.num_heads + 3}, got {args.max_len}")
    need(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    need(args.epochs > 0 or args.max_steps > 0, "give --epochs > 0 or --max-steps > 0")
    need(args.max_steps >= 0 and args.stop_after >= 0, "--max-steps and --stop-after must be >= 0")
    need(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    need(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    need(0.0 <= args.final_lr_mult <= 1.0, f"--final-lr-mult must be in [0, 1], got {args.final_lr_mult}")
    need(args.lm_loss_weight >= 0 and args.teacher_loss_weight >= 0, "loss weights must be >= 0")
    need(args.lm_loss_weight + args.teacher_loss_weight > 0, "--lm-loss-weight and --teacher-loss-weight are both 0")
    need(args.teacher_topk >= 1, f"--teacher-topk must be >= 1, got {args.teacher_topk}")
    need(args.gen_max_new_tokens >= 1 and args.gen_batch_size >= 1, "--gen-max-new-tokens and --gen-batch-size must be >= 1")
    need(args.gen_temperature >= 0, "--gen-temperature must be >= 0")
    need(args.time_budget_min >= 0 and args.gen_time_budget_min >= 0, "time budgets must be >= 0")
    need(args.feature_batch_tokens >= 1 and args.feature_shard_size >= 1,
         "--feature-batch-tokens and --feature-shard-size must be >= 1")
    need(args.eval_every >= 0 and args.save_every >= 0 and args.log_every >= 0, "--eval/save/log-every must be >= 0")
    need(args.max_prompts >= 0, "--max-prompts must be >= 0")
    need(bool(str(args.data or "").strip()), "give a data file (--data)")
    need(args.mixed_precision in ("no", "bf16", "fp16"), f"--mixed-precision must be no, bf16 or fp16, got {args.mixed_precision!r}")
    if args.feature_layers:
        need(parse_kinds(args.heads) == ["eagle"], "--feature-layers is for EAGLE heads trained alone (--heads eagle)")
        need(all(int(i) >= 0 for i in args.feature_layers), "--feature-layers are hidden-state indices >= 0")
        need(len(set(args.feature_layers)) == len(args.feature_layers), "--feature-layers lists a layer twice")


# ======================================================================================
# small utilities
# ======================================================================================
def lr_multiplier(step: int, warmup: int, total: int, final: float) -> float:
    """LR multiplier for the update made at `step` (0-based): linear warm-up, then cosine
    from 1 to `final` over the remaining planned steps (clamped at `final` afterwards)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _sha256_state(module: nn.Module) -> str:
    """Fingerprint of a module's weights (names, shapes and float32 values)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _prompt_key(prompt) -> str:
    return _sha256_json(prompt.prompt_messages)[:32]


def _fmt_s(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 90:
        return f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _model_name(spec: str) -> str:
    s = str(spec).strip()
    if not s or s.lower() == "default":
        return "smollm2-135m"
    p = Path(s).expanduser()
    name = p.stem if p.suffix.lower() == ".gguf" else p.name
    return (name or s.rstrip("/").split("/")[-1]).lower()


@dataclass
class Seq:
    """One training / held-out sequence: token ids and the answer mask (per token)."""

    pid: str
    ids: torch.Tensor  # [T] long
    mask: torch.Tensor  # [T] bool, True on answer tokens (the targets)
    split: str  # "train" | "held"

    def __len__(self) -> int:
        return int(self.ids.numel())


class _Ctx:
    """Accelerator wrapper with convenience helpers (printing, collectives, tqdm)."""

    def __init__(self, accelerator):
        self.acc = accelerator
        self.main = accelerator.is_main_process
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.device = accelerator.device
        self.log_lines: list[str] = []

    def print(self, *a) -> None:
        text = " ".join(str(x) for x in a)
        if self.main:
            self.log_lines.append(text)
        self.acc.print(text)

    def barrier(self) -> None:
        if self.world > 1:
            self.acc.wait_for_everyone()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        return self.acc.reduce(t.to(self.device), reduction="sum")

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.acc.reduce(t, reduction="sum").item() > 0)

    def bcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def heartbeat(self, label: str, every: float = 60.0):
        """A callable printing progress at most every `every` seconds when no progress bar shows."""
        state = {"last": time.time()}
        quiet = self.main and sys.stderr.isatty()

        def beat(text_fn) -> None:
            now = time.time()
            if not quiet and now - state["last"] >= every:
                state["last"] = now
                self.print(f"{label}: {text_fn()}")
        return beat

    def tqdm(self, *a, **kw):
        from tqdm.auto import tqdm

        kw.setdefault("disable", not (self.main and sys.stderr.isatty()))
        kw.setdefault("dynamic_ncols", True)
        kw.setdefault("leave", False)
        return tqdm(*a, **kw)


# ======================================================================================
# base model
# ======================================================================================
def _load_base(spec: str, dtype: str, device, progress) -> tuple[Any, Any]:
    try:
        return load_base(spec, dtype=dtype, device=device, progress=progress)
    except ModelLoadError as e:
        raise TrainError(str(e)) from None


def _model_fingerprint(model, spec: str, dtype: str) -> str:
    """Cheap identity of the base weights: config + a sample of every parameter tensor."""
    h = hashlib.sha256()
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}
    h.update(_sha256_json([cfg, dtype]).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 512)][:512].float().cpu()
            h.update(name.encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.append(src)
        elif isinstance(src, (list, tuple)):
            ids += [int(x) for x in src if isinstance(x, int)]
    return list(dict.fromkeys(ids))


# ======================================================================================
# self-distillation (batched generate, cached as JSONL, resumable)
# ======================================================================================
def _read_jsonl_records(files: Iterable[Path]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in sorted(files):
        try:
            text = f.read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("answer_ids"), list):
                out[rec["key"]] = rec
    return out


def _generation_order(prompts: list, prompt_ids: dict[str, list[int]], held_keys: set[str], seed: int,
                      batch: int) -> list:
    """Held-out first, then train in a seeded random order; inside chunks of 8 batches sorted by
    length (less padding) so a time-limited run still answers a random sample."""
    rng = random.Random(seed * 7919 + 17)
    held = [p for p in prompts if _prompt_key(p) in held_keys]
    train = [p for p in prompts if _prompt_key(p) not in held_keys]
    rng.shuffle(train)
    order = []
    for group in (held, train):
        chunk = 8 * batch
        for i in range(0, len(group), chunk):
            part = group[i: i + chunk]
            part.sort(key=lambda p: len(prompt_ids[_prompt_key(p)]))
            order += part
    return order


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], limits: list[int], eos: Sequence[int], pad: int,
                 temperature: float = 0.0, generator: Optional[torch.Generator] = None
                 ) -> list[tuple[list[int], bool]]:
    """Continue each prompt (token ids) with the model, greedy (or sampled at `temperature`), until
    its EOS or `limits[i]` new tokens. Returns per prompt (answer ids, ended on EOS).

    One left-padded batch; a row that ends leaves the batch (its KV rows dropped with
    ``batch_select_indices``), so the rest no longer pay for it: `generate` keeps computing
    finished rows until the longest answer ends (`scripts/bench_answers.py` compares the two).
    `limits[i]` >= 1."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids, attn, pos = left_padded(prompts, pad, dev)
    B, L = ids.shape
    eos_set = set(int(t) for t in eos)
    answers: list[list[int]] = [[] for _ in range(B)]
    ended = [False] * B
    live = list(range(B))  # batch row r holds prompt live[r]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=last_positions(L, 1, dev))
    while True:
        logits = out.logits[:, -1].float()
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            tok = logits.argmax(-1)
        keep = []
        for r, t in enumerate(tok.tolist()):
            i = live[r]
            answers[i].append(t)
            ended[i] = t in eos_set
            if not ended[i] and len(answers[i]) < limits[i]:
                keep.append(r)
        if not keep:
            return [(a, e) for a, e in zip(answers, ended)]
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=dev)
            cache.batch_select_indices(rows)
            attn, pos, tok = attn[rows], pos[rows], tok[rows]
            live = [live[r] for r in keep]
        attn = torch.cat([attn, attn.new_ones((len(live), 1))], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)


def _self_distill(ctx: _Ctx, args, model, tokenizer, prompts: list, held_keys: set[str], model_fp: str,
                  work: Path, deadline: Optional[float]) -> tuple[dict[str, dict], dict]:
    """Answer every prompt with the base model (cached JSONL, resumable). Returns (records by key, stats)."""
    gen_cfg = {"fmt": SELFDISTILL_FORMAT, "model": model_fp, "max_new": args.gen_max_new_tokens,
               "temperature": args.gen_temperature, "seed": args.seed if args.gen_temperature > 0 else None}
    tag = _sha256_json(gen_cfg)[:12]
    sd_dir = work / "selfdistill"
    if ctx.main:
        sd_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(sd_dir / f"selfdistill-{tag}.json", gen_cfg, default=str)
    ctx.barrier()
    files = list(sd_dir.glob(f"selfdistill-{tag}.rank*.jsonl"))
    done = _read_jsonl_records(files)

    prompt_ids: dict[str, list[int]] = {}
    too_long = 0
    for p in prompts:
        k = _prompt_key(p)
        if k in prompt_ids:
            continue
        ids = render_prompt(p, tokenizer)
        if len(ids) > args.max_len - 2:
            too_long += 1
            continue
        prompt_ids[k] = ids
    todo_all = [p for p in _generation_order([p for p in prompts if _prompt_key(p) in prompt_ids],
                                             prompt_ids, held_keys, args.seed, args.gen_batch_size)
                if _prompt_key(p) not in done]
    # de-duplicate identical prompts (same key)
    seen: set[str] = set()
    todo_all = [p for p in todo_all if not (_prompt_key(p) in seen or seen.add(_prompt_key(p)))]
    batches = [todo_all[i: i + args.gen_batch_size] for i in range(0, len(todo_all), args.gen_batch_size)]
    mine = batches[ctx.rank::ctx.world]
    stats = {"cached": len(done), "to_generate": len(todo_all), "generated_now": 0, "tokens_now": 0,
             "prompt_too_long": too_long, "stopped_by_budget": False, "tag": tag, "seconds": 0.0}
    if todo_all:
        ctx.print(f"self-distillation: {len(done)} answers cached, {len(todo_all)} prompts to answer "
                  f"(batch {args.gen_batch_size}, max {args.gen_max_new_tokens} new tokens, "
                  f"{'greedy' if args.gen_temperature <= 0 else f'T={args.gen_temperature}'})")
    else:
        ctx.print(f"self-distillation: all {len(done)} answers cached ({sd_dir})")
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    dev = next(model.parameters()).device
    t0 = time.time()
    gen_deadline = t0 + args.gen_time_budget_min * 60 if args.gen_time_budget_min > 0 else None
    if deadline is not None:
        gen_deadline = deadline if gen_deadline is None else min(gen_deadline, deadline)
    out_file = sd_dir / f"selfdistill-{tag}.rank{ctx.rank}.jsonl"
    new_records: list[dict] = []
    bar = ctx.tqdm(total=sum(len(b) for b in mine), desc="generate", unit="prompt")
    beat = ctx.heartbeat("self-distillation")
    with open(out_file, "a+", encoding="utf-8") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:  # make sure an interrupted last line does not swallow the next record
            fh.seek(fh.tell() - 1)
            if fh.read(1) != "\n":
                fh.write("\n")
        for bi, batch in enumerate(mine):
            if gen_deadline is not None and time.time() > gen_deadline:
                stats["stopped_by_budget"] = True
                break
            seqs = [prompt_ids[_prompt_key(p)] for p in batch]
            limits = [max(1, min(args.gen_max_new_tokens, args.max_len - len(s))) for s in seqs]
            gen = None
            if args.gen_temperature > 0:
                gen = torch.Generator(device=dev).manual_seed(args.seed * 100003 + bi * ctx.world + ctx.rank)
            answers = answer_batch(model, seqs, limits, eos, pad, args.gen_temperature, gen)
            for p, (ans, finished) in zip(batch, answers):
                rec = {"key": _prompt_key(p), "id": p.id, "answer_ids": ans, "finished": finished,
                       "answer": tokenizer.decode(ans, skip_special_tokens=True)}
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                new_records.append(rec)
                stats["tokens_now"] += len(ans)
            fh.flush()
            stats["generated_now"] += len(batch)
            bar.update(len(batch))
            rate = stats["tokens_now"] / max(1e-9, time.time() - t0)
            if ctx.main and not bar.disable:
                bar.set_postfix(tok_s=f"{rate:.0f}")
            beat(lambda: f"{stats['generated_now']}/{sum(len(b) for b in mine)} prompts (this process), "
                         f"{stats['tokens_now']} tokens, {rate:.0f} tok/s")
    bar.close()
    stats["seconds"] = time.time() - t0
    ctx.barrier()
    done = _read_jsonl_records(sd_dir.glob(f"selfdistill-{tag}.rank*.jsonl"))
    # stats over all processes
    tot = ctx.sum(torch.tensor([float(stats["generated_now"]), float(stats["tokens_now"]),
                                1.0 if stats["stopped_by_budget"] else 0.0], dtype=torch.float64))
    stats["generated_now"], stats["tokens_now"] = int(tot[0].item()), int(tot[1].item())
    stats["stopped_by_budget"] = bool(tot[2].item() > 0)
    if stats["generated_now"]:
        ctx.print(f"self-distillation: answered {stats['generated_now']} prompts, {stats['tokens_now']} tokens "
                  f"in {_fmt_s(stats['seconds'])} ({stats['tokens_now'] / max(1e-9, stats['seconds']):.0f} tok/s)"
                  + ("; stopped by the generation time budget" if stats["stopped_by_budget"] else ""))
    stats["prompt_ids"] = prompt_ids
    return done, stats


# ======================================================================================
# sequences and the draft vocabulary
# ======================================================================================
def _build_sequences(ctx: _Ctx, args, tokenizer, train_p: list, held_p: list,
                     sd_records: Optional[dict[str, dict]], prompt_ids: Optional[dict]) -> tuple[list[Seq], dict]:
    seqs: list[Seq] = []
    info = Counter()
    for split, plist in (("train", train_p), ("held", held_p)):
        for p in plist:
            try:
                if sd_records is not None:
                    rec = sd_records.get(_prompt_key(p))
                    if rec is None:
                        info[f"{split}_unanswered"] += 1
                        continue
                    pids = prompt_ids.get(_prompt_key(p)) if prompt_ids else None
                    if pids is None:
                        pids = render_prompt(p, tokenizer)
                    ans = [int(t) for t in rec["answer_ids"]]
                    ids, mask = pids + ans, [False] * len(pids) + [True] * len(ans)
                else:
                    if not p.has_answer:
                        info[f"{split}_no_answer"] += 1
                        continue
                    ids, mask = render_conversation(p, tokenizer)
            except DataError as e:
                info[f"{split}_render_error"] += 1
                if info[f"{split}_render_error"] <= 3:
                    ctx.print(f"warning: skipped a prompt: {e}")
                continue
            if len(ids) > args.max_len:
                info[f"{split}_truncated"] += 1
                ids, mask = ids[: args.max_len], mask[: args.max_len]
            if sum(mask[2:]) < 1:  # no answer token that any head can predict
                info[f"{split}_no_answer_tokens"] += 1
                continue
            seqs.append(Seq(p.id, torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), split))
    return seqs, dict(info)


def _init_heads(path: str, kinds: list[str], args: TrainConfig, base_config,
                eos: list[int]) -> dict[str, tuple[Path, DraftHeads]]:
    """Trained heads to start each kind from (--init-from), checked against this run's settings.

    `path` is one heads directory (when training one kind) or a directory holding one
    `*-{medusa|hydra|hydrapp}` heads directory per kind. Every kind must share one draft
    vocabulary (the feature cache and the teacher targets are built on it).
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise TrainError(f"--init-from {path}: no such directory")
    found: dict[str, Path] = {}
    if (root / CONFIG_FILE).is_file():
        if len(kinds) != 1:
            raise TrainError(f"--init-from {path} holds one kind of heads but --heads asks for {', '.join(kinds)}; "
                             "give a directory of <name>-<kind> heads (as --out writes them)")
        found[kinds[0]] = root
    else:
        for kind in kinds:
            suffix = KINDS[kind][2]
            cands = sorted(d for d in root.glob(f"*-{suffix}") if (d / CONFIG_FILE).is_file())
            if len(cands) != 1:
                what = "no" if not cands else f"{len(cands)}"
                raise TrainError(f"--init-from {path}: {what} '*-{suffix}' heads directory for {kind} (need exactly one)")
            found[kind] = cands[0]
    heads: dict[str, tuple[Path, DraftHeads]] = {}
    vocab_ref: Optional[torch.Tensor] = None
    for i, (kind, d) in enumerate(found.items()):
        try:
            h = load_heads(d, base_config)
        except CheckpointError as e:
            raise TrainError(f"--init-from: {e}") from None
        cfg = h.config
        hk, prefix, _ = KINDS[kind]
        if cfg.kind != hk or bool(cfg.prefix_layer) != prefix:
            raise TrainError(f"--init-from {d}: these are {cfg.label} heads, not {kind}")
        if not cfg.shared_lm_head or h.lm_heads is not None:
            raise TrainError(f"--init-from {d}: only heads that share the base lm_head can be fine-tuned here")
        # more layers than the init heads is allowed: the extra blocks start as the identity
        # (see _load_init), so the deeper heads begin exactly where the trained ones are
        grow = args.num_layers > cfg.num_layers and not (cfg.shared_block or cfg.shared_all_blocks)
        if cfg.num_heads != args.num_heads or (cfg.num_layers != args.num_layers and not grow):
            raise TrainError(f"--init-from {d}: {cfg.num_heads} heads x {cfg.num_layers} layers, but this run asks for "
                             f"--num-heads {args.num_heads} --num-layers {args.num_layers}"
                             + (" (heads can gain layers, not lose them)" if args.num_layers < cfg.num_layers else ""))
        vocab = h.draft_vocab
        # a --draft-vocab N run keeps N tokens plus any EOS ids (see _build_draft_vocab)
        if args.draft_vocab and (vocab is None or not args.draft_vocab <= int(vocab.numel()) <= args.draft_vocab + len(eos)):
            have = "the full vocabulary" if vocab is None else f"{int(vocab.numel())} tokens"
            raise TrainError(f"--init-from {d}: its draft vocabulary has {have}, not --draft-vocab {args.draft_vocab} "
                             "(drop --draft-vocab to keep theirs)")
        if i == 0:
            vocab_ref = vocab
        elif (vocab is None) != (vocab_ref is None) or (vocab is not None and not torch.equal(vocab, vocab_ref)):
            raise TrainError(f"--init-from {path}: the kinds' draft vocabularies differ; train them in separate runs")
        # every other field too, here and not after the (long) feature extraction
        # heads that read the last hidden state alone can gain feature layers (they start unused, see _load_init)
        layers = list(args.feature_layers) if cfg.feature_layers or hk != "eagle" else cfg.feature_layers
        want = HeadsConfig.for_base(base_config, hk, num_heads=args.num_heads, num_layers=cfg.num_layers,
                                    prefix_layer=prefix, shared_lm_head=True, feature_layers=layers,
                                    draft_vocab_size=None if vocab is None else int(vocab.numel()))
        bad = _config_mismatch(want, cfg)
        if bad:
            raise TrainError(f"--init-from {d}: the heads do not match this run ({'; '.join(bad)})")
        heads[kind] = (d, h)
    return heads


def _load_init(heads: DraftHeads, init: DraftHeads) -> None:
    """Copy trained heads into fresh `heads` of the same config, with more layers per head, or
    (EAGLE) with feature layers added. Added blocks get W = 0 and b = 0: SiLU(0) = 0 makes each an
    exact identity, so the grown heads draft exactly like `init` at step 0 (and the gradient 0.5 x
    lets them learn); added feature layers keep their init (the projection takes the last hidden
    state alone)."""
    missing, unexpected = heads.load_state_dict(init.state_dict(), strict=False)
    old_layers = init.config.num_layers
    added = {f"blocks.{k}.{j}.linear.{w}" for k in range(heads.num_heads)
             for j in range(old_layers, heads.config.num_layers) for w in ("weight", "bias")}
    if heads.config.feature_layers and not init.config.feature_layers:
        added |= {n for n, _ in heads.named_parameters() if n.startswith(("eagle.project.", "eagle.feature_norms."))}
    if unexpected or set(missing) != added:
        raise TrainError(f"--init-from: the heads' weights do not fit this run (missing {sorted(set(missing) - added)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    with torch.no_grad():
        for blocks in heads.blocks:  # none for EAGLE heads (one draft layer, no per-head blocks)
            for block in blocks[old_layers:]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()


def _config_mismatch(new: HeadsConfig, old: HeadsConfig) -> list[str]:
    """Fields (besides provenance) where a fresh config for this run differs from the init heads'."""
    a, b = new.to_dict(), old.to_dict()
    out = []
    for k in sorted(set(a) | set(b)):
        if k in ("base_model", "notes", "format", "meta"):
            continue
        x, y = a.get(k), b.get(k)
        if isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=1e-5):
            continue
        if x != y:
            out.append(f"{k} {y} (init) vs {x}")
    return out


def _build_draft_vocab(seqs: list[Seq], n: int, vocab_size: int, eos: list[int]) -> Optional[torch.Tensor]:
    """The n most frequent answer tokens of the training split plus EOS (sorted ids); None = full vocab."""
    if n <= 0 or n >= vocab_size:
        return None
    cnt = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        if s.split == "train":
            cnt += torch.bincount(s.ids[s.mask], minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(cnt[i]), i))
    chosen = [i for i in order[:n] if cnt[i] > 0]
    for e in eos:
        if 0 <= e < vocab_size and e not in chosen:
            chosen.append(e)
    if not chosen:
        chosen = [0]
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ======================================================================================
# features: base hidden states + teacher top-k (+ full-vocab greedy)
# ======================================================================================
def _feature_batches(lengths: list[int], budget_tokens: int, max_batch: int = 64) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        L = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * L > budget_tokens or len(cur) >= max_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class _FeatureExtractor:
    """Teacher-forced base forwards -> per sequence: hidden [T,h] (post-norm last hidden state),
    teacher top-k draft ids / probs [T,k] (softmax over the draft vocab) and greedy [T], the
    base model's full-vocab argmax.  Only held-out sequences need `greedy` (evaluation); for
    training sequences it is -1 and only the draft-vocab rows of the LM head are computed.
    """

    def __init__(self, model, draft_vocab: Optional[torch.Tensor], topk: int, store_dtype: torch.dtype,
                 batch_tokens: int, layers: Sequence[int] = ()):
        self.model = model
        self.layers = tuple(layers)  # `hidden` = base_features(..., layers): these layers, then the last hidden state
        self.dev = next(model.parameters()).device
        self.lm = model.get_output_embeddings()
        self.dv = None if draft_vocab is None else draft_vocab.to(self.dev)
        w = self.lm.weight
        b = getattr(self.lm, "bias", None)
        self.draft_w = w if self.dv is None else w.index_select(0, self.dv)
        self.draft_b = None if b is None else (b if self.dv is None else b.index_select(0, self.dv))
        n_draft = model.get_output_embeddings().weight.shape[0] if draft_vocab is None else int(draft_vocab.numel())
        self.topk = min(topk, n_draft)
        self.store_dtype = store_dtype
        self.batch_tokens = batch_tokens
        self._logits_to_keep = True
        self._decoder: Any = None

    def _hidden(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The heads' base features [B, T, F]: `base_features(model(..., output_hidden_states=True)
        .hidden_states, layers)`, the post-norm last hidden states alone (F = h) without layers.

        The decoder alone is used when the model exposes it: same tensors, without the LM head
        (and without the per-layer hidden states when none are read: about 1.5x faster on CPU).
        """
        hs = bool(self.layers)
        if self._decoder is None:
            get = getattr(self.model, "get_decoder", None)
            dec = get() if callable(get) else None
            self._decoder = dec if isinstance(dec, nn.Module) and dec is not self.model else False
        if self._decoder is not False:
            try:
                out = self._decoder(input_ids=ids, attention_mask=att, use_cache=False, output_hidden_states=hs)
                if hs and getattr(out, "hidden_states", None) is not None:
                    return base_features(out.hidden_states, self.layers)
                h = getattr(out, "last_hidden_state", None)
                if h is not None and not hs:
                    return h
            except TypeError:
                pass
            self._decoder = False
        kw = dict(input_ids=ids, attention_mask=att, output_hidden_states=True, use_cache=False)
        if self._logits_to_keep:
            try:
                out = self.model(**kw, logits_to_keep=last_positions(ids.shape[1], 1, ids.device))
                return base_features(out.hidden_states, self.layers)
            except TypeError:
                self._logits_to_keep = False
        return base_features(self.model(**kw).hidden_states, self.layers)

    @torch.no_grad()
    def __call__(self, seqs: list[Seq], progress=None) -> list[dict[str, torch.Tensor]]:
        out: list[Optional[dict]] = [None] * len(seqs)
        for batch in _feature_batches([len(s) for s in seqs], self.batch_tokens):
            L = max(len(seqs[i]) for i in batch)
            ids = torch.zeros((len(batch), L), dtype=torch.long)
            att = torch.zeros((len(batch), L), dtype=torch.long)
            for j, i in enumerate(batch):
                n = len(seqs[i])
                ids[j, :n] = seqs[i].ids
                att[j, :n] = 1
            hs = self._hidden(ids.to(self.dev), att.to(self.dev))
            for j, i in enumerate(batch):
                n = len(seqs[i])
                h = hs[j, :n]
                greedy, tids, tps = [], [], []
                need_greedy = seqs[i].split != "train"
                for c in range(0, n, 2048):
                    hc = h[c: c + 2048, -self.draft_w.shape[1]:]  # the last hidden state
                    if need_greedy or self.dv is None:
                        logits = self.lm(hc).float()
                        greedy.append(logits.argmax(-1) if need_greedy else torch.full_like(logits[:, 0], -1, dtype=torch.long))
                        dl = logits if self.dv is None else logits.index_select(-1, self.dv)
                    else:
                        dl = F.linear(hc, self.draft_w, self.draft_b).float()
                        greedy.append(torch.full((hc.shape[0],), -1, dtype=torch.long, device=hc.device))
                    top = torch.softmax(dl, dim=-1).topk(self.topk, dim=-1)
                    tids.append(top.indices)
                    tps.append(top.values)
                out[i] = {"hidden": h.to(self.store_dtype).cpu(),
                          "tids": torch.cat(tids).to(torch.int32).cpu(),
                          "tp": torch.cat(tps).to(torch.float16).cpu(),
                          "greedy": torch.cat(greedy).to(torch.int32).cpu()}
            if progress is not None:
                progress(len(batch), sum(len(seqs[i]) for i in batch))
        return out  # type: ignore[return-value]


def _feature_key(model_fp: str, seqs: list[Seq], draft_vocab: Optional[torch.Tensor], topk: int,
                 store_dtype: torch.dtype, max_len: int, layers: Sequence[int] = ()) -> str:
    h = hashlib.sha256()
    h.update(_sha256_json([FEATURE_FORMAT, model_fp, topk, str(store_dtype), max_len,
                           None if draft_vocab is None else draft_vocab.tolist()]
                          + ([list(layers)] if layers else [])).encode())  # caches of the last hidden state keep their keys
    for s in seqs:
        h.update(s.split.encode())
        h.update(s.ids.numpy().tobytes())
        h.update(s.mask.numpy().tobytes())
    return h.hexdigest()


class _FeatureStore:
    """Features of every sequence in memory (flat per-field tensors + offsets)."""

    def __init__(self, per_seq: list[dict[str, torch.Tensor]]):
        self.offsets = [0]
        for f in per_seq:
            self.offsets.append(self.offsets[-1] + f["hidden"].shape[0])
        self.flat = {k: torch.cat([f[k] for f in per_seq]) for k in ("hidden", "tids", "tp", "greedy")}

    def get(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return {k: v[a:b] for k, v in self.flat.items()}


def _cached_features(ctx: _Ctx, args, extractor: _FeatureExtractor, seqs: list[Seq], key: str, work: Path,
                     shard_size: int) -> tuple[_FeatureStore, dict]:
    """Load the feature cache for `key`, computing missing shards (each process its share)."""
    from safetensors.torch import load_file, save_file

    root = work / "features"
    d = root / key[:20]
    manifest_path = d / "manifest.json"
    n_shards = (len(seqs) + shard_size - 1) // shard_size
    info = {"dir": str(d), "key": key, "shards": n_shards, "reused": False, "computed_shards": 0, "seconds": 0.0}
    manifest = None
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            manifest = None
    valid = bool(manifest and manifest.get("key") == key and manifest.get("n_seqs") == len(seqs)
                 and all((d / f).is_file() for f in manifest.get("files", [])))
    if ctx.main and not valid and root.is_dir():
        # caches of other inputs stay (each is keyed: going back to those settings reuses it; a
        # run with another seed or file must not delete 16 minutes of work), but say what they hold
        others = [o for o in root.iterdir() if o.is_dir() and o.name != d.name and (o / "manifest.json").exists()]
        if others:
            size = sum(f.stat().st_size for o in others for f in o.iterdir() if f.is_file())
            ctx.print(f"features: {len(others)} cache(s) of other inputs kept in {root} ({size / 1e9:.2f} GB); "
                      "delete them to free the space")
    if ctx.main:
        d.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    files = [f"shard-{i:05d}.safetensors" for i in range(n_shards)]
    t0 = time.time()
    if not valid:
        mine = [i for i in range(n_shards) if i % ctx.world == ctx.rank and not (d / files[i]).is_file()]
        ntok = sum(len(s) for i in mine for s in seqs[i * shard_size:(i + 1) * shard_size])
        done_shards = n_shards - len([i for i in range(n_shards) if not (d / files[i]).is_file()])
        ctx.print(f"features: extracting {n_shards - done_shards} of {n_shards} shards "
                  f"({len(seqs)} sequences) into {d}")
        bar = ctx.tqdm(total=ntok, desc="features", unit="tok")
        beat = ctx.heartbeat("features")
        done_tok = [0]

        def progress(nb: int, nt: int) -> None:
            bar.update(nt)
            done_tok[0] += nt
            beat(lambda: f"{done_tok[0]}/{ntok} tokens (this process), "
                         f"{done_tok[0] / max(1e-9, time.time() - t0):.0f} tok/s")

        for i in mine:
            part = seqs[i * shard_size:(i + 1) * shard_size]
            feats = extractor(part, progress=progress)
            tensors: dict[str, torch.Tensor] = {}
            for k in ("hidden", "tids", "tp", "greedy"):
                tensors[k] = torch.cat([f[k] for f in feats]).contiguous()
            tensors["lengths"] = torch.tensor([len(s) for s in part], dtype=torch.int64)
            tmp = d / (files[i] + f".tmp{ctx.rank}")
            save_file(tensors, str(tmp), metadata={"key": key, "format": FEATURE_FORMAT})
            tmp.replace(d / files[i])
            info["computed_shards"] += 1
        bar.close()
        ctx.barrier()
        if ctx.main:
            write_json_atomic(manifest_path, {"format": FEATURE_FORMAT, "key": key, "n_seqs": len(seqs),
                                               "shard_size": shard_size, "files": files,
                                               "n_tokens": sum(len(s) for s in seqs),
                                               "created": _dt.datetime.now().isoformat(timespec="seconds")})
        ctx.barrier()
    else:
        info["reused"] = True
    per_seq: list[dict[str, torch.Tensor]] = []
    for i, f in enumerate(files):
        t = load_file(str(d / f))
        lengths = t["lengths"].tolist()
        exp = [len(s) for s in seqs[i * shard_size:(i + 1) * shard_size]]
        if lengths != exp:
            raise TrainError(f"feature cache {d / f} does not match the sequences; delete {d} and retry")
        off = 0
        for n in lengths:
            per_seq.append({k: t[k][off: off + n] for k in ("hidden", "tids", "tp", "greedy")})
            off += n
    info["seconds"] = time.time() - t0
    info["bytes"] = sum((d / f).stat().st_size for f in files)
    return _FeatureStore(per_seq), info


# ======================================================================================
# the heads' training / evaluation computation
# ======================================================================================
def head_inputs(kind: str, feat: torch.Tensor, emb: Optional[torch.Tensor], bi: torch.Tensor, ti: torch.Tensor,
                k: int) -> torch.Tensor:
    """Inputs of head k at positions (bi, ti) — the rows `DraftHeads.training_logits` builds.

    feat [B, T, h] head features (base hidden states, after the Hydra++ prefix layer if
    any; EAGLE: a list, the draft layer's output after each step); emb [B, T, h] base
    embeddings of the tokens (Hydra only).
    Medusa: h_t.  Hydra: cat[h_t, E(x_{t+1}), ..., E(x_{t+k+1})].  EAGLE: step k's output at t.
    """
    if kind == "eagle":
        return feat[k][bi, ti]
    x = feat[bi, ti]
    if kind == "medusa":
        return x
    return torch.cat([x] + [emb[bi, ti + j] for j in range(1, k + 2)], dim=-1)


class _HeadsTrainer(nn.Module):
    """All head kinds + the frozen pieces of the base they need (not parameters/buffers)."""

    def __init__(self, heads: dict[str, DraftHeads], embed_w: torch.Tensor, lm_w: torch.Tensor,
                 remap: torch.Tensor, lm_loss_w: float, teacher_loss_w: float):
        super().__init__()
        self.heads = nn.ModuleDict({KINDS[k][2]: h for k, h in heads.items()})
        self.labels = {KINDS[k][2]: k for k in heads}
        # frozen tensors kept as plain attributes: not trained, not synced by DDP, not checkpointed
        self.embed_w = embed_w
        self.lm_w = lm_w
        self.remap = remap  # full-vocab id -> draft index, -1 outside the draft vocab
        self.lm_loss_w = lm_loss_w
        self.teacher_loss_w = teacher_loss_w

    def forward(self, batch: dict[str, torch.Tensor], norms: torch.Tensor, scale: float):
        """Training loss. norms [K, 2] global counts (teacher positions, in-vocab lm positions)."""
        ids, amask, hidden = batch["ids"], batch["amask"], batch["hidden"]
        emb = F.embedding(ids, self.embed_w).to(hidden.dtype)
        tgt_all = self.remap[ids]
        total = hidden.new_zeros(())
        stats: dict[str, torch.Tensor] = {}
        for suffix, heads in self.heads.items():
            feat = heads.features(hidden, emb)
            K = heads.num_heads
            st = torch.zeros(K, 5, dtype=torch.float64, device=hidden.device)  # n, n_lm, lm_sum, t_sum, top1
            kind_loss = hidden.new_zeros(())
            for k in range(K):
                bi, ti = amask[:, k + 2:].nonzero(as_tuple=True)
                x = head_inputs(heads.config.kind, feat, emb, bi, ti, k)
                logits = heads.head_logits(k, x, self.lm_w).float()
                logp = torch.log_softmax(logits, dim=-1)
                tgt = tgt_all[bi, ti + k + 2]
                ok = tgt >= 0
                lm_sum = -(logp[ok].gather(-1, tgt[ok, None])).sum() if bool(ok.any()) else logp.sum() * 0
                tp = batch["tp"][bi, ti + k + 1]
                tp = tp / tp.sum(-1, keepdim=True).clamp_min(1e-12)
                t_sum = -(tp * logp.gather(-1, batch["tids"][bi, ti + k + 1])).sum()
                n_t, n_lm = norms[k, 0].clamp_min(1.0), norms[k, 1].clamp_min(1.0)
                kind_loss = kind_loss + self.lm_loss_w * lm_sum / n_lm + self.teacher_loss_w * t_sum / n_t
                with torch.no_grad():
                    top1 = (logits.argmax(-1) == tgt).sum() if logits.shape[0] else torch.zeros((), device=hidden.device)
                    st[k] = torch.stack([torch.tensor(float(bi.numel()), device=hidden.device, dtype=torch.float64),
                                         ok.sum().double(), lm_sum.detach().double(), t_sum.detach().double(),
                                         top1.double()])
            stats[suffix] = st
            total = total + kind_loss
        return total * scale, stats

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held-out counts per kind: [K, 3] (n, top1, top5 vs the base greedy token) and
        chain [2] (positions, sum of accepted-chain lengths)."""
        ids, amask, hidden = batch["ids"], batch["amask"], batch["hidden"]
        B, T = ids.shape
        emb = F.embedding(ids, self.embed_w).to(hidden.dtype)
        greedy_d = self.remap[batch["greedy"].clamp_min(0)]
        out = {}
        for suffix, heads in self.heads.items():
            feat = heads.features(hidden, emb)
            K = heads.num_heads
            counts = torch.zeros(K, 3, dtype=torch.float64, device=hidden.device)
            correct = torch.zeros(K, B, T, dtype=torch.bool, device=hidden.device)
            valid = torch.zeros(K, B, T, dtype=torch.bool, device=hidden.device)
            for k in range(K):
                bi, ti = amask[:, k + 2:].nonzero(as_tuple=True)
                if bi.numel() == 0:
                    continue
                logits = heads.head_logits(k, head_inputs(heads.config.kind, feat, emb, bi, ti, k), self.lm_w)
                g = greedy_d[bi, ti + k + 1]
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                c1 = top[:, 0] == g
                c5 = (top == g[:, None]).any(-1)
                counts[k] = torch.tensor([bi.numel(), c1.sum().item(), c5.sum().item()], dtype=torch.float64)
                correct[k, bi, ti] = c1
                valid[k, bi, ti] = True
            chain_ok = valid.all(0)
            cum = torch.cumprod(correct.double(), dim=0).sum(0)  # [B, T] accepted drafts along the chain
            out[suffix] = counts
            out[suffix + "/chain"] = torch.tensor([chain_ok.sum().item(), (1.0 + cum[chain_ok]).sum().item()],
                                                  dtype=torch.float64, device=hidden.device)
        return out


def _collate(seqs: list[Seq], idxs: list[int], feats: dict[int, dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    B = len(idxs)
    T = max(len(seqs[i]) for i in idxs)
    f0 = feats[idxs[0]]
    h = f0["hidden"].shape[-1]
    k = f0["tids"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    amask = torch.zeros(B, T, dtype=torch.bool)
    hidden = torch.zeros(B, T, h, dtype=torch.float32)
    tids = torch.zeros(B, T, k, dtype=torch.long)
    tp = torch.zeros(B, T, k, dtype=torch.float32)
    greedy = torch.zeros(B, T, dtype=torch.long)
    for j, i in enumerate(idxs):
        n = len(seqs[i])
        f = feats[i]
        ids[j, :n] = seqs[i].ids
        amask[j, :n] = seqs[i].mask
        hidden[j, :n] = f["hidden"].float()
        tids[j, :n] = f["tids"].long()
        tp[j, :n] = f["tp"].float()
        greedy[j, :n] = f["greedy"].long()
    out = {"ids": ids, "amask": amask, "hidden": hidden, "tids": tids, "tp": tp, "greedy": greedy}
    return {k2: v.to(device) for k2, v in out.items()}


def _batch_norms(batch_seqs: list[Seq], remap_cpu: torch.Tensor, K: int) -> torch.Tensor:
    """[K, 2] counts of (teacher positions, in-vocab lm positions) for head k in these sequences."""
    out = torch.zeros(K, 2, dtype=torch.float64)
    for s in batch_seqs:
        inv = remap_cpu[s.ids] >= 0
        for k in range(K):
            m = s.mask[k + 2:]
            out[k, 0] += float(m.sum())
            out[k, 1] += float((m & inv[k + 2:]).sum())
    return out


# ======================================================================================
# data order, schedule, checkpoints
# ======================================================================================
def _epoch_perm(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch) * 7_919 + 12_345)
    return torch.randperm(n, generator=g).tolist()


class _Order:
    """Seeded, step-indexed data order: global step -> the sequence indices of its batch."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        # full batches only (the tail of a permutation is left for later epochs), so every
        # process always gets its share of every batch
        self.steps_per_epoch = max(1, n // batch)
        self._cache: dict[int, list[int]] = {}

    def batch_at(self, step: int) -> tuple[int, list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch not in self._cache:
            self._cache = {epoch: _epoch_perm(self.n, self.seed, epoch)}
        perm = self._cache[epoch]
        return epoch, perm[i * self.batch:(i + 1) * self.batch]


def _ckpt_dir(work: Path) -> Path:
    return work / "ckpt"


def _latest_ckpt(work: Path) -> Optional[Path]:
    ptr = _ckpt_dir(work) / "latest.json"
    if not ptr.is_file():
        return None
    try:
        name = json.loads(ptr.read_text())["dir"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    d = _ckpt_dir(work) / name
    return d if (d / "trainer_state.json").is_file() else None


def _save_ckpt(ctx: _Ctx, work: Path, state: dict) -> Path:
    root = _ckpt_dir(work)
    name = f"step-{state['step']:07d}"
    d = root / name
    tmp = root / (name + ".tmp")
    if ctx.main:
        if tmp.exists():
            shutil.rmtree(tmp)
        root.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    ctx.acc.save_state(str(tmp))
    ctx.barrier()
    if ctx.main:
        write_json_atomic(tmp / "trainer_state.json", state, default=str)
        if d.exists():
            shutil.rmtree(d)
        tmp.replace(d)
        write_json_atomic(root / "latest.json", {"dir": name, "step": state["step"]}, default=str)
        for other in root.iterdir():
            if other.is_dir() and other.name != name and other.name.startswith("step-"):
                shutil.rmtree(other, ignore_errors=True)
    ctx.barrier()
    return d


# ======================================================================================
# evaluation summary
# ======================================================================================
def _eval_heldout(ctx: _Ctx, trainer: _HeadsTrainer, seqs: list[Seq], held_idx: list[int], get_feats, batch: int,
                  autocast) -> Optional[dict]:
    if not held_idx:
        return None
    mine = held_idx[ctx.rank::ctx.world]
    acc: dict[str, torch.Tensor] = {}
    for suffix, heads in trainer.heads.items():
        acc[suffix] = torch.zeros(heads.num_heads, 3, dtype=torch.float64)
        acc[suffix + "/chain"] = torch.zeros(2, dtype=torch.float64)
    trainer.eval()
    for i in range(0, len(mine), batch):
        idxs = mine[i: i + batch]
        b = _collate(seqs, idxs, get_feats(idxs), ctx.device)
        with autocast():
            res = trainer.evaluate(b)
        for key, v in res.items():
            acc[key] += v.cpu()
    trainer.train()
    out: dict[str, Any] = {}
    for suffix in trainer.heads:
        c = ctx.sum(acc[suffix].to(ctx.device)).cpu()
        ch = ctx.sum(acc[suffix + "/chain"].to(ctx.device)).cpu()
        n = c[:, 0].clamp_min(1)
        out[trainer.labels[suffix]] = {
            "top1": [round(float(x), 4) for x in (c[:, 1] / n)],
            "top5": [round(float(x), 4) for x in (c[:, 2] / n)],
            "positions": [int(x) for x in c[:, 0]],
            "tau_chain": round(float(ch[1] / ch[0].clamp_min(1)), 4),
            "chain_positions": int(ch[0]),
        }
    return out


# ======================================================================================
# the run
# ======================================================================================
@dataclass
class TrainResult:
    heads: dict[str, DraftHeads]
    out_dirs: dict[str, Path]
    report: dict
    report_path: Optional[Path] = None
    extra: dict = field(default_factory=dict)


def _read_data(args: TrainConfig) -> PromptSet:
    """The prompt set to train on; TrainError when it is missing or has nothing to train on."""
    data_path = Path(args.data).expanduser()
    if not data_path.exists():
        raise TrainError(f"data file not found: {args.data}")
    if data_path.is_dir():
        raise TrainError(f"--data {args.data} is a directory; pass a prompt/conversation file")
    try:
        pset = load_prompts(data_path)
    except DataError as e:
        raise TrainError(str(e)) from None
    if not args.self_distill and not any(p.has_answer for p in pset.prompts):
        raise TrainError(f"{args.data}: no row has an assistant answer to train on; "
                         "add answers or pass --self-distill to generate them with the base model")
    return pset


def _vocab_remap(draft_vocab: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """[vocab_size] full-vocabulary id -> draft row (-1: outside the draft vocabulary)."""
    if draft_vocab is None:
        return torch.arange(vocab_size)
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[draft_vocab] = torch.arange(draft_vocab.numel())
    return remap


def _planned_steps(args: TrainConfig, steps_per_epoch: int) -> int:
    """Steps the LR schedule is planned for: --epochs, capped by --max-steps."""
    planned = args.max_steps if args.max_steps else 0
    if args.epochs > 0:
        by_epochs = max(1, math.ceil(args.epochs * steps_per_epoch))
        planned = min(planned, by_epochs) if planned else by_epochs
    return planned


def _new_heads(kinds: list[str], args: TrainConfig, base_config, base_name: str, draft_vocab: Optional[torch.Tensor],
               n_draft: int, init: dict[str, tuple[Path, DraftHeads]]) -> dict[str, DraftHeads]:
    """kind -> fresh float32 heads (or the --init-from weights) over the draft vocabulary."""
    heads: dict[str, DraftHeads] = {}
    for kind in kinds:
        hk, prefix, _ = KINDS[kind]
        cfg = HeadsConfig.for_base(base_config, hk, num_heads=args.num_heads, num_layers=args.num_layers, prefix_layer=prefix,
                                   draft_vocab_size=None if draft_vocab is None else n_draft, shared_lm_head=True,
                                   feature_layers=list(args.feature_layers))
        cfg.base_model = base_name
        h = DraftHeads(cfg)
        if kind in init:  # start from the trained weights (config checked by _init_heads)
            _load_init(h, init[kind][1])
        if draft_vocab is not None:
            h.draft_vocab.copy_(draft_vocab)
        heads[kind] = h.float()
    return heads


def _train_record(agg: dict[str, torch.Tensor], labels: dict[str, str], args: TrainConfig, gnorms: dict[str, float]) -> tuple[dict, list[str]]:
    """Per heads kind: loss, per-head LM / teacher losses and top-1 from the summed step statistics
    `agg` (suffix -> [K, 5]: positions, targets, lm loss, teacher loss, top-1 hits); and a short
    text per kind for the progress line."""
    rec, parts = {}, []
    for s, v in agg.items():
        n = v[:, 0].clamp_min(1)
        lm = (v[:, 2] / v[:, 1].clamp_min(1))
        tl = (v[:, 3] / n)
        top1 = (v[:, 4] / v[:, 1].clamp_min(1))
        label = labels[s]
        loss_v = float((args.lm_loss_weight * lm + args.teacher_loss_weight * tl).sum())
        rec[label] = {"loss": round(loss_v, 4), "lm": [round(float(x), 4) for x in lm],
                      "teacher": [round(float(x), 4) for x in tl], "train_top1": [round(float(x), 4) for x in top1],
                      "grad_norm": round(gnorms.get(label, float("nan")), 4)}
        parts.append(f"{label} {loss_v:.3f} top1 " + "/".join(f"{float(x):.2f}" for x in top1))
    return rec, parts


_RECIPE_FIELDS = ("heads", "num_heads", "num_layers", "draft_vocab", "self_distill", "gen_max_new_tokens", "gen_batch_size",
                  "gen_temperature", "held_out", "max_prompts", "max_len", "epochs", "max_steps", "time_budget_min",
                  "batch_size", "lr", "warmup", "weight_decay", "final_lr_mult", "max_grad_norm", "lm_loss_weight",
                  "teacher_loss_weight", "teacher_topk", "mixed_precision", "dtype", "seed", "init_from")


@dataclass
class _Sequences:
    """The tokenized train and held-out sequences (answers from the file or self-distilled)."""

    seqs: list[Seq]
    train_idx: list[int]
    held_idx: list[int]
    n_train_prompts: int
    n_held_prompts: int
    info: str  # notes from building the sequences (rows without answers, cut sequences, ...)
    self_distill: Optional[dict]  # generation statistics when the base answered the prompts

    @property
    def n_train_answer_tokens(self) -> int:
        return sum(int(self.seqs[i].mask.sum()) for i in self.train_idx)


@dataclass
class _Vocab:
    """The draft vocabulary: ids [n] (None: the whole vocabulary) and the full-id -> row map."""

    ids: Optional[torch.Tensor]
    remap: torch.Tensor
    size: int


@dataclass
class _Progress:
    """Where training stands; saved with every checkpoint and restored by --resume."""

    step: int = 0
    planned: int = 0
    fitted: bool = False  # the schedule was fitted to the time budget
    history: list = field(default_factory=list)
    train_seconds: float = 0.0  # training time of the steps done (`_train_loop` adds this run's at its end)
    positions: int = 0
    stop_reason: str = "completed"

    def state(self, sig: dict, args: TrainConfig, train_seconds: Optional[float] = None) -> dict:
        return _trainer_state(self.step, self.planned, self.fitted, self.history,
                              self.train_seconds if train_seconds is None else train_seconds, self.positions, sig, args)


def _sequences(ctx: _Ctx, args: TrainConfig, model, tokenizer, prompts: list, model_fp: str, work: Path,
               deadline: Optional[float]) -> _Sequences:
    """Split the prompts, answer them with the base model (--self-distill), tokenize."""
    train_p, held_p = split_prompts(prompts, args.held_out, args.seed)
    if args.max_prompts and len(train_p) > args.max_prompts:
        rng = random.Random(args.seed)
        keep = set(rng.sample(range(len(train_p)), args.max_prompts))
        train_p = [p for i, p in enumerate(train_p) if i in keep]
    held_keys = {_prompt_key(p) for p in held_p}
    sd_stats = sd_records = prompt_ids = None
    if args.self_distill:
        sd_records, sd_stats = _self_distill(ctx, args, model, tokenizer, train_p + held_p, held_keys,
                                             model_fp, work, deadline)
        prompt_ids = sd_stats.pop("prompt_ids")
    seqs, seq_info = _build_sequences(ctx, args, tokenizer, train_p, held_p, sd_records, prompt_ids)
    data = _Sequences(seqs, [i for i, s in enumerate(seqs) if s.split == "train"],
                      [i for i, s in enumerate(seqs) if s.split == "held"], len(train_p), len(held_p), seq_info, sd_stats)
    if not data.train_idx:
        why = "no prompt was answered (generation budget too small?)" if args.self_distill else \
            "no training row has an assistant answer"
        raise TrainError(f"{args.data}: no usable training sequence: {why} ({seq_info or 'no rows'})")
    if args.batch_size < ctx.world:
        raise TrainError(f"--batch-size {args.batch_size} is smaller than the {ctx.world} processes")
    ctx.print(f"sequences: {len(data.train_idx)} train ({data.n_train_answer_tokens} answer tokens), "
              f"{len(data.held_idx)} held-out" + (f"; {seq_info}" if seq_info else ""))
    return data


def _draft_vocabulary(ctx: _Ctx, args: TrainConfig, data: _Sequences, vocab_size: int, eos: list[int],
                      init: dict[str, tuple[Path, DraftHeads]]) -> _Vocab:
    """--init-from heads keep the rows they were trained on; new heads take the most frequent answer tokens."""
    if init:
        ids = next(iter(init.values()))[1].draft_vocab
        ids = None if ids is None else ids.clone().cpu()
    else:
        ids = _build_draft_vocab(data.seqs, args.draft_vocab, vocab_size, eos)
    vocab = _Vocab(ids, _vocab_remap(ids, vocab_size), vocab_size if ids is None else int(ids.numel()))
    if ids is not None:
        held = [data.seqs[i].ids[data.seqs[i].mask] for i in data.held_idx]
        held_ans = torch.cat(held) if held else torch.zeros(0, dtype=torch.long)
        cov = float((vocab.remap[held_ans] >= 0).float().mean()) if held_ans.numel() else float("nan")
        ctx.print(f"draft vocabulary: {vocab.size} of {vocab_size} tokens (held-out answer coverage {cov:.3f})")
    return vocab


def _feature_source(ctx: _Ctx, args: TrainConfig, model, data: _Sequences, vocab: _Vocab, model_fp: str, work: Path,
                    use_cache: bool):
    """get_feats(sequence indices) -> their base hidden states and teacher top-k: from a cache on
    disk computed once, or computed per batch (held-out ones kept); and what was done."""
    base_dtype = next(model.parameters()).dtype
    store_dtype = torch.bfloat16 if base_dtype == torch.bfloat16 else torch.float16
    extractor = _FeatureExtractor(model, vocab.ids, args.teacher_topk, store_dtype, args.feature_batch_tokens,
                                  args.feature_layers)
    info: dict[str, Any] = {"cached": bool(use_cache)}
    seqs = data.seqs
    if use_cache:
        key = _feature_key(model_fp, seqs, vocab.ids, args.teacher_topk, store_dtype, args.max_len, args.feature_layers)
        store, fi = _cached_features(ctx, args, extractor, seqs, key, work, args.feature_shard_size)
        info.update(fi)
        ctx.print(f"features: {'reused cache' if fi['reused'] else 'computed'} ({fi['bytes'] / 1e6:.1f} MB, "
                  f"{_fmt_s(fi['seconds'])})")
        return (lambda idxs: {i: store.get(i) for i in idxs}), info
    held_feats: dict[int, dict] = {}

    def get_feats(idxs: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        miss = [i for i in idxs if i not in held_feats]
        got = dict(zip(miss, extractor([seqs[i] for i in miss]))) if miss else {}
        for i, f in got.items():
            if seqs[i].split == "held":
                held_feats[i] = f
        return {i: (held_feats[i] if i in held_feats else got[i]) for i in idxs}

    return get_feats, info


def _resume(ctx: _Ctx, accelerator, work: Path, run_sig: dict, planned: int) -> _Progress:
    """The latest checkpoint's progress (optimizer and heads restored into `accelerator`); a fresh
    start when there is none. TrainError when it was made with other settings or data."""
    ck = _latest_ckpt(work)
    if ck is None:
        ctx.print(f"--resume: no checkpoint in {_ckpt_dir(work)}; starting from step 0")
        return _Progress(planned=planned)
    st = json.loads((ck / "trainer_state.json").read_text())
    diff = [k for k in run_sig if st.get("signature", {}).get(k) != run_sig[k]]
    if diff:
        raise TrainError(f"checkpoint {ck} was made with different {', '.join(diff)}; "
                         "use the same settings and data, another --work-dir, or drop --resume")
    accelerator.load_state(str(ck))
    prog = _Progress(step=int(st["step"]), planned=int(st["planned_steps"]), fitted=bool(st.get("fitted", False)),
                     history=st.get("history", []), train_seconds=float(st.get("train_seconds", 0.0)),
                     positions=int(st.get("positions", 0)))
    ctx.print(f"resumed from {ck} at step {prog.step} of {prog.planned}")
    return prog


def _fit_schedule(ctx: _Ctx, args: TrainConfig, prog: _Progress, step_times: list[float], deadline: float,
                  n_held: int) -> None:
    """Shorten the planned steps (the LR schedule with them) to what the time budget leaves, once
    the step time is known."""
    sec = sorted(step_times[2:])[len(step_times[2:]) // 2]
    n_evals = (prog.planned // args.eval_every + 1) if args.eval_every else 1
    eval_cost = n_evals * sec * max(1, n_held) / max(1, args.batch_size) / 3
    left = deadline - time.time() - eval_cost - 10.0
    can = prog.step + max(1, int(0.97 * left / max(1e-6, sec)))
    new_planned = ctx.bcast(min(prog.planned, max(prog.step + 1, can)))
    prog.fitted = True
    if new_planned < prog.planned:
        ctx.print(f"time budget: {sec:.2f}s/step -> schedule shortened from {prog.planned} to {new_planned} steps")
        prog.planned = new_planned


def _log_jsonl(ctx: _Ctx, path: Path, record: dict) -> None:
    if ctx.main:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def _train_loop(ctx: _Ctx, args: TrainConfig, accelerator, trainer_p, core: "_HeadsTrainer", optimizer,
                order: "_Order", data: _Sequences, vocab: _Vocab, get_feats, prog: _Progress, run_sig: dict,
                work: Path, deadline: Optional[float], t_start: float, use_cache: bool) -> Optional[dict]:
    """Train from prog.step to prog.planned (or the budget's end); logs, evals and checkpoints on
    the way; then the final held-out evaluation (returned: kind -> figures) and checkpoint.
    Updates `prog`."""
    ctx.print(f"training: {prog.planned} planned steps ({order.steps_per_epoch} per epoch, batch {args.batch_size} "
              f"sequences), lr {args.lr}, warmup {args.warmup}, cosine to x{args.final_lr_mult}; "
              f"features {'cached' if use_cache else 'on the fly'}")
    seqs, K = data.seqs, args.num_heads
    log_path = work / "train_log.jsonl"
    t_train, seconds_before, start_step = time.time(), prog.train_seconds, prog.step
    step_times: list[float] = []
    bar = ctx.tqdm(total=prog.planned, initial=prog.step, desc="train", unit="step")
    run_stats: dict[str, torch.Tensor] = {}
    trainer_p.train()
    while prog.step < prog.planned:
        if args.stop_after and prog.step - start_step >= args.stop_after:
            prog.stop_reason = f"stopped after {args.stop_after} steps (--stop-after)"
            break
        if deadline is not None and ctx.any(time.time() > deadline):
            prog.stop_reason = "time budget spent"
            break
        ts = time.time()
        epoch, bidx = order.batch_at(prog.step)
        gidx = [data.train_idx[i] for i in bidx]
        mine = gidx[ctx.rank::ctx.world]
        norms = _batch_norms([seqs[i] for i in gidx], vocab.remap, K).to(ctx.device)
        batch = _collate(seqs, mine, get_feats(mine), ctx.device)
        mult = lr_multiplier(prog.step, args.warmup, prog.planned, args.final_lr_mult)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * mult
        loss, stats = trainer_p(batch, norms, float(ctx.world))
        accelerator.backward(loss)
        gnorms = {}
        if args.max_grad_norm > 0:
            for group in optimizer.param_groups:
                gnorms[group["name"]] = float(accelerator.clip_grad_norm_(group["params"], args.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        prog.step += 1
        prog.positions += int(norms[0, 0].item())
        for suffix, st in stats.items():
            run_stats[suffix] = run_stats.get(suffix, torch.zeros_like(st.cpu())) + st.detach().cpu()
        step_times.append(time.time() - ts)
        bar.update(1)
        if deadline is not None and args.fit_schedule and not prog.fitted and len(step_times) >= 12:
            _fit_schedule(ctx, args, prog, step_times, deadline, len(data.held_idx))
            bar.total = prog.planned
            bar.refresh()
        if args.log_every and (prog.step % args.log_every == 0 or prog.step == prog.planned):
            agg = {s: ctx.sum(v.to(ctx.device)).cpu() for s, v in run_stats.items()}
            rec = {"step": prog.step, "epoch": epoch, "lr": args.lr * mult, "elapsed_s": round(time.time() - t_start, 1),
                   "sec_per_step": round(sum(step_times[-args.log_every:]) / len(step_times[-args.log_every:]), 4)}
            per_kind, parts = _train_record(agg, core.labels, args, gnorms)
            rec.update(per_kind)
            prog.history.append({"train": rec})
            run_stats = {}
            _log_jsonl(ctx, log_path, {"type": "train", **rec})
            if ctx.main and bar.disable:
                ctx.print(f"step {prog.step}/{prog.planned} lr {args.lr * mult:.2e} " + " | ".join(parts))
            elif ctx.main:
                bar.set_postfix_str(" | ".join(parts)[:120])
        if args.eval_every and prog.step % args.eval_every == 0 and prog.step < prog.planned:
            ev = _eval_heldout(ctx, core, seqs, data.held_idx, get_feats, max(1, args.batch_size), accelerator.autocast)
            if ev is not None:
                prog.history.append({"eval": {"step": prog.step, **ev}})
                ctx.print(f"eval @ {prog.step}: " + _eval_line(ev))
                _log_jsonl(ctx, log_path, {"type": "eval", "step": prog.step, **ev})
        if args.save_every and prog.step % args.save_every == 0 and prog.step < prog.planned:
            _save_ckpt(ctx, work, prog.state(run_sig, args, seconds_before + time.time() - t_train))
    bar.close()
    prog.train_seconds = seconds_before + (time.time() - t_train)
    ctx.print(f"training: {prog.step}/{prog.planned} steps, {prog.positions} positions, "
              f"{_fmt_s(prog.train_seconds)} ({prog.stop_reason})")
    final = _eval_heldout(ctx, core, seqs, data.held_idx, get_feats, max(1, args.batch_size), accelerator.autocast)
    if final is not None:
        prog.history.append({"eval": {"step": prog.step, "final": True, **final}})
        ctx.print(f"final eval @ {prog.step}: " + _eval_line(final))
    if prog.step > start_step or not _latest_ckpt(work):
        _save_ckpt(ctx, work, prog.state(run_sig, args))
    return final


def _export(ctx: _Ctx, args: TrainConfig, core: "_HeadsTrainer", kinds: list[str], out_root: Path, name: str,
            report: dict, final_eval: Optional[dict]) -> tuple[dict[str, Path], Optional[Path]]:
    """Save each kind's heads (with the run's provenance) and the training report (json + md);
    fills report["heads"]. Returns the heads' directories and the report's path (main process)."""
    save_dtype = {"bfloat16": torch.bfloat16, "int8": "int8"}.get(args.save_dtype)
    out_dirs: dict[str, Path] = {}
    report["heads"] = {}
    for kind in kinds:
        h = core.heads[KINDS[kind][2]]
        d = out_root / f"{name}-{KINDS[kind][2]}"
        metrics = (final_eval or {}).get(kind)
        meta = {"command": report["command"], "argv": report["argv"], "kind": kind, "base_model": report["model"]["name"],
                "base_model_fingerprint": report["model"]["fingerprint"],
                "data": {k: v for k, v in report["data"].items() if k != "self_distill"},
                "data_sha256": report["data"]["sha256"], "train_time_s": report["timings"]["train_s"],
                "steps": report["steps"], "planned_steps": report["planned_steps"], "stop_reason": report["stop_reason"],
                "positions": report["positions"], "seed": args.seed, "recipe": report["recipe"], "metrics": metrics,
                "created": _dt.datetime.now().isoformat(timespec="seconds")}
        out_dirs[kind] = d
        report["heads"][kind] = {"dir": str(d), "params": count_parameters(h), "metrics": metrics}
        if ctx.main:
            save_heads(h, d, meta, dtype=save_dtype)
    report_path = None
    if ctx.main:
        report_path = out_root / REPORT_JSON
        write_json_atomic(report_path, report, default=str)
        (out_root / REPORT_MD).write_text(_report_md(report), encoding="utf-8")
        ctx.print(f"saved: {', '.join(str(p) for p in out_dirs.values())}; report {report_path}")
    return out_dirs, report_path


def run_training(args: TrainConfig) -> TrainResult:
    """Run the whole pipeline; raises TrainError on bad input. See the module docstring.

    Stages: read the prompts, load the base, answer and tokenize (`_sequences`), draft vocabulary,
    base features (`_feature_source`), heads and optimizer, resume, train (`_train_loop`), export."""
    t_start = time.time()
    _validate(args)
    kinds = parse_kinds(args.heads)
    deadline = t_start + args.time_budget_min * 60 if args.time_budget_min > 0 else None
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from accelerate import Accelerator

    pset = _read_data(args)  # before the model: a bad file fails fast
    prompts = list(pset.prompts)
    try:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    except ValueError as e:  # e.g. fp16 mixed precision where it is not supported
        raise TrainError(f"accelerate: {e}") from None
    if accelerator.device.type == "cpu" and args.mixed_precision == "fp16":
        raise TrainError("--mixed-precision fp16 is not supported on CPU; use bf16 (or no)")
    ctx = _Ctx(accelerator)
    work = Path(args.work_dir).expanduser()
    out_root = Path(args.out).expanduser()
    if ctx.main:
        work.mkdir(parents=True, exist_ok=True)
        out_root.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    ctx.print(f"entmtp train: {pset.summary()}")
    ctx.print(f"processes: {ctx.world} on {ctx.device}; heads: {', '.join(kinds)}; mixed precision: {args.mixed_precision}")

    t0 = time.time()
    model, tokenizer = _load_base(args.model, args.dtype, ctx.device, ctx.print if ctx.main else None)
    model_fp = _model_fingerprint(model, args.model, args.dtype)
    cfg_vocab = model.get_output_embeddings().weight.shape[0]
    eos = _eos_ids(model, tokenizer)
    ctx.print(f"base model {args.model!r} loaded in {_fmt_s(time.time() - t0)} "
              f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.dtype})")

    bad, n_layers = missing_layers(args.feature_layers, model.config)
    if bad:
        raise TrainError(f"--feature-layers {','.join(map(str, args.feature_layers))}: the base has hidden states 0..{n_layers}")
    data = _sequences(ctx, args, model, tokenizer, prompts, model_fp, work, deadline)
    init: dict[str, tuple[Path, DraftHeads]] = {}
    if args.init_from:
        init = _init_heads(args.init_from, kinds, args, model.config, eos)
        ctx.print("init: starting from " + ", ".join(f"{k} {d}" for k, (d, _) in init.items()))
    vocab = _draft_vocabulary(ctx, args, data, cfg_vocab, eos, init)

    order = _Order(len(data.train_idx), args.batch_size, args.seed)
    planned = _planned_steps(args, order.steps_per_epoch)
    use_cache = args.cache_features if args.cache_features is not None else planned > order.steps_per_epoch
    get_feats, feat_info = _feature_source(ctx, args, model, data, vocab, model_fp, work, use_cache)

    torch.manual_seed(args.seed)
    name = args.name or _model_name(args.model)
    base_name = "SmolLM2-135M-Instruct" if str(args.model).strip().lower() == "default" else str(args.model)
    heads = _new_heads(kinds, args, model.config, base_name, vocab.ids, vocab.size, init)
    emb_w = model.get_input_embeddings().weight.detach().float().to(ctx.device)
    lm_full = model.get_output_embeddings().weight.detach()
    lm_w = (lm_full if vocab.ids is None else lm_full.index_select(0, vocab.ids.to(lm_full.device))).float().to(ctx.device).contiguous()
    trainer = _HeadsTrainer(heads, emb_w, lm_w, vocab.remap.to(ctx.device), args.lm_loss_weight,
                            args.teacher_loss_weight).to(ctx.device)
    groups = [{"params": list(trainer.heads[KINDS[k][2]].parameters()), "name": k} for k in kinds]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    trainer_p, optimizer = accelerator.prepare(trainer, optimizer)
    core: _HeadsTrainer = accelerator.unwrap_model(trainer_p)

    seqs, train_idx, held_idx = data.seqs, data.train_idx, data.held_idx
    run_sig = {"kinds": kinds, "num_heads": args.num_heads, "num_layers": args.num_layers, "batch_size": args.batch_size,
               "seed": args.seed, "n_train": len(train_idx), "draft_vocab": None if vocab.ids is None else _sha256_json(vocab.ids.tolist()),
               "train_data": _sha256_json([[seqs[i].pid, len(seqs[i])] for i in train_idx]), "model": model_fp,
               "init_from": {k: _sha256_state(h) for k, (_, h) in init.items()} or None}
    prog = _resume(ctx, accelerator, work, run_sig, planned) if args.resume else _Progress(planned=planned)
    final_eval = _train_loop(ctx, args, accelerator, trainer_p, core, optimizer, order, data, vocab, get_feats, prog,
                             run_sig, work, deadline, t_start, use_cache)

    data_info = {"file": str(args.data), "sha256": pset.sha256, "format": pset.format, "n_prompts": len(prompts),
                 "n_skipped_rows": len(pset.skipped), "n_train_prompts": data.n_train_prompts,
                 "n_held_out_prompts": data.n_held_prompts, "n_train_sequences": len(train_idx),
                 "n_held_out_sequences": len(held_idx), "n_train_tokens": sum(len(seqs[i]) for i in train_idx),
                 "n_train_answer_tokens": data.n_train_answer_tokens,
                 "n_held_out_answer_tokens": sum(int(seqs[i].mask.sum()) for i in held_idx),
                 "sequence_notes": data.info, "self_distill": data.self_distill}
    recipe = {k: getattr(args, k) for k in _RECIPE_FIELDS}
    recipe.update({"planned_steps": prog.planned, "steps_per_epoch": order.steps_per_epoch, "draft_vocab_size": vocab.size,
                   "optimizer": "AdamW", "schedule": "linear warmup + cosine", "processes": ctx.world,
                   "features": "cached" if use_cache else "on the fly",
                   "loss": "lm_w*CE(actual next token) + teacher_w*softCE(base top-k, renormalized over draft vocab)"})
    timings = {"total_s": round(time.time() - t_start, 1), "train_s": round(prog.train_seconds, 1),
               "generation_s": round(data.self_distill["seconds"], 1) if data.self_distill else 0.0,
               "features_s": round(feat_info.get("seconds", 0.0), 1)}
    report = {"command": _command_line(), "argv": list(sys.argv), "model": {"spec": args.model, "name": base_name,
              "fingerprint": model_fp, "dtype": args.dtype, "vocab_size": cfg_vocab},
              "data": data_info, "features": feat_info, "recipe": recipe, "timings": timings, "steps": prog.step,
              "planned_steps": prog.planned, "positions": prog.positions, "stop_reason": prog.stop_reason, "heads": {},
              "history": prog.history, "created": _dt.datetime.now().isoformat(timespec="seconds")}
    out_dirs, report_path = _export(ctx, args, core, kinds, out_root, name, report, final_eval)
    ctx.barrier()
    return TrainResult(heads={k: core.heads[KINDS[k][2]] for k in kinds}, out_dirs=out_dirs, report=report,
                       report_path=report_path, extra={"seqs": seqs, "draft_vocab": vocab.ids})


def _command_line() -> str:
    """The command as typed: `entmtp train ...`, `python -m entmtp ...` or the raw argv."""
    argv = list(sys.argv) or [""]
    first = argv[0].replace("\\", "/")
    if first.endswith("entmtp/__main__.py"):
        head = ["python", "-m", "entmtp"]
    elif Path(first).name == "entmtp":
        head = ["entmtp"]
    else:
        head = [first]
    return shlex.join(head + argv[1:])


def _trainer_state(step, planned, fitted, history, train_seconds, positions, sig, args) -> dict:
    return {"format": CKPT_FORMAT, "step": step, "planned_steps": planned, "fitted": fitted,
            "schedule": {"lr": args.lr, "warmup": args.warmup, "final_lr_mult": args.final_lr_mult, "kind": "cosine"},
            "history": history, "train_seconds": train_seconds, "positions": positions, "signature": sig,
            "saved": _dt.datetime.now().isoformat(timespec="seconds")}


def _eval_line(ev: dict) -> str:
    return " | ".join(f"{k} top1 " + "/".join(f"{x:.2f}" for x in v["top1"]) + f" tau {v['tau_chain']:.2f}"
                      for k, v in ev.items())


def _report_md(r: dict) -> str:
    lines = ["# Draft-head training report", "",
             f"* command: `{r['command']}`",
             f"* base model: {r['model']['name']} ({r['model']['dtype']})",
             f"* data: `{r['data']['file']}` sha256 {r['data']['sha256'][:16]}…, {r['data']['n_prompts']} prompts; "
             f"{r['data']['n_train_sequences']} train sequences ({r['data']['n_train_answer_tokens']} answer tokens), "
             f"{r['data']['n_held_out_sequences']} held-out",
             f"* steps: {r['steps']} / {r['planned_steps']} planned ({r['stop_reason']}), {r['positions']} positions",
             f"* time: total {_fmt_s(r['timings']['total_s'])}, generation {_fmt_s(r['timings']['generation_s'])}, "
             f"features {_fmt_s(r['timings']['features_s'])}, training {_fmt_s(r['timings']['train_s'])}",
             f"* draft vocabulary: {r['recipe']['draft_vocab_size']} tokens; batch {r['recipe']['batch_size']} sequences; "
             f"lr {r['recipe']['lr']}; loss weights lm {r['recipe']['lm_loss_weight']} / teacher {r['recipe']['teacher_loss_weight']}"
             + (f"; started from the heads in `{r['recipe']['init_from']}`" if r["recipe"].get("init_from") else ""),
             "", "## Held-out agreement with the base model's greedy token (teacher-forced)", "",
             "| heads | dir | params | top-1 per head | top-5 per head | chain tau |", "|---|---|---|---|---|---|"]
    for kind, v in r["heads"].items():
        m = v.get("metrics") or {}
        t1 = " / ".join(f"{x:.3f}" for x in m.get("top1", [])) or "n/a"
        t5 = " / ".join(f"{x:.3f}" for x in m.get("top5", [])) or "n/a"
        tau = f"{m['tau_chain']:.3f}" if m else "n/a"
        lines.append(f"| {kind} | `{v['dir']}` | {v['params'] / 1e6:.2f}M | {t1} | {t5} | {tau} |")
    lines += ["", "Chain tau = 1 + Σ_k Π_{j≤k} [head j top-1 = base greedy], averaged over held-out positions where "
              "every head has an answer target (exact for teacher-forced Medusa/Hydra chains).", ""]
    return "\n".join(lines)


# ======================================================================================
# entry points
# ======================================================================================
def requested_cpu_processes(environ=os.environ, parent_cmdline: Optional[list[str]] = None) -> int:
    """Processes asked for by `accelerate launch --cpu --num_processes N` when accelerate started
    only this one (its simple launcher fans CPU processes out only through mpirun); else 1.

    The count is read from the launching `accelerate launch` command line (Linux /proc).
    """
    if environ.get("ACCELERATE_USE_CPU", "").lower() != "true" or "WORLD_SIZE" in environ:
        return 1
    if parent_cmdline is None:
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return 1
        parent_cmdline = [x.decode(errors="replace") for x in raw.split(b"\0") if x]
    if not any(a == "launch" or a.endswith(("accelerate.commands.launch", "accelerate-launch")) for a in parent_cmdline):
        return 1
    for i, a in enumerate(parent_cmdline):
        val = None
        if a in ("--num_processes", "--num-processes") and i + 1 < len(parent_cmdline):
            val = parent_cmdline[i + 1]
        elif a.startswith(("--num_processes=", "--num-processes=")):
            val = a.split("=", 1)[1]
        if val is not None:
            try:
                return max(1, int(val))
            except ValueError:
                return 1
    return 1


def _fan_out_cpu(n: int, argv: list[str]) -> int:
    """Run `python -m entmtp <argv>` as n CPU processes (gloo) through torch.distributed.run."""
    import socket

    from torch.distributed.run import main as torchrun

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    print(f"entmtp train: accelerate launched one CPU process for --num_processes {n}; "
          f"starting {n} CPU processes (gloo) with torch.distributed.run", file=sys.stderr)
    extra = [] if "--cpu" in argv else ["--cpu"]
    try:
        torchrun(["--nproc_per_node", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
                  "-m", "entmtp", *argv, *extra])
    except Exception as e:  # ChildFailedError: the processes printed their own errors above
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainError(f"the {n} training processes failed ({first[:200]})") from None
    return 0


def main(args: TrainConfig) -> int:
    """`entmtp train`: returns 0 on success; raises TrainError (one line) on bad input."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n = requested_cpu_processes()
    if n > 1:
        return _fan_out_cpu(n, sys.argv[1:])
    run_training(args)
    return 0
