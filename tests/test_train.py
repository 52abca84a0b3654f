"""`entmtp train` on a tiny random Llama with an in-memory WordLevel tokenizer (ChatML template)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from entmtp import cli
from entmtp import train as T
from entmtp.checkpoints import load_heads
from entmtp.heads import DraftHeads, HeadsConfig

REPO = Path(__file__).resolve().parent.parent

WORDS = ("one two three four five six seven eight nine ten red green blue cat dog bird fish tree sun moon "
         "star rain snow wind fire water earth stone gold iron count list name say tell write about the a of "
         "and to in is it what how why please colors animals numbers from up down"
         ).split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + ["system", "user", "assistant"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A saved tiny LlamaForCausalLM + tokenizer (so `--model PATH` works)."""
    import transformers

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   initializer_range=0.1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits: a peaked teacher the heads can learn in a few steps
        model.get_output_embeddings().weight.mul_(2.0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _rows(n: int = 40) -> list[dict]:
    nums = "one two three four five six seven eight nine ten".split()
    cols = "red green blue".split()
    animals = "cat dog bird fish".split()
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            s = i % 5
            rows.append({"id": f"n{i}", "prompt": f"count from {nums[s]} please",
                         "answer": " ".join(nums[s:] + nums[:s])})
        elif kind == 1:
            rows.append({"id": f"c{i}", "prompt": f"list colors and {animals[i % 4]}",
                         "answer": " ".join((cols + [animals[i % 4]]) * 3)})
        else:
            rows.append({"id": f"a{i}", "prompt": f"name animals from {nums[i % 10]}",
                         "answer": " ".join(animals * 2 + nums[: 1 + i % 6])})
    return rows


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    return p


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """A fresh accelerate state per run, and one torch thread: tiny matmuls on 2 shared cores
    are 10-40x slower with OpenMP spin-waiting threads."""
    from accelerate.state import AcceleratorState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)
    torch.set_num_threads(threads)


def _args(tiny_dir, data_file, tmp_path, *extra: str, tag: str = "run"):
    argv = ["--model", str(tiny_dir), "--data", str(data_file), "--heads", "medusa,hydra,hydra++",
            "--num-heads", "3", "--batch-size", "4", "--max-steps", "12", "--warmup", "2", "--lr", "1e-2",
            "--eval-every", "0", "--save-every", "0", "--log-every", "1", "--max-len", "64", "--held-out", "0.15",
            "--work-dir", str(tmp_path / f"{tag}-work"), "--out", str(tmp_path / f"{tag}-out"), "--cpu",
            "--epochs", "50", *extra]
    return _cfg(argv)


def _cfg(argv: list[str]) -> T.TrainConfig:
    """The TrainConfig `entmtp train ARGV` runs with."""
    return cli.train_config(cli.build_parser().parse_args(["train", *argv]))


