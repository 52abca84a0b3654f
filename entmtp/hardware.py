"""What the decoding hardware is: its instruction set, as kernel dispatch sees it, and a fingerprint.

Nothing here decides which kernels or trees pay: that is measured on each machine
(`entmtp.tuning`). This module only says which kernels *can* run (`cpu_isa`) and names the
machine a measurement belongs to (`fingerprint`).

`ENTMTP_ISA=generic|avx2|avx512|avx512_bf16|amx` makes dispatch behave as on a CPU of that
class, so every branch runs (and is tested) on any machine: it can take capabilities away, never
add ones the CPU lacks (asking for more than the CPU has is capped at what it has). The one branch
above a machine's own that tests can reach is AMX, emulated (`amx_emulated`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shlex

import torch

from .threads import default_threads

ISA_ORDER = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # each implies the ones before it


def amx_emulated() -> bool:
    """ENTMTP_AMX_EMULATION=1: a test switch. On a CPU with AVX512-BF16 but no AMX, dispatch takes
    the AMX branch and entmtp's kernel library is built with its tile instructions emulated in
    scalar code (`csrc/bf16_panels.cpp`), so that branch runs in tests on machines without AMX.
    Slow; for tests only. Ignored where the CPU has AMX itself or lacks AVX512-BF16."""
    return os.environ.get("ENTMTP_AMX_EMULATION", "").strip() == "1" and _hardware_isa() == "avx512_bf16"


def native_isa() -> str:
    """The CPU's widest instructions torch's kernels use: amx, avx512_bf16, avx512, avx2, or
    generic (anything else: older x86, ARM, ...); "amx" where `amx_emulated`."""
    return "amx" if amx_emulated() else _hardware_isa()


@functools.lru_cache(maxsize=None)
def _hardware_isa() -> str:
    cpu = getattr(torch, "cpu", None)
    try:
        if cpu._is_amx_tile_supported():
            return "amx"
        if cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except AttributeError:
        pass
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return cap if cap in ISA_ORDER else "generic"


def cpu_isa() -> str:
    """The instruction set kernel dispatch assumes: `native_isa`, capped by ENTMTP_ISA when set.
    Raises ValueError for an unknown ENTMTP_ISA."""
    native = native_isa()
    want = os.environ.get("ENTMTP_ISA", "").strip().lower()
    if not want:
        return native
    if want not in ISA_ORDER:
        raise ValueError(f"ENTMTP_ISA={want!r} is not one of {', '.join(ISA_ORDER)}")
    return ISA_ORDER[min(ISA_ORDER.index(want), ISA_ORDER.index(native))]


def isa_at_least(isa: str) -> bool:
    """Whether dispatch may use `isa` (an ISA_ORDER name) here."""
    return ISA_ORDER.index(cpu_isa()) >= ISA_ORDER.index(isa)


def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX-512 BF16)."""
    return isa_at_least("avx512_bf16")


def hardware_class(device) -> str:
    """'cpu-<isa>' for a CPU device, else the device type ('cuda', 'mps', ...)."""
    kind = torch.device(device).type
    return f"cpu-{cpu_isa()}" if kind == "cpu" else kind


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else platform's word for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


CACHE_SIZE_FALLBACK = 32 << 20  # bytes, where the OS does not say


def parse_cache_size(text: str) -> int:
    """A sysfs cache size ("32768K", "1024K", "32M") in bytes; 0 for anything else."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "KMG" else t
    return int(digits) * scale if digits.isdigit() else 0


@functools.lru_cache(maxsize=None)
def largest_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest CPU cache the first core sees (Linux sysfs), else CACHE_SIZE_FALLBACK."""
    sizes = []
    try:
        for entry in os.listdir(root):
            try:
                with open(os.path.join(root, entry, "size")) as f:
                    sizes.append(parse_cache_size(f.read()))
            except OSError:
                continue
    except OSError:
        pass
    return max(sizes, default=0) or CACHE_SIZE_FALLBACK


def synchronize(device) -> None:
    """Wait for `device`'s queued work (CUDA runs asynchronously): timings must include it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# the environment variables that cap the ISA of torch's own kernels and of oneDNN (the "stock"
# every kernel choice is measured against), by the fingerprint field that names the cap
STOCK_ISA_CAPS = {"torch_isa": ("ATEN_CPU_CAPABILITY",), "onednn_isa": ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}

# environment variables that change which kernels run or what they measure (docs/cli.md)
DISPATCH_ENV = ("ENTMTP_ISA", "ENTMTP_AMX_EMULATION", "ENTMTP_PANELS", "ENTMTP_DRAFT_INT8", "ENTMTP_TUNE",
                "ENTMTP_THREADS", "ENTMTP_ADAPTIVE_THREADS", "OMP_NUM_THREADS",
                *(name for names in STOCK_ISA_CAPS.values() for name in names))


def dispatch_env() -> str:
    """Those of DISPATCH_ENV that are set, as `NAME=value` words before a command (a report's
    command line then reproduces the run: `ENTMTP_ISA=avx2 entmtp bench ...`); "" when none is."""
    return " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in DISPATCH_ENV if os.environ.get(k, "").strip())


def fingerprint(device) -> dict:
    """What a measurement on `device` depends on: the CPU (model, ISA as dispatched, the ISA
    torch's own kernels and oneDNN may use, cores, the threads torch starts with, OpenMP's wait
    policy) or GPU name, and the torch version. `ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA`
    cap the stock kernels every comparison with "stock" measures, so a profile taken under a
    cap is not one for the machine without it."""
    dev = torch.device(device)
    out = {"device": dev.type, "torch": torch.__version__, "machine": platform.machine()}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    else:
        out.update(cpu=_cpu_model(), isa=cpu_isa(), cores=os.cpu_count(), threads=default_threads(),
                   wait_policy=os.environ.get("OMP_WAIT_POLICY", ""))
        for field, names in STOCK_ISA_CAPS.items():  # named only when set: uncapped fingerprints stay as they were
            cap = next((os.environ[n].strip().lower() for n in names if os.environ.get(n, "").strip()), "")
            if cap:
                out[field] = cap
    return out


def fingerprint_id(device) -> str:
    """A short stable name for `fingerprint(device)`."""
    return hashlib.sha256(json.dumps(fingerprint(device), sort_keys=True).encode()).hexdigest()[:12]


__all__ = ["ISA_ORDER", "amx_emulated", "native_isa", "cpu_isa", "isa_at_least", "fast_bf16_matmul", "hardware_class", "fingerprint",
           "fingerprint_id", "STOCK_ISA_CAPS", "DISPATCH_ENV", "dispatch_env", "synchronize"]
