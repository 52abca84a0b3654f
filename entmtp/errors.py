"""Messages a user reads: one line, whatever the exception or text."""

from __future__ import annotations


def one_line(x: BaseException | str, limit: int = 300, typed: bool = False) -> str:
    """At most `limit` characters on one line: text with its whitespace collapsed, or an
    exception's first non-empty message line (its type's name when it has none; `typed`
    prefixes the type's name)."""
    if isinstance(x, BaseException):
        lines = [ln for ln in str(x).splitlines() if ln.strip()]
        text = " ".join(lines[0].split()) if lines else ""
        name = type(x).__name__
        text = (f"{name}: {text}" if typed else text) if text else name
    else:
        text = " ".join(str(x).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = ["one_line"]
