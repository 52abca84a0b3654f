"""Prepacked CPU linear layers: the same products at a fraction of the cost.

torch's CPU `F.linear` hands its backend a plain ``[out, in]`` weight on every call. In
bfloat16 that backend is oneDNN, which re-lays the weight out (blocked, with the VNNI pairing
its bf16 kernels read) each time: every layer's weight is read, rewritten and read again. In
float32 it is MKL's sgemm, which is slow for the few rows of decoding (1 token, or a draft tree
of 2-32) on an AVX2 CPU: a 2-row forward of SmolLM2-135M cost 1.6x a 1-row one. Packing each
weight once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing
pass does) and calling its prepacked kernel removes both costs (`python scripts/bench_kernels.py`):

* bfloat16, 2-core AVX-512-bf16 CPU: all 211 linears of SmolLM2-135M take 16.5 ms instead of
  23.4 ms for 1 row and 17.8 ms instead of 29.4 ms for 9 rows. The products are bit-identical
  to `F.linear`'s: `packed_twin` probes every layer with its real weight and refuses otherwise.
* float32, 2-core AVX2 CPU: a whole forward after 200 cached tokens takes 69 ms instead of 79 ms
  for 1 row, 65 instead of 114 for 4 rows and 79 instead of 135 for 9, so draft trees of up to
  ~9 nodes cost barely more than one token. oneDNN sums in another order than MKL (logits within
  2-3e-6 of their scale; every layer probed at 1e-5), the same kind of difference as between a
  tree forward and a one-token forward, so greedy outputs stay identical to `generate` except
  at exact near-ties; `entmtp bench` reports the identity rate of every run, and
  `kernels="stock"` keeps transformers' own kernels.
* bfloat16 on a CPU with AVX2 but no bf16 instructions (oneDNN refuses bf16 there, torch falls
  back to a slow loop: a 9-row forward cost 4.3 one-row ones) runs entmtp's own kernel
  (`csrc/bf16_panels.cpp`, built once with torch's C++ extension builder): each weight repacked
  once into 16-column panels, widened to fp32 in registers, fp32 accumulation -- the same exact
  products in another order, within bf16 rounding of the stock kernel (probed per layer); a 9-row
  forward costs ~1.2 one-row ones. On AVX-512 CPUs the same products run on 32-column panels
  (the same bits, half the instructions), and on AVX512-BF16 ones layers fed bf16 run on k-pair
  panels for vdpbf16ps; on AMX CPUs every layer runs on the same k-pairs as AMX tiles (16 rows x 16
  columns x 32 products an instruction: the lm_head at 16 rows costs ~1.1x one row, not ~4x)
  (`panel_layout`; `python scripts/bench_panel_layouts.py`). The same library fuses what costs more dispatch than
  arithmetic: Llama-style RMSNorms (`FusedRMSNorm`, one op instead of eight) and gated MLPs
  (`FusedMLP`: gate and up as one panel product, silu x up in fp32, three ops instead of five
  module calls), each probed against the module it replaces; with float32 attention
  (`entmtp.attention`) a one-row bf16 step of SmolLM2-135M here fell from ~41 to ~31 ms.
  Where attention runs in float32, Llama-style attentions are fused too (`FusedAttention`: q|k|v
  one panel product, the rotary embedding in one op, keys cached in fp32, entmtp's `attend` op,
  o_proj on the fp32 result): steps ~20% faster again, and since `attend` computes each row
  from its own visible keys in a fixed order, a tree's rows get the numbers one-token steps
  would -- greedy speculation on the twin emits exactly its plain tokens, in bf16 too.
* float32 on the same library: weights repacked into float32 panels (no widening), each output
  column one chain of fp32 FMAs over k whatever the row count, gated MLPs and attentions fused
  as above without the bf16 roundings. On the 2-core AMX Xeon a one-row step of SmolLM2-135M took
  26.0 ms against stock's 33.5, an 8-row tree 34.9 against 63.1, and the forward is row-invariant,
  so float32 speculation emits exactly the plain loop's tokens too (which stay within rounding of
  `generate`'s, measured by every bench).

* int8, for drafting only: the draft heads' slice of the lm_head quantised per token row
  (`Int8PanelLinear`), read by the same micro-kernels (int8 widened exactly), one byte a weight;
  `heads.HeadRunner` drafts through it where it is measured faster (drafts are verified, so it
  changes which tokens are proposed at near-ties, never what is emitted).

The twin shares every parameter and buffer with the model (only the packed weights are new
memory); the model itself is left untouched, so transformers' own `generate`, training and
calibration on it run the stock kernels.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .attention import fp32_sdpa_attention, use_fp32_attention
from .hardware import amx_emulated, cpu_isa, fast_bf16_matmul, isa_at_least
from .paths import atomic_file, cache_dir

# kernel sets for the decoding twin: "stock" (transformers' own), "onednn" (linears prepacked for
# oneDNN), "onednn-trees" (float32: prepacked for tree rows, transformers' own for a one-row step,
# where MKL's one-row product beats oneDNN's), "panels" (entmtp's own library: row-invariant bf16
# panels, fused norms / MLPs / attention, float32 attention). "auto" = measured per machine
# (`entmtp.tuning`); "packed" = the first packed set available here (onednn, else panels).
KERNEL_SETS = ("stock", "onednn", "onednn-trees", "panels")
ONE_ROW_STOCK = ("stock", "onednn-trees")  # sets whose one-row step is transformers' own code path
KERNELS = ("auto", "packed") + KERNEL_SETS
AUTO_MAX_BYTES = 2 << 30  # auto packs models whose linear weights total at most this (the twin doubles them)


PACKABLE = (torch.bfloat16, torch.float32)
FP32_PROBE_RTOL = 1e-5  # a packed float32 layer may differ from F.linear by this much of its output scale
# a bf16 panel layer may differ from the exact product (fp32 of the bf16 inputs) by this much of its
# output scale: bf16 output rounding is at most 2^-8 relative, fp32 accumulation far below (torch's own
# bf16 kernels are within the same bound)
BF16_PANEL_PROBE_RTOL = 2.0 ** -8
PANELS_SOURCE = Path(__file__).parent / "csrc" / "bf16_panels.cpp"


@functools.lru_cache(maxsize=None)
def _onednn_packing_unavailable(dtype: torch.dtype) -> Optional[str]:
    """None when this torch build and CPU can prepack a `dtype` linear, else why not (one line).

    Probed once per dtype by packing a small weight: oneDNN's bf16 reorder needs AVX-512
    (bw/vl/dq) or AVX-NE-CONVERT, and an AVX2-only CPU raises RuntimeError only when asked."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN prepacked linear"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=dtype))
    except RuntimeError:
        if dtype == torch.bfloat16:
            return "this CPU has no oneDNN bf16 linear kernels (they need AVX-512 or AVX-NE-CONVERT)"
        return f"oneDNN cannot prepack {str(dtype).removeprefix('torch.')} linears on this CPU"
    return None


