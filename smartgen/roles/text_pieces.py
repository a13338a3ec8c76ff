"""The text each generated token adds to a stream (incremental detokenization), holding back half characters."""

from __future__ import annotations

__all__ = ["MAX_HELD_TOKENS", "text_piece"]

# a UTF-8 character is at most 4 bytes, so a byte-level tokenizer completes one within 3 more tokens: a trailing
# U+FFFD still there after that is final (invalid bytes, which a model with random weights emits often), and holding
# it back would hold every later token's text too (the stream went silent for whole requests)
MAX_HELD_TOKENS = 3


def text_piece(text: str, shown: str, held: int) -> tuple[str, str, int]:
    """What one more token adds to a stream: `text` is every token so far decoded, `shown` what has streamed,
    `held` how many tokens in a row added nothing because the text ended in half a character (U+FFFD). Returns
    (piece to stream, shown after it, held after it)."""
    if text.endswith("\ufffd") and held < MAX_HELD_TOKENS:
        return "", shown, held + 1
    return text[len(shown) :], text, 0
