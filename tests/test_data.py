"""Tests for entmtp.data: formats, malformed input, limits, splitting and rendering."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from entmtp import data
from entmtp.data import (
    DataError,
    Prompt,
    PromptSet,
    RowError,
    bundled_prompts,
    load_prompts,
    render_conversation,
    render_prompt,
    split_prompts,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Demands strictly alternating user/assistant turns, like Llama-2 / Mistral templates.
STRICT = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Renders the *final* assistant turn differently (like reasoning templates): not prefix-stable.
UNSTABLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def base_tokenizer():
    """A tiny byte-level BPE trained in memory: exact round trips, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, what is the answer? The answer is 42.",
                             "user assistant system: write a poem about the sea"], trainer=trainer)

    def make(template=None):
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       chat_template=template)
    return make


@pytest.fixture(scope="module")
def chat_tok(base_tokenizer):
    return base_tokenizer(CHATML)


def write(tmp_path: Path, name: str, content) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def jsonl(rows) -> str:
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def assert_one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message
    assert len(message) < 1100


def data_error(source, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load_prompts(source, **kwargs)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert_one_line(message)
    return message


# ----------------------------------------------------------------------------- row shapes

def test_sharegpt_conversations_keep_system_and_answer(tmp_path):
    rows = [{"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi?"},
        {"from": "gpt", "value": "Hello."},
        {"from": "human", "value": "Bye?"},
        {"from": "gpt", "value": "Bye."}]}]
    ps = load_prompts(write(tmp_path, "sg.jsonl", jsonl(rows)))
    (p,) = ps.prompts
    assert p.id == "c1"
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert p.has_answer and p.answer == "Bye."
    assert p.user_turns == ["Hi?", "Bye?"] and p.user_text == "Hi?\n\nBye?"
    assert p.prompt_messages[-1] == {"role": "user", "content": "Bye?"}
    assert ps.format == "jsonl" and ps.skipped == []


def test_openai_messages_with_text_parts(tmp_path):
    rows = [{"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]},
        {"role": "assistant", "content": "Done."}]},
        {"messages": [{"role": "user", "content": "plain"}]}]
    ps = load_prompts(write(tmp_path, "oa.json", json.dumps(rows)))
    first, second = ps.prompts
    assert first.messages == [{"role": "system", "content": "sys"},
                              {"role": "user", "content": "Part one. Two."},
                              {"role": "assistant", "content": "Done."}]
    assert not second.has_answer and second.answer is None and second.id == "row-2"


def test_alpaca_instruction_input_output(tmp_path):
    rows = [{"instruction": "Translate.", "input": "Hallo", "output": "Hello"},
            {"instruction": "Tell a joke.", "input": "", "output": ""}]
    a, b = load_prompts(write(tmp_path, "alpaca.json", json.dumps(rows))).prompts
    assert a.messages == [{"role": "user", "content": "Translate.\n\nHallo"},
                          {"role": "assistant", "content": "Hello"}]
    assert b.messages == [{"role": "user", "content": "Tell a joke."}] and not b.has_answer


def test_mtbench_turns_keep_category_and_question_id(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a blog.", "Rewrite it."]}]
    (p,) = load_prompts(write(tmp_path, "question.jsonl", jsonl(rows))).prompts
    assert p.id == "81" and p.category == "writing"
    assert p.messages == [{"role": "user", "content": "Write a blog."},
                          {"role": "user", "content": "Rewrite it."}]


def test_humaneval_and_gsm8k_and_generic_fields(tmp_path):
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n    ", "canonical_solution": "return 1"},
            {"question": "2+2?", "answer": "#### 4"},
            {"text": "free text"},
            {"input": "just input", "response": "r"},
            {"prompt": "p", "completion": "c", "system": "You are terse."},
            "a bare string row"]
    ps = load_prompts(write(tmp_path, "mixed.jsonl", jsonl(rows)))
    he, gsm, text, inp, comp, bare = ps.prompts
    assert he.id == "HumanEval/0" and he.messages == [{"role": "user", "content": "def f():\n    "}]
    assert gsm.user_text == "2+2?" and gsm.answer == "#### 4"
    assert text.user_text == "free text" and not text.has_answer
    assert inp.user_text == "just input" and inp.answer == "r"
    assert comp.messages[0] == {"role": "system", "content": "You are terse."} and comp.answer == "c"
    assert bare.messages == [{"role": "user", "content": "a bare string row"}]


