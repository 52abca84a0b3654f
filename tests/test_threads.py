"""OpenMP waiting and CPU threads: the policy chosen before torch loads, the load of this process's
cores read from the kernel's counters, and the governor that decodes with one thread while other
processes use the cores."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from entmtp import decoding, threads
from entmtp.decoding import DecodeConfig, Engine
from entmtp.threads import CoreLoad, ThreadGovernor

ROOT = Path(__file__).resolve().parents[1]


def _stat(path: Path, busy_ticks: list[int], idle_ticks: int = 1000) -> None:
    """A /proc/stat with one line per CPU: `busy_ticks[i]` user ticks and `idle_ticks` idle ones."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 {idle_ticks} 0 0 0 0 0 0" for i, b in enumerate(busy_ticks)]
    path.write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")


def test_core_load_is_the_busy_time_of_our_cores_less_our_own(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    now, ours = [100.0], [10.0]
    _stat(stat, [0, 0, 0])
    load = CoreLoad(cpus=[0, 1], stat_path=str(stat), cpu_time=lambda: ours[0], clock=lambda: now[0])
    # in 1 s, cores 0 and 1 were busy 1.6 s, 1.0 s of it ours: others used 0.6 of a core
    _stat(stat, [tick, int(0.6 * tick), 5 * tick])  # cpu2 is not ours: not counted
    now[0], ours[0] = 101.0, 11.0
    assert load.others() == pytest.approx(0.6, abs=0.02)
    # the next reading is since this one; our own time is never taken for someone else's
    now[0], ours[0] = 102.0, 13.0
    _stat(stat, [2 * tick, int(1.6 * tick), 5 * tick])
    assert load.others() == pytest.approx(0.0)
    stat.write_text("nothing here\n")
    assert load.others() is None and CoreLoad(cpus=[0], stat_path=str(tmp_path / "missing")).sample() is None


def test_a_registered_worker_process_counts_as_our_own_cpu(tmp_path):
    """`generate` timed in a worker process (`stock_process`) is not a busy neighbour: its CPU
    time joins ours, read from /proc/<pid>/stat; a worker that has ended is dropped."""
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "4242").mkdir()
    # pid (comm with a space and a paren) state ppid ... utime=fields[11] stime=fields[12] after the ")"
    rest = ["S", "1"] + ["0"] * 9 + [str(3 * tick), str(tick)] + ["0"] * 30
    (tmp_path / "4242" / "stat").write_text("4242 (python (x)) " + " ".join(rest) + "\n")
    assert threads.process_cpu_seconds(4242, str(tmp_path)) == pytest.approx(4.0)
    assert threads.process_cpu_seconds(999, str(tmp_path)) is None
    workers = {4242, 999}
    mine = sum(os.times()[:2])
    total = threads.own_cpu_seconds(workers, str(tmp_path))
    assert mine + 4.0 <= total < mine + 4.0 + 1.0  # ours (a little more by now) plus the worker's
    assert workers == {4242}  # the ended one is gone

    # the governor's load: a second's busy cores, the worker's 0.8 s of it ours
    stat, now, worker = tmp_path / "stat", [0.0], [0.0]
    _stat(stat, [0, 0])
    load = CoreLoad(cpus=[0, 1], stat_path=str(stat), cpu_time=lambda: worker[0], clock=lambda: now[0])
    _stat(stat, [tick, 0])
    now[0], worker[0] = 1.0, 0.8
    assert load.others() == pytest.approx(0.2, abs=0.02)
    assert CoreLoad().cpu_time is threads.own_cpu_seconds  # the default counts registered workers


class _ScriptedLoad:
    def __init__(self, values):
        self.values = list(values)

    def others(self):
        return self.values.pop(0)


