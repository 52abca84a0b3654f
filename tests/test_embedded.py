"""The embedded default: SmolLM2-135M-Instruct with our trained heads, offline."""

import subprocess
import sys

import pytest
import torch

from entmtp.methods import default_tree
from entmtp.decoding import DecodeConfig
from entmtp.models import HEAD_KINDS, load_engine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine():
    return load_engine("default", {k: k for k in HEAD_KINDS}, progress=None)


def test_embedded_heads_are_small_and_share_the_lm_head(engine):
    for name, runner in engine.runners.items():
        cfg = runner.config
        assert cfg.shared_lm_head and cfg.num_heads == 5 and cfg.draft_vocab_size
        n = sum(p.numel() for p in runner.heads.parameters())
        assert n < 20e6  # no per-head 49k x 576 LM-head copy (28M parameters each)


@pytest.mark.parametrize("heads", sorted(HEAD_KINDS))
def test_embedded_heads_are_lossless_and_accept_drafts(engine, heads):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Give me three tips for staying focused while studying."}],
                                               add_generation_prompt=True, return_dict=False)
    ref = engine.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    r = engine.run(ids, heads=heads, tree=default_tree(engine, heads), config=DecodeConfig(max_new_tokens=40))
    assert r.tokens == ref
    assert r.tau > 1.3  # trained heads: drafts are accepted on a real prompt


def test_cli_answers_sensibly_offline():
    p = subprocess.run([sys.executable, "-m", "entmtp", "generate", "--model", "default", "--method", "hydra",
                        "What is the capital of France?", "--max-new-tokens", "24"],
                       capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "tau" in p.stderr


def test_shipped_banks_and_trees_resolve(engine):
    from entmtp.scheduler import default_bank_path, load_bank

    for name in engine.runners:
        bank = load_bank(default_bank_path(engine, name))
        assert bank.trees and all(t.depth <= engine.runners[name].config.num_heads for t in bank.trees)
        assert default_tree(engine, name).name.startswith("smollm2-135m-")


def test_every_recorded_tree_and_bank_exists_for_every_dtype_and_hardware_class():
    """The heads record defaults per dtype and hardware class (default_tree_float32@cpu-avx2, ...):
    each one must name a shipped file that loads, whichever machine runs the tests."""
    import json

    from entmtp.models import DEFAULT_HEADS_DIR
    from entmtp.scheduler import load_bank
    from entmtp.trees import TREES_DIR, resolve_tree

    keys = []
    for cfg in sorted(DEFAULT_HEADS_DIR.glob("*/config.json")):
        meta = json.loads(cfg.read_text()).get("meta", {})
        for key, name in meta.items():
            if key.startswith("default_tree"):
                assert resolve_tree(str(TREES_DIR / name)).n_nodes >= 1, (cfg, key)
                keys.append(key)
            elif key.startswith("default_bank"):
                assert load_bank(TREES_DIR / name).trees, (cfg, key)
    assert "default_tree_float32@cpu-avx2" in keys and "default_tree" in keys


def test_accept_by_depth_script_reports_a_consistent_survival_table():
    """scripts/accept_by_depth.py: P(accept >= d) never rises with d, the chain's tau is 1 + their
    sum, and the trained Hydra heads accept drafts on the bench prompts."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "scripts" / "accept_by_depth.py"), "--heads", "hydra",
                        "--per-category", "1", "--max-new-tokens", "24", "--depth", "3"],
                       capture_output=True, text=True, timeout=600, cwd=root,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| bench.jsonl")]
    assert len(rows) == 1, p.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == "bench.jsonl (6)" and cells[1] == "hydra" and int(cells[2]) > 0
    surv = [float(x) for x in cells[3:6]]
    assert surv == sorted(surv, reverse=True) and surv[0] > 0.1
    assert abs(float(cells[6]) - (1 + sum(surv))) < 0.011
    assert re.search(r"P\(accept >= 3\)", p.stdout)


def test_compare_lookup_script_measures_variants_losslessly():
    """scripts/compare_lookup.py: one row per variant, every output equal to the first variant's
    (greedy lookup is lossless), no lookup rows without lookup; a bad variant is refused. In bf16
    where entmtp's row-invariant panels run; elsewhere (kernels off, or a CPU without them) bf16
    tree rows are not bitwise one-row steps, so in float32."""
    from pathlib import Path

    from entmtp.kernels import kernel_options

    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    dtype = "bfloat16" if kernel_options(torch.bfloat16)["panels"] is None else "float32"
    cmd = [sys.executable, str(root / "scripts" / "compare_lookup.py"), "--n", "2", "--max-new-tokens", "24",
           "--dtype", dtype]
    p = subprocess.run(cmd + ["--variants", "0,4:1,4:2"], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert p.returncode == 0, p.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in p.stdout.splitlines()
            if line.startswith("| no lookup") or line.startswith("| 4 tokens")]
    assert [r[0] for r in rows] == ["no lookup", "4 tokens after >= 1-token matches", "4 tokens after >= 2-token matches"]
    assert rows[0][2] == "1.000x" and float(rows[0][4]) == 0.0  # the reference, and no grafted rows without lookup
    assert all(r[-1] == "2/2" and float(r[3]) >= 1.0 for r in rows)
    bad = subprocess.run(cmd + ["--variants", "4:7"], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert bad.returncode == 2 and "bad variant '4:7'" in bad.stderr and "Traceback" not in bad.stderr
