"""The bundled prompt files and the training-prompt builder (scripts/build_train_prompts.py)."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from entmtp.data import bundled_prompts, load_prompts

ROOT = Path(__file__).resolve().parents[1]
BENCH_CATEGORIES = {"conversation", "code", "math", "summarization", "qa", "translation"}


def load_builder():
    spec = importlib.util.spec_from_file_location("build_train_prompts",
                                                  ROOT / "scripts" / "build_train_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder():
    return load_builder()


def test_bench_prompts():
    ps = load_prompts(bundled_prompts("bench"))
    assert ps.skipped == [] and len(ps) == 60
    assert Counter(p.category for p in ps) == {c: 10 for c in BENCH_CATEGORIES}
    assert len({p.id for p in ps}) == 60
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in ps)
    assert len({p.user_text for p in ps}) == 60
    for p in ps:
        if p.category == "summarization":  # instruction + a passage of 80-150 words
            passage = max(p.user_text.split("\n\n"), key=len)
            assert 80 <= len(passage.split()) <= 150, p.id


def test_calibration_example_and_chat_examples(builder):
    calib = load_prompts(bundled_prompts("calib_example"))
    assert calib.skipped == [] and 35 <= len(calib) <= 45
    assert all(p.user_turns and p.category for p in calib)
    bench = builder.HeldOutFilter(p.user_text for p in load_prompts(bundled_prompts("bench")))
    assert not any(bench.matches(p.user_text) for p in calib)  # distinct from the benchmark

    chat = load_prompts(bundled_prompts("chat_examples"))
    assert chat.skipped == [] and 6 <= len(chat) <= 10
    assert all(len(p.messages) == 1 for p in chat)


def test_held_out_filter(builder):
    bench = load_prompts(bundled_prompts("bench"))
    bench_text = next(p.user_text for p in bench if p.category == "summarization")
    held_out = builder.load_held_out(builder.HELD_OUT_FILES)
    passage_words = max(bench_text.split("\n\n"), key=len).split()
    candidates = [
        ("qa", "How do clouds form?"),
        ("summarization", bench_text),                                   # verbatim
        ("summarization", "  " + bench_text.upper().replace(",", " ;")),  # same after normalizing
        ("summarization", "Shorten this: " + " ".join(passage_words[10:30])),  # shares 8-word runs
        ("qa", "why is the sky BLUE"),                                   # short bench prompt
        ("qa", "Why is the sea salty?"),
    ]
    kept = builder.drop_held_out(candidates, held_out)
    assert kept == [candidates[0], candidates[-1]]


def test_build_train_prompts(builder, tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    assert builder.main(["--out", str(out), "--n", "300", "--seed", "3"]) == 0
    assert "wrote 300 prompts" in capsys.readouterr().out

    ps = load_prompts(out)
    assert ps.skipped == [] and len(ps) == 300
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(r) == {"id", "category", "messages"} for r in rows)
    assert len({p.id for p in ps}) == 300
    assert len({builder.normalize(p.user_text) for p in ps}) == 300
    assert all(p.category and [m["role"] for m in p.messages] == ["user"] for p in ps)

    held_out = builder.load_held_out(builder.HELD_OUT_FILES)
    assert not any(held_out.matches(p.user_text) for p in ps)

    again = tmp_path / "again.jsonl"
    builder.main(["--out", str(again), "--n", "300", "--seed", "3"])
    assert again.read_bytes() == out.read_bytes()  # deterministic for a seed

    # --only-ids keeps exactly the listed rows, in order; ids the build does not have are an error
    keep = [rows[i]["id"] for i in (0, 7, 299)]
    (tmp_path / "ids.txt").write_text("\n".join(keep) + "\n")
    subset = tmp_path / "subset.jsonl"
    assert builder.main(["--out", str(subset), "--n", "300", "--seed", "3", "--only-ids", str(tmp_path / "ids.txt")]) == 0
    assert [json.loads(line) for line in subset.read_text().splitlines()] == [rows[0], rows[7], rows[299]]
    (tmp_path / "ids.txt").write_text("generated-99999\n")
    with pytest.raises(SystemExit) as e:
        builder.main(["--out", str(subset), "--n", "300", "--seed", "3", "--only-ids", str(tmp_path / "ids.txt")])
    assert e.value.code == 2 and "not among the 300 built prompts" in capsys.readouterr().err

    # --id-prefix renames every id and changes nothing else (files of two seeds can be concatenated)
    prefixed = tmp_path / "prefixed.jsonl"
    assert builder.main(["--out", str(prefixed), "--n", "300", "--seed", "3", "--id-prefix", "s3-"]) == 0
    renamed = [json.loads(line) for line in prefixed.read_text().splitlines()]
    assert [r["id"] for r in renamed] == ["s3-" + r["id"] for r in rows]
    assert [{**r, "id": None} for r in renamed] == [{**r, "id": None} for r in rows]

    # --dedupe-against drops exact (normalised) repeats of an earlier training file and keeps the rest
    # in order; --max-per-category caps each category in file order
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(json.dumps({**r, "messages": [{"role": "user", "content": r["messages"][0]["content"].upper() + " !"}]}) + "\n"
                               for r in rows[:100]))
    deduped = tmp_path / "deduped.jsonl"
    assert builder.main(["--out", str(deduped), "--n", "300", "--seed", "3", "--dedupe-against", str(earlier)]) == 0
    assert [json.loads(line) for line in deduped.read_text().splitlines()] == rows[100:]
    capped = tmp_path / "capped.jsonl"
    assert builder.main(["--out", str(capped), "--n", "300", "--seed", "3", "--max-per-category", "5"]) == 0
    got = [json.loads(line) for line in capped.read_text().splitlines()]
    cats = {r["category"] for r in rows}
    assert len(got) == 5 * len(cats)
    assert got == [r for r in rows if [x["category"] for x in rows[: rows.index(r) + 1]].count(r["category"]) <= 5]


def test_generated_source_alone(builder, monkeypatch):
    """Without the optional packages the generator still fills --n."""
    monkeypatch.setattr(builder, "chatterbot_prompts", lambda: [])
    monkeypatch.setattr(builder, "chitchat_prompts", lambda: [])
    rows, counts = builder.build(500, 0, builder.load_held_out(builder.HELD_OUT_FILES))
    assert counts == {"generated": 500}
    assert len({r["messages"][0]["content"] for r in rows}) == 500
    assert len({r["category"] for r in rows}) >= 8


def load_chat_builder():
    spec = importlib.util.spec_from_file_location("build_chat_prompts", ROOT / "scripts" / "build_chat_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chat_builder():
    module = load_chat_builder()
    if not module.chitchat_conversations() or not module.chatterbot_conversations():
        pytest.skip("chitchat-dataset / chatterbot-corpus not installed (requirements-dev.txt)")
    return module


def roles_alternate_to_a_user_turn(messages) -> bool:
    roles = [m["role"] for m in messages]
    return roles[-1] == "user" and all(a != b for a, b in zip(roles, roles[1:]))


def test_heldout_chat_set_is_rebuilt_exactly(chat_builder, tmp_path):
    committed = ROOT / "entmtp" / "prompts" / "heldout_chat.jsonl"
    out = tmp_path / "heldout.jsonl"
    assert chat_builder.main(["heldout", "--out", str(out)]) == 0
    assert out.read_bytes() == committed.read_bytes()
    ps = load_prompts(committed)
    assert ps.skipped == [] and len(ps) == 56
    rows = [json.loads(line) for line in committed.read_text(encoding="utf-8").splitlines()]
    assert Counter(r["source"] for r in rows) == {"written": 39, "chitchat": 8, "chatterbot": 9}
    assert len({json.dumps(r["messages"]) for r in rows}) == 56
    assert sum(len(r["messages"]) > 1 for r in rows) >= 4  # multi-turn context is part of what is measured
    assert sum(r["category"].startswith("non-english") for r in rows) >= 5
    assert all(roles_alternate_to_a_user_turn(r["messages"]) for r in rows)


def test_chat_training_prompts_come_only_from_training_conversations(chat_builder, tmp_path):
    out = tmp_path / "train.jsonl"
    assert chat_builder.main(["train", "--out", str(out), "--n", "400", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 400 and all(roles_alternate_to_a_user_turn(r["messages"]) for r in rows)
    assert {r["source"] for r in rows} == {"chitchat", "chatterbot", "generated"}
    # every chitchat prompt is a run of turns of a conversation outside the held-out bucket
    runs_by_bucket: dict[bool, set] = {True: set(), False: set()}
    for key, turns in chat_builder.chitchat_conversations():
        held = chat_builder.bucket(key) == 0
        for i in range(len(turns)):
            for j in range(i + 1, min(i + 5, len(turns)) + 1):
                runs_by_bucket[held].add(tuple(turns[i:j]))
    chit = [tuple(m["content"] for m in r["messages"]) for r in rows if r["source"] == "chitchat"]
    assert len(chit) == 140
    assert all(c in runs_by_bucket[False] for c in chit)
    # and none of the evaluation set is trained on
    heldout = {json.dumps(r["messages"]) for r in map(json.loads, (ROOT / "entmtp" / "prompts" / "heldout_chat.jsonl")
                                                       .read_text(encoding="utf-8").splitlines())}
    assert not heldout & {json.dumps(r["messages"]) for r in rows}
