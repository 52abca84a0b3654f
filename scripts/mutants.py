"""Known bugs of a speculative decoder, each put into a temporary copy of the repository: the
tests that claim to guard against it must fail there.

    .venv/bin/python scripts/mutants.py               # every mutant; exit 1 when one is missed
    .venv/bin/python scripts/mutants.py --list
    .venv/bin/python scripts/mutants.py position_ids causal_mask

Each mutant is a textual patch: a file, text that must occur in it exactly once, and its
replacement. When a refactor moves or rewrites the text, the patch stops with an error instead
of reporting a bug that was never put in (tests/test_mutants.py checks that every patch still
applies to the current sources). The copy is taken from the working tree (tracked and untracked,
not ignored files); its tests run with the copy first on PYTHONPATH and as the working directory,
with this script's Python (run it with the virtual environment's) and a cache of their own (a
mutant's measurements and kernel builds never reach the cache other processes read). The unpatched copy must pass
the same tests first, so that a failure means the mutant was caught, not a broken environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXACTNESS = ("tests/test_decoding.py::test_oracle_drafts_accept_long_paths_and_stay_exact",
             "tests/test_decoding.py::test_eager_attention_is_exact",
             "tests/test_decoding.py::test_concurrent_generations_do_not_mix")
SAMPLING = ("tests/test_acceptance.py::test_speculative_sampling_preserves_the_joint_of_three_tokens",)


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail with the mutant in
    env: tuple[tuple[str, str], ...] = ()  # set for its tests (e.g. the dispatch branch they must run)


MUTANTS = (
    Mutant("position_ids", "tree nodes at position past + index instead of past + depth",
           "entmtp/decoding.py", "position_ids=(buf.depths + self.past)[None]",
           "position_ids=(torch.arange(len(tokens), device=dev) + self.past)[None]", EXACTNESS),
    Mutant("crop_not_gather", "the cache keeps the first rows of the tree, not the accepted path's",
           "entmtp/verify.py", "    if path == list(range(a)):\n", "    if True:\n",
           EXACTNESS + ("tests/test_kvcache.py::test_keep_cache_entries_on_growing_layers_matches_dynamic_layers",)),
    Mutant("causal_mask", "a causal mask over the tree (siblings visible) instead of the tree mask",
           "entmtp/verify.py", "    mask[0, 0, :, past:] = bias\n",
           "    mask[0, 0, :, past:] = torch.triu(torch.full_like(bias, torch.finfo(bias.dtype).min), 1)\n", EXACTNESS),
    Mutant("biased_deep_sampling", "speculative sampling at half the temperature at drafted nodes below the root",
           "entmtp/acceptance.py", "return _walk(tree, tokens, lambda node: self._sample(logits[node], rng))",
           "return _walk(tree, tokens, lambda node: self._sample(logits[node] * (1.0 if node == 0 else 2.0), rng))",
           SAMPLING),
    Mutant("eagle_context_token", "EAGLE context rows read the token at their own position, not the next one",
           "entmtp/heads.py", "feats, toks = [hidden[:-1]], [tokens[1:]]", "feats, toks = [hidden[:-1]], [tokens[:-1]]",
           ("tests/test_decoding.py::test_eagle_context_after_decoding_equals_one_pass",)),
    Mutant("eagle_layers_swapped", "decoding hands EAGLE heads the base layers in another order than training read them",
           "entmtp/verify.py", "h = base_features(out.hidden_states, layers)[0] if hidden else None",
           "h = base_features(out.hidden_states, tuple(reversed(layers)))[0] if hidden else None",
           ("tests/test_decoding.py::test_eagle_context_after_decoding_equals_one_pass",)),
    Mutant("answer_rows_kept_positions", "self-distillation drops an ended answer's row but not its position ids",
           "entmtp/train.py", "attn, pos, tok = attn[rows], pos[rows], tok[rows]",
           "attn, tok = attn[rows], tok[rows]; pos = pos[:len(keep)]",
           ("tests/test_train.py::test_answer_batch_equals_generate_per_prompt",)),
    Mutant("clear_leaves_last_update", "a reply cleared mid-stream ends without its own empty update (its last "
           "streamed update can then land in the browser after Clear's)",
           "entmtp/ui_chat.py", "            yield (chat_box, skip, *rest)", "            pass",
           ("tests/test_app_client.py::test_a_cleared_reply_ends_with_the_empty_chat",)),
    Mutant("kernels_below_stock", "the tuner takes the fastest row-invariant set even where its one-row step is "
           "slower than stock's (our plain loop would then lose to `generate`)",
           "entmtp/tuning.py", "not_slower = [t for t in ran if one_row(t) <= limit] or ran", "not_slower = ran",
           ("tests/test_tuning.py::test_choice_prefers_row_invariant_sets_no_slower_than_stock",)),
    Mutant("shared_one_row_judged_by_noise", "a set whose one-row step is stock's own path is judged and ranked by its "
           "own noisy one-row timing (float32 trees then fall back to stock's)",
           "entmtp/tuning.py", "shared = stock is not None and t.name in ONE_ROW_STOCK", "shared = False",
           ("tests/test_tuning.py::test_choice_prefers_row_invariant_sets_no_slower_than_stock",)),
    Mutant("bench_loses_partial_reports", "`entmtp bench` writes its reports only at the end (an interrupt loses "
           "every prompt it measured)",
           "entmtp/bench.py", "            on_prompt(runs, i + 1)\n", "            pass\n",
           ("tests/test_bench.py::test_an_interrupted_bench_keeps_the_reports_of_the_prompts_it_finished",)),
    Mutant("lookup_rows_free", "the prompt-lookup choice ignores the rows a grafted branch adds (a branch then "
           "always looks free and is chosen where rows are dear)",
           "entmtp/autotune.py", "np.stack([tree.n_nodes + extra, np.maximum(tree.depth, p)], 1)",
           "np.stack([tree.n_nodes + 0 * extra, tree.depth + 0 * p], 1)",
           ("tests/test_search.py::test_trace_replay_with_a_lookup_branch_equals_on_policy_decoding",)),
    Mutant("lookup_tuning_unused", "entmtp decodes with the registry's prompt-lookup branch whatever was tuned here",
           "entmtp/methods.py", "    if tuned is not None and tuned.lookup_min_ngram is not None:",
           "    if False:", ("tests/test_methods.py::test_entmtp_lookup_branch_is_the_one_tuned_here",)),
    Mutant("governor_unused", "decoding keeps all threads while another process holds a core (every parallel "
           "region then waits on it)", "entmtp/decoding.py", "            self.engine.governor.apply()\n",
           "            pass\n", ("tests/test_threads.py::test_engine_decodes_under_the_governor",)),
    Mutant("amx_tile_half", "the AMX kernel multiplies columns 16-31 of a panel by the weights of columns 0-15",
           "entmtp/csrc/bf16_panels.cpp", "    TILE_LOADD(5, b + kWideCols, 128);\n", "    TILE_LOADD(5, b, 128);\n",
           ("tests/test_kernels.py::test_amx_tiles_are_row_invariant_and_exact_up_to_fp32_sums",
            "tests/test_kernels.py::test_panel_twin_decodes_the_same_tokens_as_stock"),
           env=(("ENTMTP_AMX_EMULATION", "1"),)),
    Mutant("f32_panel_half", "the float32 panel kernel multiplies columns 8-15 of a panel by the weights of columns 0-7",
           "entmtp/csrc/bf16_panels.cpp", "  hi = _mm256_loadu_ps(row + 8);\n", "  hi = _mm256_loadu_ps(row);\n",
           ("tests/test_kernels.py::test_float32_panels_are_row_invariant_and_within_rounding_of_f_linear",)),
    Mutant("i8_panel_half", "the int8 draft panels widen columns 8-15 of a k-row from the bytes of columns 0-7",
           "entmtp/csrc/bf16_panels.cpp", "  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));\n",
           "  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));\n",
           ("tests/test_kernels.py::test_int8_draft_panels_are_the_dequantised_product_and_row_invariant",)),
    Mutant("latency_one_sided", "a tree's step is timed against the plain steps before its generation only",
           "entmtp/calibrate.py", "t / ((before + after) / 2) for t in ts", "t / before for t in ts",
           ("tests/test_search.py::test_latency_is_measured_against_plain_steps_around_each_generation",)),
    Mutant("compute_thread_bypassed", "the app runs its model handlers in gradio's worker threads (one OpenMP team each)",
           "entmtp/ui.py", "on_compute = COMPUTE.wrap", "on_compute = lambda handler, *how: handler",
           ("tests/test_app_client.py::test_every_model_call_runs_on_the_one_compute_thread",)),
    Mutant("stock_worker_neighbour", "the thread governor counts the generate worker's CPU as a busy neighbour's",
           "entmtp/stock_process.py", "        count_as_own(self.proc.pid)", "        pass",
           ("tests/test_stock_process.py::test_the_worker_decodes_what_this_process_decodes",)),
    Mutant("lean_layer_unprobed", "the decoding twin's lean decoder layers are taken without their bitwise probe",
           "entmtp/kernels.py", "    return torch.equal(outs[0], outs[1])", "    return True",
           ("tests/test_kernels.py::test_lean_decoder_layers_decode_exactly_as_the_layers_own_forward",)),
    Mutant("attend_group_key", "attention scores every query head of a pass against the first head's query",
           "entmtp/csrc/bf16_panels.cpp", "qv[g] = _mm256_loadu_ps(qr[g] + d);", "qv[g] = _mm256_loadu_ps(qr[0] + d);",
           ("tests/test_kernels.py::test_attend_gives_each_query_head_the_bits_it_has_alone",
            "tests/test_kernels.py::test_attend_is_the_attention_and_each_row_its_own")),
    Mutant("argmax_last_tie", "greedy acceptance's argmax takes the last of tied maxima, not the first",
           "entmtp/csrc/bf16_panels.cpp", "at = t + __builtin_ctz(bits);", "at = t + 31 - __builtin_clz(bits);",
           ("tests/test_kernels.py::test_first_argmax_gives_torch_argmax_indices",)),
    Mutant("dynamic_stops_early", "a dynamic tree expands only the nodes above its best node, not above the "
           "budget-th best: deeper nodes that belong in the tree are never drafted",
           "entmtp/heads.py", "sorted(v[0] for v in cand.values())[-budget]", "sorted(v[0] for v in cand.values())[-1]",
           ("tests/test_scheduler.py::test_dynamic_tree_is_the_best_budget_nodes_of_the_full_expansion",)),
    Mutant("busy_measurement_cached", "a kernel profile or trees measured while other processes held the cores are "
           "cached as this machine's", "entmtp/threads.py", "    if others is None or others < BUSY_CORES:\n        return None",
           "    if True:\n        return None",
           ("tests/test_tuning.py::test_measurements_taken_while_other_processes_use_the_cores_are_not_cached",
            "tests/test_threads.py::test_busy_note_names_a_measurement_taken_while_others_used_the_cores")),
    Mutant("float32_masks_for_stock_attention", "float32 tree masks for a twin whose attention is not entmtp's own "
           "(sdpa wants the query's dtype)", "entmtp/kernels.py",
           "    if attns and all(isinstance(m, FusedAttention) for m in attns):", "    if True:",
           ("tests/test_kernels.py::test_tree_masks_come_in_the_dtype_the_twins_attention_reads",)),
    Mutant("cache_written_in_place", "cache files written in place: a failed write leaves half a file where the last "
           "good one was", "entmtp/paths.py",
           '    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")', "    tmp = path",
           ("tests/test_paths.py::test_json_is_written_whole_or_not_at_all",)),
    Mutant("build_baton_kept", "a build killed mid-way leaves torch's lock file and the next build waits on it",
           "entmtp/kernels.py", '        (build / "lock").unlink(missing_ok=True)', "        pass",
           ("tests/test_kernels.py::test_a_build_killed_midway_does_not_stall_the_next",)),
    Mutant("kinds_compared_apart", "entmtp's Hydra-family heads chosen by latency models measured apart, the "
           "side-by-side timing ignored", "entmtp/autotune.py",
           "        out[h] = best_speedup(t) * own / ratio if ratio == ratio and ratio > 0 else best_speedup(t)",
           "        out[h] = best_speedup(t)",
           ("tests/test_tuning.py::test_heads_measured_apart_are_compared_by_their_trees_timed_side_by_side",)),
    Mutant("prefill_not_cropped", "a generation started from a kept prefill decodes after the previous "
           "generation's positions", "entmtp/decoding.py", "            self.cache.crop(-extra)", "            pass",
           ("tests/test_decoding.py::test_generations_from_one_prefill_decode_as_from_their_own",)),
    Mutant("latency_prefills_each_generation", "the tuner prefills the measuring context for every generation "
           "(~2 s each after 1,536 tokens)", "entmtp/calibrate.py", "    pre = context_prefill(engine, ctx, heads, prefills)\n",
           "    pre = None\n", ("tests/test_search.py::test_latency_steps_are_warm_and_contexts_bounded",)),
    Mutant("long_context_prefilled_whole", "the tuner runs a 1,536-token measuring context through the model "
           "(~2 s a tune) where its first tokens' cache rows, repeated, time the same", "entmtp/calibrate.py",
           "    p = engine.prefill(ids[:COMPUTED_CONTEXT], heads=heads)\n", "    p = engine.prefill(ids, heads=heads)\n",
           ("tests/test_search.py::test_a_long_measuring_context_runs_only_its_first_tokens_through_the_model",)),
    Mutant("latency_grid_first_stage_only", "the tuner never times trees past its first stage, so a larger "
           "tree that would win where rows are cheap (a GPU) is never priced", "entmtp/autotune.py",
           "        if bound >= (1 - NEAR_TIE) * top and nxt is not None:\n", "        if False:\n",
           ("tests/test_tuning.py::test_the_latency_grid_is_timed_only_where_a_tree_could_be_chosen",)),
    Mutant("lookup_rows_untimed", "the tuner prices the prompt-lookup branch's extra rows by extrapolating "
           "past the timed sizes", "entmtp/autotune.py",
           "            need = lookup_grid_jobs(choose_tree(pool).tree, latency, grid) if pool else []\n",
           "            need = []\n",
           ("tests/test_tuning.py::test_the_rows_a_chosen_trees_lookup_branch_adds_are_timed",)),
    Mutant("near_tie_to_the_bigger_tree", "the tune takes a tree predicted 0.1% faster at twice the rows",
           "entmtp/autotune.py", "    near = [c for c in cands if c.predicted_tokens_per_s >= (1 - NEAR_TIE) * top]",
           "    near = [c for c in cands if c.predicted_tokens_per_s >= top]",
           ("tests/test_tuning.py::test_a_near_tie_goes_to_the_smaller_tree",)),
    Mutant("context_prefills_not_shared", "a tune of several kinds prefills each kind's measuring contexts again "
           "(~2 s a kind after 1,536 tokens)", "entmtp/calibrate.py", "                self._by_key[key] = p\n",
           "                pass\n", ("tests/test_tuning.py::test_kinds_tuned_together_prefill_each_measuring_context_once",)),
    Mutant("draft_lm_timed_hot", "the draft lm_head slice is timed with the caches as the last call left them "
           "(bf16 looked twice as fast as int8; in decoding int8 drafted faster)", "entmtp/heads.py",
           "                    flush()\n", "                    pass\n",
           ("tests/test_kernels.py::test_draft_lm_timings_time_a_draft_step_from_flushed_caches",)),
    Mutant("invariance_checked_past_a_difference", "a set already found not row-invariant is checked again at "
           "16 rows (~1 s of the kernel probe)", "entmtp/tuning.py",
           "            break  # one chain that differs decides it", "            pass  # one chain that differs decides it",
           ("tests/test_tuning.py::test_invariance_is_checked_up_to_the_first_chain_that_differs",)),
    Mutant("probe_twin_built_again", "the engine builds the chosen kernel set's twin again after the probe built "
           "and timed it (~0.65 s of a load)", "entmtp/decoding.py",
           "        if built is not None and built[1] == chosen:", "        if False:",
           ("tests/test_tuning.py::test_the_probe_builds_each_set_once_and_the_engine_decodes_with_its_twin",)),
    Mutant("whole_curves_of_every_set", "every kernel set is timed at every row count, not only the chosen one "
           "(~3 s of stock's and oneDNN's 1-32-row forwards)", "entmtp/tuning.py",
           "rows=ranking_rows(rows), **kw))", "rows=tuple(rows), **kw))",
           ("tests/test_tuning.py::test_probe_measures_every_set_that_runs_and_checks_invariance_bitwise",)),
)


class PatchError(RuntimeError):
    """A mutant's target text is not in its file exactly once."""