def _packing_unavailable(dtype: torch.dtype) -> Optional[str]:
    """`_onednn_packing_unavailable`, as on the CPU class ENTMTP_ISA names (`entmtp.hardware`)."""
    if not isa_at_least("avx2"):
        return f"oneDNN packing is not used on this CPU class ({cpu_isa()})"
    if dtype == torch.bfloat16 and not isa_at_least("avx512"):
        return "this CPU has no oneDNN bf16 linear kernels (they need AVX-512 or AVX-NE-CONVERT)"
    return _onednn_packing_unavailable(dtype)


BUILD_LOCK_TIMEOUT_S = 900.0  # a build takes about 20 s; past this another process's build is taken as hung


@contextlib.contextmanager
def _build_lock(build: Path, timeout_s: float = BUILD_LOCK_TIMEOUT_S):
    """Hold the build directory for one process. torch's builder guards a build with a lock *file*
    that a process killed mid-build leaves behind, and every later build waits on it forever; this
    lock is the operating system's, released when its holder dies. Any torch lock file found while
    holding it is such a leftover (every builder holds this lock first), so it is removed.
    Raises RuntimeError after `timeout_s` of another process holding it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(build / "entmtp-build.lock"), timeout=timeout_s)
    try:
        lock.acquire()
    except Timeout:
        raise RuntimeError(f"another process has been building in {build} for over {timeout_s:.0f} s") from None
    try:
        (build / "lock").unlink(missing_ok=True)
        yield
    finally:
        lock.release()


def _staged_source(build: Path) -> Path:
    """The kernel source copied into its build directory (rewritten only when it differs): the
    build's inputs then do not depend on where entmtp is installed, so a second checkout sharing
    the cache loads the built library instead of rebuilding it under running processes."""
    staged = build / PANELS_SOURCE.name
    text = PANELS_SOURCE.read_bytes()
    if not staged.is_file() or staged.read_bytes() != text:
        with atomic_file(staged, "wb") as f:
            f.write(text)
    return staged


def _panels_unavailable() -> Optional[str]:
    """None when entmtp's panel kernels (csrc/bf16_panels.cpp) are loaded, else why not.

    Built on first use (a C++ compiler and ninja; about 20 s) into `cache_dir()/kernels`, once per
    torch version and source; later processes load the built library. ENTMTP_PANELS=0 disables them."""
    if os.environ.get("ENTMTP_PANELS", "1") == "0":
        return "entmtp's panel kernels are disabled (ENTMTP_PANELS=0)"
    if not isa_at_least("avx2"):
        return f"entmtp's panel kernels need AVX2 and FMA (this CPU class: {cpu_isa()})"
    return _build_panels()


@functools.lru_cache(maxsize=None)
def _build_panels() -> Optional[str]:
    """Load (building once) the panel library; None when loaded, else why not."""
    if _panel_ops_registered():
        return None  # loaded earlier in this process: a second library would register the ops again (abort)
    from torch.utils.cpp_extension import load

    # one name per source (its hash), so torch's builder never renames a rebuilt library and a
    # process never loads two libraries registering the same ops
    name = f"entmtp_bf16_panels_{_source_hash()[:10]}"
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
    if amx_emulated():  # the test build: AMX tile instructions in scalar code (`hardware.amx_emulated`)
        name, flags = f"{name}_amxemu", flags + ["-DENTMTP_EMULATE_AMX"]
    build = cache_dir() / "kernels" / f"{name}-torch-{torch.__version__}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build), _ninja_on_path():
            load(name=name, sources=[str(_staged_source(build))], build_directory=str(build),
                 extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        torch.ops.entmtp_cpu.bf16_pack_panels(torch.zeros(16, 8, dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: say why, decode on stock
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return f"entmtp's panel kernels could not be built here ({first})"
    return None


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs `ninja` from PATH; the pip-installed one lives beside this Python (a
    virtual environment's bin/), which is not on PATH when the environment is not activated."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        extra = [os.path.dirname(sys.executable)]
        try:
            import ninja

            extra.insert(0, ninja.BIN_DIR)
        except (ImportError, AttributeError):
            pass
        os.environ["PATH"] = os.pathsep.join(extra + [old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _panel_ops_registered() -> bool:
    """Whether this process has already loaded the panel ops (torch.ops.entmtp_cpu.*)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("entmtp_cpu::bf16_panels_linear", "CPU")
    except (AttributeError, RuntimeError):
        return False


# panel layouts of entmtp's bf16 linears, by the widest instructions dispatch allows: (columns, k-pairs, AMX tiles)
PANEL_LAYOUTS = {"avx2": (16, False, False), "avx512": (32, False, False), "avx512_bf16": (32, True, False),
                 "amx": (32, True, True)}


def panel_layout() -> str:
    """The panel layout for this CPU as dispatch sees it (`ENTMTP_ISA` lowers it):

    * "avx2": 16-column panels, weights widened to fp32, fp32 FMAs;
    * "avx512": 32-column panels, the same FMA chain per output column as "avx2" (the same bits)
      in half the instructions;
    * "avx512_bf16": 32 columns in k-pairs for vdpbf16ps (bf16 pairs multiplied exactly, summed
      into fp32): twice the products per instruction and no widening; inputs are taken as bf16
      (an fp32 input is rounded, as a stock bf16 layer would). Other bits than the FMA layouts.
    * "amx": the same k-pairs as AMX tiles (TDPBF16PS: 16 rows x 16 columns x 32 products per
      instruction), so a tree's extra rows cost little beyond reading the weights once; an fp32
      input is split into two bf16 terms (hi + lo), ~16 significant bits. Other bits again.

    Every layout computes each row alone in a fixed order, so a tree's rows are bitwise one-row
    steps; the plain loop and the tree always share one layout."""
    return next((isa for isa in ("amx", "avx512_bf16", "avx512") if isa_at_least(isa)), "avx2")