def _run_error(tiny_dir, data_file, tmp_path, *extra: str) -> str:
    """The one-line TrainError a one-step run with `extra` flags stops with."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    with pytest.raises(T.TrainError) as e:
        T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "1", *extra, tag="e"))
    assert "\n" not in str(e.value)
    return str(e.value)


def _train_losses(report: dict, label: str) -> list[float]:
    return [h["train"][label]["loss"] for h in report["history"] if "train" in h]


# ------------------------------------------------------------------------------------- units
def test_lr_schedule_warmup_cosine():
    m = [T.lr_multiplier(s, 4, 20, 0.1) for s in range(25)]
    assert m[0] == pytest.approx(0.25) and m[3] == pytest.approx(1.0)
    assert m[4] == pytest.approx(1.0) and m[20] == pytest.approx(0.1) and m[24] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(m[4:], m[5:]))


def test_parse_kinds_and_errors():
    assert T.parse_kinds("medusa, Hydra,hydrapp,hydra,EAGLE") == ["medusa", "hydra", "hydra++", "eagle"]
    with pytest.raises(T.TrainError, match="unknown head kind 'medusa2'"):
        T.parse_kinds("medusa,medusa2")


@pytest.mark.parametrize("kind,prefix", [("medusa", False), ("hydra", False), ("hydra", True), ("eagle", False)])
def test_head_inputs_match_training_logits(kind, prefix):
    """The gathered per-position rows give exactly DraftHeads.training_logits."""
    torch.manual_seed(0)
    layer = prefix or kind == "eagle"
    cfg = HeadsConfig(kind=kind, num_heads=3, hidden_size=16, vocab_size=40, prefix_layer=prefix,
                      num_attention_heads=4 if layer else 0, num_key_value_heads=2 if layer else 0,
                      intermediate_size=32 if layer else 0)
    heads = DraftHeads(cfg)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    embed = torch.nn.Embedding(40, 16)
    lm = torch.randn(40, 16)
    hidden, ids = torch.randn(2, 9, 16), torch.randint(0, 40, (2, 9))
    ref = heads.training_logits(hidden, ids, embed, lm)
    emb = embed(ids)
    feat = heads.features(hidden, emb)
    for k in range(3):
        bi, ti = torch.ones(2, 9 - k - 2, dtype=torch.bool).nonzero(as_tuple=True)
        got = heads.head_logits(k, T.head_inputs(kind, feat, emb, bi, ti, k), lm)
        torch.testing.assert_close(got, ref[k][bi, ti])


def test_features_are_post_norm_hidden_states_and_teacher_topk(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    seqs = [T.Seq("a", torch.tensor([3, 9, 10, 11, 2]), torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool), "held"),
            T.Seq("b", torch.tensor([3, 12, 2]), torch.tensor([0, 1, 1], dtype=torch.bool), "train")]
    dv = torch.tensor([2, 9, 10, 11, 12, 20])
    feats = T._FeatureExtractor(model, dv, 4, torch.float16, 64)(seqs)
    for s, f in zip(seqs, feats):
        with torch.no_grad():
            out = model(input_ids=s.ids[None], output_hidden_states=True)
        torch.testing.assert_close(f["hidden"].float(), out.hidden_states[-1][0].half().float())
        if s.split == "held":  # the full-vocab greedy token is only needed for evaluation
            assert torch.equal(f["greedy"].long(), out.logits[0].argmax(-1))
        else:
            assert (f["greedy"] == -1).all()
        p = torch.softmax(out.logits[0][:, dv], -1).topk(4, -1)
        assert torch.equal(f["tids"].long(), p.indices)
        torch.testing.assert_close(f["tp"].float(), p.values.half().float())


def test_draft_vocab_most_frequent_plus_eos():
    seqs = [T.Seq("a", torch.tensor([5, 5, 5, 6, 6, 7, 9]), torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.bool), "train"),
            T.Seq("b", torch.tensor([8, 8, 8, 8]), torch.tensor([1, 1, 1, 1], dtype=torch.bool), "held")]
    dv = T._build_draft_vocab(seqs, 2, 20, [3])
    assert dv.tolist() == [3, 5, 6]  # 8 is held-out only; 9 is not an answer token
    assert T._build_draft_vocab(seqs, 0, 20, [3]) is None


def test_step_indexed_order_is_deterministic():
    a, b = T._Order(10, 3, seed=1), T._Order(10, 3, seed=1)
    assert a.steps_per_epoch == 3
    seq = [a.batch_at(s) for s in range(7)]
    assert [b.batch_at(s) for s in reversed(range(7))][::-1] == seq
    assert sorted(sum((x[1] for x in seq[:3]), [])) == sorted(set(sum((x[1] for x in seq[:3]), [])))
    assert seq[3][0] == 1 and seq[0][1] != seq[3][1]


# ------------------------------------------------------------------------------------- end to end
def test_training_lowers_loss_saves_and_reloads(tiny_dir, data_file, tmp_path):
    args = _args(tiny_dir, data_file, tmp_path, "--max-steps", "30", "--draft-vocab", "20", "--eval-every", "10",
                 "--heads", "medusa,hydra,hydra++,eagle")
    res = T.run_training(args)
    rep = res.report
    for label in ("medusa", "hydra", "hydra++", "eagle"):
        losses = _train_losses(rep, label)
        assert len(losses) == 30
        assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, (label, losses)
        m = rep["heads"][label]["metrics"]
        assert len(m["top1"]) == 3 and 1.0 <= m["tau_chain"] <= 4.0
    assert rep["steps"] == 30 and rep["stop_reason"] == "completed"
    assert rep["recipe"]["draft_vocab_size"] <= 21
    assert sum("eval" in h for h in rep["history"]) == 3  # steps 10, 20 and the final one
    out = tmp_path / "run-out"
    assert {p.name for p in out.iterdir()} >= {"tiny-llama0-medusa", "tiny-llama0-hydra", "tiny-llama0-hydrapp",
                                                 "tiny-llama0-eagle", "train_report.json", "train_report.md"}
    assert json.loads((out / "train_report.json").read_text())["steps"] == 30
    # reload: identical outputs
    torch.manual_seed(1)
    V = rep["model"]["vocab_size"]
    hidden, ids = torch.randn(2, 10, 32), torch.randint(0, V, (2, 10))
    embed = torch.nn.Embedding(V, 32)
    for label, d in res.out_dirs.items():
        loaded = load_heads(d)
        trained = res.heads[label].eval()
        assert torch.equal(loaded.draft_vocab, trained.draft_vocab)
        meta = loaded.meta
        assert meta["steps"] == 30 and meta["data_sha256"] and meta["metrics"]["tau_chain"] > 0
        assert loaded.config.prefix_layer == (label == "hydra++") and loaded.config.label == label
        lm = torch.randn(loaded.config.draft_vocab_size, 32)
        with torch.no_grad():
            a = trained.training_logits(hidden, ids, embed, lm)
            b = loaded.training_logits(hidden, ids, embed, lm)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_resume_continues_exactly(tiny_dir, data_file, tmp_path):
    straight = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "10", "--epochs", "9",
                                    tag="straight"))
    first = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "10", "--epochs", "9",
                                 "--stop-after", "5", tag="split"))
    assert first.report["steps"] == 5 and "stop-after" in first.report["stop_reason"]
    assert first.report["features"]["cached"] and not first.report["features"]["reused"]
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    second = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "10", "--epochs", "9",
                                  "--resume", tag="split"))
    assert second.report["steps"] == 10 and second.report["features"]["reused"]
    for label in straight.heads:
        for (n, a), (_, b) in zip(straight.heads[label].state_dict().items(), second.heads[label].state_dict().items()):
            assert torch.equal(a, b), (label, n)
    # the resumed run's log continues with the same batches: identical per-step losses
    assert _train_losses(second.report, "hydra") == _train_losses(straight.report, "hydra")


def test_init_from_fine_tunes_trained_heads(tiny_dir, data_file, tmp_path):
    """--init-from starts every kind from trained heads (their draft vocabulary kept) and trains on."""
    kinds = ("--heads", "medusa,hydra,hydra++,eagle")
    first = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "20", "--draft-vocab", "20", *kinds, tag="a"))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    # a tiny learning rate: the fine-tuned heads stay next to the ones they started from
    tuned = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "2", "--lr", "1e-9",
                                 "--init-from", str(tmp_path / "a-out"), *kinds, tag="b"))
    AcceleratorState._reset_state(True)
    fresh = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "2", "--lr", "1e-9",
                                 "--draft-vocab", "20", *kinds, tag="c"))
    assert tuned.report["recipe"]["init_from"] == str(tmp_path / "a-out")
    assert f"started from the heads in `{tmp_path / 'a-out'}`" in (tmp_path / "b-out" / "train_report.md").read_text()
    for label in ("medusa", "hydra", "hydra++", "eagle"):
        start, now = first.heads[label], tuned.heads[label]
        assert torch.equal(now.draft_vocab, start.draft_vocab)
        for (n, a), (_, b) in zip(start.state_dict().items(), now.state_dict().items()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6), (label, n)
        # the first step's loss is the trained heads' loss, far below fresh heads'
        assert _train_losses(tuned.report, label)[0] < 0.8 * _train_losses(fresh.report, label)[0]
    # one kind from its own directory
    AcceleratorState._reset_state(True)
    one = T.run_training(_args(tiny_dir, data_file, tmp_path, "--heads", "hydra", "--max-steps", "1",
                               "--init-from", str(first.out_dirs["hydra"]), tag="d"))
    assert torch.equal(one.heads["hydra"].draft_vocab, first.heads["hydra"].draft_vocab)

    def err(*extra):
        return _run_error(tiny_dir, data_file, tmp_path, *extra)

    assert "4 --num-layers" in err("--init-from", str(tmp_path / "a-out"), "--num-heads", "4")
    assert "one kind" in err("--init-from", str(first.out_dirs["hydra"]))
    assert "not hydra" in err("--heads", "hydra", "--init-from", str(first.out_dirs["medusa"]))
    assert "--draft-vocab 30" in err("--init-from", str(tmp_path / "a-out"), "--draft-vocab", "30")
    assert "no such directory" in err("--init-from", str(tmp_path / "nowhere"))
    assert "no '*-medusa' heads directory" in err("--init-from", str(tmp_path))

    # more layers: the added blocks start as the identity, so the grown heads begin exactly as
    # the trained ones (same logits) and then train on; fewer layers is an error
    AcceleratorState._reset_state(True)
    grown = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "1", "--lr", "1e-9", "--num-layers", "2",
                                 "--init-from", str(tmp_path / "a-out"), tag="f"))
    torch.manual_seed(2)
    V = first.report["model"]["vocab_size"]
    hidden, ids, embed = torch.randn(2, 8, 32), torch.randint(0, V, (2, 8)), torch.nn.Embedding(V, 32)
    for label in ("medusa", "hydra", "hydra++"):
        big, small = grown.heads[label].eval(), first.heads[label].eval()
        assert big.config.num_layers == 2 and small.config.num_layers == 1
        assert all(len(b) == 2 for b in big.blocks)
        lm = torch.randn(big.config.draft_vocab_size, 32)
        with torch.no_grad():
            for x, y in zip(big.training_logits(hidden, ids, embed, lm), small.training_logits(hidden, ids, embed, lm)):
                assert torch.allclose(x, y, atol=1e-4), label
        assert _train_losses(grown.report, label)[0] == pytest.approx(_train_losses(tuned.report, label)[0], rel=1e-3)
    assert "not lose them" in err("--num-layers", "1", "--init-from", str(tmp_path / "f-out"))


def test_on_the_fly_features_match_cache(tiny_dir, data_file, tmp_path):
    a = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "6", "--heads", "hydra",
                             "--cache-features", tag="cache"))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    b = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "6", "--heads", "hydra",
                             "--no-cache-features", tag="fly"))
    assert a.report["features"]["cached"] and not b.report["features"]["cached"]
    for (n, x), (_, y) in zip(a.heads["hydra"].state_dict().items(), b.heads["hydra"].state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)


def test_feature_cache_invalidated_by_changed_input(tiny_dir, data_file, tmp_path):
    base = ("--max-steps", "2", "--heads", "medusa", "--cache-features", "--log-every", "0")
    a = T.run_training(_args(tiny_dir, data_file, tmp_path, *base, tag="inv"))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    b = T.run_training(_args(tiny_dir, data_file, tmp_path, *base, "--max-len", "40", tag="inv"))
    assert not a.report["features"]["reused"] and not b.report["features"]["reused"]
    assert a.report["features"]["key"] != b.report["features"]["key"]
    # the other input's cache is kept (never deleted behind the user's back) and reused when its
    # settings come back
    assert Path(a.report["features"]["dir"]).is_dir() and Path(b.report["features"]["dir"]).is_dir()
    AcceleratorState._reset_state(True)
    c = T.run_training(_args(tiny_dir, data_file, tmp_path, *base, "--max-len", "40", tag="inv"))
    assert c.report["features"]["reused"] and c.report["features"]["key"] == b.report["features"]["key"]
    AcceleratorState._reset_state(True)
    d = T.run_training(_args(tiny_dir, data_file, tmp_path, *base, tag="inv"))
    assert d.report["features"]["reused"] and d.report["features"]["key"] == a.report["features"]["key"]


def test_bf16_base_and_mixed_precision(tiny_dir, data_file, tmp_path):
    res = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "3", "--heads", "hydra++",
                               "--dtype", "bfloat16", "--mixed-precision", "bf16", "--save-dtype", "bfloat16",
                               "--draft-vocab", "16", "--cache-features"))
    assert res.report["steps"] == 3 and res.report["features"]["cached"]
    from safetensors.torch import load_file

    stored = load_file(str(res.out_dirs["hydra++"] / "heads.safetensors"))
    assert {v.dtype for v in stored.values() if v.is_floating_point()} == {torch.bfloat16}
    loaded = load_heads(res.out_dirs["hydra++"])
    for (n, a), b in zip(res.heads["hydra++"].state_dict().items(), loaded.state_dict().values()):
        assert a.dtype in (torch.float32, torch.long)  # fp32 master weights
        rounded = a.to(torch.bfloat16).to(b.dtype) if a.is_floating_point() else a
        assert torch.equal(rounded, b), n


def test_time_budget_stops_cleanly(tiny_dir, data_file, tmp_path):
    res = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "100000", "--heads", "medusa",
                               "--time-budget-min", "0.0001", "--log-every", "0"))
    assert res.report["steps"] == 0 and res.report["stop_reason"] == "time budget spent"
    assert load_heads(res.out_dirs["medusa"]).meta["stop_reason"] == "time budget spent"
    assert (tmp_path / "run-out" / "train_report.json").is_file()


def test_time_budget_fits_the_schedule(tiny_dir, data_file, tmp_path):
    res = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "100000", "--heads", "medusa",
                               "--num-heads", "1", "--time-budget-min", "0.08", "--log-every", "0"))
    rep = res.report
    assert 12 <= rep["planned_steps"] < 100000 and rep["steps"] >= 12
    assert rep["stop_reason"] in ("completed", "time budget spent")


def test_self_distill_generates_resumes_and_trains(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"tell about the {w} please" for w in WORDS[:14]) + "\n")
    common = ("--self-distill", "--gen-max-new-tokens", "8", "--gen-batch-size", "4", "--max-steps", "4",
              "--heads", "medusa,hydra", "--held-out", "0.2")
    args = _cfg(
        ["--model", str(tiny_dir), "--data", str(prompts), "--work-dir", str(tmp_path / "w"), "--out",
         str(tmp_path / "o"), "--cpu", "--log-every", "0", "--batch-size", "4", *common])
    res = T.run_training(args)
    sd = res.report["data"]["self_distill"]
    assert sd["generated_now"] == 14 and sd["cached"] == 0
    files = list((tmp_path / "w" / "selfdistill").glob("selfdistill-*.rank0.jsonl"))
    assert len(files) == 1
    lines = files[0].read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 14 and all(1 <= len(r["answer_ids"]) <= 8 for r in recs)
    assert res.report["data"]["n_train_sequences"] + res.report["data"]["n_held_out_sequences"] == 14
    assert res.report["steps"] == 4
    # interrupted generation: keep 9 records plus a half-written line -> only 5 are generated again
    files[0].write_text("\n".join(lines[:9]) + "\n" + lines[9][: len(lines[9]) // 2])
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    res2 = T.run_training(args)
    sd2 = res2.report["data"]["self_distill"]
    assert sd2["cached"] == 9 and sd2["generated_now"] == 5
    recs2 = T._read_jsonl_records([files[0]])
    assert len(recs2) == 14
    # greedy generation is deterministic: same answers as the first time
    assert {r["key"]: r["answer_ids"] for r in recs} == {k: r["answer_ids"] for k, r in recs2.items()}


def test_errors_are_one_line(tiny_dir, data_file, tmp_path):
    def err(*extra, data=None):
        argv = ["--model", str(tiny_dir), "--data", str(data or data_file), "--work-dir", str(tmp_path / "w"),
                "--out", str(tmp_path / "o"), "--cpu", *extra]
        with pytest.raises(T.TrainError) as e:
            T.main(_cfg(argv))
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "not found" in err(data=tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n{"bar": 2}\n')
    assert "no usable prompt" in err(data=bad)
    noans = tmp_path / "noans.txt"
    noans.write_text("what is a cat\nwhat is a dog\n")
    assert "--self-distill" in err(data=noans)
    assert "unknown head kind" in err("--heads", "medusa,eagle3")
    assert "--batch-size" in err("--batch-size", "0")
    assert "does not exist" in err("--model", str(tmp_path / "no-model"))


def test_cli_error_without_traceback(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "entmtp", "train", "--data", str(tmp_path / "nope.jsonl"), "--cpu",
                        "--work-dir", str(tmp_path / "w")],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    err_lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: data file not found")


def test_accelerate_launch_two_processes(tiny_dir, data_file, tmp_path):
    """`accelerate launch --cpu --num_processes 2 -m entmtp train`: two CPU processes (gloo) end to
    end; the result matches a single-process run.

    accelerate 1.15 starts ONE process for this command (its simple launcher fans CPU processes
    out only through mpirun); `entmtp train` sees the request and starts the two itself.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    train_args = ["--model", str(tiny_dir), "--data", str(data_file), "--heads", "medusa,hydra++", "--num-heads", "2",
                  "--batch-size", "4", "--max-steps", "6", "--epochs", "5", "--warmup", "1", "--eval-every", "3",
                  "--save-every", "3", "--log-every", "2", "--max-len", "64", "--draft-vocab", "24",
                  "--cache-features", "--feature-shard-size", "8", "--cpu"]
    work, out = tmp_path / "w", tmp_path / "o"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "entmtp", "train",
           *train_args, "--work-dir", str(work), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "train_report.json").read_text())
    assert "starting 2 CPU processes" in r.stderr
    assert rep["recipe"]["processes"] == 2 and rep["steps"] == 6
    assert rep["features"]["cached"] and rep["features"]["shards"] == 5
    assert (work / "ckpt" / "latest.json").is_file()
    multi = load_heads(out / "tiny-llama0-hydrapp")
    assert multi.config.prefix_layer and multi.meta["steps"] == 6
    # the log is written once (main process only)
    log = [json.loads(x) for x in (work / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if x["type"] == "train"] == [2, 4, 6]
    # same data order and globally normalized loss: one process gives the same heads
    single = T.run_training(_cfg(
        [*train_args, "--work-dir", str(tmp_path / "w1"), "--out", str(tmp_path / "o1")]))
    for label, suffix in (("medusa", "medusa"), ("hydra++", "hydrapp")):
        a = load_heads(out / f"tiny-llama0-{suffix}").state_dict()
        for n, v in single.heads[label].state_dict().items():
            torch.testing.assert_close(a[n], v, atol=1e-5, rtol=1e-4, msg=f"{label} {n}")


def test_requested_cpu_processes_reads_the_accelerate_command():
    env = {"ACCELERATE_USE_CPU": "True"}
    launch = ["/usr/bin/python", "/x/accelerate", "launch", "--cpu", "--num_processes", "2", "-m", "entmtp", "train"]
    assert T.requested_cpu_processes(env, launch) == 2
    assert T.requested_cpu_processes(env, [*launch[:4], "--num_processes=3", *launch[6:]]) == 3
    assert T.requested_cpu_processes({**env, "WORLD_SIZE": "2"}, launch) == 1  # already distributed
    assert T.requested_cpu_processes({}, launch) == 1  # not launched by accelerate on CPU
    assert T.requested_cpu_processes(env, ["bash", "-c", "x"]) == 1
    assert T.requested_cpu_processes(env, [*launch[:5], "two"]) == 1
    module = ["/usr/bin/python", "-m", "accelerate.commands.launch", "--num_processes", "4", "--cpu", "-m", "entmtp"]
    assert T.requested_cpu_processes(env, module) == 4


def test_multi_layer_eagle_heads_train_from_one_layer_ones_and_reload(tiny_dir, data_file, tmp_path):
    """EAGLE heads reading several base layers (--feature-layers): the features are those layers'
    outputs then the last hidden state; heads grown from one-layer EAGLE heads start exactly where
    those were (same first loss), then learn; the saved heads reload with the layers they read."""
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    seq = T.Seq("a", torch.tensor([3, 9, 10, 11, 2]), torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool), "held")
    f = T._FeatureExtractor(model, None, 4, torch.float32, 64, layers=(1, 0))([seq])[0]
    with torch.no_grad():
        hs = model(input_ids=seq.ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(f["hidden"], torch.cat([hs[1][0], hs[0][0], hs[-1][0]], -1))
    with torch.no_grad():  # the teacher and the greedy token still come from the last hidden state
        logits = model(input_ids=seq.ids[None]).logits[0]
    assert torch.equal(f["greedy"].long(), logits.argmax(-1))
    assert torch.equal(f["tids"].long(), torch.softmax(logits, -1).topk(4, -1).indices)

    eagle = ("--heads", "eagle")
    one = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "20", "--draft-vocab", "20", *eagle, tag="a"))
    AcceleratorState._reset_state(True)
    grown = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "12", "--feature-layers", "1,0",
                                 "--init-from", str(one.out_dirs["eagle"]), *eagle, tag="b"))
    AcceleratorState._reset_state(True)
    again = T.run_training(_args(tiny_dir, data_file, tmp_path, "--max-steps", "2", "--lr", "1e-9",
                                 "--init-from", str(one.out_dirs["eagle"]), *eagle, tag="c"))
    first, cont = _train_losses(grown.report, "eagle"), _train_losses(again.report, "eagle")
    assert abs(first[0] - cont[0]) < 1e-4 * cont[0]  # the projection starts as "the last hidden state"
    assert sum(first[-3:]) < sum(first[:3])
    loaded = load_heads(grown.out_dirs["eagle"])
    assert loaded.config.feature_layers == [1, 0] and loaded.eagle.project.weight.shape == (32, 96)
    torch.testing.assert_close(loaded.eagle.project.weight, grown.heads["eagle"].eagle.project.weight.to(loaded.eagle.project.weight.dtype))

    def err(*extra):
        return _run_error(tiny_dir, data_file, tmp_path, *extra)

    assert "EAGLE heads trained alone" in err("--heads", "hydra,eagle", "--feature-layers", "1")
    assert "hidden states 0..2" in err("--heads", "eagle", "--feature-layers", "5")


