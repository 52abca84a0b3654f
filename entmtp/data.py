"""Prompt / calibration / training-data loading: the one loader every command and the app use.

Entry points
------------
``load_prompts(source)``        read a file (or raw ``bytes``) into a :class:`PromptSet`.
``render_prompt(p, tok)``       token ids of a prompt, ready for generation.
``render_conversation(p, tok)`` token ids of prompt + answer and a mask of the answer tokens.
``split_prompts(ps, f, seed)``  deterministic calibration / held-out split.
``bundled_prompts(name)``       path of a prompt file shipped in ``entmtp/prompts/``.

File formats (detected from the content; ``format=`` forces one)
----------------------------------------------------------------
* **Plain text** (``.txt``/``.text``/``.md`` files, or content that is not JSON / JSONL).
  Rule: split the file into *blocks* at blank lines.  If there are two or more blocks and at
  least one of them spans several lines, every block is one prompt (paragraph mode, newlines
  inside a block are kept).  Otherwise every non-blank line is one prompt.
  So "one prompt per line" files work with or without blank lines between the lines, and
  multi-line prompts just need a blank line between them.
* **JSON**: a list of rows; or an object holding the list under ``data``, ``rows``,
  ``questions``, ``prompts``, ``examples``, ``items``, ``instances``, ``records``,
  ``samples``, ``test`` or ``train``; or an object that is not a row and holds exactly one
  list; otherwise a single object / string is one row.
* **JSONL** (``.jsonl``/``.ndjson`` files, or detected): one row per line; blank lines are
  ignored.  A document starting with ``{`` or ``"`` that does not parse as a whole is read
  as JSONL when some unindented line parses on its own (so a truncated last line only loses
  that row); otherwise a ``{`` document gets the JSON error (with line and column) and a
  ``"`` one is read as plain text.

Row shapes (first match wins)
-----------------------------
* a bare string: one user message;
* ShareGPT ``conversations``: ``from``/``value`` (``human``/``user``, ``gpt``/``assistant``,
  ``system``; ``role``/``content`` also accepted);
* OpenAI ``messages``: ``role``/``content``; content may be a list of ``{"type": "text",
  "text": ...}`` parts (other part types are rejected, not silently dropped);
* MT-bench / Spec-Bench ``turns``: a list of strings, taken as successive user turns;
* Alpaca ``instruction`` (+ ``input``, joined by a blank line) (+ ``output``);
* ``prompt`` (HumanEval, may also be a message list), ``question`` (GSM8K), ``text``, ``input``.

An assistant answer is kept when present (ShareGPT ``gpt`` turns, ``assistant`` messages,
``output``, ``answer``, ``response``, ``completion``) since head training can use it.
Flat rows may also carry a ``system`` string.  ``id`` / ``question_id`` / ``task_id`` /
``idx`` become :attr:`Prompt.id` (default ``row-N``; duplicates get ``#N`` appended) and
``category`` becomes :attr:`Prompt.category`.

Errors
------
Problems with single rows are collected in :attr:`PromptSet.skipped` as :class:`RowError`
(1-based *line* number for JSONL and text, 1-based *element* number for JSON lists) and the
row is skipped, never in silence: :meth:`PromptSet.skipped_note` is the line ("skipped 1 of 3
rows: line 2: …") that ``score``, ``search``, ``train`` and the app show.  Problems with the
whole input (missing, empty, binary, not UTF-8, unparsable JSON, over ``max_bytes`` /
``max_rows``, no usable row) raise :class:`DataError`, a ``ValueError`` whose message is one
human-readable line.  Nothing else is raised for bad data.

Rendering and splitting
-----------------------
Rendering uses the tokenizer's chat template; a template that rejects successive same-role
turns (MT-bench ``turns``) is retried with those turns joined by a blank line.  Without a
template the contents are joined by blank lines.  The split hashes (seed, prompt messages), so
it is independent of order, keeps duplicates together and is stable when rows are appended.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from .errors import one_line

__all__ = [
    "DataError",
    "Prompt",
    "PromptSet",
    "RowError",
    "bundled_prompts",
    "load_prompts",
    "render_conversation",
    "render_prompt",
    "split_prompts",
]

Format = Literal["auto", "json", "jsonl", "text"]
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_BYTES = 20_000_000
DEFAULT_MAX_ROWS = 100_000
DEFAULT_MAX_CHARS_PER_PROMPT = 200_000  # ~50k tokens: room for long-context prompts

_PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
_TEXT_SUFFIXES = (".txt", ".text", ".md")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_CONTAINER_KEYS = ("data", "rows", "questions", "prompts", "examples", "items",
                   "instances", "records", "samples", "test", "train")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                   "model": "assistant", "system": "system"}
_OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
                 "developer": "system", "model": "assistant"}
_ID_KEYS = ("id", "question_id", "task_id", "idx")
_PROMPT_KEYS = ("prompt", "question", "text", "input")
_ANSWER_KEYS = ("output", "answer", "response", "completion")
_ROW_KEYS = ("conversations", "conversation", "messages", "turns", "instruction") + _PROMPT_KEYS


class DataError(ValueError):
    """Unusable input as a whole; the message is a single human-readable line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message, 1000))


