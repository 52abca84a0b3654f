"""`entmtp bench` on a tiny model: every report written, identity to hf measured, ratios sane."""

import csv
import json
import os

from conftest import random_heads, save_tiny_base
from entmtp import cli
from entmtp.bench import Run, headline, headline_lines, spread, summarize, take_per_category
from entmtp.checkpoints import save_heads
from entmtp.data import Prompt


def test_bench_end_to_end(tmp_path, capsys):
    model, _ = save_tiny_base(tmp_path / "base")
    save_heads(random_heads(model, "hydra", num_heads=4), tmp_path / "hydra")
    prompts = tmp_path / "p.jsonl"
    rows = [{"question_id": f"q{i}", "category": ["chat", "math"][i % 2], "turns": [f"hello world {i}"]} for i in range(6)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench"
    code = cli.main(["bench", "--base", str(tmp_path / "base"), "--heads", str(tmp_path / "hydra"), "--prompts", str(prompts),
                     "--methods", "hf,pld,baseline,lookup,hydra,dynamic", "--max-new-tokens", "12", "--tree", "binary_2x2",
                     "--per-category", "2", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    s = json.loads((out / "summary.json").read_text())
    assert set(s["methods"]) == {"hf", "pld", "baseline", "lookup", "hydra", "dynamic"}
    assert s["meta"]["lookup"] == {"baseline": 0, "lookup": 8, "hydra": 0, "dynamic": 0}
    for m, v in s["methods"].items():
        assert v["identical_to_hf"] == 1.0  # float32 greedy: every method is lossless
        assert v.get("identical_to_baseline") == (None if m in ("hf", "pld") else 1.0)  # our methods vs our loop
        # two separate figures: over our own loop (ours only) and over generate (all)
        assert (v.get("speedup_vs_baseline") is None) == (m in ("hf", "pld")) and v["speedup_vs_hf"] > 0
        assert len(v["tokens_per_s_by_repeat"]) == 1
        assert v["tokens_per_s"] > 0 and v["tau"] >= 1.0 and v["prompts"] == 4
    assert s["methods"]["hf"]["speedup_vs_hf"] == 1.0 and s["methods"]["baseline"]["tau"] == 1.0
    assert s["methods"]["baseline"]["speedup_vs_baseline"] == 1.0
    assert set(s["categories"]) == {"chat", "math"}
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4 * 6
    report = (out / "report.md").read_text()
    assert "| hydra |" in report and "identical to baseline |" in report and "speedup vs baseline | speedup vs hf |" in report and "plotly" in (out / "report.html").read_text()
    # what ran where: the hardware class, and the trees the heads record (none here) and the override
    assert s["meta"]["hardware"].startswith("cpu-") and s["meta"]["overrides"]["tree"] == "binary_2x2"
    assert len(s["meta"]["date"]) == 10 and f"({s['meta']['date']})" in report  # results carry their date
    assert list(s["meta"]["recorded_trees"].values()) == [{"tree": None, "bank": None}]  # one head set, nothing recorded
    assert "overridden by --tree binary_2x2" in (out / "report.md").read_text()
    assert "speedup vs baseline | speedup vs hf |" in printed.out and "bookkeeping share of step time" in printed.out
    # the headline: our loop over generate, identity per method; no medusa / entmtp ran, so no ratio is made
    # up for them; one repeat: no spread
    assert set(s["headline"]) == {"baseline_vs_hf", "identical_to_hf"}
    assert s["headline"]["baseline_vs_hf"] == s["methods"]["baseline"]["speedup_vs_hf"]
    assert s["headline"]["identical_to_hf"] == {m: 1.0 for m in ("pld", "baseline", "lookup", "hydra", "dynamic")}
    assert "kernels: our plain loop / hf generate tokens/s" in printed.out
    assert "token-identical to hf: pld 100%, baseline 100%" in printed.out and "Hydra-family" not in printed.out
    assert "* token-identical to hf:" in report
    # hf and pld ran in a worker process with the environment's own OpenMP waiting, not entmtp's passive
    from entmtp.threads import USER_WAIT_POLICY
    worker = s["meta"]["stock_process"]
    assert worker["wait_policy"] == (USER_WAIT_POLICY or "default") and worker["pid"] != os.getpid()
    assert "(hf and pld: stock transformers, in a process of their own (OpenMP waiting" in report


def _tiny_bench(tmp_path, n=4):
    save_tiny_base(tmp_path / "base")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": f"q{i}", "turns": [f"hello world {i}"]}) for i in range(n)))
    return ["bench", "--base", str(tmp_path / "base"), "--prompts", str(prompts), "--methods", "hf,baseline",
            "--max-new-tokens", "6", "--out", str(tmp_path / "bench")]


def test_no_stock_process_times_generate_in_this_process(tmp_path, capsys):
    code = cli.main(_tiny_bench(tmp_path, n=2) + ["--no-stock-process"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    s = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert s["meta"]["stock_process"] is None and s["methods"]["baseline"]["identical_to_hf"] == 1.0
    assert "(hf and pld: stock transformers, in this process)" in (tmp_path / "bench" / "report.md").read_text()


def test_max_seconds_stops_after_a_whole_prompt_and_says_so(tmp_path, capsys):
    code = cli.main(_tiny_bench(tmp_path) + ["--max-seconds", "0.000001"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    s = json.loads((tmp_path / "bench" / "summary.json").read_text())
    # the first prompt passes the budget: every method ran on it, and on nothing after it
    assert {m: v["prompts"] for m, v in s["methods"].items()} == {"hf": 1, "baseline": 1}
    assert s["meta"]["prompts"] == 1 and s["meta"]["planned_prompts"] == 4
    assert "1 of 4 prompts (stopped early: --max-seconds 1e-06)" in (tmp_path / "bench" / "report.md").read_text()
    assert "stopped early (--max-seconds 1e-06): 1 of 4 prompts" in printed.out
    assert (tmp_path / "bench" / "report.html").exists()


def test_an_interrupted_bench_keeps_the_reports_of_the_prompts_it_finished(tmp_path, capsys, monkeypatch):
    from entmtp import bench

    real = bench.summarize
    calls = []

    def interrupt_on_the_third(runs, methods):  # the partial report after prompt 2 is written, then ^C
        calls.append(len(runs))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(runs, methods)

    monkeypatch.setattr(bench, "summarize", interrupt_on_the_third)
    code = cli.main(_tiny_bench(tmp_path))
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == f"interrupted after 2 of 4 prompts; their reports are in {tmp_path / 'bench'}/"
    s = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert s["meta"]["prompts"] == 2 and s["methods"]["baseline"]["prompts"] == 2
    assert "2 of 4 prompts (stopped early: interrupted)" in (tmp_path / "bench" / "report.md").read_text()
    with open(tmp_path / "bench" / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 2 * 2


def test_bad_max_seconds_is_one_line(tmp_path, capsys):
    code = cli.main(["bench", "--max-seconds", "-1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "max_seconds must be >= 0" in err and len(err.strip().splitlines()) == 1


def test_bad_method_is_one_line(tmp_path, capsys):
    code = cli.main(["bench", "--methods", "hf,warp", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "unknown method(s) warp" in err and len(err.strip().splitlines()) == 1


def test_take_per_category():
    ps = [Prompt.from_text(f"t{i}", id=str(i), category="ab"[i % 2]) for i in range(7)]
    assert [p.id for p in take_per_category(ps, 2)] == ["0", "1", "2", "3"]


def test_headline_takes_the_best_hydra_family_method():
    ms = {"hf": (10.0, 1.0), "medusa": (30.0, 0.5), "hydra": (33.0, 0.5), "hydra++": (36.0, 0.25), "entmtp": (40.0, None)}
    summary = {"methods": {m: {"tokens_per_s": t, "identical_to_hf": i} for m, (t, i) in ms.items()}}
    h = headline(summary)
    assert h["entmtp_vs_hf"] == 4.0 and "entmtp_vs_baseline" not in h  # no baseline ran
    assert h["hydra_vs_medusa"] == {"ratio": 1.2, "method": "hydra++"}
    assert h["identical_to_hf"] == {"medusa": 0.5, "hydra": 0.5, "hydra++": 0.25, "entmtp": None}
    lines = headline_lines(h)
    assert lines[0] == "entmtp / hf generate tokens/s: 4.00x"
    assert lines[1] == "best Hydra-family (hydra++) / medusa tokens/s: 1.200x"
    assert lines[2] == "token-identical to hf: medusa 50%, hydra 50%, hydra++ 25%, entmtp n/a"
    # with our plain loop: speculation over it first, then the kernels' share; entmtp_vs_hf is their product
    summary["methods"]["baseline"] = {"tokens_per_s": 20.0}
    h = headline(summary)
    assert (h["entmtp_vs_baseline"], h["baseline_vs_hf"]) == (2.0, 2.0)
    assert headline_lines(h)[:3] == ["speculation: entmtp / our plain loop (same kernels) tokens/s: 2.00x",
                                     "entmtp / hf generate tokens/s: 4.00x", "kernels: our plain loop / hf generate tokens/s: 2.00x"]
    # without hf nothing is relative to it; without medusa no family ratio
    del summary["methods"]["hf"], summary["methods"]["medusa"]
    assert headline(summary) == {"entmtp_vs_baseline": 2.0}
    del summary["methods"]["baseline"]
    assert headline(summary) == {}


def _runs(tps: dict[str, list[float]]) -> list[Run]:
    """One prompt of 10 tokens per (method, repeat) at the given tokens/s."""
    return [Run("p", "all", m, i, 10, 10 / t, 10, [1] * 10) for m, ts in tps.items() for i, t in enumerate(ts)]


def test_headline_spread_over_repeats():
    """Three or more repeats: each headline ratio carries its min, max and stdev over the repeats."""
    tps = {"hf": [10.0, 10.0, 10.0], "baseline": [20.0, 20.0, 25.0], "entmtp": [30.0, 40.0, 50.0]}
    s = summarize(_runs(tps), list(tps))
    h = s["headline"]
    assert h["entmtp_vs_baseline"] == 40.0 / 20.0 and h["entmtp_vs_hf"] == 4.0  # medians per prompt
    sp = h["spread"]["entmtp_vs_baseline"]
    assert (sp["min"], sp["max"], sp["repeats"]) == (1.5, 2.0, 3) and abs(sp["stdev"] - spread([1.5, 2.0, 2.0])["stdev"]) < 1e-12
    assert (h["spread"]["entmtp_vs_hf"]["min"], h["spread"]["entmtp_vs_hf"]["max"]) == (3.0, 5.0)
    assert s["methods"]["entmtp"]["speedup_vs_baseline"] == 2.0 and s["methods"]["entmtp"]["tokens_per_s_by_repeat"] == [30.0, 40.0, 50.0]
    assert "(each repeat over all prompts: 1.50-2.00x, sd 0.289 over 3 repeats)" in headline_lines(h)[0]
    # two repeats are too few for a spread
    two = summarize(_runs({m: v[:2] for m, v in tps.items()}), list(tps))["headline"]
    assert "spread" not in two and spread([1.0, 2.0]) is None


def test_interleaved_rounds_rotate_every_competitor_through_every_position():
    from entmtp.interleave import rotated
    items = ["hf", "baseline", "hydra"]
    rounds = [rotated(items, t) for t in range(6)]
    assert rounds[0] == items and rounds[1] == ["baseline", "hydra", "hf"] and rounds[3] == items
    for r in rounds:
        assert sorted(r) == sorted(items)  # each round runs everyone once
    for pos in range(len(items)):  # over len(items) rounds each competitor takes each position once
        assert sorted(r[pos] for r in rounds[:3]) == sorted(items)
    assert rotated(range(4), 6) == [2, 3, 0, 1] and rotated([], 5) == []