def test_answer_batch_equals_generate_per_prompt(tiny_dir):
    """Batched answering with finished rows leaving the batch gives each prompt what `generate`
    gives it alone (greedy, float32): the dropped KV rows, the left padding and the per-prompt
    limits change nothing."""
    import transformers

    # sharp attention and a short rotary period: a token's position changes what it attends to,
    # so a row carrying another row's position ids answers differently
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    cfg.initializer_range, cfg.rope_parameters = 0.6, {"rope_type": "default", "rope_theta": 4.0}
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    eos = int(model.config.eos_token_id)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 5, 1, 7, 4)]
    limits = [12, 3, 20, 7, 1, 16]
    got = T.answer_batch(model, prompts, limits, [eos], pad=eos)
    for p, lim, (ans, ended) in zip(prompts, limits, got):
        ref = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=lim, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist()
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert ans == ref and ended == (ref[-1] == eos) and 1 <= len(ans) <= lim
    # rows really end at different steps (else nothing left the batch)
    assert len({len(a) for a, _ in got}) > 2
    # sampling: seeded, reproducible, within the limits
    a = T.answer_batch(model, prompts, limits, [eos], eos, 1.0, torch.Generator().manual_seed(3))
    b = T.answer_batch(model, prompts, limits, [eos], eos, 1.0, torch.Generator().manual_seed(3))
    assert a == b and all(1 <= len(x) <= lim for (x, _), lim in zip(a, limits))
