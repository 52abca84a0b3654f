"""The CPU class as dispatch sees it (ENTMTP_ISA can only take capabilities away), the machine
fingerprint tuning profiles are cached under, and the bf16 advice."""

import os
import sys

import pytest
import torch

from entmtp import hardware, kernels
from entmtp.hardware import ISA_ORDER, cpu_isa, fast_bf16_matmul, hardware_class, native_isa


def test_hardware_class_names_the_cpu_isa_or_the_device_type():
    isa = cpu_isa()
    assert isa in ISA_ORDER
    assert hardware_class("cpu") == hardware_class(torch.device("cpu")) == f"cpu-{isa}"
    assert hardware_class("cuda:1") == "cuda" and hardware_class("mps") == "mps"
    units = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert fast_bf16_matmul() == (isa in ("amx", "avx512_bf16"))
    if not os.environ.get("ENTMTP_ISA"):  # as torch itself reports them
        assert fast_bf16_matmul() == units


@pytest.mark.parametrize("want", ISA_ORDER)
def test_isa_switch_caps_at_the_native_isa(want, monkeypatch):
    monkeypatch.setenv("ENTMTP_ISA", want)
    got = cpu_isa()
    assert ISA_ORDER.index(got) == min(ISA_ORDER.index(want), ISA_ORDER.index(native_isa()))
    assert hardware.fingerprint("cpu")["isa"] == got  # a profile measured under the switch is its own


def test_amx_emulation_adds_only_amx_and_only_to_an_avx512_bf16_cpu(monkeypatch):
    """ENTMTP_AMX_EMULATION=1 lifts an AVX512-BF16 CPU (and no other) to the AMX branch, names its
    own kernel library (its timings are not the real tiles'), and ENTMTP_ISA still lowers it."""
    hw = hardware._hardware_isa()
    monkeypatch.delenv("ENTMTP_ISA", raising=False)
    monkeypatch.setenv("ENTMTP_AMX_EMULATION", "1")
    assert hardware.amx_emulated() == (hw == "avx512_bf16")
    assert native_isa() == ("amx" if hw in ("avx512_bf16", "amx") else hw)
    if hardware.amx_emulated():
        assert cpu_isa() == "amx" and kernels.panel_layout() == "amx" and kernels.library_id().endswith("-amx-emulated")
        monkeypatch.setenv("ENTMTP_ISA", "avx512")
        assert cpu_isa() == "avx512" and kernels.library_id().endswith("-avx512-emulated")  # the build loaded
        monkeypatch.delenv("ENTMTP_ISA")
    monkeypatch.setenv("ENTMTP_AMX_EMULATION", "0")
    assert not hardware.amx_emulated() and native_isa() == hw
    assert not kernels.library_id().endswith("-emulated")


def test_fingerprint_names_machine_threads_and_torch(monkeypatch):
    fp = hardware.fingerprint("cpu")
    assert fp["torch"] == torch.__version__ and fp["cores"] >= 1 and fp["cpu"]
    assert fp["wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "")  # a profile per policy
    a = hardware.fingerprint_id("cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1" if fp["threads"] != 1 else "2")
    assert hardware.fingerprint_id("cpu") != a


def test_fingerprint_names_caps_on_the_stock_kernels_only_when_set(monkeypatch):
    """Capping torch's or oneDNN's instruction set (to see a machine as an AVX2-only one) makes
    another machine for the cached measurements; without a cap the fingerprint names neither."""
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    plain = hardware.fingerprint("cpu")
    assert "torch_isa" not in plain and "onednn_isa" not in plain
    ids = {hardware.fingerprint_id("cpu")}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware.fingerprint("cpu")["onednn_isa"] == "avx2"
    ids.add(hardware.fingerprint_id("cpu"))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert hardware.fingerprint("cpu")["torch_isa"] == "avx2"
    ids.add(hardware.fingerprint_id("cpu"))
    assert len(ids) == 3


def test_bf16_advice_only_where_speculation_cannot_pay():
    assert kernels.dtype_advice("cpu", torch.float32) is None and kernels.dtype_advice("cuda", torch.bfloat16) is None
    advice = kernels.dtype_advice("cpu", torch.bfloat16)
    if fast_bf16_matmul() or kernels.pack_method(torch.bfloat16)[0] is not None:
        assert advice is None
    else:
        assert "no fast bf16 kernels" in advice and "--dtype float32" in advice and "\n" not in advice


def test_bf16_advice_on_a_generic_cpu_names_the_reason(monkeypatch):
    """A CPU with neither bf16 units nor the panels (ENTMTP_ISA=generic dispatches as on one) gets the note."""
    monkeypatch.setenv("ENTMTP_ISA", "generic")
    advice = kernels.dtype_advice("cpu", torch.bfloat16, remedy="load it in float32")
    assert "cpu-generic" in advice and advice.endswith("load it in float32") and "\n" not in advice


def test_a_reports_command_line_carries_the_dispatch_settings_it_ran_under(monkeypatch):
    """`entmtp bench` under ENTMTP_ISA=avx2 (and caps on torch and oneDNN) writes a command line that
    reproduces the run: the settings first, quoted; none when none is set."""
    from entmtp import cli

    for var in hardware.DISPATCH_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["entmtp", "bench", "--dtype", "bfloat16"])
    assert hardware.dispatch_env() == "" and cli._command("bench") == "entmtp bench --dtype bfloat16"
    monkeypatch.setenv("ENTMTP_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ENTMTP_THREADS", "1 2")  # quoted as a shell would need it
    assert cli._command("bench") == ("ENTMTP_ISA=avx2 ENTMTP_THREADS='1 2' ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                                     "entmtp bench --dtype bfloat16")