def test_governor_drops_to_one_thread_while_others_use_the_cores_and_comes_back():
    gov = ThreadGovernor(2, load=_ScriptedLoad([0.0, 0.9, 0.5, None, 0.1, threads.BUSY_CORES]), interval=0.0)
    assert [gov.threads() for _ in range(6)] == [2, 1, 1, 1, 2, 1]  # an unreadable load keeps the count
    slow = ThreadGovernor(4, load=_ScriptedLoad([0.9]), interval=3600)
    assert slow.threads() == 4 and slow.threads() == 4  # read at most once an interval
    before = torch.get_num_threads()
    try:
        assert ThreadGovernor(2, load=_ScriptedLoad([0.9]), interval=0.0).apply() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_engine_decodes_under_the_governor(tmp_path, monkeypatch):
    """With a measured count above one and a readable load, each step runs with the governor's
    count: one thread while another process holds a core; the tokens do not depend on it."""
    monkeypatch.setenv("ENTMTP_TUNE", "1")
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decoding, "apply_threads", lambda profile: 2)
    monkeypatch.setattr(decoding, "adaptive_threads_possible", lambda: True)
    before = torch.get_num_threads()
    try:
        model = tiny_model("llama", vocab=96, dtype=torch.float32, seed=2)
        eng = Engine(model, None, {}, kernels="auto")
        assert eng.governor is not None and eng.governor.wide == 2
        eng.governor.load, eng.governor.interval = _ScriptedLoad([0.0] + [1.0] * 50), 0.0
        cfg = DecodeConfig(max_new_tokens=8, eos_token_ids=())
        torch.set_num_threads(2)
        busy = eng.run([5, 9, 11, 5], config=cfg).tokens
        assert torch.get_num_threads() == 1 and eng.governor.others == 1.0
        assert busy == Engine(model, None, {}, kernels="stock").run([5, 9, 11, 5], config=cfg).tokens
        monkeypatch.setattr(decoding, "adaptive_threads_possible", lambda: False)
        assert Engine(model, None, {}, kernels="auto").governor is None
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("env,expect", [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),  # the environment's own choice holds
    ({"ENTMTP_ADAPTIVE_THREADS": "0"}, "PASSIVE"),  # no governor: passive waiting
    ({"ENTMTP_THREADS": "2"}, "PASSIVE"),  # a fixed count: passive waiting
    ({}, "adaptive"),  # OpenMP's own waiting where the governor can run, else passive
])
def test_wait_policy_is_set_before_torch_loads(env, expect):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "ENTMTP_ADAPTIVE_THREADS", "ENTMTP_THREADS")}
    code = ("import entmtp, os, sys; from entmtp.threads import adaptive_threads_possible as a; "
            "print(os.environ.get('OMP_WAIT_POLICY'), a(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, cwd=ROOT)
    policy, adaptive, torch_loaded = out.stdout.split()
    assert out.returncode == 0 and torch_loaded == "False"  # decided before any torch import
    if expect == "adaptive":
        assert policy == ("None" if adaptive == "True" else "PASSIVE")
    else:
        assert policy == expect


def test_machine_panel_says_when_the_thread_count_is_governed():
    from entmtp.ui_machine import profile_html

    base = {"fingerprint": {"cpu": "a CPU", "isa": "avx2", "cores": 2, "torch": "2.13.0"}, "dtype": "bfloat16",
            "kernels": "stock", "kernels_why": "transformers' own", "threads": 2, "row_invariant": False,
            "kernel_trials": [{"name": "stock", "ran": True, "ms_by_rows": {"1": 10.0}}], "probe_s": 1.0, "heads": {}}
    governed, fixed = profile_html({**base, "threads_governed": True}), profile_html({**base, "threads_governed": False})
    assert "<b>threads</b>: 2 (measured" in governed and "(governor)" in governed
    assert "<b>threads</b>: 2 (measured" in fixed and "(governor)" not in fixed


def test_busy_note_names_a_measurement_taken_while_others_used_the_cores(tmp_path):
    """A measurement during which other processes used at least BUSY_CORES of our cores is named
    as such (and so not cached); a quiet one, or unreadable counters, is not."""
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    now, ours = [100.0], [10.0]
    _stat(stat, [0, 0])
    busy = CoreLoad(cpus=[0, 1], stat_path=str(stat), cpu_time=lambda: ours[0], clock=lambda: now[0])
    _stat(stat, [tick, tick])  # 2 s busy in 1 s, 1 s of it ours: another process held a core
    now[0], ours[0] = 101.0, 11.0
    note = threads.busy_note(busy, "the kernel profile was")
    assert note.startswith("the kernel profile was measured while other processes used 1.0 cores'") and "not cached" in note
    quiet = CoreLoad(cpus=[0, 1], stat_path=str(stat), cpu_time=lambda: ours[0], clock=lambda: now[0])
    _stat(stat, [tick + int(0.5 * tick), tick + int(0.5 * tick)])  # 1 s busy in 1 s, all of it ours
    now[0], ours[0] = 102.0, 12.0
    assert threads.busy_note(quiet, "x") is None
    stat.write_text("nothing here\n")
    assert threads.busy_note(CoreLoad(cpus=[0], stat_path=str(stat)), "x") is None and threads.busy_note(None, "x") is None