@dataclass(frozen=True)
class RowError:
    """A skipped row: ``row`` is 1-based; ``unit`` says what it counts: ``"line"`` (JSONL, text)
    or ``"row"`` (the element of a JSON list)."""

    row: int
    reason: str
    unit: str = "row"

    def __str__(self) -> str:
        return f"{self.unit} {self.row}: {self.reason}"


@dataclass(frozen=True)
class Prompt:
    """One prompt as chat messages (``role`` in system/user/assistant, ``content`` str).

    A final assistant message is the given answer (see :attr:`has_answer`).  ``messages`` is a
    list for convenience, so instances are not hashable; do not mutate it.
    """

    id: str
    messages: list[dict]
    category: str | None = None

    @classmethod
    def from_text(cls, text: str, id: str = "prompt", category: str | None = None) -> "Prompt":
        """A single user-message prompt (e.g. typed into the app)."""
        if not isinstance(text, str) or not text.strip():
            raise DataError("the prompt is empty")
        return cls(id=id, messages=[{"role": "user", "content": text}], category=category)

    @property
    def has_answer(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "assistant"

    @property
    def answer(self) -> str | None:
        """The final assistant message, if any."""
        return self.messages[-1]["content"] if self.has_answer else None

    @property
    def prompt_messages(self) -> list[dict]:
        """The messages without the final assistant answer (what generation starts from)."""
        return self.messages[:-1] if self.has_answer else list(self.messages)

    @property
    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    @property
    def user_text(self) -> str:
        """All user turns joined by a blank line."""
        return "\n\n".join(self.user_turns)

    @property
    def num_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


@dataclass(frozen=True)
class PromptSet:
    """Loaded prompts, the rows skipped and why, and provenance (source name, sha256 of bytes)."""

    prompts: list[Prompt]
    skipped: list[RowError]
    source: str
    sha256: str
    format: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    @property
    def n_rows(self) -> int:
        """Rows read: the prompts and the skipped rows."""
        return len(self.prompts) + len(self.skipped)

    def skipped_note(self, max_reasons: int = 3) -> str:
        """``"skipped 1 of 2 rows: line 1: …"`` with the first reasons, or ``""`` when no row was
        skipped: the line every command and the app show beside what they did with the rest."""
        if not self.skipped:
            return ""
        return f"skipped {len(self.skipped)} of {self.n_rows} rows: " + _describe_errors(self.skipped, max_reasons)

    def summary(self, max_reasons: int = 3) -> str:
        """One line for logs and reports (with `skipped_note` when rows were skipped)."""
        text = f"{len(self.prompts)} prompts from {self.source} ({self.format}, sha256 {self.sha256[:12]})"
        if self.skipped:
            text += "; " + self.skipped_note(max_reasons)
        return text


# ----------------------------------------------------------------------------- helpers

def _snippet(value: Any, limit: int = 40) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(one_line(text, limit))


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _describe_errors(errors: Sequence[RowError], limit: int) -> str:
    shown = "; ".join(str(e) for e in errors[:limit])
    return shown + (f"; … {len(errors) - limit} more" if len(errors) > limit else "")


def _human_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n:,} bytes"