def test_prompt_given_as_message_list(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    (p,) = load_prompts(write(tmp_path, "pl.jsonl", jsonl(rows))).prompts
    assert p.answer == "a" and p.user_text == "q"


@pytest.mark.parametrize("doc", [
    {"data": ["one", "two"]},
    {"questions": [{"question": "one"}, {"question": "two"}]},
    {"version": 3, "problems": ["one", "two"]},  # the only list in a non-row object
])
def test_json_object_containers(tmp_path, doc):
    ps = load_prompts(write(tmp_path, "c.json", json.dumps(doc)))
    assert [p.user_text for p in ps] == ["one", "two"] and ps.format == "json"


def test_json_single_row_object(tmp_path):
    doc = {"conversations": [{"from": "human", "value": "only"}]}
    ps = load_prompts(write(tmp_path, "one.json", json.dumps(doc, indent=2)))
    assert len(ps) == 1 and ps[0].user_text == "only"


def test_text_one_prompt_per_line(tmp_path):
    ps = load_prompts(write(tmp_path, "p.txt", "first\r\nsecond\n  third  \n"))
    assert [p.user_text for p in ps] == ["first", "second", "third"]
    assert ps.format == "text"
    # Single lines separated by blank lines are still one prompt per line.
    ps = load_prompts(write(tmp_path, "q.txt", "first\n\nsecond\n\n\nthird\n"))
    assert [p.user_text for p in ps] == ["first", "second", "third"]
    assert [p.id for p in ps] == ["row-1", "row-3", "row-6"]  # ids carry the line number


def test_text_blank_line_paragraphs(tmp_path):
    content = "Write a poem\nabout the sea.\n\nSummarise:\nline two\n\n\nsingle\n"
    ps = load_prompts(write(tmp_path, "p.txt", content))
    assert [p.user_text for p in ps] == ["Write a poem\nabout the sea.", "Summarise:\nline two", "single"]
    assert [p.id for p in ps] == ["row-1", "row-4", "row-8"]


def test_text_without_suffix_and_txt_with_json_like_content(tmp_path):
    assert load_prompts(b"plain prompt\nanother").format == "text"
    ps = load_prompts(write(tmp_path, "braces.txt", "{not json} but a prompt\n"))
    assert ps.format == "text" and ps[0].user_text == "{not json} but a prompt"
    assert load_prompts(b'"Quoted" opening line\nnext').format == "text"
    assert load_prompts(b'"one"\n"two"\n').format == "jsonl"
    forced = load_prompts(b'["a"]', format="text")
    assert forced[0].user_text == '["a"]'


def test_bytes_source_name_and_sha256():
    raw = jsonl([{"prompt": "x"}]).encode()
    ps = load_prompts(raw, name="upload.jsonl")
    assert isinstance(ps, PromptSet) and ps.source == "upload.jsonl"
    assert ps.sha256 == hashlib.sha256(raw).hexdigest()
    assert load_prompts(bytearray(raw)).source == "<bytes>"


def test_path_str_and_upload_object(tmp_path):
    path = write(tmp_path, "u.jsonl", jsonl(["a", "b"]))

    class Upload:  # what some web frameworks hand over: an object with the temp path
        def __init__(self, p):
            self.path = p
    assert len(load_prompts(str(path))) == 2
    assert len(load_prompts(Upload(str(path)))) == 2
    assert "pass a file path or bytes" in data_error(12345)


def test_json_named_file_holding_jsonl_and_bom(tmp_path):
    path = write(tmp_path, "mislabelled.json", b"\xef\xbb\xbf" + jsonl(["a", {"prompt": "b"}]).encode())
    ps = load_prompts(path)
    assert ps.format == "jsonl" and [p.user_text for p in ps] == ["a", "b"]


def test_duplicate_ids_made_unique(tmp_path):
    ps = load_prompts(write(tmp_path, "d.jsonl", jsonl([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])))
    assert [p.id for p in ps] == ["1", "1#2"]


def test_summary_mentions_skips(tmp_path):
    ps = load_prompts(write(tmp_path, "s.jsonl", jsonl(["ok", 5])))
    line = ps.summary()
    assert_one_line(line)
    assert "1 prompts" in line and "skipped 1 of 2 rows: line 2: " in line


def test_skipped_rows_are_counted_with_their_first_reasons(tmp_path):
    ps = load_prompts(write(tmp_path, "c.jsonl", '{"turns": 42}\n{"prompt": "what is a cat?"}\n'))
    assert [p.user_text for p in ps] == ["what is a cat?"] and ps.n_rows == 2
    assert ps.skipped_note() == "skipped 1 of 2 rows: line 1: 'turns' is a number, expected a list of strings"
    assert str(ps.skipped[0]) == "line 1: 'turns' is a number, expected a list of strings"
    many = load_prompts(write(tmp_path, "m.jsonl", jsonl([1, "ok", 2, {"x": 1}, [3], "fine", None])))
    note = many.skipped_note(max_reasons=2)
    assert_one_line(note)
    assert note.startswith("skipped 5 of 7 rows: line 1: ") and "; line 3: " in note and note.endswith("… 3 more")
    assert "line 4" not in note
    listed = load_prompts(write(tmp_path, "l.json", json.dumps(["ok", 7])))
    assert listed.skipped_note().startswith("skipped 1 of 2 rows: row 2: ")  # an element of a JSON list
    clean = load_prompts(write(tmp_path, "g.jsonl", jsonl(["a", "b"])))
    assert clean.skipped_note() == "" and clean.summary() == f"2 prompts from {clean.source} (jsonl, sha256 {clean.sha256[:12]})"


# ----------------------------------------------------------------------------- malformed input

def test_truncated_jsonl_keeps_good_lines(tmp_path):
    content = jsonl([{"prompt": "a"}, {"prompt": "b"}]) + '{"prompt": "c", "ans'
    ps = load_prompts(write(tmp_path, "t.jsonl", content))
    assert [p.user_text for p in ps] == ["a", "b"]
    assert len(ps.skipped) == 1 and ps.skipped[0].row == 3
    assert "invalid JSON" in ps.skipped[0].reason and "truncated" in ps.skipped[0].reason


def test_bad_first_jsonl_line_still_reads_as_jsonl(tmp_path):
    content = '{"prompt": "broken\n' + jsonl([{"prompt": "fine"}])
    ps = load_prompts(write(tmp_path, "x.jsonl", content))
    assert [p.user_text for p in ps] == ["fine"] and ps.skipped[0].row == 1


def test_truncated_json_array_reports_line_and_column(tmp_path):
    content = json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2)[:-12]
    message = data_error(write(tmp_path, "t.json", content))
    assert "invalid JSON at line" in message and "column" in message and "truncated" in message
    assert "t.json" in message