def pack_panels(weight: torch.Tensor, layout: Optional[str] = None, fp32_input: bool = False) -> torch.Tensor:
    """weight [N, K] bf16 -> its panels for `bf16_panels_linear` in `layout` (default `panel_layout()`).
    fp32_input: the layer is fed float32 values (an attention output, a fused MLP's middle) whose
    products must stay exact to bf16's precision, so the vdpbf16ps k-pair layout (bf16 inputs)
    gives way to the FMA one; AMX tiles take such inputs as two bf16 terms.
    A float32 weight -> float32 panels for `f32_panels_linear` (16 or 32 columns by the layout's
    width; the same fp32 FMA chain per column either way)."""
    layout = layout or panel_layout()
    cols, pairs, tiles = PANEL_LAYOUTS[layout]
    if weight.dtype == torch.float32:
        return torch.ops.entmtp_cpu.f32_pack_panels(weight.detach(), cols)
    if fp32_input and pairs and not tiles:
        cols, pairs, tiles = PANEL_LAYOUTS["avx512"]
    return torch.ops.entmtp_cpu.bf16_pack_panels(weight.detach(), cols, pairs, tiles)


def panels_product(x: torch.Tensor, panels: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
                   out_float: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., n] with W in `pack_panels` panels: float32 panels take and
    give float32; bf16 ones give bf16, or the float32 sums when out_float."""
    if panels.dtype == torch.float32:
        return torch.ops.entmtp_cpu.f32_panels_linear(x, panels, n, bias)
    return torch.ops.entmtp_cpu.bf16_panels_linear(x, panels, n, bias, out_float)


FUSED_FP32_RTOL = 1e-4  # a fused float32 module (another summation order, exp) against the module it replaces


def move_rows(tensors: list[torch.Tensor], src: list[int], dst: int) -> bool:
    """In each tensor [B, heads, L, D], rows src[i] of dim 2 move to dst + i (src ascending, src[i] >=
    dst + i): a tree step's accepted keys and values, every layer in one call of entmtp's `keep_rows`
    op. False, with nothing moved, where the op cannot take them (not built here, or off the CPU)."""
    if not tensors or not all(t.is_cpu for t in tensors) or _panels_unavailable():
        return False  # (the op checks each tensor's layout itself)
    torch.ops.entmtp_cpu.keep_rows(tensors, src, dst)
    return True


def first_argmax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [..., V] float32 or bfloat16 on the CPU -> x.argmax(-1): the same indices (ties to the
    first, a NaN as the maximum) through entmtp's `first_argmax` op, about a tenth of aten's cost
    (bf16 read as it is: widening to fp32 is exact, so no converted copy). None where the op
    cannot run: another device or dtype, or the kernel library not loaded in this process (never
    built for this alone)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() == 0 or x.shape[-1] == 0:
        return None
    switches = (os.environ.get("ENTMTP_PANELS"), os.environ.get("ENTMTP_ISA"))
    if switches not in _LOADED_UNDER:  # the checks cost as much as the op: once per setting found loaded
        if not _panel_ops_registered() or _panels_unavailable():
            return None
        _LOADED_UNDER.add(switches)
    if x.dim() == 2:
        return torch.ops.entmtp_cpu.first_argmax(x)
    return torch.ops.entmtp_cpu.first_argmax(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])


_LOADED_UNDER: set = set()  # (ENTMTP_PANELS, ENTMTP_ISA) settings under which the library was found loaded


def within_scale(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> bool:
    """Whether y is within rtol of ref's largest magnitude everywhere (the probes' closeness)."""
    return bool((y.float() - ref.float()).abs().max() <= rtol * ref.float().abs().max().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """sha256 of the kernel library's source (names its build and the measurements taken with it)."""
    return hashlib.sha256(PANELS_SOURCE.read_bytes() if PANELS_SOURCE.is_file() else b"").hexdigest()


def library_id() -> str:
    """Names the version of entmtp's kernel library as dispatched here (its source and panel layout):
    measurements of its speed are only valid for the library they were taken with."""
    return f"k{_source_hash()[:8]}-{panel_layout()}" + ("-emulated" if amx_emulated() else "")


def kernel_options(dtype: torch.dtype, device="cpu") -> dict[str, Optional[str]]:
    """Each kernel set of KERNEL_SETS -> None when it can run for `dtype` on `device` here, else
    why not (one line). "stock" always can."""
    out: dict[str, Optional[str]] = {"stock": None}
    if torch.device(device).type != "cpu":
        why = f"packed kernels are for CPU models (this one is on {torch.device(device).type})"
        return {**out, "onednn": why, "onednn-trees": why, "panels": why}
    if dtype not in PACKABLE:
        why = f"packed kernels are for bfloat16 and float32 models (this one is {str(dtype).removeprefix('torch.')})"
        return {**out, "onednn": why, "onednn-trees": why, "panels": why}
    out["onednn"] = _packing_unavailable(dtype)
    out["onednn-trees"] = out["onednn"] or (None if dtype == torch.float32 else
                                            "one-row steps on stock kernels is a float32 set (in bf16 oneDNN's packed "
                                            "kernel is the stock one without its per-call relayout)")
    out["panels"] = _panels_unavailable()
    return out


def pack_method(dtype: torch.dtype) -> tuple[Optional[str], Optional[str]]:
    """The first packed kernel set available for `dtype` on this CPU: ("onednn", None),
    ("panels", None), or (None, why not)."""
    opts = kernel_options(dtype)
    for name in ("onednn", "panels"):
        if opts[name] is None:
            return name, None
    return None, "; ".join(v for k, v in opts.items() if v and (k == "onednn" or dtype == torch.bfloat16))