class _RowProblem(Exception):
    """Internal: why one row is unusable (becomes a RowError)."""


# ----------------------------------------------------------------------------- reading bytes

def _resolve_source(source: Any, name: str | None) -> tuple[bytes | None, Path | None, str]:
    """Return (raw bytes or None, path or None, display name) for the accepted source types."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), None, name or "<bytes>"
    # Upload objects (e.g. older Gradio file wrappers) carry the temp file path.
    if not isinstance(source, (str, os.PathLike)):
        for attr in ("path", "name"):
            candidate = getattr(source, attr, None)
            if isinstance(candidate, (str, os.PathLike)):
                source = candidate
                break
        else:
            raise DataError(f"cannot read prompts from {type(source).__name__}: "
                            "pass a file path or bytes")
    path = Path(source)
    return None, path, name or str(path)


def _read_limited(path: Path, max_bytes: int, display: str) -> bytes:
    try:
        if not path.exists():
            raise DataError(f"{display}: file not found")
        if path.is_dir():
            raise DataError(f"{display}: is a directory, expected a prompt file")
        size = path.stat().st_size
        if size > max_bytes:
            raise DataError(f"{display} is {_human_bytes(size)}, over the limit of "
                            f"{_human_bytes(max_bytes)} (max_bytes)")
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)  # +1: catches files that grow or lie about their size
    except OSError as exc:
        raise DataError(f"{display}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise DataError(f"{display} is over the limit of {_human_bytes(max_bytes)} (max_bytes)")
    return raw


def _decode(raw: bytes, display: str) -> str:
    if b"\x00" in raw:
        raise DataError(f"{display} contains NUL bytes: it looks like a binary file "
                        "(or UTF-16 text; save it as UTF-8)")
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate a BOM written by Windows editors
    except UnicodeDecodeError as exc:
        raise DataError(f"{display} is not UTF-8 text (invalid byte 0x{raw[exc.start]:02x} at "
                        f"offset {exc.start}); is it a binary file?") from None


# ----------------------------------------------------------------------------- parsing

def _detect_format(text: str, path: Path | None) -> str:
    suffix = path.suffix.lower() if path is not None else ""
    if suffix in _TEXT_SUFFIXES:
        return "text"
    if suffix in _JSONL_SUFFIXES:  # even a one-line file, or lines that are not objects
        return "jsonl"
    first = text.lstrip()[:1]
    if first == "[":
        return "json"
    if first in ("{", '"'):
        try:
            json.loads(text)
            return "json"
        except (ValueError, RecursionError):
            pass
        if _looks_like_jsonl(text):
            return "jsonl"
        # A broken '{' document is a JSON error worth showing; a '"' start is likely prose.
        return "json" if first == "{" else "text"
    return "text"


def _looks_like_jsonl(text: str) -> bool:
    """True if some unindented line is a JSON object/string by itself (pretty JSON is indented)."""
    for line in text.split("\n"):
        if line[:1] in ("{", '"'):
            try:
                if isinstance(json.loads(line), (dict, str)):
                    return True
            except (ValueError, RecursionError):
                continue
    return False


def _looks_truncated(exc: json.JSONDecodeError, text: str) -> bool:
    """The parser ran out of input (error at the end, or a string never closed)."""
    return exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")


def _json_rows(text: str, display: str) -> list[tuple[int, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (is the file truncated?)" if _looks_truncated(exc, text) else ""
        raise DataError(f"{display}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                        f"{exc.msg}{hint}") from None
    except RecursionError:
        raise DataError(f"{display}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal with too many digits
        raise DataError(f"{display}: invalid JSON: {exc}") from None
    rows = _rows_of_document(doc, display)
    return list(enumerate(rows, start=1))


def _rows_of_document(doc: Any, display: str) -> list[Any]:
    if isinstance(doc, list):
        return doc
    if isinstance(doc, str):
        return [doc]
    if not isinstance(doc, dict):
        raise DataError(f"{display}: expected a JSON list of rows or an object, got {_type_name(doc)}")
    for key in _CONTAINER_KEYS:
        if isinstance(doc.get(key), list):
            return doc[key]
    # An object that is not itself a row and holds exactly one list: that list is the rows.
    if not any(key in doc for key in _ROW_KEYS):
        lists = [v for v in doc.values() if isinstance(v, list)]
        if len(lists) == 1:
            return lists[0]
    return [doc]


def _jsonl_rows(text: str) -> tuple[list[tuple[int, Any]], list[RowError]]:
    rows: list[tuple[int, Any]] = []
    errors: list[RowError] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            truncated = " (truncated line?)" if _looks_truncated(exc, line) else ""
            errors.append(RowError(number, f"invalid JSON at column {exc.colno}: {exc.msg}{truncated}", "line"))
        except RecursionError:
            errors.append(RowError(number, "invalid JSON: nested too deeply", "line"))
        except ValueError as exc:
            errors.append(RowError(number, f"invalid JSON: {one_line(str(exc), 120)}", "line"))
    return rows, errors


def _text_rows(text: str) -> list[tuple[int, Any]]:
    """Apply the plain-text rule (see module docstring): paragraphs or lines."""
    lines = [line.rstrip("\r") for line in text.split("\n")]
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate(lines, start=1):
        if line.strip():
            if not current:
                start = number
            current.append(line.rstrip())
        elif current:
            blocks.append((start, current))
            current = []
    if current:
        blocks.append((start, current))
    if len(blocks) >= 2 and any(len(block) > 1 for _, block in blocks):
        return [(start, "\n".join(block).strip()) for start, block in blocks]
    return [(start + i, line.strip()) for start, block in blocks for i, line in enumerate(block)]


# ----------------------------------------------------------------------------- rows -> Prompt

def _require_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _RowProblem(f"{what} is {_type_name(value)}, expected a string")
    if not value.strip():
        raise _RowProblem(f"{what} is empty")
    return value


def _content_text(content: Any, what: str) -> str:
    """Message content: a string, or a list of text parts (OpenAI multi-part format)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise _RowProblem(f"{what} has non-text content ({one_line(str(kind), 30)})")
        content = "".join(texts)
    return _require_text(content, what)