def patched(m: Mutant, text: str) -> str:
    """`text` (the contents of m.path) with the mutant in; PatchError when the target is not there once."""
    n = text.count(m.old)
    if n != 1:
        raise PatchError(f"mutant {m.name}: its target text occurs {n} times in {m.path}, not once "
                         f"(the source changed: update the mutant in scripts/mutants.py): {m.old.strip()!r}")
    return text.replace(m.old, m.new)


def apply(m: Mutant, root: Path) -> str:
    """Put the mutant into the copy at `root`; returns the file's original text."""
    f = root / m.path
    text = f.read_text()
    f.write_text(patched(m, text))
    return text


def working_tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files, relative to `root`."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def copy_tree(src: Path, dst: Path) -> None:
    for rel in working_tree_files(src):
        s = src / rel
        if s.is_file():  # deleted but still tracked: skip
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, dst / rel)


def test_env(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", TOKENIZERS_PARALLELISM="false",
               ENTMTP_CACHE=str(root.parent / "cache"))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_copy(root: Path, python: str) -> None:
    """The copy's entmtp is the one its tests import (not an installed one)."""
    out = subprocess.run([python, "-c", "import entmtp; print(entmtp.__file__)"], cwd=root, env=test_env(root),
                         capture_output=True, text=True)
    where = Path(out.stdout.strip() or "?").resolve()
    if out.returncode or root.resolve() not in where.parents:
        raise SystemExit(f"error: the copy's tests would import entmtp from {where}, not from {root} ({out.stderr.strip()[-200:]})")