def dtype_advice(device, dtype, remedy: str = "use --dtype float32") -> str | None:
    """One line for a user decoding in `dtype` on `device` where speculation cannot pay, else None:
    bf16 on a CPU without bf16 matrix units where neither packed kernel set can run (torch's
    fallback bf16 path makes a tree step cost several one-token steps)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or fast_bf16_matmul():
        return None
    method, why = pack_method(torch.bfloat16)
    if method is not None:
        return None
    return (f"note: this CPU (cpu-{cpu_isa()}) has no fast bf16 kernels ({why}): in bfloat16 a draft tree "
            f"costs several one-token steps and speculative decoding is slower than plain decoding; {remedy}")


def probe_ok(layer: nn.Module, rows: tuple[int, ...] = (1, 7)) -> bool:
    """Whether a packed or fused layer keeps its claim (`layer.claim`, `layer.matches`) on random
    inputs [r, layer.in_features] of each row count r."""
    g = torch.Generator().manual_seed(0)
    dtype = next(layer.parameters()).dtype
    with torch.no_grad():
        return all(layer.matches(torch.randn(r, layer.in_features, generator=g).to(dtype)) for r in rows)


def shared_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free `nn.Linear` whose weight is `weight` [out, in] itself (shared, not copied)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


def packed_layer(weight: torch.Tensor) -> Optional[nn.Module]:
    """weight [out, in] bf16 on CPU -> a packed bias-free layer x [..., in] -> [..., out] sharing
    it (oneDNN's, else entmtp's AVX2 panels), or None when neither is available here or its probe
    fails."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    method, _ = pack_method(torch.bfloat16)
    if method is None:
        return None
    lin = shared_linear(weight)
    try:
        layer = PackedLinear(lin) if method == "onednn" else PanelLinear(lin)
    except RuntimeError:
        return None
    return layer if probe_ok(layer) else None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) with W prepacked for oneDNN (`PackedLinear.packed`) -> [..., out]."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*lead, out_features)


class _PackedBase(nn.Module):
    """An `nn.Linear` whose weight is also kept in a kernel's own layout. x [..., in] -> [..., out].

    `weight` and `bias` are the original (shared) parameters, for code that reads them."""

    layout = ""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.layout}"

    @property
    def claim(self) -> str:
        """How close to torch's product this layer's output is promised to be (`matches` checks it)."""
        raise NotImplementedError

    def matches(self, x: torch.Tensor) -> bool:
        """x [r, in] -> whether this layer's output on x keeps `claim`."""
        raise NotImplementedError


class PackedLinear(_PackedBase):
    """Weight prepacked for oneDNN. one_row_stock: a one-row input takes `F.linear` (torch's own
    kernel: MKL's in float32, faster than oneDNN's for one row on some CPUs), more rows the packed one."""

    layout = "packed"

    def __init__(self, linear: nn.Linear, one_row_stock: bool = False):
        super().__init__(linear)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.one_row_stock = one_row_stock
        if one_row_stock:
            self.layout = "packed for tree rows"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_row_stock and x.numel() == x.shape[-1]:
            return nn.functional.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed, self.out_features, self.bias)

    @property
    def claim(self) -> str:
        # bf16: the same kernel as F.linear without its per-call relayout; fp32: another summation order
        if self.weight.dtype == torch.bfloat16:
            return "bit-identical to F.linear"
        return f"within {FP32_PROBE_RTOL:g} of F.linear"

    def matches(self, x: torch.Tensor) -> bool:
        y, ref = self(x), nn.functional.linear(x, self.weight, self.bias)
        if self.weight.dtype == torch.bfloat16:
            return torch.equal(y, ref)
        return within_scale(y, ref, FP32_PROBE_RTOL)