def _chat_messages(items: Any, field_name: str, role_key: str, content_key: str,
                   role_map: dict[str, str]) -> list[dict]:
    if not isinstance(items, list):
        raise _RowProblem(f"'{field_name}' is {_type_name(items)}, expected a list of messages")
    messages = []
    for i, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise _RowProblem(f"message {i} in '{field_name}' is {_type_name(item)}, expected an object")
        # Accept both naming schemes: ShareGPT dumps often mix from/value and role/content.
        raw_role = item.get(role_key, item.get("role", item.get("from")))
        role = role_map.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise _RowProblem(f"message {i} in '{field_name}' has unsupported role {_snippet(raw_role, 20)}")
        content = item.get(content_key, item.get("content", item.get("value")))
        messages.append({"role": role, "content": _content_text(content, f"message {i} ({role})")})
    return messages


def _flat_messages(row: dict) -> list[dict]:
    """Alpaca / HumanEval / GSM8K / generic single-field rows."""
    if "instruction" in row:
        user = _require_text(row["instruction"], "'instruction'")
        extra = row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise _RowProblem(f"'input' is {_type_name(extra)}, expected a string")
        if extra and extra.strip():
            user = f"{user}\n\n{extra}"
        messages = [{"role": "user", "content": user}]
    else:
        key = next((k for k in _PROMPT_KEYS if k in row), None)
        if key is None:
            keys = ", ".join(sorted(map(str, row))[:8]) or "none"
            raise _RowProblem("no prompt found: expected one of conversations, messages, turns, "
                              f"instruction, prompt, question, text, input (keys present: {one_line(keys, 120)})")
        if key == "prompt" and isinstance(row[key], list):  # prompt given as a message list
            messages = _chat_messages(row[key], "prompt", "role", "content", _OPENAI_ROLES)
        else:
            messages = [{"role": "user", "content": _require_text(row[key], f"'{key}'")}]
    if "system" in row and row["system"] is not None and messages[0]["role"] != "system":
        system = row["system"]
        if not isinstance(system, str):
            raise _RowProblem(f"'system' is {_type_name(system)}, expected a string")
        if system.strip():
            messages.insert(0, {"role": "system", "content": system})
    return messages