def test_truncated_pretty_json_object_is_a_json_error(tmp_path):
    content = json.dumps({"data": [{"prompt": "a"}, {"prompt": "b"}]}, indent=2)[:-20]
    assert "invalid JSON at line" in data_error(write(tmp_path, "t.json", content))


def test_wrong_types_are_skipped_with_reasons(tmp_path):
    rows = [5, ["list"], {"prompt": 7}, {"messages": "nope"},
            {"messages": [{"role": "tool", "content": "x"}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            {"conversations": [{"from": "gpt", "value": "no user"}]},
            {"turns": []}, {"turns": ["ok", 3]}, {"prompt": "   "}, {"foo": 1, "bar": 2},
            {"prompt": "good", "answer": 42},
            {"prompt": "the one good row"}]
    ps = load_prompts(write(tmp_path, "w.json", json.dumps(rows)))
    assert [p.user_text for p in ps] == ["the one good row"] and ps[0].id == "row-13"
    reasons = {e.row: e.reason for e in ps.skipped}
    assert sorted(reasons) == list(range(1, 13))
    assert "a number" in reasons[1] and "expected an object or a string" in reasons[1]
    assert "a list" in reasons[2]
    assert "'prompt' is a number" in reasons[3]
    assert "'messages' is a string" in reasons[4]
    assert "unsupported role 'tool'" in reasons[5]
    assert "non-text content (image_url)" in reasons[6]
    assert "no user message" in reasons[7]
    assert "'turns' is empty" in reasons[8]
    assert "turn 2 is a number" in reasons[9]
    assert "'prompt' is empty" in reasons[10]
    assert "no prompt found" in reasons[11] and "bar, foo" in reasons[11]
    assert "'answer' is a number" in reasons[12]
    for error in ps.skipped:
        assert isinstance(error, RowError)
        assert_one_line(str(error))


@pytest.mark.parametrize("content", [b"", b"   \n\n\t\n", b"\xef\xbb\xbf"])
def test_empty_file(tmp_path, content):
    assert "is empty" in data_error(write(tmp_path, "e.jsonl", content))


def test_binary_nul_and_invalid_utf8(tmp_path):
    assert "NUL bytes" in data_error(write(tmp_path, "b.bin", b"\x7fELF\x00\x01\x02garbage"))
    assert "UTF-16" in data_error("x".encode("utf-16"))
    message = data_error(write(tmp_path, "l.txt", b"caf\xe9 au lait\n"))
    assert "not UTF-8" in message and "0xe9" in message and "offset 3" in message


def test_no_usable_row_lists_reasons(tmp_path):
    message = data_error(write(tmp_path, "n.jsonl", jsonl([1, 2, {"x": 1}])))
    assert "no usable prompt" in message and "3 rows skipped" in message
    assert "line 1:" in message and "line 3: no prompt found" in message


def test_enormous_line(tmp_path):
    huge = "x" * 300_000
    ps = load_prompts(write(tmp_path, "h.txt", f"short\n{huge}\nalso short\n"), max_chars_per_prompt=100_000)
    assert [p.user_text for p in ps] == ["short", "also short"]
    assert ps.skipped[0].row == 2 and "300,000 characters" in ps.skipped[0].reason
    # An enormous unparsable JSONL line: reported briefly, without echoing its content.
    garbage = '{"prompt": "' + "y" * 500_000 + '" oops}'
    ps = load_prompts(write(tmp_path, "h.jsonl", jsonl(["ok"]) + garbage + "\n"))
    assert len(ps) == 1 and ps.skipped[0].row == 2 and len(ps.skipped[0].reason) < 200


def test_pathological_json():
    assert "nested too deeply" in data_error(b"[" * 200_000)
    assert "invalid JSON" in data_error(b"[" + b"1" * 10_000 + b"]")  # int over the digit limit
    assert "no usable prompt" in data_error(b"[]")
    assert "expected a JSON list of rows or an object, got a number" in data_error(b"42", format="json")
    ps = load_prompts(b'["a list line"]\n"ok"\n', format="jsonl")
    assert [p.user_text for p in ps] == ["ok"] and "a list" in ps.skipped[0].reason


def test_missing_file_and_directory(tmp_path):
    assert "file not found" in data_error(tmp_path / "nope.jsonl")
    assert "is a directory" in data_error(tmp_path)


def test_unknown_format_argument():
    assert "unknown format" in data_error(b"x", format="csv")


# ----------------------------------------------------------------------------- limits

def test_max_bytes(tmp_path):
    path = write(tmp_path, "big.txt", "line\n" * 1000)
    message = data_error(path, max_bytes=1000)
    assert "over the limit" in message and "max_bytes" in message
    assert "max_bytes" in data_error(b"x" * 2000, max_bytes=1000)
    assert len(load_prompts(path, max_bytes=5000)) == 1000


def test_max_rows(tmp_path):
    path = write(tmp_path, "rows.jsonl", jsonl([f"p{i}" for i in range(11)]))
    message = data_error(path, max_rows=10)
    assert "11 rows" in message and "max_rows" in message
    assert len(load_prompts(path, max_rows=11)) == 11
    assert "max_rows" in data_error(json.dumps(["a"] * 5).encode(), max_rows=4)


def test_max_chars_counts_all_messages():
    raw = jsonl([{"prompt": "a" * 60, "answer": "b" * 60}, {"prompt": "short"}]).encode()
    ps = load_prompts(raw, max_chars_per_prompt=100)
    assert [p.user_text for p in ps] == ["short"]
    assert "120 characters" in ps.skipped[0].reason and "max_chars_per_prompt" in ps.skipped[0].reason


# ----------------------------------------------------------------------------- split

def _prompts(n: int) -> list[Prompt]:
    return [Prompt.from_text(f"question number {i}", id=f"q{i}") for i in range(n)]


def test_split_deterministic_disjoint_and_order_independent():
    prompts = _prompts(200)
    cal, held = split_prompts(prompts, 0.25, seed=7)
    assert (cal, held) == split_prompts(prompts, 0.25, seed=7)
    ids_cal, ids_held = {p.id for p in cal}, {p.id for p in held}
    assert not ids_cal & ids_held and len(ids_cal | ids_held) == 200
    assert 25 <= len(held) <= 80  # ~50 expected
    shuffled = prompts[:]
    random.Random(1).shuffle(shuffled)
    cal2, held2 = split_prompts(shuffled, 0.25, seed=7)
    assert {p.id for p in held2} == ids_held
    assert [p.id for p in held] == [p.id for p in prompts if p.id in ids_held]  # input order kept
    assert {p.id for p in split_prompts(prompts, 0.25, seed=8)[1]} != ids_held


def test_split_stable_when_appending_and_duplicates_together():
    prompts = _prompts(100)
    _, held = split_prompts(prompts, 0.3, seed=0)
    _, held_more = split_prompts(prompts + _prompts(150)[100:], 0.3, seed=0)
    assert {p.id for p in held} == {p.id for p in held_more if int(p.id[1:]) < 100}
    dupes = [Prompt(id=f"d{i}", messages=[{"role": "user", "content": "same"},
                                          {"role": "assistant", "content": f"answer {i}"}])
             for i in range(5)]
    for seed in range(10):
        cal, held = split_prompts(dupes + _prompts(20), 0.5, seed)
        dup_sides = {any(p.id == d.id for p in held) for d in dupes}
        assert len(dup_sides) == 1  # all duplicates on one side, even with different answers


def test_split_edges():
    prompts = _prompts(10)
    assert split_prompts(prompts, 0.0, 1) == (prompts, [])
    assert split_prompts(prompts, 1.0, 1) == ([], prompts)
    cal, held = split_prompts(prompts[:2], 0.01, 3)
    assert len(cal) == 1 and len(held) == 1  # a tiny fraction still leaves a non-empty side
    assert split_prompts([], 0.5, 0) == ([], [])
    for bad in (-0.1, 1.5, "0.2", True):
        with pytest.raises(DataError):
            split_prompts(prompts, bad, 0)


# ----------------------------------------------------------------------------- rendering

def test_render_prompt_with_chat_template(chat_tok):
    p = Prompt(id="x", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "hello world"},
                                 {"role": "assistant", "content": "The answer is 42."}])
    ids = render_prompt(p, chat_tok)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert chat_tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                    "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    full = render_prompt(p, chat_tok, add_generation_prompt=False)
    assert chat_tok.decode(full).endswith("<|im_start|>assistant\nThe answer is 42.<|im_end|>\n")


