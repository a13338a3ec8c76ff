"""Fills a haystack to a target length in tokens and places needles at their depths."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Insert", "Built", "assemble", "count_tokens"]


@dataclass(frozen=True, slots=True)
class Insert:
    """A needle: goes after round(depth·n) of the n haystack items."""

    depth: float
    text: str
    is_answer: bool  # its span is reported in Sample.needle_spans
    joins_as_item: bool = False  # joined with the item separator (a JSON pair) rather than carrying its own newlines


class Built(NamedTuple):
    prompt: str
    num_tokens: int
    answer_spans: list[tuple[int, int]]  # char spans of the answer needles, surrounding whitespace excluded


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` without special tokens; takes an HF tokenizer or a `tokenizers.Tokenizer`."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return len(getattr(encoded, "ids", encoded))


def assemble(
    head: str,
    items: Iterator[str],
    inserts: list[Insert],
    tail: str,
    sep: str,
    target_tokens: int,
    tokenizer,
    tolerance: float = 0.01,
) -> Built:
    """head + haystack items with inserts + tail, with as many items as bring it to target_tokens (±tolerance)."""
    pool: list[str] = []

    def take(n: int) -> list[str]:
        while len(pool) < n:
            pool.append(next(items))
        return pool[:n]

    fixed = count_tokens(tokenizer, head + "".join(i.text for i in inserts) + tail)
    sample = take(64)
    per_item = max(1.0, count_tokens(tokenizer, sep.join(sample)) / len(sample))
    num_items = max(0, round((target_tokens - fixed) / per_item))
    best: Built | None = None
    for _ in range(8):
        built = _join(head, take(num_items), inserts, tail, sep, tokenizer)
        if best is None or abs(built.num_tokens - target_tokens) < abs(best.num_tokens - target_tokens):
            best = built
        error = target_tokens - built.num_tokens
        step = round(error / per_item)
        if abs(error) <= tolerance * target_tokens or step == 0 or (num_items == 0 and step < 0):
            break
        num_items = max(0, num_items + step)
    assert best is not None  # the loop above runs at least once
    return best


def _join(head: str, items: list[str], inserts: list[Insert], tail: str, sep: str, tokenizer) -> Built:
    n = len(items)
    # (position, order) keeps needles at the same position in the order given
    slots = sorted(((round(i.depth * n), order, i) for order, i in enumerate(inserts)), key=lambda s: s[:2])
    pieces: list[tuple[str, Insert | None]] = []
    cursor = 0
    for position, _, insert in slots:
        pieces += [(text, None) for text in items[cursor:position]]
        pieces.append((insert.text, insert))
        cursor = position
    pieces += [(text, None) for text in items[cursor:]]

    out = [head]
    length = len(head)
    spans: list[tuple[int, int]] = []
    previous_is_item = False
    for text, piece_insert in pieces:
        is_item = piece_insert is None or piece_insert.joins_as_item
        if is_item and previous_is_item:
            out.append(sep)
            length += len(sep)
        if piece_insert is not None and piece_insert.is_answer:
            stripped = text.strip()
            start = length + text.index(stripped)
            spans.append((start, start + len(stripped)))
        out.append(text)
        length += len(text)
        previous_is_item = is_item
    out.append(tail)
    prompt = "".join(out)
    return Built(prompt, count_tokens(tokenizer, prompt), spans)