def _answer(row: dict) -> str | None:
    for key in _ANSWER_KEYS:
        value = row.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _RowProblem(f"'{key}' is {_type_name(value)}, expected a string")
        return value if value.strip() else None  # an empty answer is just "no answer"
    return None


def _row_messages(row: Any) -> list[dict]:
    if isinstance(row, str):
        return [{"role": "user", "content": _require_text(row, "the prompt")}]
    if not isinstance(row, dict):
        raise _RowProblem(f"row is {_type_name(row)}, expected an object or a string")
    for key in ("conversations", "conversation"):
        if key in row:
            return _chat_messages(row[key], key, "from", "value", _SHAREGPT_ROLES)
    if "messages" in row:
        return _chat_messages(row["messages"], "messages", "role", "content", _OPENAI_ROLES)
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise _RowProblem(f"'turns' is {_type_name(turns) if turns != [] else 'empty'}, expected a list of strings")
        return [{"role": "user", "content": _require_text(t, f"turn {i}")} for i, t in enumerate(turns, 1)]
    messages = _flat_messages(row)
    answer = _answer(row) if messages[-1]["role"] != "assistant" else None
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


def _row_meta(row: Any) -> tuple[str | None, str | None]:
    """(explicit id, category) from a dict row; non-scalar values are ignored."""
    if not isinstance(row, dict):
        return None, None
    row_id = next((str(row[k]) for k in _ID_KEYS
                   if isinstance(row.get(k), (str, int)) and not isinstance(row.get(k), bool)
                   and str(row[k]).strip()), None)
    category = row.get("category")
    category = str(category) if isinstance(category, (str, int)) and str(category).strip() else None
    return row_id, category


def _to_prompt(number: int, row: Any, max_chars: int, seen_ids: set[str]) -> Prompt:
    messages = _row_messages(row)
    if not any(m["role"] == "user" for m in messages):
        raise _RowProblem("no user message")
    total = sum(len(m["content"]) for m in messages)
    if total > max_chars:
        raise _RowProblem(f"prompt is {total:,} characters, over the limit of {max_chars:,} "
                          "(max_chars_per_prompt)")
    row_id, category = _row_meta(row)
    prompt_id = one_line(row_id, 200) if row_id else f"row-{number}"
    if prompt_id in seen_ids:  # ids must be unique: reports and splits key on them
        prompt_id = f"{prompt_id}#{number}"
    seen_ids.add(prompt_id)
    return Prompt(id=prompt_id, messages=messages, category=category)


# ----------------------------------------------------------------------------- public: loading

def load_prompts(
    source: str | os.PathLike | bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_chars_per_prompt: int = DEFAULT_MAX_CHARS_PER_PROMPT,
    format: Format = "auto",
    name: str | None = None,
) -> PromptSet:
    """Load prompts from a file path (also an uploaded temp file) or raw ``bytes``.

    ``name`` is the source name used in messages and :attr:`PromptSet.source` (defaults to
    the path, or ``"<bytes>"``).  Bad rows are skipped and listed in ``skipped``; an input
    that is unusable as a whole raises :class:`DataError`.  See the module docstring.
    """
    if format not in ("auto", "json", "jsonl", "text"):
        raise DataError(f"unknown format {format!r}: use auto, json, jsonl or text")
    raw, path, display = _resolve_source(source, name)
    if raw is None:
        raw = _read_limited(path, max_bytes, display)
    elif len(raw) > max_bytes:
        raise DataError(f"{display} is {_human_bytes(len(raw))}, over the limit of "
                        f"{_human_bytes(max_bytes)} (max_bytes)")
    sha256 = hashlib.sha256(raw).hexdigest()
    text = _decode(raw, display)
    if not text.strip():
        raise DataError(f"{display} is empty")

    fmt = _detect_format(text, path) if format == "auto" else format
    errors: list[RowError] = []
    if fmt == "json":
        rows = _json_rows(text, display)
    elif fmt == "jsonl":
        rows, errors = _jsonl_rows(text)
    else:
        rows = _text_rows(text)
    if len(rows) + len(errors) > max_rows:
        raise DataError(f"{display} has {len(rows) + len(errors):,} rows, over the limit of "
                        f"{max_rows:,} (max_rows)")

    prompts: list[Prompt] = []
    seen_ids: set[str] = set()
    for number, row in rows:
        try:
            prompts.append(_to_prompt(number, row, max_chars_per_prompt, seen_ids))
        except _RowProblem as exc:
            errors.append(RowError(number, one_line(str(exc)), "row" if fmt == "json" else "line"))
    errors.sort(key=lambda e: e.row)
    if not prompts:
        detail = f": {len(errors)} rows skipped ({_describe_errors(errors, 3)})" if errors else ""
        raise DataError(f"{display}: no usable prompt ({fmt}){detail}")
    return PromptSet(prompts=prompts, skipped=errors, source=display, sha256=sha256, format=fmt)


