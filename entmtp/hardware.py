"""What the decoding hardware is, in the terms tree calibration needs.

A draft tree is chosen by expected tokens/s = tau / step time, and step time depends on the
matrix units and kernels far more than on the model: on an AVX-512-BF16 CPU a bf16 forward over
a 5-row tree costs about one 1-row step (SmolLM2-135M); on an AVX2-only CPU (no bf16 instructions,
oneDNN refuses bf16) torch's own bf16 path made it 2.6 one-row steps and a 33-row tree 14, entmtp's
AVX2 panel kernels (`entmtp.kernels`) 1.2 and 3.1 (`scripts/step_rows.py`).
A tree calibrated on one class of CPU can thus be slower than plain decoding on another, so
calibrated trees and banks are recorded per hardware class (`hardware_class`) and looked up
by it (`entmtp.scheduler.recorded_default`).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def cpu_isa() -> str:
    """The CPU's widest matrix instructions torch uses: amx, avx512_bf16, avx512, avx2, or
    torch's own name for others (lower case, e.g. default, sve256)."""
    cpu = getattr(torch, "cpu", None)
    try:
        if cpu._is_amx_tile_supported():
            return "amx"
        if cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except AttributeError:
        pass
    return torch.backends.cpu.get_cpu_capability().lower()


def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX-512 BF16)."""
    return cpu_isa() in ("amx", "avx512_bf16")


def hardware_class(device) -> str:
    """'cpu-<isa>' for a CPU device, else the device type ('cuda', 'mps', ...)."""
    kind = torch.device(device).type
    return f"cpu-{cpu_isa()}" if kind == "cpu" else kind


def dtype_advice(device, dtype, remedy: str = "use --dtype float32") -> str | None:
    """One line for a user decoding in `dtype` on `device` where speculation cannot pay, else None.

    On a CPU without bf16 matrix units and without entmtp's AVX2 bf16 kernels (`entmtp.kernels`:
    no compiler to build them, or no AVX2) torch multiplies bf16 on a slow path whose cost grows
    with every row: a 1-node tree step took 66 ms against 38 ms for a plain step on our AVX2 CPU
    (trees/reports/smollm2-135m-hydrapp-bf16-avx2-stock-search.md), while float32 with packed kernels
    makes a 5-row step cost 1.2 one-row steps."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or fast_bf16_matmul():
        return None
    from .kernels import pack_method

    method, why = pack_method(torch.bfloat16)
    if method is not None:
        return None
    return (f"note: this CPU ({hardware_class(device)}) has no fast bf16 kernels ({why}): in bfloat16 a draft tree "
            f"costs several one-token steps and speculative decoding is slower than plain decoding; {remedy}")