def run_tests(root: Path, tests: tuple[str, ...], python: str, timeout: float, env: tuple = ()) -> tuple[int, str]:
    """(pytest's exit code, the first failing test or the output's tail). A passing run where a
    test was skipped is exit code 5 (a named test did not run here: neither a catch nor a miss)."""
    cmd = [python, "-m", "pytest", "-q", "-x", "-rfs", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env={**test_env(root), **dict(env)}, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    text = out.stdout + out.stderr
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in text.splitlines() if line.startswith("FAILED ")]
    lines = text.strip().splitlines()
    if out.returncode == 0 and lines and " skipped" in lines[-1]:
        skip = next((line for line in lines if line.startswith("SKIPPED")), lines[-1])
        return 5, skip.split(": ", 1)[-1]
    return out.returncode, failed[0] if failed else " | ".join(lines[-3:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--python", default=sys.executable, help="Python that runs the tests (default: this one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for one mutant's tests")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:22s} {m.path}: {m.what}")
        return 0
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"error: unknown mutant {', '.join(unknown)} (have: {', '.join(by_name)})", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: stop the tests, remove the copy
    with tempfile.TemporaryDirectory(prefix="entmtp-mutants-") as tmp:
        root = Path(tmp) / "repo"
        copy_tree(ROOT, root)
        for m in chosen:  # every patch applies before anything runs
            patched(m, (root / m.path).read_text())
        check_imports_copy(root, args.python)
        unable: dict = {}  # env -> why its tests cannot run on this machine
        for env in dict.fromkeys(m.env for m in chosen):
            tests = tuple(dict.fromkeys(t for m in chosen if m.env == env for t in m.tests))
            t0 = time.perf_counter()
            code, detail = run_tests(root, tests, args.python, args.timeout, env)
            if code == 5:
                unable[env] = detail
                continue
            if code != 0:
                print(f"error: the unpatched copy fails its tests ({detail}); fix that first", file=sys.stderr)
                return 2
            where = f" with {' '.join(f'{k}={v}' for k, v in env)}" if env else ""
            print(f"{'unpatched':22s} passes   {len(tests)} tests{where} ({time.perf_counter() - t0:.0f} s)", flush=True)
        missed = errors = 0
        for m in chosen:
            if m.env in unable:
                print(f"{m.name:22s} not run  its tests skip on this machine ({unable[m.env]})", flush=True)
                continue
            original = apply(m, root)
            t0 = time.perf_counter()
            try:
                code, detail = run_tests(root, m.tests, args.python, args.timeout, m.env)
            finally:
                (root / m.path).write_text(original)
            took = f"{time.perf_counter() - t0:.0f} s"
            if code == 1:
                print(f"{m.name:22s} caught   by {detail} ({took})", flush=True)
            elif code == 0:
                missed += 1
                print(f"{m.name:22s} MISSED   {m.what}: {len(m.tests)} tests pass ({took})", flush=True)
            else:  # collection error, timeout, crash: not an honest catch
                errors += 1
                print(f"{m.name:22s} ERROR    pytest exit {code}: {detail} ({took})", flush=True)
    return 1 if missed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