def bundled_prompts(name: str) -> Path:
    """Path of the packaged prompt file ``entmtp/prompts/{name}.jsonl`` (or ``.txt``)."""
    directory = _PROMPTS_DIR
    available = sorted({p.stem for p in directory.glob("*.jsonl")} | {p.stem for p in directory.glob("*.txt")}) \
        if directory.is_dir() else []
    # Names only: a path here would let a caller read arbitrary files through the app.
    if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        for suffix in (".jsonl", ".txt"):
            candidate = directory / f"{name}{suffix}"
            if candidate.is_file():
                return candidate
    listing = ", ".join(available) if available else "none are installed"
    raise DataError(f"no bundled prompt set named {_snippet(name, 60)}; available: {listing}")


# ----------------------------------------------------------------------------- public: split

def _split_key(prompt: Prompt, seed: int) -> float:
    """Uniform [0, 1) from sha256(seed, prompt messages without the answer)."""
    body = json.dumps(prompt.prompt_messages, ensure_ascii=False, sort_keys=True)
    digest = hashlib.sha256(f"{seed}\x00{body}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_prompts(prompts: Iterable[Prompt], held_out_fraction: float,
                  seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Split into (calibration, held_out), deterministically.

    Each prompt goes to held-out iff a hash of (seed, its messages without the answer) falls
    below ``held_out_fraction``.  So the split does not depend on input order, identical
    prompts (even with different answers) always land on the same side, and appending rows
    never moves existing ones.  Sizes are therefore approximate; the one exception: when a
    fraction strictly between 0 and 1 would leave a side empty although there are at least two
    distinct prompts, the distinct prompt nearest the threshold is moved there.
    Input order is kept within each side.
    """
    if isinstance(held_out_fraction, bool) or not isinstance(held_out_fraction, (int, float)) \
            or not 0.0 <= held_out_fraction <= 1.0:
        raise DataError(f"held_out_fraction must be a number between 0 and 1, got {held_out_fraction!r}")
    prompts = list(prompts)
    keys = [_split_key(p, seed) for p in prompts]
    held = [k < held_out_fraction for k in keys]
    distinct = sorted(set(keys))
    if 0.0 < held_out_fraction < 1.0 and len(distinct) >= 2:
        if not any(held):
            held = [k == distinct[0] for k in keys]
        elif all(held):
            held = [k != distinct[-1] for k in keys]
    calibration = [p for p, h in zip(prompts, held) if not h]
    held_out = [p for p, h in zip(prompts, held) if h]
    return calibration, held_out


# ----------------------------------------------------------------------------- public: rendering

def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ids_from_result(result: Any) -> list[int]:
    """apply_chat_template / __call__ may return a list, a nested list, or a BatchEncoding."""
    if hasattr(result, "keys") and "input_ids" in result:
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(t) for t in result]


def _merge_same_role(messages: list[dict]) -> list[dict]:
    """Join consecutive same-role messages, for templates that demand alternating roles."""
    merged: list[dict] = []
    for m in messages:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    return merged


def _apply_template(tokenizer: Any, messages: list[dict], *, tokenize: bool,
                    add_generation_prompt: bool, prompt_id: str) -> Any:
    """Run the chat template; on a template error retry with same-role turns merged."""
    kwargs = dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt)
    if tokenize:
        kwargs["return_dict"] = False
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as first:  # template errors come as jinja/ValueError/TypeError alike
        merged = _merge_same_role(messages)
        if merged != messages:
            try:
                return tokenizer.apply_chat_template(merged, **kwargs)
            except Exception:
                pass
        raise DataError(f"chat template failed for prompt {prompt_id}: "
                        f"{type(first).__name__}: {first}") from None


def _plain_text(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    if not text:
        return []
    return _ids_from_result(tokenizer(text, add_special_tokens=special)["input_ids"])


def render_prompt(prompt: Prompt, tokenizer: Any, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``prompt``.

    With ``add_generation_prompt`` (generation), a final assistant answer is dropped and the
    template's assistant header appended.  Without a chat template the message contents are
    joined by blank lines and tokenized with the tokenizer's special tokens (e.g. BOS).
    """
    messages = prompt.prompt_messages if add_generation_prompt else list(prompt.messages)
    if _has_chat_template(tokenizer):
        result = _apply_template(tokenizer, messages, tokenize=True,
                                 add_generation_prompt=add_generation_prompt, prompt_id=prompt.id)
        return _ids_from_result(result)
    return _encode(tokenizer, _plain_text(messages), special=True)


def _template_segments(prompt: Prompt, tokenizer: Any) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_answer) pieces.

    Each assistant turn's span is the difference between the rendering up to and including
    it and the rendering before it with the generation prompt, so it contains the answer and
    the template's end-of-turn marker (the model must learn to stop).
    """
    messages = list(prompt.messages)
    render = lambda msgs, gen: _apply_template(tokenizer, msgs, tokenize=False,  # noqa: E731
                                               add_generation_prompt=gen, prompt_id=prompt.id)
    full = render(messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    try:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = render(messages[:i], True), render(messages[: i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
                raise _RowProblem("template is not prefix-stable")
            segments += [(full[pos:len(before)], False), (full[len(before):len(upto)], True)]
            pos = len(upto)
    except (_RowProblem, DataError):
        return _located_segments(full, messages, prompt.id)
    segments.append((full[pos:], False))
    return segments


def _located_segments(full: str, messages: list[dict], prompt_id: str) -> list[tuple[str, bool]]:
    """Fallback for templates that re-render history: find each answer's text in order."""
    segments: list[tuple[str, bool]] = []
    pos = 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        start = full.find(m["content"], pos)
        if start < 0:
            raise DataError(f"cannot find the assistant answer of prompt {prompt_id} in its "
                            "chat-template rendering")
        end = start + len(m["content"])
        segments += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    segments.append((full[pos:], False))
    return segments