class PanelLinear(_PackedBase):
    """bf16 or float32 weight also kept in panels for entmtp's kernel (`csrc/bf16_panels.cpp`, layout
    `panel_layout()`).

    Every row count runs the panel kernel, each row alone in a fixed order: bf16 within bf16
    rounding of torch's (a one-row step too: faster than torch's bf16 kernel here, and identity
    with `generate` is lost anyway once the prompt, attention and norms run on other kernels);
    float32 within FP32_PROBE_RTOL of `F.linear` (MKL sums in another order; greedy identity with
    `generate` is measured by every bench)."""

    layout = "panels"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.panels = pack_panels(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return panels_product(x, self.panels, self.out_features, self.bias)

    @property
    def claim(self) -> str:
        if self.panels.dtype == torch.float32:
            return f"within {FP32_PROBE_RTOL:g} of F.linear"
        return f"within {BF16_PANEL_PROBE_RTOL:g} of the exact product"

    def matches(self, x: torch.Tensor) -> bool:
        if self.panels.dtype == torch.float32:
            ref = nn.functional.linear(x, self.weight, self.bias)
            return within_scale(self(x), ref, FP32_PROBE_RTOL)
        exact = nn.functional.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return within_scale(self(x), exact, BF16_PANEL_PROBE_RTOL)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scales [N] float32), symmetric per output row:
    weight[n] ~ q[n] * scales[n], |q| <= 127 (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


INT8_PROBE_RTOL = 1e-5  # the int8 panels against the product with their own dequantised weights


class Int8PanelLinear(_PackedBase):
    """A bias-free linear for drafting only: its weight quantised to int8 per output row
    (`quantize_rows`) in panels for entmtp's kernel (`i8_panels_linear`), one byte a weight instead
    of two. x [..., in] bf16 or fp32 -> [..., out] float32.

    Drafts are verified token by token, so what this changes is which tokens are proposed (the
    top candidates move only at near-ties), never what is emitted. Each row is summed alone in a
    fixed order, as in the other panels."""

    layout = "int8 panels"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        if linear.bias is not None:
            raise ValueError("the int8 draft panels take bias-free layers")
        q, self.scales = quantize_rows(linear.weight)
        cols = PANEL_LAYOUTS[panel_layout()][0]
        self.panels = torch.ops.entmtp_cpu.i8_pack_panels(q, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.entmtp_cpu.i8_panels_linear(x, self.panels, self.scales, self.out_features)

    @property
    def claim(self) -> str:
        return f"within {INT8_PROBE_RTOL:g} of the product with its int8 weights"

    def matches(self, x: torch.Tensor) -> bool:
        q, scales = quantize_rows(self.weight)
        ref = nn.functional.linear(x.float(), q.float() * scales[:, None])
        return within_scale(self(x), ref, INT8_PROBE_RTOL)


def int8_draft_layer(weight: torch.Tensor) -> Optional[Int8PanelLinear]:
    """weight [out, in] on CPU -> an `Int8PanelLinear` of it, or None where entmtp's panel kernels
    do not run here or its probe fails."""
    if weight.device.type != "cpu" or _panels_unavailable():
        return None
    layer = Int8PanelLinear(shared_linear(weight))
    return layer if probe_ok(layer) else None


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm, weight * bf16(x * rsqrt(mean(x^2) + eps)) computed in fp32, as one
    op of entmtp's kernel library instead of eight (each costing more dispatch than arithmetic).
    x [..., h] bf16 -> [..., h] bf16. `weight` is the original (shared) parameter."""

    claim = "within bf16 rounding of the RMSNorm it replaces"

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.in_features = norm.weight.shape[0]
        self.eps = float(self._eps_of(norm))
        self.__dict__["_reference"] = norm.forward  # the replaced forward, for `matches` (not a submodule)

    @staticmethod
    def _eps_of(norm: nn.Module):
        """The norm's epsilon: transformers' `variance_epsilon`, or `eps` (None when neither)."""
        return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        """Whether `mod` looks like an RMSNorm this op computes (the probe then checks it does)."""
        w = getattr(mod, "weight", None)
        eps = FusedRMSNorm._eps_of(mod)
        return (type(mod).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
                and w.dtype == torch.bfloat16 and isinstance(eps, float) and not mod._modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.entmtp_cpu.bf16_rms_norm(x, self.weight, self.eps)

    def matches(self, x: torch.Tensor) -> bool:
        ref = self._reference(x).float()
        return within_scale(self(x), ref, BF16_PANEL_PROBE_RTOL)


class FusedMLP(nn.Module):
    """A gated MLP down(silu(gate(x)) * up(x)) on the panels in three op calls: gate and up as one
    panel product (fp32 sums), silu(gate) * up fused in fp32, fp32 into down_proj, rounded to bf16
    once at the end. x [..., h] bf16 -> [..., h] bf16, within bf16 rounding of the exact product
    (torch's rounds three times on the way, and takes five module calls and five ops). A float32
    MLP the same way without the rounding, within FUSED_FP32_RTOL of the module."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_weight, self.up_weight, self.down_weight = g.weight, u.weight, d.weight  # shared parameters
        self.in_features, self.inter, self.out_features = g.in_features, g.out_features, d.out_features
        self.gate_up = pack_panels(torch.cat([g.weight.detach(), u.weight.detach()]))
        self.down = pack_panels(d.weight, fp32_input=True)
        self.__dict__["_reference"] = mlp.forward

    @property
    def claim(self) -> str:
        if self.gate_up.dtype == torch.float32:
            return f"within {FUSED_FP32_RTOL:g} of the gated MLP"
        return "within bf16 rounding of the exact gated MLP"

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        """Whether `mod` looks like a bias-free bf16 or float32 SiLU gated MLP (the probe then checks it is one)."""
        lins = [getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mod, "act_fn", None)
        return (all(type(x) is nn.Linear and x.bias is None for x in lins)
                and len({x.weight.dtype for x in lins}) == 1 and lins[0].weight.dtype in (torch.bfloat16, torch.float32)
                and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
                and set(mod._modules) == {"gate_proj", "up_proj", "down_proj", "act_fn"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.entmtp_cpu
        gu = panels_product(x, self.gate_up, 2 * self.inter, None, True)
        return panels_product(ops.silu_mul(gu), self.down, self.out_features)

    def matches(self, x: torch.Tensor) -> bool:
        if x.dtype == torch.float32:
            ref = self._reference(x)
            return within_scale(self(x), ref, FUSED_FP32_RTOL)
        f = lambda w: w.float()  # noqa: E731
        xf = x.float()
        exact = nn.functional.linear(nn.functional.silu(xf @ f(self.gate_weight).T) * (xf @ f(self.up_weight).T), f(self.down_weight))
        tol = BF16_PANEL_PROBE_RTOL * exact.abs().max().clamp_min(1e-30)
        # ours within one rounding of the exact MLP, and the module's own forward near it too
        # (it is this formula: three bf16 roundings on the way)
        return bool((self(x).float() - exact).abs().max() <= tol
                    and (self._reference(x).float() - exact).abs().max() <= 8 * tol)


class FusedAttention(nn.Module):
    """A Llama-style attention (q/k/v/o projections, rotate-half rotary embedding, grouped-query
    sdpa) for a bf16 model whose attention runs in float32 (`entmtp.attention`): q|k|v as one
    panel product with fp32 sums, the rotary embedding and the head split in one op in fp32, keys
    and values cached in fp32, fp32 attention, fp32 into o_proj, rounded to bf16 once at the end.
    hidden_states [B, q, h] bf16 -> ([B, q, h] bf16, None). Within bf16 rounding of the exact
    attention (torch's rounds q, k, v, each rotary product and the attention output to bf16 on
    the way, over some 25 op calls a layer; this takes 4 and a cache update).

    The attention op (`attend`) computes every row from its query and the keys it sees alone, so
    a tree's rows get exactly the numbers one-token steps would: with the panels (the same
    summation order for any row count) and row-wise fused ops, greedy speculation on this twin
    emits exactly the tokens of plain decoding on it, in bf16 too. A float32 attention the same
    way on float32 panels, within FUSED_FP32_RTOL of the module."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.layer_idx, self.scaling, self.head_dim = attn.layer_idx, attn.scaling, attn.head_dim
        self.num_heads, self.num_kv_heads = q.out_features // self.head_dim, k.out_features // self.head_dim
        self.num_key_value_groups, self.is_causal = self.num_heads // self.num_kv_heads, True  # read by sdpa helpers
        self.in_features, self.out_features = q.in_features, o.out_features
        self.q_weight, self.k_weight, self.v_weight, self.o_weight = q.weight, k.weight, v.weight, o.weight  # shared
        self.qkv = pack_panels(torch.cat([q.weight.detach(), k.weight.detach(), v.weight.detach()]))
        self.qkv_bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias]).detach()
        self.o = pack_panels(o.weight, fp32_input=True)
        self.o_bias = o.bias
        self.__dict__["_reference"] = attn  # the replaced module, for `matches` (not a submodule)

    @property
    def claim(self) -> str:
        if self.qkv.dtype == torch.float32:
            return f"within {FUSED_FP32_RTOL:g} of the attention"
        return "within bf16 rounding of the exact attention"

    @staticmethod
    def fits(mod: nn.Module) -> bool:
        """Whether `mod` looks like a full (not sliding-window) Llama-style bf16 or float32 attention:
        exactly q/k/v/o `nn.Linear` projections, biases on all of q/k/v or none, none on o (the probe
        then checks the formula: rotary convention, scaling, grouping)."""
        lins = [getattr(mod, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not (all(type(x) is nn.Linear for x in lins) and len({x.weight.dtype for x in lins}) == 1
                and lins[0].weight.dtype in (torch.bfloat16, torch.float32)):
            return False
        head_dim, cfg = getattr(mod, "head_dim", None), getattr(mod, "config", None)
        if not isinstance(head_dim, int) or head_dim % 8:  # the attention op works in 8-lane blocks
            return False
        layer_types = getattr(cfg, "layer_types", None) or []
        idx = getattr(mod, "layer_idx", None)
        return (set(mod._modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
                and isinstance(idx, int) and isinstance(getattr(mod, "scaling", None), float)
                and len({x.bias is None for x in lins[:3]}) == 1 and lins[3].bias is None
                and lins[0].out_features % head_dim == 0 and lins[1].out_features % head_dim == 0
                and getattr(mod, "sliding_window", None) is None
                and getattr(cfg, "attn_logit_softcapping", None) is None
                # a layer typed full attention; untyped, no sliding window in the config (Mistral reads it there)
                and (layer_types[idx] == "full_attention" if idx < len(layer_types)
                     else getattr(cfg, "sliding_window", None) is None))

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        ops = torch.ops.entmtp_cpu
        b, q_len = hidden_states.shape[:2]
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        qkv = panels_product(hidden_states, self.qkv, width, self.qkv_bias, True)
        cos, sin = position_embeddings
        query, key, value = ops.rope_split(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        m = attention_mask
        if m is None or (m.dim() == 4 and m.shape[1] == 1 and m.shape[0] in (1, b) and m.shape[2:] == (q_len, key.shape[-2])):
            # no mask: causal (a prompt) or one row; else a tree's or padding mask
            out = ops.attend(query, key, value, m, m is None, self.scaling)
        else:
            kwargs.pop("dropout", None)
            out, _ = fp32_sdpa_attention(self, query, key, value, m, scaling=self.scaling, **kwargs)
        return panels_product(out.reshape(b, q_len, -1), self.o, self.out_features, self.o_bias), None

    def matches(self, x: torch.Tensor) -> bool:
        """x [r, h]: r rows as one sequence (all but the last 3 as a causal prompt into a fresh
        cache, then the rest as a tree with an explicit mask) through this, the replaced module
        and an exact float32 copy of it: this within bf16 rounding of the copy, the module within
        its own roundings of it (so the copy computes the module's formula)."""
        from transformers import DynamicCache

        r, d = x.shape[0], self.head_dim
        split = max(1, r - 3)
        g = torch.Generator().manual_seed(1)
        angle = torch.arange(r)[:, None] * torch.rand(d // 2, generator=g)[None] * 2.0
        angle = torch.cat([angle, angle], -1)[None]  # [1, r, d]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        exact_module = copy.deepcopy(self._reference).float()
        outs = []
        for mod, dtype in ((self, x.dtype), (self._reference, x.dtype), (exact_module, torch.float32)):
            cache, parts = DynamicCache(), []
            for lo, hi in ((0, split), (split, r)):
                if hi <= lo:
                    continue
                mask = None
                if lo:  # a tree: each new row sees the prompt, itself and the row two before it
                    mask = torch.full((1, 1, hi - lo, hi), float("-inf"), dtype=dtype)
                    mask[..., :lo] = 0
                    for i in range(hi - lo):
                        mask[0, 0, i, lo + i] = 0
                        if i >= 2:
                            mask[0, 0, i, lo + i - 2] = 0
                out, _ = mod(x[None, lo:hi].to(dtype), position_embeddings=(cos[:, lo:hi].to(dtype), sin[:, lo:hi].to(dtype)),
                             attention_mask=mask, cache=cache)
                parts.append(out.float())
            outs.append(torch.cat(parts, 1))
        ours, module, exact = outs
        if x.dtype == torch.float32:
            return within_scale(ours, module, FUSED_FP32_RTOL)
        tol = BF16_PANEL_PROBE_RTOL * exact.abs().max().clamp_min(1e-30)
        # the module rounds to bf16 some ten times on the way (up to ~9 tol seen on SmolLM2-135M); another
        # formula (rotary convention, scaling) would miss by a sizeable fraction of the output scale
        return bool((ours - exact).abs().max() <= tol and (module - exact).abs().max() <= 32 * tol)


LEAN_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _hooks_anywhere(modules) -> bool:
    """Whether any of `modules` or the process (torch's global module hooks) has forward hooks."""
    if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
        return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return True
    return False


def _lean_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                  use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    """A pre-norm decoder layer, x + attn(norm(x)) then x + mlp(norm(x)), calling its children's
    `forward` directly: what the layer's own forward computes, in the same ops and order, without
    four module calls and the keyword plumbing between them (~3% of a SmolLM2-135M bf16 step).
    Where a child or the process holds forward hooks (added after load, say, to watch attention),
    the layer's own forward runs, so they fire."""
    kids = (self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)
    if _hooks_anywhere(kids):
        return type(self).__mro__[1].forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                             cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    cache = kwargs.pop("past_key_values", cache)
    a, _ = self.self_attn.forward(hidden_states=self.input_layernorm.forward(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    x = hidden_states + a
    return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


@functools.lru_cache(maxsize=None)
def _lean_class(cls: type) -> type:
    """A subclass of a decoder layer class with `_lean_forward` (a subclass, so that transformers'
    output recorders, which match layers by class, still find it)."""
    return type(f"Lean{cls.__name__}", (cls,), {"forward": _lean_forward, "__module__": __name__,
                                               "__doc__": f"{cls.__name__} with entmtp's lean forward (probed bitwise)."})


def _lean_matches(layer: nn.Module, lean: type) -> bool:
    """Whether `lean`'s forward gives bitwise the layer's own on random inputs: a causal prompt of 4
    rows into a fresh cache, then 3 rows with a tree mask (each sees the prompt and itself)."""
    from transformers import DynamicCache

    p = next(layer.parameters())
    head_dim = getattr(layer.self_attn, "head_dim", None)
    h = getattr(layer.self_attn, "in_features", None) or getattr(getattr(layer.self_attn, "q_proj", None), "in_features", None)
    if not isinstance(head_dim, int) or not isinstance(h, int):
        return False
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 7, h, generator=g).to(p.dtype)
    angle = torch.arange(7)[:, None] * torch.rand(head_dim // 2, generator=g)[None]
    angle = torch.cat([angle, angle], -1)[None]
    cos, sin = angle.cos().to(p.dtype), angle.sin().to(p.dtype)
    outs = []
    for forward in (type(layer).forward, lean.forward):
        cache, parts = DynamicCache(), []
        for lo, hi in ((0, 4), (4, 7)):
            mask = None
            if lo:
                mask = torch.full((1, 1, hi - lo, hi), torch.finfo(p.dtype).min, dtype=p.dtype)
                mask[..., :lo] = 0
                mask[0, 0].diagonal(lo).zero_()
            pos = torch.arange(lo, hi)[None]
            parts.append(forward(layer, x[:, lo:hi], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                                 position_embeddings=(cos[:, lo:hi], sin[:, lo:hi])))
        outs.append(torch.cat(parts, 1))
    return torch.equal(outs[0], outs[1])


def lean_decoder_layers(twin: nn.Module) -> int:
    """Give each decoder layer of a decoding twin whose children are exactly a pre-norm layer's
    (`LEAN_CHILDREN`) the lean forward, where the probe finds it bitwise the layer's own. Only ever
    on a twin: the model itself is never modified. Returns how many."""
    n = 0
    with torch.no_grad():
        for mod in twin.modules():
            kids = dict(mod.named_children())
            if tuple(sorted(kids)) != tuple(sorted(LEAN_CHILDREN)) or type(mod).__name__.startswith("Lean"):
                continue
            lean = _lean_class(type(mod))
            try:
                ok = _lean_matches(mod, lean)
            except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):  # another shape or signature: kept
                ok = False
            if ok:
                mod.__class__ = lean
                n += 1
    return n


def can_pack(model: nn.Module) -> Optional[str]:
    """None when `model` can run prepacked linears, else why not (one line)."""
    p = next(model.parameters(), None)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu":
        return f"packed kernels are for CPU models (this one is on {p.device.type})"
    if p.dtype not in PACKABLE:
        return f"packed kernels are for bfloat16 and float32 models (this one is {str(p.dtype).removeprefix('torch.')})"
    return pack_method(p.dtype)[1]


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The layers `packed_twin` packs: CPU `nn.Linear`s in the model's dtype."""
    p = next(model.parameters(), None)
    return [m for m in model.modules() if type(m) is nn.Linear and p is not None and m.weight.dtype == p.dtype
            and m.weight.dtype in PACKABLE and m.weight.device.type == "cpu"]


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the weights `packed_twin` would pack (the extra memory the twin needs)."""
    seen = {id(m.weight): m.weight for m in _linears(model)}
    return sum(w.numel() * w.element_size() for w in seen.values())


def twin_of(model: nn.Module, replace: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None) -> nn.Module:
    """A twin of `model`: its own modules (shallow copies: their own module, parameter, buffer
    and hook tables, the same tensors), except those `replace(module)` returns a new module for
    (not descended into). `model` is not modified and hooks added to it later do not fire on
    the twin. Errors of `replace` (ValueError for a failed probe) propagate."""
    memo: dict[int, nn.Module] = {}

    def twin(mod: nn.Module) -> nn.Module:
        if id(mod) in memo:
            return memo[id(mod)]
        new: Optional[nn.Module] = replace(mod) if replace is not None else None
        if new is None:
            new = copy.copy(mod)
            # own tables (a shallow copy would share them), same tensors and hook functions:
            # hooks added to `model` later (e.g. a forward counter) do not reach the twin, and
            # transformers' output-capturing hooks (hidden states) already installed keep working
            for k, v in mod.__dict__.items():
                if isinstance(v, dict):
                    new.__dict__[k] = v.copy()
            new._modules = {k: (twin(c) if c is not None else None) for k, c in mod._modules.items()}
        memo[id(mod)] = new
        return new

    return twin(model)


def packed_twin(model: nn.Module, method: Optional[str] = None, fused_attention: bool = False,
                fused_extra: tuple[type, ...] = ()) -> nn.Module:
    """A twin of `model` (`twin_of`) whose `nn.Linear` layers of its dtype are `PackedLinear`s
    (method "onednn") or `PanelLinear`s (method "panels": entmtp's bf16 kernel); method None =
    the first available (`pack_method`); all else shared. With the panels, gated MLPs and
    RMSNorms are fused where their probes pass, and so are attentions when `fused_attention`
    (only for a model that attends in float32: `FusedAttention` does). `fused_extra`: more fused
    module classes (with `fits`, `claim`, `matches` and optionally `probe_rows`), tried first,
    e.g. the Hydra++ layer of draft heads.
    Raises ValueError (with the reason the kernels cannot run, or the first layer whose probe differs)."""
    why = can_pack(model)
    dtype = next(model.parameters()).dtype if why is None else None
    if why is None and method is not None:
        why = kernel_options(dtype).get(method, f"unknown kernel set {method!r}")
    if why:
        raise ValueError(why)
    panels = (method or pack_method(dtype)[0]) == "panels"
    layer_class = PanelLinear if panels else functools.partial(PackedLinear, one_row_stock=method == "onednn-trees")

    def replace(mod: nn.Module) -> Optional[nn.Module]:
        if panels:  # fused modules of entmtp's kernel library, where the probe agrees
            for fused in fused_extra + ((FusedAttention, FusedMLP, FusedRMSNorm) if fused_attention else (FusedMLP, FusedRMSNorm)):
                if fused.fits(mod):
                    new = fused(mod)
                    if probe_ok(new, getattr(new, "probe_rows", (1, 7))):
                        return new
        if type(mod) is nn.Linear and mod.weight.dtype == dtype:
            new = layer_class(mod)
            if not probe_ok(new):
                raise ValueError(f"the packed kernel is not {new.claim} here ({mod.in_features}x{mod.out_features})")
            return new
        return None

    return twin_of(model, replace)


def preferred_kernels(model: nn.Module) -> str:
    """The kernel set `auto` takes when nothing was measured (ENTMTP_TUNE=0): the row-invariant
    panels for bf16 where they run (speculation then emits exactly the plain loop's tokens), else
    oneDNN's packed linears where they run, else stock. `entmtp.tuning` measures instead."""
    p = next(model.parameters())
    opts = kernel_options(p.dtype, p.device)
    if kernel_bytes_ok(model) is not None:
        return "stock"
    return next((k for k in ("panels", "onednn") if opts[k] is None), "stock")


def kernel_bytes_ok(model: nn.Module) -> Optional[str]:
    """None when the packed copies of `model`'s weights fit AUTO_MAX_BYTES, else why not."""
    extra = linear_bytes(model)
    if extra > AUTO_MAX_BYTES:
        return (f"the packed copies would need {extra / 2**30:.1f} GiB more memory (auto packs up to "
                f"{AUTO_MAX_BYTES / 2**30:.0f} GiB; use --kernels onednn or panels)")
    return None


KERNEL_WHY = {
    "stock": "transformers' own kernels",
    "onednn": "linears prepacked for oneDNN (no per-call weight relayout; bf16 bit-identical to stock, fp32 within "
              f"{FP32_PROBE_RTOL:g}, probed)",
    "onednn-trees": "linears prepacked for oneDNN for tree rows, transformers' own for one-row steps (fp32 within "
                    f"{FP32_PROBE_RTOL:g}, probed)",
    "panels": "entmtp's kernel library: bf16 linears in panels with fp32 sums, each row alone in a fixed order (the "
              "same bits for any row count), RMSNorms, gated MLPs and Llama attentions fused, attention in float32 (probed)",
}
PANELS_FP32_WHY = ("entmtp's kernel library: float32 linears in panels, each row alone in a fixed order (the same bits "
                   f"for any row count; within {FP32_PROBE_RTOL:g} of F.linear), gated MLPs and Llama attentions fused "
                   "(probed)")  # "panels" for a float32 model


def tree_mask_dtype(twin: nn.Module) -> torch.dtype:
    """The dtype of the additive tree mask `twin` reads as it is: float32 where every decoder layer's
    attention is a `FusedAttention` (whose `attend` op works on float32 masks: one in the model's
    dtype was converted again in each layer, ~0.1 ms a tree step on a 30-layer bf16 model), else
    the weights' dtype, what sdpa and eager attention take. The mask's values (0 or the dtype's
    most negative number) hide the same keys in either."""
    attns = [m for name, m in twin.named_modules() if name.rsplit(".", 1)[-1] == "self_attn"]
    if attns and all(isinstance(m, FusedAttention) for m in attns):
        return torch.float32
    return next(twin.parameters()).dtype


def decode_model(model: nn.Module, kernels: str = "auto") -> tuple[nn.Module, str, str]:
    """The model to decode with for a kernel set: (model or its twin, the set's name, why).

    kernels: one of KERNEL_SETS; "packed" = the first packed set available (`pack_method`);
    "auto" = `preferred_kernels` (the unmeasured order; the engine measures instead, through
    `entmtp.tuning`). A set that cannot run here raises ValueError when asked for by name;
    the model itself is never modified."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)} (got {kernels!r})")
    if kernels == "auto":  # the unmeasured order; a set whose build or probe fails gives way to the next
        p = next(model.parameters())
        opts = kernel_options(p.dtype, p.device)
        refused = [opts[k] for k in ("panels", "onednn") if opts[k]] + [kernel_bytes_ok(model) or ""]
        first = preferred_kernels(model)
        for name in dict.fromkeys([first] + [k for k in ("panels", "onednn") if opts[k] is None and first != "stock"]):
            if name == "stock":
                break
            try:
                return decode_model(model, name)
            except ValueError as e:
                refused.append(str(e))
        why = "; ".join(r for r in dict.fromkeys(refused) if r)
        return model, "stock", KERNEL_WHY["stock"] + (f" ({why})" if why else "")
    if kernels == "packed":
        why = can_pack(model)
        if why:
            raise ValueError(f"cannot use packed kernels: {why}")
        kernels = pack_method(next(model.parameters()).dtype)[0]
    if kernels == "stock":
        return model, "stock", KERNEL_WHY["stock"]
    p = next(model.parameters())
    why = can_pack(model) or kernel_options(p.dtype, p.device)[kernels]
    if why:
        raise ValueError(f"cannot use the {kernels} kernels: {why}")
    sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    fuse_attention = kernels == "panels" and sdpa
    try:
        twin = packed_twin(model, method=kernels, fused_attention=fuse_attention)
    except ValueError as e:
        raise ValueError(f"cannot use the {kernels} kernels: {e}") from None
    if fuse_attention and p.dtype == torch.bfloat16:  # a float32 model attends in float32 already
        use_fp32_attention(twin, model.config)
    lean_decoder_layers(twin)
    if kernels != "panels":
        return twin, kernels, KERNEL_WHY[kernels]
    why = PANELS_FP32_WHY if p.dtype == torch.float32 else KERNEL_WHY["panels"]
    return twin, kernels, f"{why}; {panel_layout()} panel layout"


__all__ = ["KERNELS", "KERNEL_SETS", "ONE_ROW_STOCK", "PACKABLE", "PackedLinear", "PanelLinear", "Int8PanelLinear", "quantize_rows", "int8_draft_layer",
           "panels_product", "move_rows", "within_scale", "FusedAttention", "FusedMLP",
           "FusedRMSNorm", "lean_decoder_layers", "tree_mask_dtype", "kernel_options", "pack_method", "dtype_advice", "shared_linear", "packed_layer",
           "packed_linear", "PANEL_LAYOUTS", "pack_panels", "panel_layout", "library_id", "can_pack", "linear_bytes", "twin_of", "packed_twin", "preferred_kernels",
           "decode_model"]
