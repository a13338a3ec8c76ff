"""Trace replay: a Mooncake FAST'25 JSONL trace scaled to this machine, with prompts whose equal hash_ids are equal tokens.

One JSON object per line: `timestamp` (ms from the trace's start), `input_length`, `output_length` and `hash_ids`,
one id per 512-token block of the prompt (the last block partial as `input_length` says); two requests whose lists
start with the same ids share that prefix. Scaling keeps the order and the prefix structure:

- `length_scale` s: a block is round(512·s) tokens (at least 1); a request keeps its number of blocks, and its last
  block keeps its share of a block, so input = (blocks - 1)·block + round(last / 512 · block), at least 1 token.
  Outputs scale by s too, at least MIN_OUTPUT_TOKENS (TBT needs a third token; a few more make it a mean).
- `time_scale` t: arrival = (timestamp - the first replayed one's) / 1000 · t seconds (t < 1 replays faster);
  `rate`, when given instead, picks t so that the replayed requests arrive at that mean rate.
- `start` skips the first N requests of the file, `max_requests` keeps at most that many after them.
- A request longer than `max_input` tokens is clipped to its first `max_input` (its prefix structure kept) or
  refused (not sent, counted), as `over_length` says.

A block's tokens are a function of its hash id alone (seeded random ids from the vocabulary): in this trace an id
always names the same prefix chain (ids are assigned to chains, never reused), so equal ids give equal blocks and
equal leading runs of ids give equal prompt prefixes, which is what the nodes' prefix caches key on.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "single_token_words",
    "prompt_text",
    "TRACE_BLOCK_TOKENS",
    "MIN_OUTPUT_TOKENS",
    "OVER_LENGTH",
    "TraceRequest",
    "TraceSlice",
    "read_trace",
    "block_tokens_for",
    "prompt_tokens",
    "expected_cached",
]

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's block: one hash id per 512 prompt tokens
MIN_OUTPUT_TOKENS = 4
OVER_LENGTH = ("clip", "refuse")
FIRST_TOKEN_ID = 3  # past pad, BOS and EOS of the sample tokenizer (ids 0-2)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One replayed request, scaled: when it is sent (s from the replay's start), its prompt and output lengths."""

    index: int  # line number in the file (0-based)
    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # the blocks it covers (fewer than the file's when clipped)
    clipped: bool = False  # longer than max_input in the trace: cut to its first max_input tokens
    refused: bool = False  # longer than max_input and over_length "refuse": not sent

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1 or not self.hash_ids:
            raise ValueError(f"trace request {self.index}: needs a prompt token, an output token and a hash id")


@dataclass(slots=True)
class TraceSlice:
    """The replayed part of a trace, scaled, and how it was cut."""

    path: str
    block_tokens: int
    time_scale: float
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def num_clipped(self) -> int:
        return sum(r.clipped for r in self.requests)

    @property
    def num_refused(self) -> int:
        return sum(r.refused for r in self.requests)

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].at_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float | None:
        """Mean arrival rate (requests per second between the first arrival and the last); None when they all
        arrive at once."""
        return (len(self.requests) - 1) / self.span_s if self.span_s > 0 else None

    def rescaled(self, rate: float) -> TraceSlice:
        """The same requests at the times that make their mean arrival rate `rate` per second."""
        span = self.span_s / self.time_scale  # unscaled seconds
        if len(self.requests) < 2 or span <= 0:
            raise ValueError("a trace slice needs two requests at different times to be replayed at a given rate")
        scale = (len(self.requests) - 1) / rate / span
        moved = [_replace_at(r, r.at_s / self.time_scale * scale) for r in self.requests]
        return TraceSlice(self.path, self.block_tokens, scale, moved)

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "block_tokens": self.block_tokens,
            "time_scale": self.time_scale,
            "requests": len(self.requests),
            "clipped": self.num_clipped,
            "refused": self.num_refused,
            "span_s": self.span_s,
        }


def _replace_at(request: TraceRequest, at_s: float) -> TraceRequest:
    return TraceRequest(
        request.index,
        at_s,
        request.input_tokens,
        request.output_tokens,
        request.hash_ids,
        request.clipped,
        request.refused,
    )


def block_tokens_for(length_scale: float) -> int:
    """Tokens per hash id at this length scale."""
    if not length_scale > 0:
        raise ValueError("--length-scale must be positive")
    return max(1, round(TRACE_BLOCK_TOKENS * length_scale))