def _plain_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    # The blank line before an answer belongs to the answer, so the prompt part equals the
    # render_prompt() text exactly and the model learns what follows it.
    segments: list[tuple[str, bool]] = []
    for i, m in enumerate(messages):
        text = m["content"] if i == 0 else "\n\n" + m["content"]
        segments.append((text, m["role"] == "assistant"))
    return segments


def render_conversation(prompt: Prompt, tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and, per token, whether it is assistant answer text.

    With a chat template the answer spans include the end-of-turn marker; without one the
    EOS token (if any) is appended as part of the final answer.  Pieces are tokenized
    separately so the tokens before the final answer equal ``render_prompt(prompt, tok)``.
    """
    templated = _has_chat_template(tokenizer)
    segments = _template_segments(prompt, tokenizer) if templated else _plain_segments(prompt.messages)
    ids: list[int] = []
    mask: list[bool] = []
    for index, (text, is_answer) in enumerate(segments):
        # Templates spell out their special tokens; plain text needs the tokenizer's BOS once.
        piece = _encode(tokenizer, text, special=(not templated and index == 0))
        ids += piece
        mask += [is_answer] * len(piece)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not templated and prompt.has_answer and isinstance(eos, int):
        ids.append(eos)
        mask.append(True)
    return ids, mask