def test_render_conversation_masks_answers(chat_tok):
    p = Prompt(id="x", messages=[{"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": "world"},
                                 {"role": "user", "content": "what is the answer?"},
                                 {"role": "assistant", "content": "The answer is 42."}])
    ids, mask = render_conversation(p, chat_tok)
    assert len(ids) == len(mask) and all(isinstance(m, bool) for m in mask)
    assert ids == render_prompt(p, chat_tok, add_generation_prompt=False)
    prompt_ids = render_prompt(p, chat_tok)
    assert ids[:len(prompt_ids)] == prompt_ids and not mask[len(prompt_ids) - 1]
    answer_text = chat_tok.decode([t for t, m in zip(ids, mask) if m])
    assert answer_text == "world<|im_end|>\nThe answer is 42.<|im_end|>\n"
    assert chat_tok.decode(ids[len(prompt_ids):]) == "The answer is 42.<|im_end|>\n"


def test_render_conversation_without_answer_has_empty_mask(chat_tok):
    ids, mask = render_conversation(Prompt.from_text("hello"), chat_tok)
    assert ids and not any(mask)


def test_render_unstable_template_falls_back_to_locating_answers(base_tokenizer):
    tok = base_tokenizer(UNSTABLE)
    p = Prompt(id="x", messages=[{"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": "world"},
                                 {"role": "user", "content": "again"},
                                 {"role": "assistant", "content": "the sea"}])
    ids, mask = render_conversation(p, tok)
    assert "<think></think>the sea" in tok.decode(ids)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "worldthe sea"