def read_trace(
    path: Path,
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    start: int = 0,
    max_requests: int | None = None,
    max_input: int | None = None,
    over_length: str = "clip",
) -> TraceSlice:
    """Reads and scales a slice of the trace at `path` (see the module's docstring). Raises ValueError, naming the
    line, for a file that is not such a trace."""
    if not time_scale > 0:
        raise ValueError("--time-scale must be positive")
    if start < 0 or (max_requests is not None and max_requests < 1):
        raise ValueError("--start must be >= 0 and --max-requests >= 1")
    if over_length not in OVER_LENGTH:
        raise ValueError(f"--over-length must be one of {', '.join(OVER_LENGTH)}")
    block = block_tokens_for(length_scale)
    if max_input is not None and max_input < 1:
        raise ValueError("--max-input must be at least 1 token")
    rows: list[tuple[int, tuple[float, int, int, list[int]]]] = []
    try:
        with path.open() as handle:
            for number, line in enumerate(handle):
                if number < start or not line.strip():
                    continue
                if max_requests is not None and len(rows) >= max_requests:
                    break
                rows.append((number, _parse(line, number, path)))
    except OSError as exc:
        raise ValueError(f"--trace {path}: {exc.strerror or exc}") from None
    if not rows:
        raise ValueError(f"--trace {path}: no requests after --start {start}")
    first = rows[0][1][0]
    requests = []
    for number, (stamp, input_length, output_length, ids) in rows:
        last = input_length - (len(ids) - 1) * TRACE_BLOCK_TOKENS
        tokens = max(1, (len(ids) - 1) * block + round(last / TRACE_BLOCK_TOKENS * block))
        output = max(MIN_OUTPUT_TOKENS, round(output_length * length_scale))
        clipped = refused = False
        if max_input is not None and tokens > max_input:
            clipped, refused = over_length == "clip", over_length == "refuse"
            if clipped:
                tokens = max_input
                ids = ids[: -(-tokens // block)]
        at = (stamp - first) / 1000 * time_scale
        requests.append(TraceRequest(number, at, tokens, output, tuple(ids), clipped, refused))
    return TraceSlice(str(path), block, time_scale, requests)


def _parse(line: str, number: int, path: Path) -> tuple[float, int, int, list[int]]:
    where = f"--trace {path}, line {number + 1}"
    try:
        row = json.loads(line)
        stamp, input_length, output_length = (
            float(row["timestamp"]),
            int(row["input_length"]),
            int(row["output_length"]),
        )
        ids = [int(i) for i in row["hash_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a Mooncake trace record ({type(exc).__name__}: {exc})") from None
    if input_length < 1 or output_length < 1 or not ids:
        raise ValueError(f"{where}: needs input_length and output_length >= 1 and some hash_ids")
    if not (len(ids) - 1) * TRACE_BLOCK_TOKENS < input_length <= len(ids) * TRACE_BLOCK_TOKENS:
        raise ValueError(f"{where}: {len(ids)} hash ids do not cover {input_length} tokens in 512-token blocks")
    return stamp, input_length, output_length, ids


def prompt_tokens(request: TraceRequest, block_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """The request's prompt as token ids: block i is `block_tokens` seeded ids of hash id i (the last one cut to the
    request's length), drawn from [FIRST_TOKEN_ID, vocab)."""
    if vocab <= FIRST_TOKEN_ID:
        raise ValueError(f"a vocabulary of {vocab} tokens leaves none past the special ones")
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        rng = random.Random(f"smartgen-trace:{seed}:{hash_id}")
        tokens.extend(rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(block_tokens))
    return tokens[: request.input_tokens]


MIN_WORDS = 64  # single-token words a tokenizer must have for text prompts (fewer: blocks would repeat too often)


def single_token_words(tokenizer: Any) -> list[str]:
    """Words of the tokenizer's vocabulary that encode back to their one token with their leading space (" key"), in
    id order: any run of them encodes to exactly those tokens, so a text prompt made of them is a known token list.
    ValueError where there are fewer than MIN_WORDS."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text[:1] == " " and text[1:].isalpha() and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(text)
    if len(words) < MIN_WORDS:
        raise ValueError(f"the tokenizer has {len(words)} single-token words, fewer than {MIN_WORDS}: no text prompts")
    return words


def prompt_text(request: TraceRequest, block_tokens: int, words: list[str], seed: int = 0) -> str:
    """The request's prompt as text, for a router that takes no token ids (SGLang's refuses them with 422): the
    words of `single_token_words`, one per token, drawn as `prompt_tokens` draws ids, so equal hash ids give equal
    text blocks and the node's tokenizer gives back one token per word (after its BOS, if it adds one)."""
    ids = prompt_tokens(request, block_tokens, FIRST_TOKEN_ID + len(words), seed)
    return "".join(words[i - FIRST_TOKEN_ID] for i in ids)


def expected_cached(requests: list[TraceRequest], block_tokens: int) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache keyed by `block_tokens` blocks holds when it
    arrives, if every earlier request finished first and cached its whole blocks: the leading run of its whole blocks
    whose ids came whole before. (The decode node uses all of them; a prefill node computes one token whatever it
    holds, so it uses at most input - 1.)"""
    seen: set[int] = set()
    cached = []
    for request in requests:
        if request.refused:
            cached.append(0)
            continue
        whole = request.input_tokens // block_tokens
        run = 0
        while run < whole and request.hash_ids[run] in seen:
            run += 1
        cached.append(run * block_tokens)
        seen.update(request.hash_ids[:whole])
    return cached
