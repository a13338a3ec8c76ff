"""Incremental detokenization: half characters wait for the rest, invalid bytes do not silence the stream."""

from transformers import AutoTokenizer

from smartgen.apps.bench.models import SAMPLE_MODEL
from smartgen.roles.text_pieces import MAX_HELD_TOKENS, text_piece


def _stream(tokenizer, ids: list[int]) -> list[str]:
    shown, held, pieces = "", 0, []
    for i in range(len(ids)):
        piece, shown, held = text_piece(tokenizer.decode(ids[: i + 1]), shown, held)
        pieces.append(piece)
    return pieces


def test_a_character_split_over_tokens_streams_whole_and_invalid_bytes_do_not_hold_the_rest():
    tokenizer = AutoTokenizer.from_pretrained(SAMPLE_MODEL)
    split = tokenizer.encode("a中b", add_special_tokens=False)
    pieces = _stream(tokenizer, split)
    assert "".join(pieces) == "a中b" and "中" in pieces and not any("\ufffd" in p for p in pieces)
    # a continuation byte with no lead (random weights emit such tokens): it can never complete
    stray = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    words = tokenizer.encode(" one two three four five", add_special_tokens=False)
    ids = [stray, *words]
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all(pieces[MAX_HELD_TOKENS:]), "past the longest character every token streams its text"
    assert pieces[: len(words)] != [""] * len(words), "the stream did not go silent"
