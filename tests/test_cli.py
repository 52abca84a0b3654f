"""The command line: generate with any base + any heads, JSON traces, one-line errors."""

import json
import subprocess
import sys

import pytest

from conftest import random_heads, save_tiny_base
from entmtp import cli
from entmtp.checkpoints import save_heads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model, tok = save_tiny_base(d / "base")
    save_heads(random_heads(model, "hydra", num_heads=4), d / "hydra")
    save_heads(random_heads(model, "medusa", num_heads=3), d / "medusa")
    return d


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_trace_matches_baseline(tiny, capsys):
    base = ["generate", "--base", str(tiny / "base"), "hello world", "--max-new-tokens", "12", "--json"]
    code, out, _ = run(capsys, *base, "--method", "baseline")
    assert code == 0
    ref = json.loads(out)
    for heads, tree in (("hydra", "mc_sim_7b_63"), ("medusa", "wide3_chain2")):
        code, out, _ = run(capsys, *base, "--method", "hydra", "--heads", str(tiny / heads), "--tree", tree)
        assert code == 0
        got = json.loads(out)
        assert got["tokens"] == ref["tokens"]
        assert got["summary"]["new_tokens"] == len(got["tokens"])
        step = next(s for s in got["steps"] if s["time_verify"])
        assert step["n_nodes"] > 0 and len(step["token_texts"]) == step["n_nodes"] + 1


def test_generate_with_lookup_is_identical_and_records_copied_nodes(tiny, capsys):
    base = ["generate", "--base", str(tiny / "base"), "hello world hello world hello", "--max-new-tokens", "40", "--json"]
    _, out, _ = run(capsys, *base, "--method", "baseline")
    ref = json.loads(out)
    for extra in (["--method", "lookup"], ["--method", "hydra", "--heads", str(tiny / "hydra"), "--lookup", "6"]):
        code, out, _ = run(capsys, *base, *extra)
        assert code == 0
        got = json.loads(out)
        assert got["tokens"] == ref["tokens"]
        assert any(s.get("lookup_nodes") for s in got["steps"]), extra
    code, _, err = run(capsys, *base[:-1], "--method", "lookup")  # without --json: the summary line counts copies
    assert code == 0 and "prompt lookup (up to 8):" in err and "tokens accepted" in err
    code, out, err = run(capsys, *base, "--method", "hydra", "--heads", str(tiny / "hydra"), "--lookup", "-2")
    assert code != 0 and "lookup" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generate_prints_answer_and_summary(tiny, capsys):
    code, out, err = run(capsys, "generate", "--base", str(tiny / "base"), "--heads", str(tiny / "hydra"),
                         "--tree", "chain_3", "hello", "--max-new-tokens", "8")
    assert code == 0 and "tau" in err and "tokens/s" in err


@pytest.mark.parametrize("extra,needle", [
    (["--tree", "no_such_tree"], "unknown tree"),
    (["--heads", "/nonexistent/heads"], "heads not found"),
    (["--tree", "chain_5"], "exceeds the 4 draft heads"),
    (["--temperature", "-1"], "temperature"),
    (["--dtype", "float16", "--kernels", "packed"], "packed kernels are for bfloat16 and float32"),
])
def test_errors_are_one_line(tiny, capsys, extra, needle):
    args = ["generate", "--base", str(tiny / "base"), "--method", "hydra", "hello", "--max-new-tokens", "4"]
    if "--heads" not in extra:
        args += ["--heads", str(tiny / "hydra")]
    code, out, err = run(capsys, *args, *extra)
    assert code == 2
    assert err.strip().startswith("error:") and needle in err and len(err.strip().splitlines()) == 1


def test_malformed_tree_file(tiny, capsys, tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('{"paths": [[0], [1, 1]]}')
    code, _, err = run(capsys, "generate", "--base", str(tiny / "base"), "--heads", str(tiny / "hydra"),
                       "--tree", str(bad), "hi")
    assert code == 2 and "[1, 1] has no parent [1]" in err and len(err.strip().splitlines()) == 1


def test_heads_for_another_hidden_size(tiny, capsys, tmp_path):
    import transformers

    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=4))
    save_heads(random_heads(other, "hydra"), tmp_path / "h48")
    code, _, err = run(capsys, "generate", "--base", str(tiny / "base"), "--heads", str(tmp_path / "h48"), "hi")
    assert code == 2 and "hidden size" in err and len(err.strip().splitlines()) == 1


