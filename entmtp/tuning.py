"""Which kernels decode fastest on this machine, and whether they are row-invariant: measured once
per (machine, model shapes, dtype, device) and cached.

A recorded table of "what paid on the machines we had" is wrong on the next machine: oneDNN's
bf16 linears are bit-identical to a one-row product up to 32 rows on one CPU and not on another,
torch's bf16 attention drifts from 8 tree rows on an AMX Xeon, MKL's float32 GEMM beats oneDNN's
prepacked one there and loses on an AVX2 EPYC. So at first load a short probe (`probe_kernels`,
a few seconds for a 135M model) runs every kernel set that can run here (`kernels.KERNEL_SETS`)
and measures, on the real model with random tokens after a cached context:

* the step latency for one tree row and 8 (`ms_by_rows`, fastest of interleaved repeats; what the
  choice ranks by), and for the chosen set 1, 2, 4, ... 32 rows (128 on CUDA): its latency curve;
* row invariance, bitwise: the logits of a chain of R rows verified in one forward against R
  one-row steps. Where they are equal, tree verification computes exactly what the plain loop
  computes, so greedy speculation emits exactly the plain loop's tokens.

The choice (`choose`): among the sets whose one-row step is no slower than stock (so the plain
loop never loses to transformers' own), the fastest row-invariant one for draft trees; where none
is row-invariant, the fastest of them, and the engine says speculation matches plain decoding up
to rounding (its identity rate is measured, not claimed).

`ENTMTP_TUNE=0` skips the probe (the unmeasured order, `kernels.preferred_kernels`);
`ENTMTP_TUNE=refresh` measures again. Profiles live in `cache_dir()/tuning/<machine>/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .hardware import fingerprint, fingerprint_id, synchronize
from .kernels import (KERNEL_SETS, ONE_ROW_STOCK, can_pack, decode_model, kernel_bytes_ok, kernel_options, library_id,
                      preferred_kernels, tree_mask_dtype)
from .kvcache import decoding_cache
from .paths import cache_dir, write_json_atomic
from .threads import CoreLoad, adaptive_threads_possible, busy_note, default_threads, threads_override, torch_threads
from .verify import forward, tree_mask

PROFILE_FORMAT = "entmtp-kernel-profile/1"
NOT_SLOWER = 1.05  # a set's one-row step may cost this much of stock's and still count as "not slower" (timing noise)
THREADS_GAIN = 1.5  # all threads must decode this much faster than one to be chosen (see measure_threads)
ADAPTIVE_GAIN = 1.1  # ... where a governor gives them up while other processes use the cores
CPU_ROWS = (1, 2, 4, 8, 16, 32)
CUDA_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class KernelTrial:
    """One kernel set measured on one model: latency per row count (ms, fastest of the repeats) and row invariance."""

    name: str
    why: str = ""  # what the set is, or why it cannot run here
    ran: bool = False
    ms_by_rows: dict[int, float] = field(default_factory=dict)
    invariant_rows: dict[int, bool] = field(default_factory=dict)  # R -> R-row chain == R one-row steps, bitwise

    @property
    def row_invariant(self) -> bool:
        return self.ran and bool(self.invariant_rows) and all(self.invariant_rows.values())

    def tree_ms(self) -> float:
        """The cost the choice ranks by: a one-row step plus an 8-row tree step (or the widest measured below it)."""
        rows = [r for r in self.ms_by_rows if r <= 8]
        return self.ms_by_rows[1] + self.ms_by_rows[max(rows)]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["ms_by_rows"] = {str(k): round(v, 3) for k, v in self.ms_by_rows.items()}
        d["invariant_rows"] = {str(k): v for k, v in self.invariant_rows.items()}
        return d

    @staticmethod
    def from_json(d: dict) -> "KernelTrial":
        return KernelTrial(d["name"], d.get("why", ""), bool(d.get("ran")),
                           {int(k): float(v) for k, v in d.get("ms_by_rows", {}).items()},
                           {int(k): bool(v) for k, v in d.get("invariant_rows", {}).items()})


@dataclass
class KernelProfile:
    """What the probe measured for one (machine, model shapes, dtype, device) and what it chose."""

    choice: str
    why: str
    row_invariant: bool  # the chosen set's tree rows are bitwise one-row steps
    trials: list[KernelTrial]
    fingerprint: dict
    model_key: dict
    threads: Optional[int] = None  # CPU: torch threads that decode fastest with the chosen set (None: not measured)
    threads_ms: dict[int, float] = field(default_factory=dict)  # threads -> the chosen set's tree_ms
    created: str = ""
    probe_s: float = 0.0
    measured: bool = True  # False: ENTMTP_TUNE=0 (nothing measured)
    cache_file: Optional[str] = None
    # the chosen set's decoding twin as the probe built it (`decode_model`'s triple), for the engine
    # to take instead of building it again; never cached
    built: Optional[tuple] = field(default=None, repr=False, compare=False)

    def trial(self, name: str) -> Optional[KernelTrial]:
        return next((t for t in self.trials if t.name == name), None)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("choice", "why", "row_invariant", "fingerprint", "model_key", "threads",
                                           "created", "probe_s", "measured")}
        d["threads_ms"] = {str(k): round(v, 3) for k, v in self.threads_ms.items()}
        return {"format": PROFILE_FORMAT, **d, "trials": [t.to_json() for t in self.trials]}

    @staticmethod
    def from_json(d: dict) -> "KernelProfile":
        if d.get("format") != PROFILE_FORMAT:
            raise ValueError("not an entmtp kernel profile")
        return KernelProfile(d["choice"], d["why"], bool(d["row_invariant"]), [KernelTrial.from_json(t) for t in d["trials"]],
                             d["fingerprint"], d["model_key"], d.get("threads"),
                             {int(k): float(v) for k, v in (d.get("threads_ms") or {}).items()},
                             d.get("created", ""), float(d.get("probe_s", 0.0)), bool(d.get("measured", True)))

    def summary(self) -> str:
        """One line: the chosen set, whether it is lossless, and its 1-row and 8-row step."""
        t = self.trial(self.choice)
        lat = ""
        if t is not None and t.ms_by_rows:
            lat = ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in t.ms_by_rows.items() if r in (1, 8))
            lat = f" ({lat})"
        exact = "row-invariant: speculation emits exactly the plain loop's tokens" if self.row_invariant else \
            "not row-invariant: speculation matches plain decoding up to rounding"
        threads = f"; {self.threads} CPU thread{'s' if self.threads != 1 else ''}" if self.threads else ""
        return f"kernels {self.choice}{lat}{threads}; {exact}"


def config_hash(model) -> str:
    """A short hash of the model's architecture: its config without names, paths and versions."""
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "entmtp_info"):
        cfg.pop(k, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_key(model) -> dict:
    """What the kernels' speed and invariance depend on: the architecture's shapes, dtype and
    device, not the weights."""
    p = next(model.parameters())
    return {"architecture": type(model).__name__, "config": config_hash(model),
            "dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device),
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}


def machine_dir(device) -> Path:
    """`cache_dir()/tuning/<machine fingerprint>-<kernel library id>/`: where this machine's
    measurements live (a new version of entmtp's kernels measures again)."""
    return cache_dir() / "tuning" / f"{fingerprint_id(device)}-{library_id()}"


def profile_path(model) -> Path:
    """`machine_dir()/<architecture>-<dtype>-<device>-<config hash>.json`."""
    key = model_key(model)
    dev = torch.device(key["device"])
    return machine_dir(dev) / f"{key['architecture']}-{key['dtype']}-{dev.type}-{key['config']}.json"


def chain_mask(rows: int, past: int, dtype, device) -> Optional[torch.Tensor]:
    """The additive mask of a chain-shaped tree of `rows` rows after `past` cached positions."""
    if rows == 1:
        return None
    bias = torch.full((rows, rows), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return tree_mask(bias, past)


@torch.inference_mode()
def measure_set(model, name: str, rows: tuple[int, ...] = CPU_ROWS, context: int = 96, repeats: int = 5,
                check_rows: tuple[int, ...] = (4, 16), seed: int = 0) -> KernelTrial:
    """Build `model`'s decoding twin for kernel set `name` and measure it (see the module doc).
    A set that cannot run here comes back with ran=False and the reason."""
    try:
        twin, _, why = decode_model(model, name)
    except ValueError as e:
        return KernelTrial(name, str(e))
    return measure_twin(twin, name, why, rows, context, repeats, check_rows, seed)


@torch.inference_mode()
def measure_twin(twin, name: str, why: str, rows: tuple[int, ...] = CPU_ROWS, context: int = 96, repeats: int = 5,
                 check_rows: tuple[int, ...] = (4, 16), seed: int = 0) -> KernelTrial:
    """`measure_set` on a decoding twin already built for set `name` (`kernels.decode_model`)."""
    trial = KernelTrial(name, why, True)
    dev = next(twin.parameters()).device
    cache, rand = _cached_context(twin, context, seed)
    past = context
    times = _time_rows(twin, cache, {r: rand(r) for r in rows}, past, repeats)
    trial.ms_by_rows = {r: min(ts) * 1e3 for (_, r), ts in times.items()}
    for r in check_rows:
        ids, pos = rand(r), (past + torch.arange(r, device=dev))[None]
        tree_logits, _ = forward(twin, ids, cache, mask=chain_mask(r, past, tree_mask_dtype(twin), dev), position_ids=pos)
        cache.crop(-r)
        one = [forward(twin, ids[:, i:i + 1], cache, position_ids=pos[:, i:i + 1])[0][0] for i in range(r)]
        cache.crop(-r)
        trial.invariant_rows[r] = bool(torch.equal(tree_logits, torch.stack(one)))
        if not trial.invariant_rows[r]:
            break  # one chain that differs decides it; a longer one would cost ~1 s of one-row steps (stock, 2 cores)
    return trial


@torch.inference_mode()
def time_curve(twin, trial: KernelTrial, rows: tuple[int, ...], context: int = 96, repeats: int = 5,
               seed: int = 0) -> None:
    """Time `rows` of the set `trial` measured, on its twin, in rounds of their own (every row
    count in each), and keep per row count the fastest of these and the earlier timings: the
    latency curve of the chosen set, whose choice read only the rows `ranking_rows` names (a
    set's figures only fall, so a choice among trials stays what it was)."""
    cache, rand = _cached_context(twin, context, seed)
    times = _time_rows(twin, cache, {r: rand(r) for r in rows}, context, repeats)
    for (_, r), ts in times.items():
        trial.ms_by_rows[r] = min(min(ts) * 1e3, trial.ms_by_rows.get(r, float("inf")))
    trial.ms_by_rows = dict(sorted(trial.ms_by_rows.items()))


def ranking_rows(rows: tuple[int, ...]) -> tuple[int, ...]:
    """The row counts `choose` ranks sets by (`KernelTrial.tree_ms`): one row and the widest of
    `rows` up to 8. The other sets' whole curves were display: on the 2-core AVX-512-bf16 EPYC
    stock's and oneDNN's 1-32-row curves took ~3 s of a ~8.5 s probe (40-74 and 29-56 ms a forward)."""
    wide = [r for r in rows if 1 < r <= 8]
    return (1, max(wide)) if wide else (1,)


def _cached_context(twin, context: int, seed: int):
    """A decoding cache holding `context` random tokens run through `twin`, and the generator of
    further random token ids (n -> [1, n] long) the timing goes on with."""
    dev = next(twin.parameters()).device
    vocab = twin.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(min(3, vocab - 1), vocab, (1, n), generator=g).to(dev)  # noqa: E731
    cache = decoding_cache(twin)
    forward(twin, rand(context), cache)
    return cache, rand


def _time_rows(twin, cache, ids: dict[int, torch.Tensor], past: int, repeats: int,
               threads: tuple[Optional[int], ...] = (None,)) -> dict[tuple[Optional[int], int], list[float]]:
    """Seconds of a forward of each chain `ids[r]` [1, r] after `past` cached tokens, with each CPU
    thread count in `threads` (None: as set): {(threads, r): [seconds per timed round]}.

    Row counts and thread counts are interleaved in every round (the thread counts' order alternated)
    and the first round is untimed (per-shape kernel set-up): a burst of load elsewhere on the
    machine then slows one sample of each, and a drift of its speed hits all alike."""
    dev = next(twin.parameters()).device
    dtype = tree_mask_dtype(twin)  # as the decoding loop builds its masks
    inputs = {r: (x, (past + torch.arange(r, device=dev))[None], chain_mask(r, past, dtype, dev)) for r, x in ids.items()}
    times: dict[tuple[Optional[int], int], list[float]] = {(n, r): [] for n in threads for r in ids}
    for k in range(repeats + 1):
        for n in (threads if k % 2 == 0 else threads[::-1]):
            with torch_threads(n):
                for r, (x, pos, mask) in inputs.items():
                    synchronize(dev)
                    t = time.perf_counter()
                    forward(twin, x, cache, mask=mask, position_ids=pos)
                    synchronize(dev)
                    if k:
                        times[(n, r)].append(time.perf_counter() - t)
                    cache.crop(-r)
    return times


def choose(trials: list[KernelTrial]) -> tuple[str, str, bool]:
    """(kernel set, why, row invariant) from measured trials (see the module doc)."""
    ran = [t for t in trials if t.ran and t.ms_by_rows]
    stock = next((t for t in ran if t.name == "stock"), None)
    if not ran:
        return "stock", "no kernel set could be measured; transformers' own kernels", False
    limit = stock.ms_by_rows[1] * NOT_SLOWER if stock is not None else float("inf")

    def one_row(t: KernelTrial) -> float:
        # a set whose one-row step *is* stock's code path costs stock's, whatever its own trial's noise
        shared = stock is not None and t.name in ONE_ROW_STOCK
        return min(t.ms_by_rows[1], stock.ms_by_rows[1]) if shared else t.ms_by_rows[1]

    not_slower = [t for t in ran if one_row(t) <= limit] or ran  # our plain loop never slower than stock's
    exact = [t for t in not_slower if t.row_invariant]
    pick = min(exact or not_slower, key=lambda t: t.tree_ms() - t.ms_by_rows[1] + one_row(t))
    one, tree = pick.ms_by_rows[1], pick.tree_ms() - pick.ms_by_rows[1]
    versus = ""
    if stock is not None and pick is not stock:
        versus = f" (stock: {stock.ms_by_rows[1]:.1f} ms and {stock.tree_ms() - stock.ms_by_rows[1]:.1f} ms)"
    if exact:
        why = (f"fastest row-invariant set no slower than stock: {one:.1f} ms a one-row step, {tree:.1f} ms an "
               f"8-row tree{versus}")
    else:
        why = (f"no set here is row-invariant and no slower than stock, so the fastest no slower than stock: "
               f"{one:.1f} ms a one-row step, "
               f"{tree:.1f} ms an 8-row tree{versus}")
    return pick.name, why, pick.row_invariant


def probe_kernels(model, sets: Optional[tuple[str, ...]] = None, progress: Optional[Callable[[str], object]] = None,
                  **kw) -> KernelProfile:
    """Measure every kernel set of `sets` (default: every one that can run here) on `model` and
    choose; on a CPU also the thread count (`measure_threads`). ENTMTP_THREADS is not consulted:
    the profile is cached per machine, and an override of one run must not stand in for the
    measurement of later ones (it still wins when applied: `apply_threads`)."""
    t0 = time.perf_counter()
    p = next(model.parameters())
    opts = kernel_options(p.dtype, p.device)
    too_big = kernel_bytes_ok(model) if can_pack(model) is None else None
    rows = kw.pop("rows", CUDA_ROWS if p.device.type == "cuda" else CPU_ROWS)
    cpu = p.device.type == "cpu"
    before = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(default_threads())
    try:
        trials: list[KernelTrial] = []
        # the current pick's twin, built once for its trial, its curve, the threads and the engine
        # (a set's build and per-layer probes took ~0.65 s for a 135M model); the pick after each
        # trial is the one before or the set just measured (`choose`), so at most two twins live
        kept: Optional[tuple] = None
        for name in sets or KERNEL_SETS:
            why = opts.get(name) or (too_big if name != "stock" else None)
            if why:
                trials.append(KernelTrial(name, why))
                continue
            if progress:
                progress(f"tuning: measuring the {name} kernels")
            try:
                built = decode_model(model, name)
            except ValueError as e:
                trials.append(KernelTrial(name, str(e)))
                continue
            trials.append(measure_twin(built[0], name, built[2], rows=ranking_rows(rows), **kw))
            if choose(trials)[0] == name:
                kept = built
            del built
        choice, why, invariant = choose(trials)
        if kept is None or kept[1] != choice:
            kept = decode_model(model, choice)
        chosen = next((t for t in trials if t.name == choice and t.ran), None)
        if chosen is not None and set(rows) - set(chosen.ms_by_rows):
            time_curve(kept[0], chosen, tuple(rows), **{k: v for k, v in kw.items() if k in ("context", "repeats", "seed")})
            choice, why, invariant = choose(trials)  # the same set (only its figures fell), its words from the curve
        threads, threads_ms = None, {}
        if cpu and default_threads() > 1:
            if progress:
                progress("tuning: measuring CPU threads")
            threads, threads_ms = measure_threads(model, choice, twin=kept[0])
    finally:
        torch.set_num_threads(before)
    return KernelProfile(choice, why, invariant, trials, fingerprint(p.device), model_key(model), threads=threads,
                         threads_ms=threads_ms, created=time.strftime("%Y-%m-%dT%H:%M:%S"), probe_s=time.perf_counter() - t0,
                         built=kept)


def measure_threads(model, name: str, twin=None) -> tuple[int, dict[int, float]]:
    """(fastest thread count, {threads: tree_ms}) for kernel set `name`: the default count against
    one thread, timed in turns (a one-row and an 8-row forward each). Small models decode in
    thousands of short parallel regions a second; their synchronisation can cost more than a second core gives, and a thread
    that waits on a core another process holds stalls every region: all threads are chosen only
    when they are THREADS_GAIN times as fast as one, or ADAPTIVE_GAIN times where the engine's
    `threads.ThreadGovernor` drops to one thread while other processes use the cores. twin: the
    set's decoding twin where already built."""
    n = torch.get_num_threads()
    if twin is None:
        twin, _, _ = decode_model(model, name)
    cache, rand = _cached_context(twin, 96, seed=1)
    # the counts in turns within each round (`_time_rows`): the set's own trial, timed earlier with the
    # other sets in between, would compare the counts across a drift of the machine's speed
    times = _time_rows(twin, cache, {1: rand(1), 8: rand(8)}, 96, 5, threads=(n, 1))
    out = {c: min(times[(c, 1)]) * 1e3 + min(times[(c, 8)]) * 1e3 for c in (n, 1)}
    return choose_threads(out, ADAPTIVE_GAIN if adaptive_threads_possible() else THREADS_GAIN), out


def choose_threads(ms_by_threads: dict[int, float], gain: float = THREADS_GAIN) -> int:
    """{threads: ms} -> the count to decode with: the most threads only where they are `gain`
    times as fast as one (with another busy process on a 2-core machine two spinning threads
    decoded at ~0.3x their idle speed, one thread at ~1.0x: `python scripts/busy_neighbour.py`),
    else one."""
    n = max(ms_by_threads)
    return n if 1 in ms_by_threads and ms_by_threads[1] >= ms_by_threads[n] * gain else 1


def apply_threads(profile: KernelProfile) -> Optional[int]:
    """Set torch's CPU threads to ENTMTP_THREADS, else to the profile's measured count. Returns
    the count set (None: left as it is)."""
    n = threads_override() or profile.threads
    if n:
        torch.set_num_threads(n)
    return n


def unmeasured_profile(model) -> KernelProfile:
    """ENTMTP_TUNE=0: the unmeasured order, nothing timed (invariance is not claimed: unknown)."""
    p = next(model.parameters())
    name = preferred_kernels(model)
    return KernelProfile(name, "not measured (ENTMTP_TUNE=0): the default order", False, [], fingerprint(p.device),
                         model_key(model), created=time.strftime("%Y-%m-%dT%H:%M:%S"), measured=False)


def _threads_unmeasured(prof: KernelProfile, device) -> bool:
    return device.type == "cpu" and default_threads() > 1 and not prof.threads


def kernel_profile(model, progress: Optional[Callable[[str], object]] = None) -> KernelProfile:
    """This machine's kernel profile for `model`: read from the cache, else measured and cached --
    unless other processes used the cores meanwhile (`threads.busy_note`): then it holds for this
    process and is measured again at the next load. ENTMTP_TUNE=0: not measured;
    ENTMTP_TUNE=refresh: measured again."""
    mode = os.environ.get("ENTMTP_TUNE", "1").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return unmeasured_profile(model)
    path = profile_path(model)
    if mode != "refresh" and path.is_file():
        try:
            prof = KernelProfile.from_json(json.loads(path.read_text()))
            p = next(model.parameters())
            opts = kernel_options(p.dtype, p.device)
            # still runnable (a kernel build may have gone), with every set that runs here measured (a
            # newer version may have more), and with the thread count measured (a profile probed
            # under an ENTMTP_THREADS override once lacked it)
            measured = {t.name for t in prof.trials}
            if (opts.get(prof.choice) is None and all(k in measured for k in KERNEL_SETS if opts.get(k) is None)
                    and not _threads_unmeasured(prof, p.device)):
                prof.cache_file = str(path)
                return prof
        except (ValueError, KeyError, TypeError, json.JSONDecodeError, OSError):
            pass  # unreadable: measure again
    load = CoreLoad()
    prof = probe_kernels(model, progress=progress)
    busy = busy_note(load, "the kernel profile was")
    if busy:  # kept for this process only: a browser opening beside the app must not choose for good
        prof.why += f" ({busy})"
        return prof
    try:
        write_json_atomic(path, prof.to_json())
        prof.cache_file = str(path)
    except OSError as e:  # a read-only home: the profile still holds for this process
        prof.why += f" (not cached: {e.strerror or e})"
    return prof


__all__ = ["KernelTrial", "KernelProfile", "chain_mask", "model_key", "profile_path", "measure_set", "measure_twin",
           "time_curve", "ranking_rows", "choose", "probe_kernels", "unmeasured_profile", "kernel_profile",
           "measure_threads", "choose_threads", "apply_threads"]
