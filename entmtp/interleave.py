"""Interleaved measurement: each round runs every competitor (methods, trees) once, in an order
rotated by the round's index, so that drift in the machine's speed (a shared VM, a neighbour's
burst) hits every competitor alike instead of whichever ran during it."""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """items in the order of round `turn`: starting at index turn mod len(items), wrapping round.
    rotated("abc", 1) == ["b", "c", "a"]; an empty sequence stays empty."""
    if not items:
        return []
    k = turn % len(items)
    return list(items[k:]) + list(items[:k])


__all__ = ["rotated"]