def test_strict_template_merges_successive_user_turns(base_tokenizer):
    tok = base_tokenizer(STRICT)
    p = Prompt(id="mt", messages=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert tok.decode(render_prompt(p, tok)) == "<|im_start|>user\none\n\ntwo<|im_end|>\n<|im_start|>assistant\n"
    bad = Prompt(id="bad", messages=[{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}])
    with pytest.raises(DataError) as info:
        render_prompt(bad, tok)
    assert_one_line(str(info.value))
    assert "bad" in str(info.value) and "roles must alternate" in str(info.value)


def test_render_without_chat_template(base_tokenizer):
    tok = base_tokenizer(None)
    p = Prompt(id="x", messages=[{"role": "user", "content": "hello world"},
                                 {"role": "assistant", "content": "42"}])
    ids = render_prompt(p, tok)
    assert tok.decode(ids) == "hello world"
    full, mask = render_conversation(p, tok)
    assert full[:len(ids)] == ids and not any(mask[:len(ids)])
    assert full[-1] == tok.eos_token_id and mask[-1]
    assert tok.decode([t for t, m in zip(full, mask) if m]) == "\n\n42<|endoftext|>"


# ----------------------------------------------------------------------------- bundled / misc

def test_bundled_prompts(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_PROMPTS_DIR", tmp_path / "missing")
    with pytest.raises(DataError, match="none are installed"):
        bundled_prompts("mtbench")
    monkeypatch.setattr(data, "_PROMPTS_DIR", tmp_path)
    write(tmp_path, "mtbench.jsonl", jsonl(["x"]))
    write(tmp_path, "short.txt", "y\n")
    assert bundled_prompts("mtbench") == tmp_path / "mtbench.jsonl"
    assert bundled_prompts("short") == tmp_path / "short.txt"
    for name in ("nope", "../mtbench", "/etc/passwd"):
        with pytest.raises(DataError) as info:
            bundled_prompts(name)
        assert "available: mtbench, short" in str(info.value)


def test_prompt_from_text_and_helpers():
    p = Prompt.from_text("hi", id="a", category="chat")
    assert (p.id, p.category, p.has_answer, p.num_chars) == ("a", "chat", False, 2)
    with pytest.raises(DataError):
        Prompt.from_text("   ")


# ----------------------------------------------------------------------------- commands report skipped rows

BAD_THEN_GOOD = '{"turns": 42}\n{"prompt": "what is the capital of france?"}\n'
SKIPPED = "skipped 1 of 2 rows: line 1: 'turns' is a number, expected a list of strings"


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory):
    """A tiny saved base model with random Hydra heads, and calibration files with a bad row."""
    from conftest import random_heads, save_tiny_base
    from entmtp.checkpoints import save_heads

    d = tmp_path_factory.mktemp("lab")
    model, _ = save_tiny_base(d / "base")
    save_heads(random_heads(model, "hydra", num_heads=3, seed=2), d / "hydra")
    (d / "calib.jsonl").write_text(BAD_THEN_GOOD)
    good = ["hello world", "the cat sat on the mat", "one two three four", "paris is the capital", "how are you today?"]
    (d / "more.jsonl").write_text('{"turns": 42}\n' + jsonl([{"prompt": t, "answer": "yes it is"} for t in good]))
    return d


def run_cli(capsys, *argv):
    from entmtp import cli

    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_score_says_which_row_it_skipped_and_scores_the_good_one(tiny_lab, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, "score", "--base", tiny_lab / "base", "--heads", tiny_lab / "hydra", "--tree", "chain_2",
                             "--data", tiny_lab / "calib.jsonl", "--max-new-tokens", 6, "--union-nodes", 8,
                             "--latency-repeats", 1, "--no-progress", "--json")
    assert code == 0, err
    assert SKIPPED in err
    assert json.loads(out)["n_prompts"] == 1  # stdout stays JSON


def test_search_says_which_row_it_skipped(tiny_lab, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "search", "--base", tiny_lab / "base", "--heads", tiny_lab / "hydra", "--data",
                           tiny_lab / "more.jsonl", "--budgets", "2", "--out", tmp_path / "out", "--max-new-tokens", 4,
                           "--union-nodes", 8, "--latency-repeats", 1, "--no-progress", "--eval-prompts", 1)
    assert code == 0, err
    assert "skipped 1 of 6 rows: line 1: 'turns' is a number" in err


def test_train_says_which_row_it_skipped(tiny_lab, tmp_path, capsys):
    """The data line comes before the model loads: a directory without a model stops train there."""
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, "train", "--data", tiny_lab / "more.jsonl", "--model", tmp_path / "empty", "--cpu",
                             "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert "skipped 1 of 6 rows: line 1: 'turns' is a number" in out + err
    assert code == 2 and "Traceback" not in err
