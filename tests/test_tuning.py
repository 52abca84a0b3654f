"""Self-tuning at load: kernel sets measured (latency by rows, bitwise row invariance), the choice
rule, the per-machine cache, and trees chosen from acceptance statistics with measured latency."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_heads, tiny_model
from entmtp import autotune, hardware, kernels, tuning
from entmtp.calibrate import collect_stats, latency_jobs
from entmtp.decoding import DecodeConfig, Engine
from entmtp.tuning import KernelTrial, choose

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tuning_on(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_TUNE", "1")
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def trial(name, one, eight, invariant):
    return KernelTrial(name, "", True, {1: one, 8: eight}, {4: invariant, 16: invariant})


def test_choice_prefers_row_invariant_sets_no_slower_than_stock():
    stock, fast, exact = trial("stock", 40, 60, False), trial("onednn", 30, 35, False), trial("panels", 20, 30, True)
    assert choose([stock, fast, exact])[::2] == ("panels", True)
    slow_exact = trial("panels", 45, 50, True)  # invariant but its one-row step loses to stock: not taken
    name, why, inv = choose([stock, fast, slow_exact])
    assert (name, inv) == ("onednn", False) and "no set here is row-invariant" in why
    # nothing row-invariant: the fastest for trees among the sets whose one-row step is not slower than stock
    slow_one = trial("onednn", 50, 52, False)
    assert choose([stock, slow_one])[0] == "stock"
    assert choose([stock, slow_one, trial("onednn-trees", 40.5, 53, False)])[0] == "onednn-trees"
    # onednn-trees' one-row step is stock's own path: a noisy trial of it (here 20% over stock) is not
    # a slower one-row step, so its faster trees still win
    assert choose([stock, slow_one, trial("onednn-trees", 48, 53, False)])[0] == "onednn-trees"
    assert choose([stock])[0] == "stock"
    assert choose([KernelTrial("panels", "cannot run")])[0] == "stock"  # nothing measured: stock


def test_probe_measures_every_set_that_runs_and_checks_invariance_bitwise():
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=2)
    prof = tuning.probe_kernels(model, rows=(1, 2, 8), repeats=2, check_rows=(4,))
    names = [t.name for t in prof.trials]
    assert names == list(kernels.KERNEL_SETS)
    opts = kernels.kernel_options(torch.bfloat16)
    for t in prof.trials:
        assert t.ran == (opts[t.name] is None)
        if t.ran:  # the choice ranks by one row and 8; the chosen set's whole curve is timed
            assert set(t.ms_by_rows) == ({1, 2, 8} if t.name == prof.choice else {1, 8})
            assert all(v > 0 for v in t.ms_by_rows.values())
            assert set(t.invariant_rows) == {4}
    if opts["panels"] is None:  # entmtp's set computes every row as a one-row step would
        assert prof.trial("panels").row_invariant
    assert prof.choice in [t.name for t in prof.trials if t.ran]


def test_the_probe_builds_each_set_once_and_the_engine_decodes_with_its_twin(tuning_on, monkeypatch):
    """Each kernel set's decoding twin is built once (its build and per-layer probes took ~0.65 s
    for the embedded model): the chosen set's curve, the threads measurement and the engine use
    the twin its trial was timed on; a cached profile makes the engine build the twin itself."""
    monkeypatch.delenv("ENTMTP_ISA", raising=False)
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=3)
    builds, threads_twins = [], []
    real_build, real_threads = kernels.decode_model, tuning.measure_threads

    def counting_build(m, name="auto"):
        out = real_build(m, name)
        builds.append((name, out[0]))
        return out

    def recording_threads(m, name, twin=None):
        threads_twins.append(twin)
        return real_threads(m, name, twin=twin)

    monkeypatch.setattr(tuning, "decode_model", counting_build)
    monkeypatch.setattr("entmtp.decoding.decode_model", counting_build)
    monkeypatch.setattr(tuning, "measure_threads", recording_threads)
    monkeypatch.setattr(tuning, "default_threads", lambda: 2)  # the threads are measured on any machine
    monkeypatch.setattr(tuning, "busy_note", lambda *a: None)  # cached even while other processes ran
    engine = Engine(model, None, {}, kernels="auto")
    ran = [t.name for t in engine.kernel_profile.trials if t.ran]
    assert sorted(name for name, _ in builds) == sorted(ran)  # one build per set that ran, none by the engine
    chosen = next(twin for name, twin in builds if name == engine.kernels)
    assert engine.decode_model is chosen and threads_twins == [chosen]
    assert engine.kernel_profile.built is None  # the profile holds no model once the engine took it
    builds.clear()
    again = Engine(model, None, {}, kernels="auto")  # the profile from the cache: the engine builds its twin
    assert [name for name, _ in builds] == [again.kernels] and again.decode_model is builds[0][1]


def test_invariance_is_checked_up_to_the_first_chain_that_differs(monkeypatch):
    """A set whose 4-row chain already differs from its one-row steps is not checked at 16 rows
    (the answer is known; the check is 16 one-row forwards); one that matches is checked at every
    length."""
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=2)
    same = tuning.measure_set(model, "stock", rows=(1,), repeats=1, check_rows=(4, 16))
    monkeypatch.setattr(tuning.torch, "equal", lambda a, b: False)
    differs = tuning.measure_set(model, "stock", rows=(1,), repeats=1, check_rows=(4, 16))
    monkeypatch.undo()
    assert differs.invariant_rows == {4: False} and not differs.row_invariant
    assert set(same.invariant_rows) == ({4, 16} if same.invariant_rows[4] else {4})


def test_an_isa_switch_to_generic_leaves_only_stock(monkeypatch):
    monkeypatch.setenv("ENTMTP_ISA", "generic")
    prof = tuning.probe_kernels(tiny_model("llama", vocab=96, dtype=torch.bfloat16), rows=(1, 8), repeats=1, check_rows=(4,))
    assert [t.name for t in prof.trials if t.ran] == ["stock"] and prof.choice == "stock"


def test_profile_is_cached_per_machine_and_refreshed_on_request(tuning_on, monkeypatch):
    from entmtp.hardware import native_isa

    monkeypatch.delenv("ENTMTP_ISA", raising=False)
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    first = tuning.kernel_profile(model)
    assert first.measured and Path(first.cache_file).is_file() and str(tuning_on) in first.cache_file
    saved = json.loads(Path(first.cache_file).read_text())
    assert saved["format"] == tuning.PROFILE_FORMAT and saved["fingerprint"]["isa"]
    again = tuning.kernel_profile(model)
    assert again.created == first.created and again.choice == first.choice  # read, not measured
    monkeypatch.setenv("ENTMTP_TUNE", "refresh")
    assert tuning.kernel_profile(model).probe_s > 0
    monkeypatch.setenv("ENTMTP_TUNE", "0")
    off = tuning.kernel_profile(model)
    assert not off.measured and off.choice == kernels.preferred_kernels(model)
    monkeypatch.setenv("ENTMTP_TUNE", "1")
    if native_isa() != "generic":
        monkeypatch.setenv("ENTMTP_ISA", "generic")  # another dispatch class: another profile
        assert tuning.kernel_profile(model).cache_file != first.cache_file


def test_engine_decodes_on_the_tuned_kernels_and_says_whether_it_is_exact(tuning_on):
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)})
    prof = eng.kernel_profile
    assert eng.kernels == prof.choice and eng.row_invariant == prof.row_invariant
    assert prof.why in eng.kernels_reason
    if eng.row_invariant:  # then speculation is the plain loop, token for token
        cfg = DecodeConfig(max_new_tokens=30, eos_token_ids=())
        from entmtp.trees import resolve_tree

        plain = eng.run([5, 9, 11, 5, 9], config=cfg).tokens
        assert eng.run([5, 9, 11, 5, 9], heads="hydra", tree=resolve_tree("mc_sim_7b_63").truncated(3), config=cfg).tokens == plain


def test_trees_are_chosen_from_statistics_and_measured_latency(tuning_on):
    model = tiny_model("llama", vocab=96, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    stats = collect_stats(eng, "hydra", [[5, 9, 11, 5, 9, 30], [7, 7, 7, 20, 21, 22]], max_new_tokens=24, max_rank=8)
    tuned = autotune.tune_trees(eng, "hydra", stats=stats, repeats=1)
    assert tuned.tree.n_nodes >= 1 and tuned.tree.depth <= 3
    assert tuned.latency.baseline_s > 0 and tuned.predicted_speedup > 0
    # the choice is the best of the lab's own scoring over the same statistics and latency, among
    # the trees whose steps were timed (`staged_latency`)
    from entmtp.search import search_trees

    best = max(c.predicted_tokens_per_s for c in autotune.priced(
        search_trees(stats, [max(autotune.CPU_SIZES)], None, depths=range(1, 4)), tuned.latency))
    assert tuned.predicted_tau / tuned.latency.cost(tuned.tree.n_nodes, tuned.tree.depth) == pytest.approx(best)
    back = autotune.TunedTrees.from_json(json.loads(json.dumps(tuned.to_json())))
    assert back.tree.paths == tuned.tree.paths and (back.bank is None) == (tuned.bank is None)
    # no statistics shipped with random heads: nothing tuned, the recorded tree serves
    assert autotune.tuned_trees(eng, "hydra") is None


def test_tuned_trees_are_kept_per_cpu_thread_count(tuning_on):
    """Trees timed with one torch thread count are not reused by decoding with another (a second
    thread makes a tree's extra rows cheaper than a one-row step; trees chosen at 2 threads
    decoded at 1 are too big)."""
    from entmtp.threads import torch_threads

    model = tiny_model("llama", vocab=96, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    with torch_threads(1):
        one = autotune.trees_path(eng, "hydra")
    with torch_threads(2):
        two = autotune.trees_path(eng, "hydra")
    assert one != two and one.parent == two.parent and "-t1-" in one.name and "-t2-" in two.name
    # under the governor, trees are for its full count even while it decodes with one thread
    from entmtp.threads import ThreadGovernor

    eng.governor = ThreadGovernor(2)
    with torch_threads(1):
        assert autotune.trees_path(eng, "hydra") == two and autotune.decoding_threads(eng) == 2


@pytest.mark.model
def test_tune_command_prints_the_profile_of_this_machine(tmp_path):
    """`entmtp tune` on the embedded model: every kernel set's latency by rows and invariance,
    the choice, threads, and a tree per heads from the shipped statistics -- as text and JSON.
    It measures into a cache of its own (never the user's profile: a tune taken while tests run is
    not this machine's), which shares the user's built kernels and converted model."""
    import os

    from entmtp.paths import cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    real = cache_dir()
    for entry in (real.iterdir() if real.is_dir() else ()):
        if entry.is_dir() and entry.name != "tuning":  # (lock files are made where they are used)
            (cache / entry.name).symlink_to(entry)
    env = {**os.environ, "ENTMTP_TUNE": "1", "HF_HUB_OFFLINE": "1", "ENTMTP_CACHE": str(cache)}
    before = sorted((p, p.stat().st_mtime) for p in (real / "tuning").rglob("*")) if (real / "tuning").is_dir() else []
    cmd = [sys.executable, "-m", "entmtp", "tune", "--dtype", "bfloat16", "--methods", "medusa", "--json", "--refresh"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    prof = json.loads(p.stdout)
    assert [t["name"] for t in prof["kernel_trials"]] == list(kernels.KERNEL_SETS)
    assert prof["kernels"] in [t["name"] for t in prof["kernel_trials"] if t["ran"]]
    assert prof["probe_s"] < 60 or hardware.amx_emulated()  # scalar tiles are slow; the budget is for real ones
    medusa = prof["heads"]["medusa"]
    assert medusa["nodes"] >= 1 and medusa["predicted_tau"] >= 1.0 and "shipped acceptance records" in medusa["why"]
    # the prompt-lookup branch is scored here too (the shipped statistics keep their continuations)
    assert medusa["lookup_min_ngram"] in (0, 1, 2, 3) and set(medusa["lookup_speedups"]) == {"off", "1", "2", "3"}
    chosen = "off" if not medusa["lookup_min_ngram"] else str(medusa["lookup_min_ngram"])
    assert medusa["lookup_speedups"][chosen] == max(medusa["lookup_speedups"].values())
    text = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert text.returncode == 0 and "| kernel set |" in text.stdout and "medusa: tree" in text.stdout
    assert "prompt lookup" in text.stdout
    # the text run measures again where the JSON run's profile was taken while the cores were busy
    # (not cached), so its thread count can differ; its own threads line must be consistent
    threads = next((line for line in text.stdout.splitlines() if line.startswith("threads: ")), "")
    assert "(governor)" not in threads or int(threads.split()[1]) > 1, threads  # a governor drops from several to one
    assert not prof["threads_governed"] or (prof["threads"] or 0) > 1
    bad = subprocess.run(cmd[:4] + ["--methods", "nope"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "unknown method" in bad.stderr and "nope" in bad.stderr and "Traceback" not in bad.stderr
    assert (cache / "tuning").is_dir()
    assert before == (sorted((p, p.stat().st_mtime) for p in (real / "tuning").rglob("*")) if (real / "tuning").is_dir() else [])


def test_gpu_check_script_runs_here_on_the_cpu(tmp_path):
    """scripts/gpu_check.py (the prepared CUDA check) run with --device cpu: float32 identity to
    generate for every method, a latency curve to 128 rows, flash attention refused, device_map."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(out["float32"][m] == "4/4" for m in ("baseline", "medusa", "hydra", "hydra++", "eagle", "eagle-layers"))
    assert set(out["bfloat16"]["step_ms_by_rows"]) == {str(r) for r in (1, 2, 4, 8, 16, 32, 64, 128)}
    assert "cannot take a tree mask" in out["flash_refused"] and out["device_map_auto"]["identical"] == "4/4"


def test_threads_are_added_only_where_they_pay_for_a_busy_neighbour():
    """One thread unless all of them are at least THREADS_GAIN times as fast (a second thread
    waiting on a core another process holds stalls every parallel region)."""
    from entmtp.tuning import ADAPTIVE_GAIN, THREADS_GAIN, choose_threads

    assert choose_threads({2: 21.3, 1: 27.1}) == 1  # 1.27x faster: not worth the risk
    assert choose_threads({16: 10.0, 1: 10.0 * THREADS_GAIN}) == 16
    assert choose_threads({1: 20.0}) == 1 and choose_threads({4: 30.0, 1: 20.0}) == 1
    # where a governor drops to one thread while other processes use the cores, a smaller gain pays
    assert choose_threads({2: 21.3, 1: 27.1}, ADAPTIVE_GAIN) == 2
    assert choose_threads({2: 21.3, 1: 21.3 * ADAPTIVE_GAIN * 0.99}, ADAPTIVE_GAIN) == 1


def test_a_cached_profile_missing_a_set_that_runs_here_is_measured_again(tuning_on):
    """A profile cached by a version with fewer kernel sets would keep its old choice for good:
    where a set that runs here has no trial in it, the profile is measured again."""
    model = tiny_model("llama", vocab=96, dtype=torch.float32)
    prof = tuning.kernel_profile(model)
    path = Path(prof.cache_file)
    saved = json.loads(path.read_text())
    assert tuning.kernel_profile(model).created == prof.created  # read from the cache
    runs = [t["name"] for t in saved["trials"] if t["ran"]]
    if len(runs) < 2:
        pytest.skip("only stock runs here")
    saved["trials"] = [t for t in saved["trials"] if t["name"] != runs[-1]]
    saved["created"] = "before"
    path.write_text(json.dumps(saved))
    again = tuning.kernel_profile(model)
    assert again.created != "before" and runs[-1] in {t.name for t in again.trials}


def test_a_threads_override_during_the_probe_does_not_stand_in_for_the_measurement(tuning_on, monkeypatch):
    """ENTMTP_THREADS fixes one run's count; the cached profile still holds the measured count for
    later runs without it (a profile once cached threads=None under an override, and every later
    run then decoded with all cores: 0.6x one thread's speed on a 2-core VM). A cached profile
    without a measured count is measured again."""
    monkeypatch.setattr(tuning, "default_threads", lambda: 2)
    monkeypatch.setenv("ENTMTP_THREADS", "1")
    before = torch.get_num_threads()
    model = tiny_model("llama", vocab=96, dtype=torch.bfloat16)
    prof = tuning.kernel_profile(model)
    assert prof.threads in (1, 2) and set(prof.threads_ms) == {1, 2}
    saved = json.loads(Path(prof.cache_file).read_text())
    assert saved["threads"] == prof.threads
    assert tuning.apply_threads(prof) == 1  # the override wins where it is set
    monkeypatch.delenv("ENTMTP_THREADS")
    saved["threads"], saved["threads_ms"] = None, {}  # a profile from before: no measured count
    Path(prof.cache_file).write_text(json.dumps(saved))
    again = tuning.kernel_profile(model)
    assert again.threads in (1, 2) and set(again.threads_ms) == {1, 2}  # measured again, not read
    torch.set_num_threads(before)


def test_thread_counts_are_timed_in_turns_and_the_faster_chosen(monkeypatch):
    """The thread counts are timed in the same rounds, their order alternated, so a machine whose
    speed drifts (here every forward 2% slower than the one before) cannot favour the count timed
    first; with two threads twice as fast, two are chosen, and with one thread faster, one."""
    import time as time_mod

    model = tiny_model("llama", vocab=96, dtype=torch.float32)
    real, calls = tuning.forward, []

    for two_faster in (True, False):
        calls.clear()

        def slow_forward(twin, ids, cache, **kw):
            out = real(twin, ids, cache, **kw)
            n = torch.get_num_threads()
            calls.append((n, ids.shape[1]))
            per = (0.5 if n == 2 else 1.0) if two_faster else (1.5 if n == 2 else 1.0)
            time_mod.sleep(0.004 * per * 1.02 ** len(calls))
            return out

        monkeypatch.setattr(tuning, "forward", slow_forward)
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            n, ms = tuning.measure_threads(model, "stock")
        finally:
            torch.set_num_threads(before)
        timed = [c for c in calls if c[1] in (1, 8)]
        rounds = [timed[i: i + 4] for i in range(0, len(timed), 4)]
        assert len(rounds) == 6 and all({c for c, _ in r} == {1, 2} for r in rounds)
        assert [r[0][0] for r in rounds] == [2, 1, 2, 1, 2, 1]  # the order alternates round by round
        assert set(ms) == {1, 2} and n == (2 if two_faster else 1)


def test_switch_point_is_where_the_smaller_tree_starts_to_pay():
    """Each tree's step time linear in the context between its two timings: the switch is where
    tau / cost crosses, clamped to the measured range."""
    # tree a: tau 2.0, 10 -> 20 ms from 100 to 1100 tokens; tree b: tau 1.5, 8 -> 12 ms
    c = autotune.switch_point(2.0, 0.010, 0.020, 1.5, 0.008, 0.012, 100, 1100)
    cost_a, cost_b = 0.010 + (c - 100) * 1e-5, 0.008 + (c - 100) * 4e-6
    assert 100 < c < 1100 and 2.0 / cost_a == pytest.approx(1.5 / cost_b, rel=1e-3)
    assert autotune.switch_point(2.0, 0.010, 0.011, 1.5, 0.008, 0.0085, 100, 1100) == 1100  # a pays throughout
    assert autotune.switch_point(1.0, 0.010, 0.020, 1.5, 0.008, 0.012, 100, 1100) == 100  # b pays throughout


def test_a_smaller_tree_is_tuned_for_long_contexts(tuning_on, monkeypatch):
    """Where a tree's rows cost more after a long context, tuning keeps a second tree for it (no
    larger or deeper than the first), switched to where the two trees' predicted tokens/s cross; it
    survives the cache file, shows in the machine profile, and `build_scheduler` switches to it."""
    from entmtp import methods, scheduler
    from entmtp.calibrate import LatencyModel

    model = tiny_model("llama", vocab=20, seed=3, max_pos=4096)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    stats = collect_stats(eng, "hydra", [[5, 9, 11, 5, 9, 30 % 20], [7, 7, 7, 2, 3, 4]], max_new_tokens=40, max_rank=8)
    timed = []

    def fake_latency(engine, heads, *, max_nodes, repeats, context_tokens, sizes=None, depths=None, jobs=None, **kw):
        jobs = jobs or latency_jobs(sizes, depths)
        timed.append((context_tokens, max(n for n, _ in jobs), max(d for _, d in jobs)))
        per_row = 1e-5 if context_tokens <= autotune.SHORT_CONTEXT else 8e-3  # rows nearly free, then dear
        return LatencyModel(0.01, by_depth({(n, d): 0.01 + 1e-4 * d + per_row * n for n, d in jobs}))

    monkeypatch.setattr(autotune, "measure_latency", fake_latency)
    tuned = autotune.tune_trees(eng, "hydra", stats=stats, repeats=1)
    long = tuned.long
    assert long is not None, tuned.why
    # no larger or deeper than the first
    assert [t for t in timed if t[0] != autotune.SHORT_CONTEXT] == [(long.context, tuned.tree.n_nodes, tuned.tree.depth)]
    assert long.context == min(autotune.LONG_CONTEXT, eng.max_context // 4)
    assert long.tree.n_nodes < tuned.tree.n_nodes and long.predicted_speedup > long.short_tree_speedup
    assert long.from_tokens == autotune.switch_point(
        tuned.predicted_tau, tuned.latency.cost(tuned.tree.n_nodes, tuned.tree.depth),
        long.latency.cost(tuned.tree.n_nodes, tuned.tree.depth), long.predicted_tau,
        tuned.latency.cost(long.tree.n_nodes, long.tree.depth), long.latency.cost(long.tree.n_nodes, long.tree.depth),
        autotune.SHORT_CONTEXT, long.context)
    assert "long contexts" not in tuned.why  # the long-context tree is said once, on its own line
    back = autotune.TunedTrees.from_json(json.loads(json.dumps(tuned.to_json())))
    assert back.long.tree.paths == long.tree.paths and back.long.from_tokens == long.from_tokens
    assert back.long.latency.cost(2, 1) == pytest.approx(long.latency.cost(2, 1))

    monkeypatch.setattr(methods, "tuned_trees", lambda engine, heads, progress=None, prefills=None: tuned)
    monkeypatch.setattr(autotune, "tuned_trees", lambda engine, heads, progress=None, prefills=None: tuned)
    for name in ("static", "entropy", "dynamic"):
        policy = methods.build_scheduler(eng, "hydra", scheduler=name, progress=None)
        assert isinstance(policy, scheduler.ContextSwitch) and policy.from_tokens == long.from_tokens, name
    static = methods.build_scheduler(eng, "hydra", scheduler="static", progress=None)
    assert static.short.tree.paths == tuned.tree.paths and static.long.tree.paths == long.tree.paths
    assert not isinstance(methods.build_scheduler(eng, "hydra", tree="chain_2", scheduler="static", progress=None),
                          scheduler.ContextSwitch)  # a tree asked for is decoded as it is
    lc = autotune.machine_profile(eng)["heads"]["hydra"]["long_context"]
    assert lc["nodes"] == long.tree.n_nodes and lc["from_tokens"] == long.from_tokens
    assert autotune.format_profile(autotune.machine_profile(eng)).count(f"from {long.from_tokens} cached tokens") == 1
    from entmtp.ui_machine import profile_html  # the app's Machine tab says it once too
    assert profile_html(autotune.machine_profile(eng)).count(f"from {long.from_tokens} cached tokens") == 1

    # the same step times after a long context: no second tree
    monkeypatch.setattr(autotune, "measure_latency", lambda *a, **k: fake_latency(*a, **{**k, "context_tokens": 96}))
    again, why = autotune.tune_long_context(eng, "hydra", stats, tuned, 1024, repeats=1)
    assert again is None and "the same tree still pays best" in why

    # a short tree of a size between the grid's (5 nodes) is timed at its own size there
    from dataclasses import replace

    from entmtp.calibrate import representative_tree

    timed.clear()
    five = replace(tuned, tree=representative_tree(5, 2))
    autotune.tune_long_context(eng, "hydra", stats, five, 1024, repeats=1)
    assert timed == [(96, 5, 2)]


def by_depth(costs):
    """{(size, depth): seconds} as `LatencyModel.points`."""
    out = {}
    for (n, d), t in sorted(costs.items()):
        out.setdefault(d, []).append((n, t))
    return out


def test_latency_model_floor_and_merge():
    """`floor` bounds a step from below by what fewer rows at fewer levels cost; `merged` puts two
    models' points on the faster plain step by their ratios."""
    from entmtp.calibrate import LatencyModel

    lm = LatencyModel(0.010, {1: [(1, 0.011), (4, 0.013), (16, 0.030)], 2: [(2, 0.012), (8, 0.020)]})
    assert lm.measured_size(1) == 16 and lm.measured_size(2) == 8 and lm.measured_size(3) == 0
    assert lm.floor(12, 2) == pytest.approx(lm.cost(12, 1))  # depth 1's rows bound depth 2 beyond its timed sizes
    assert lm.floor(12, 2) > lm.cost(8, 2) and lm.floor(24, 3) == pytest.approx(0.030)  # no extrapolation
    assert lm.floor(4, 1) == pytest.approx(0.013) and lm.floor(1, 1) >= lm.baseline_s
    more = LatencyModel(0.012, {2: [(12, 0.036)]})  # a slower second: ratio 3.0
    both = lm.merged(more)
    assert both.baseline_s == 0.010 and both.cost(12, 2) == pytest.approx(0.030)
    assert both.cost(4, 1) == pytest.approx(0.013) and both.measured_size(2) == 12 and both.meta["stages"] == 2


def test_the_latency_grid_is_timed_only_where_a_tree_could_be_chosen(monkeypatch):
    """`staged_latency` times the small trees and the depth-1 trees of every size first, then only
    the sizes some tree could still win with, at the step time of fewer rows: where rows are dear
    the large deep trees are never timed, where they are nearly free the whole grid is, and either
    way the tree chosen is the one the whole grid would choose. The chosen tree's prompt-lookup
    rows are timed too."""
    from entmtp.calibrate import LatencyModel, latency_jobs
    from entmtp.search import price_candidates, search_trees

    model = tiny_model("llama", vocab=20, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    stats = collect_stats(eng, "hydra", [[5, 9, 11, 5, 9, 10], [7, 7, 7, 2, 3, 4]], max_new_tokens=40, max_rank=8)
    searched = search_trees(stats, [max(autotune.CPU_SIZES)], None, depths=range(1, 4))
    grid = latency_jobs(autotune.CPU_SIZES, range(1, 4))
    for per_row, per_level in ((4e-3, 1e-3), (1e-6, 1e-6), (3e-4, 2e-4)):  # a CPU, a GPU, between
        def cost(n, d):
            return 0.01 + per_level * d + per_row * n

        asked = []

        def fake(engine, heads, *, max_nodes, jobs, repeats, context_tokens, prefills=None):
            asked.append(sorted(jobs))
            return LatencyModel(0.01, by_depth({(n, d): cost(n, d) for n, d in jobs}))

        monkeypatch.setattr(autotune, "measure_latency", fake)
        lm = autotune.staged_latency(eng, "hydra", searched, autotune.CPU_SIZES, range(1, 4), repeats=1)
        assert asked[0] == sorted(j for j in grid if j[0] <= autotune.FIRST_STAGE_NODES or j[1] == 1)
        assert sum(len(a) for a in asked) == len({j for a in asked for j in a})  # nothing timed twice
        whole = LatencyModel(0.01, by_depth({j: cost(*j) for j in grid}))
        chosen = autotune.choose_tree(autotune.priced(searched, lm))
        assert chosen.tree.key() == autotune.choose_tree(price_candidates(searched, whole)).tree.key(), per_row
        for d in range(chosen.depth, max(chosen.depth, autotune.LOOKUP_LENGTH) + 1):
            if d <= 3:  # the lookup branch's rows priced from timed steps
                assert lm.measured_size(d) >= min(chosen.n_nodes + autotune.LOOKUP_LENGTH, max(n for n, dd in grid if dd == d))
        untimed = lm.meta["untimed"]
        if per_row == 4e-3:
            assert untimed and len(asked) == 1 and all(n > autotune.FIRST_STAGE_NODES and d > 1 for n, d in untimed)
        if per_row == 1e-6:  # rows nearly free: on past the first stage
            assert len(asked) > 1
        # every tree left unpriced is, at its true step time, short of the chosen one by more than a near tie
        top = max(c.predicted_speedup for c in price_candidates(searched, whole))
        unpriced = [c for c in price_candidates(searched, whole) if c.n_nodes > lm.measured_size(c.depth)]
        assert all(c.predicted_speedup < (1 - autotune.NEAR_TIE) * top for c in unpriced)


def test_the_rows_a_chosen_trees_lookup_branch_adds_are_timed(monkeypatch):
    """A prompt-lookup branch grafts up to LOOKUP_LENGTH rows and levels onto the chosen tree, and
    `choose_lookup` prices them: where the first stage did not time that many rows at those depths,
    a last stage does (a 6-node depth-2 tree: 10 rows at depths 2-4)."""
    from entmtp.calibrate import LatencyModel, latency_jobs, representative_tree
    from entmtp.search import Candidate

    grid = latency_jobs(autotune.CPU_SIZES, range(1, 5))
    first = LatencyModel(0.01, by_depth({(n, d): 0.01 + 1e-3 * n for n, d in grid
                                         if n <= autotune.FIRST_STAGE_NODES or d == 1}))
    assert autotune.lookup_grid_jobs(representative_tree(6, 2), first, grid) == [(12, 2), (12, 3), (12, 4)]
    assert autotune.lookup_grid_jobs(representative_tree(3, 1), first, grid) == []  # 7 rows: timed
    assert autotune.lookup_grid_jobs(representative_tree(8, 1), first, grid) == [(12, 2), (12, 3), (12, 4)]

    def cand(n, d, tau):
        return Candidate(representative_tree(n, d), ["given"], [d], tau, 0.0)

    cands = [cand(2, 1, 1.3), cand(6, 2, 2.2), cand(24, 3, 2.3)]  # the 6-node tree wins; 24 nodes cannot
    asked = []

    def fake(engine, heads, *, max_nodes, jobs, repeats, context_tokens, prefills=None):
        asked.append(sorted(jobs))
        return LatencyModel(0.01, by_depth({(n, d): 0.01 + 1e-3 * n for n, d in jobs}))

    monkeypatch.setattr(autotune, "measure_latency", fake)
    lm = autotune.staged_latency(None, "hydra", cands, autotune.CPU_SIZES, range(1, 5), repeats=1)
    assert autotune.choose_tree(autotune.priced(cands, lm)).n_nodes == 6
    assert asked[1:] == [[(12, 2), (12, 3), (12, 4)]] and [24, 3] in lm.meta["untimed"]


def test_machine_chart_draws_heads_steps_relative_to_a_plain_step():
    """The Machine tab's chart: kernel sets in ms as probed; each heads' whole step as its ratio to a
    plain step (what the latency model measures robustly) times the chosen set's one-row forward, so
    a machine that ran faster during one measurement than the other cannot draw a tree step below a
    forward; without kernel trials the steps stay in ms."""
    from entmtp.ui_machine import latency_figure

    prof = {"kernels": "panels", "kernel_trials": [{"name": "panels", "ran": True, "ms_by_rows": {"1": 20.0, "8": 24.0}},
                                                   {"name": "stock", "ran": True, "ms_by_rows": {"1": 40.0, "8": 44.0}}],
            "heads": {"hydra": {"plain_step_ms": 15.0, "step_ms_by_nodes_depth1": {"1": 16.5, "4": 18.0}}}}
    fig = latency_figure(prof)
    heads = [t for t in fig.data if t.name.startswith("hydra heads")]
    assert len(heads) == 1 and "relative to a plain step" in heads[0].name
    assert list(heads[0].y) == pytest.approx([22.0, 24.0]) and list(heads[0].customdata) == pytest.approx([1.1, 1.2])
    alone = latency_figure({**prof, "kernel_trials": []})
    assert [list(t.y) for t in alone.data] == [pytest.approx([16.5, 18.0])] and "relative" not in alone.data[0].name


def test_a_near_tie_goes_to_the_smaller_tree():
    """Among trees predicted within NEAR_TIE of the best tokens/s the fewest nodes (then levels)
    win: rows priced in a slow second of a VM look cheaper than they decode; beyond it, the best."""
    from types import SimpleNamespace as C

    n8 = C(n_nodes=8, depth=2, predicted_tokens_per_s=100.0)
    n4 = C(n_nodes=4, depth=1, predicted_tokens_per_s=99.9)  # Medusa's case: 0.1% below
    n4d2 = C(n_nodes=4, depth=2, predicted_tokens_per_s=99.95)
    n2 = C(n_nodes=2, depth=1, predicted_tokens_per_s=100.0 * (1 - autotune.NEAR_TIE) - 0.01)  # just beyond
    assert autotune.choose_tree([n8, n4d2, n4, n2]) is n4
    assert autotune.choose_tree([n8, n2]) is n8
    assert autotune.choose_tree([n4]) is n4


def test_the_entropy_scheduler_follows_a_re_tune_that_drops_the_bank(tuning_on):
    """entmtp's entropy scheduler takes the bank the tune chose; after a re-tune that finds no bank
    beats the static tree, the earlier tune's bank must not go on deciding steps."""
    from entmtp.calibrate import LatencyModel
    from entmtp.methods import build_scheduler
    from entmtp.scheduler import EntropyBucketScheduler
    from entmtp.trees import Tree

    model = tiny_model("llama", vocab=96, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    small, big = Tree.from_paths([[0], [1]], "small"), Tree.from_paths([[0], [1], [0, 0], [0, 0, 0]], "big")
    latency = LatencyModel(0.01, {1: [(1, 0.011), (2, 0.012)]})

    def cache(bank):
        tuned = autotune.TunedTrees("hydra", big, 2.0, 1.5, latency, bank)
        path = autotune.trees_path(eng, "hydra")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(tuned.to_json()))

    cache(EntropyBucketScheduler({"small": small, "big": big}, [1.0], ["big", "small"]))
    first = build_scheduler(eng, "hydra", "entmtp", progress=None)
    assert sorted(t.name for t in first.trees) == ["big", "small"] and first.edges == [1.0]
    cache(EntropyBucketScheduler({"big": big}, [], ["big"], meta={"fit": "static: no held-out gain"}))  # the re-tune
    again = build_scheduler(eng, "hydra", "entmtp", progress=None)
    assert [t.name for t in again.trees] == ["big"] and again.edges == []
    assert autotune.tuned_bank(eng, "hydra").table == ["big"]
    from entmtp.methods import make_runner

    assert "big (entropy scheduler, one bucket)" in make_runner(eng, "entmtp", 8, progress=None).label


def test_tuned_trees_are_measured_again_when_the_step_code_changes(tuning_on, tmp_path, monkeypatch):
    """The trees' cache file is named by a hash of the engine's step code besides the kernel
    library's: timings taken before (say) drafts went int8 are not trusted after."""
    model = tiny_model("llama", vocab=96, dtype=torch.float32, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    assert f"-e{autotune.engine_code_id()}.json" in autotune.trees_path(eng, "hydra").name
    assert len(autotune.STEP_SOURCES) >= 5
    pkg = Path(autotune.__file__).parent
    assert all((pkg / name).is_file() for name in autotune.STEP_SOURCES)
    copy_dir = tmp_path / "pkg"
    copy_dir.mkdir()
    for name in autotune.STEP_SOURCES:
        (copy_dir / name).write_bytes((pkg / name).read_bytes())
    monkeypatch.setattr(autotune, "__file__", str(copy_dir / "autotune.py"))
    autotune.engine_code_id.cache_clear()
    try:
        same = autotune.engine_code_id()
        (copy_dir / "heads.py").write_text((pkg / "heads.py").read_text() + "\n# changed\n")
        autotune.engine_code_id.cache_clear()
        assert autotune.engine_code_id() != same
    finally:
        monkeypatch.undo()
        autotune.engine_code_id.cache_clear()
    assert autotune.engine_code_id() == same  # the copy was the package's code, byte for byte


class _Load:
    """A stand-in `threads.CoreLoad`: other processes used `others` cores during the measurement."""

    others_cores = 0.0

    def others(self):
        return type(self).others_cores


def test_measurements_taken_while_other_processes_use_the_cores_are_not_cached(tuning_on, monkeypatch):
    """A kernel profile or tuned trees measured while another process held a core (a browser
    opening beside the app) hold for this process only: nothing is written, the reason is said,
    the engine does not measure its trees again within the process, and the next load of a quiet
    machine measures and caches them."""
    monkeypatch.setattr(tuning, "CoreLoad", _Load)
    monkeypatch.setattr(autotune, "CoreLoad", _Load)
    model = tiny_model("llama", vocab=96, seed=3)
    _Load.others_cores = 1.2
    prof = tuning.kernel_profile(model)
    assert prof.cache_file is None and "measured while other processes used 1.2 cores'" in prof.why
    assert not tuning.profile_path(model).exists()
    _Load.others_cores = 0.05
    assert Path(tuning.kernel_profile(model).cache_file).is_file()

    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    stats = collect_stats(eng, "hydra", [[5, 9, 11, 5, 9, 30], [7, 7, 7, 20, 21, 22]], max_new_tokens=24, max_rank=8)
    monkeypatch.setattr(autotune, "shipped_stats", lambda runner: stats)
    measured = []
    tune = autotune.tune_trees
    monkeypatch.setattr(autotune, "tune_trees", lambda *a, **k: measured.append(1) or tune(*a, **k))
    _Load.others_cores = 0.9
    held = autotune.tuned_trees(eng, "hydra")
    assert "not cached" in held.why and not autotune.trees_path(eng, "hydra").exists()
    assert autotune.tuned_trees(eng, "hydra") is held and len(measured) == 1  # held for this engine
    _Load.others_cores = 0.0
    fresh = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    assert "not cached" not in autotune.tuned_trees(fresh, "hydra").why and autotune.trees_path(fresh, "hydra").is_file()
    assert len(measured) == 2


def test_trees_that_cannot_be_cached_are_held_for_the_process_and_it_says_why(tuning_on, monkeypatch):
    """A cache that cannot be written (a read-only home on a Space) costs the next process a
    measurement, never this one a second: the engine holds its trees and says they were not cached."""
    model = tiny_model("llama", vocab=96, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3)}, kernels="stock")
    stats = collect_stats(eng, "hydra", [[5, 9, 11, 5, 9, 30], [7, 7, 7, 20, 21, 22]], max_new_tokens=24, max_rank=8)
    monkeypatch.setattr(autotune, "shipped_stats", lambda runner: stats)

    def read_only(path, data, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(autotune, "write_json_atomic", read_only)
    measured = []
    tune = autotune.tune_trees
    monkeypatch.setattr(autotune, "tune_trees", lambda *a, **k: measured.append(1) or tune(*a, **k))
    held = autotune.tuned_trees(eng, "hydra")
    assert held.why.endswith("(not cached: Permission denied)") and not autotune.trees_path(eng, "hydra").exists()
    assert autotune.tuned_trees(eng, "hydra") is held and len(measured) == 1


def test_heads_measured_apart_are_compared_by_their_trees_timed_side_by_side(tuning_on, monkeypatch):
    """Two heads' latency models, each measured on its own, can sit in different phases of a
    machine's speed; their tuned trees are timed again in shared rounds and each prediction is
    scaled by (its own model's step ratio / the shared one). The shared timing is cached, and a
    timing taken while other processes used the cores is held by the engine only."""
    from entmtp import calibrate

    model = tiny_model("llama", vocab=96, seed=3)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3),
                               "hydra++": random_heads(model, "hydra", num_heads=3, prefix=True, seed=1)}, kernels="stock")
    real = calibrate.measure_step_ratios(eng, {"hydra": autotune.Tree.from_paths([[0], [1], [0, 0]]),
                                               "hydra++": autotune.Tree.from_paths([[0]])}, rounds=2, context_tokens=16)
    assert set(real) == {"hydra", "hydra++"} and all(0 < r < 100 for r in real.values())
    with pytest.raises(ValueError, match="no heads named medusa"):
        calibrate.measure_step_ratios(eng, {"medusa": autotune.Tree.from_paths([[0]])})

    tuned = {}
    for h in ("hydra", "hydra++"):
        stats = collect_stats(eng, h, [[5, 9, 11, 5, 9, 30], [7, 7, 7, 20, 21, 22]], max_new_tokens=24, max_rank=8)
        monkeypatch.setattr(autotune, "shipped_stats", lambda runner, stats=stats: stats)
        tuned[h] = autotune.tuned_trees(eng, h)
    own = {h: t.latency.cost(t.tree.n_nodes, t.tree.depth) / t.latency.baseline_s for h, t in tuned.items()}
    timings = []
    shared = {"hydra": 2.0 * own["hydra"], "hydra++": 0.5 * own["hydra++"]}
    monkeypatch.setattr(autotune, "measure_step_ratios", lambda e, trees, **kw: timings.append(set(trees)) or dict(shared))
    out = autotune.compared_speedups(eng, tuned)
    assert out["hydra"] == pytest.approx(autotune.best_speedup(tuned["hydra"]) / 2)
    assert out["hydra++"] == pytest.approx(autotune.best_speedup(tuned["hydra++"]) * 2)
    assert timings == [{"hydra", "hydra++"}]
    assert autotune.compared_speedups(eng, tuned) == out and len(timings) == 1  # read back, not timed again
    assert autotune.compared_speedups(eng, {"hydra": tuned["hydra"]}) == {"hydra": autotune.best_speedup(tuned["hydra"])}
    from entmtp.ui_machine import profile_html

    prof = autotune.machine_profile(eng, family=("hydra++", "hydra"))
    chosen = max(out, key=out.get)
    assert prof["family"]["heads"] == chosen and len(timings) == 1
    assert f"entmtp drafts with {chosen}" in autotune.format_profile(prof) and f"entmtp drafts with {chosen}" in profile_html(prof)
    assert "family" not in autotune.machine_profile(eng)

    for f in autotune.machine_dir(eng.device).glob("compared-*.json"):
        f.unlink()
    monkeypatch.setattr(autotune, "CoreLoad", _Load)
    _Load.others_cores = 1.0
    fresh = Engine(model, None, {h: eng.runners[h].heads for h in eng.runners}, kernels="stock")
    assert autotune.compared_speedups(fresh, tuned) == out and len(timings) == 2
    assert not list(autotune.machine_dir(eng.device).glob("compared-*.json"))  # busy: not cached
    assert autotune.compared_speedups(fresh, tuned) == out and len(timings) == 2  # held by the engine
    _Load.others_cores = 0.0

    def read_only(path, data, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(autotune, "write_json_atomic", read_only)
    said = []
    third = Engine(model, None, {h: eng.runners[h].heads for h in eng.runners}, kernels="stock")
    assert autotune.compared_speedups(third, tuned, progress=said.append) == out and len(timings) == 3
    assert said[-1] == "tuning: the side-by-side timing is not cached (Permission denied); it holds for this process"
    assert autotune.compared_speedups(third, tuned) == out and len(timings) == 3  # held, not timed again


def test_kinds_tuned_together_prefill_each_measuring_context_once(tuning_on, monkeypatch):
    """`tune_all` measures every kind on the same contexts and prefills each once for all of them
    (heads reading the same base layers); each kind tuned on its own prefills its contexts again.
    The trees tuned either way are measured, not borrowed."""
    from collections import Counter

    model = tiny_model("llama", vocab=20, seed=3, max_pos=4096)
    eng = Engine(model, None, {"hydra": random_heads(model, "hydra", num_heads=3),
                               "medusa": random_heads(model, "medusa", num_heads=3)}, kernels="stock")
    prompts = [[5, 9, 11, 5, 9, 10], [7, 7, 7, 2, 3, 4]]
    stats = {id(eng.runners[h]): collect_stats(eng, h, prompts, max_new_tokens=40, max_rank=8) for h in eng.runners}
    monkeypatch.setattr(autotune, "shipped_stats", lambda runner: stats[id(runner)])
    lengths = []
    own_prefill = eng.prefill

    def counted(ids, heads=None):
        lengths.append(len(ids))
        return own_prefill(ids, heads=heads)

    monkeypatch.setattr(eng, "prefill", counted)
    together = autotune.tune_all(eng, ["hydra", "medusa"])
    assert all(t is not None and t.latency.baseline_s > 0 for t in together.values())
    shared = Counter(lengths)
    assert shared and set(shared.values()) == {1}, shared  # each context once, for both kinds

    lengths.clear()
    monkeypatch.setenv("ENTMTP_TUNE", "refresh")  # measured again, each kind on its own
    apart = {h: autotune.tuned_trees(eng, h) for h in ("hydra", "medusa")}
    assert all(t is not None and t.latency.baseline_s > 0 for t in apart.values())
    assert Counter(lengths)[autotune.SHORT_CONTEXT] == 2 and sum(Counter(lengths).values()) > sum(shared.values())