def test_model_without_heads_needs_heads(tiny, capsys):
    code, _, err = run(capsys, "generate", "--model", str(tiny / "base"), "--method", "medusa", "hi")
    assert code == 2 and "--heads" in err


def test_python_dash_m_entry_point(tiny):
    p = subprocess.run([sys.executable, "-m", "entmtp", "generate", "--base", str(tiny / "base"), "--method", "baseline",
                        "hello", "--max-new-tokens", "5", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["tokens"]) <= 5


def test_bf16_generation_with_packed_or_stock_kernels(tiny, capsys):
    """--kernels packed and stock both run; speculation on the packed kernels emits exactly their
    own plain greedy tokens, and those are stock's up to the first near-tie of the stock logits.
    (Since the fused norms and float32 attention, packed bf16 rounds differently from stock, so a
    random tiny model's near-ties may break differently -- as one CI CPU showed at token 3.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entmtp.kernels import can_pack
    from conftest import tiny_model, tokens_before_near_tie

    why = can_pack(tiny_model("llama", dtype=torch.bfloat16))
    if why:
        pytest.skip(why)
    base = ["generate", "--base", str(tiny / "base"), "--heads", str(tiny / "hydra"), "--dtype", "bfloat16",
            "--raw", "hello world", "--max-new-tokens", "16", "--json"]
    outs = {}
    for kernels, method in (("packed", "hydra"), ("packed", "baseline"), ("stock", "baseline")):
        code, out, err = run(capsys, *base, "--kernels", kernels, "--method", method)
        assert code == 0, err
        outs[kernels, method] = json.loads(out)["tokens"]
    plain, stock = outs["packed", "baseline"], outs["stock", "baseline"]
    assert outs["packed", "hydra"] == plain
    assert len(plain) == 16 or plain[-1] == 1  # 1 = the tiny tokenizer's end token
    model = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=torch.bfloat16)
    prompt = AutoTokenizer.from_pretrained(tiny / "base")("hello world")["input_ids"]
    agree = tokens_before_near_tie(model, prompt, stock)
    assert agree >= 1 and plain[:agree] == stock[:agree]


def test_bf16_on_a_cpu_without_bf16_kernels_says_so(tiny, capsys):
    import torch

    from entmtp.hardware import fast_bf16_matmul
    from entmtp.kernels import pack_method

    code, out, err = run(capsys, "generate", "--base", str(tiny / "base"), "--heads", str(tiny / "hydra"),
                         "--dtype", "bfloat16", "hello", "--max-new-tokens", "4")
    assert code == 0, err
    fast = fast_bf16_matmul() or pack_method(torch.bfloat16)[0] is not None
    assert ("no fast bf16 kernels" in err) == (not fast)


def test_gpu_bench_script_usage_is_one_line(tmp_path):
    """scripts/gpu_bench.sh (the prepared device run): bad use is one line and a non-zero exit."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    r = subprocess.run(["bash", str(script), "launch"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stderr.strip().startswith("gpu_bench: usage:") and len(r.stderr.strip().splitlines()) == 1
    # `bench` without staged parts says so instead of unpacking nothing
    r = subprocess.run(["bash", str(script), "bench", "--device", "cpu"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "GPU_STAGE": str(tmp_path / "stage")})
    assert r.returncode == 1 and "no staged parts" in r.stdout + r.stderr


def test_gpu_check_script_without_transformers_or_wheels_says_what_to_do(tmp_path):
    """scripts/gpu_check.sh on a machine whose python lacks transformers 5.24 and with no carried
    wheels: one line naming the staging command, a non-zero exit, nothing installed."""
    import shutil
    import subprocess
    from pathlib import Path

    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import transformers"], capture_output=True).returncode == 0:
        pytest.skip("needs a python3 without transformers")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    r = subprocess.run(["bash", str(script), "--device", "cpu"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "GPU_PYTHON": bare, "GPU_WHEELS": str(tmp_path / "none")})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"gpu_check: transformers 5.24 is not installed and no wheels are in {tmp_path / 'none'} "
        f"(bash scripts/gpu_check.sh stage, then carry {tmp_path / 'none'})"]
