"""Hardware classes: the key under which step times, trees and banks are calibrated."""

import torch

from entmtp.hardware import cpu_isa, fast_bf16_matmul, hardware_class


def test_hardware_class_names_the_cpu_isa_or_the_device_type():
    isa = cpu_isa()
    assert isa and isa == isa.lower() and " " not in isa
    assert hardware_class("cpu") == hardware_class(torch.device("cpu")) == f"cpu-{isa}"
    assert hardware_class("cuda:1") == "cuda" and hardware_class("mps") == "mps"
    # bf16 matrix units are exactly the two classes named for them, as torch itself reports them
    units = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert fast_bf16_matmul() == (isa in ("amx", "avx512_bf16")) == units


def test_bf16_advice_only_where_speculation_cannot_pay():
    from entmtp.hardware import dtype_advice

    assert dtype_advice("cpu", torch.float32) is None and dtype_advice("cuda", torch.bfloat16) is None
    from entmtp import kernels

    advice = dtype_advice("cpu", torch.bfloat16)
    if fast_bf16_matmul() or kernels.pack_method(torch.bfloat16)[0] is not None:
        assert advice is None
    else:
        assert "no fast bf16 kernels" in advice and "--dtype float32" in advice and "\n" not in advice


def test_bf16_advice_when_neither_bf16_units_nor_panels(monkeypatch):
    """An AVX2 CPU that cannot build the panel kernels (no compiler) gets the note, with the reason."""
    from entmtp import hardware, kernels

    monkeypatch.setattr(hardware, "fast_bf16_matmul", lambda: False)
    monkeypatch.setattr(kernels, "pack_method", lambda dtype: (None, "no compiler here"))
    advice = hardware.dtype_advice("cpu", torch.bfloat16, remedy="load it in float32")
    assert "no compiler here" in advice and advice.endswith("load it in float32") and "\n" not in advice
