"""The bench's streaming client: one completion over the decode node's SSE stream, each text chunk timed as it arrives.

What it measures is what a streaming HTTP client sees (as `vllm bench serve` and AIPerf measure it): the clock
starts when the request is sent (after the HTTP client is built: building one loads the certificates, 20-40 ms
here, which is the bench's cost, not the node's) and each `data:` event carrying text is stamped when its line is
read. The node's own figures (its `usage`: TTFT, TTST and TBT from the request's arrival there, `ctl`) come in the
usage event at the end and are kept beside the client's, named `node_*`.

The node streams one chunk per token, with empty text where the token adds none yet (a special token, half of a
multi-byte character, the possible start of a stop string), as vLLM's server does, and every chunk is stamped, as
vLLM's bench client does: TTFT is the first token's arrival whatever its text. `client_tokens` < the node's
`completion_tokens` would say that tokens left the node together. TTFT and TTST are then the first and
second chunks', and TBT still divides the time from the second chunk to the last by the tokens between them (the
node's count, as `vllm bench serve` divides by the output tokens): a token without text of its own is a step all
the same, and per-chunk gaps would read a middle one as a slower step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["RequestFailed", "Streamed", "stream_completion"]

TIMEOUT = httpx.Timeout(10.0, read=600.0)  # a batch's last prefill on a slow link may keep its first chunk away


class RequestFailed(RuntimeError):
    """The decode node could not be reached, refused the request, or failed it while streaming."""


@dataclass(slots=True)
class Streamed:
    """One streamed completion: its text, the node's usage, and when (client clock) each text chunk arrived."""

    text: str
    usage: dict[str, Any]  # the node's own, from the stream's usage event
    sent: float  # time.perf_counter() when the request was sent
    arrivals: list[float]  # seconds from `sent` to each text chunk, in order
    end: float  # seconds from `sent` to the stream's end ([DONE])

    def timings(self) -> dict[str, Any]:
        """The client's figures (`ttft`, `ttst`, `tbt`: the mean time per token after the second, `itl`: every gap
        between chunks, `e2e`, `ctl`: the arrivals, `client_tokens`) and the node's beside them (`node_ttft`,
        `node_ttst`, `node_tbt`, `node_ctl`), all in seconds; None where the stream had too few chunks; and
        `prefill_tokens`, the output tokens the prefill node computed (the joins' windows start after them)."""
        times = self.arrivals
        usage = self.usage
        steps = max(len(times), int(usage.get("completion_tokens") or 0)) - 2  # tokens after the second
        return {
            "ttft": times[0] if times else None,
            "ttst": times[1] if len(times) > 1 else None,
            "tbt": (times[-1] - times[1]) / steps if len(times) > 2 else None,
            "e2e": self.end,
            "itl": [b - a for a, b in zip(times, times[1:])],
            "ctl": list(times),
            "client_tokens": len(times),
            "node_ttft": usage.get("ttft"),
            "node_ttst": usage.get("ttst"),
            "node_tbt": usage.get("tbt"),
            "node_ctl": usage.get("ctl") or [],
            # output tokens the prefill node computed (2: the forecast step's token was the second)
            "prefill_tokens": usage.get("prefill_tokens") or 1,
        }

    def record(self) -> dict[str, Any]:
        """`timings()` with what a load or trace run keeps of the usage: prompt and output tokens (the node's count,
        as vLLM's output_len), prompt tokens the prefill node's prefix cache supplied (`cached_tokens`) and those
        the decode node's held (`held_tokens`)."""
        usage = self.usage
        return {
            **self.timings(),
            "prompt_tokens": usage.get("prompt_tokens"),
            "output_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "held_tokens": usage.get("held_tokens"),
        }


def stream_completion(url: str, body: dict[str, Any], timeout: httpx.Timeout = TIMEOUT) -> Streamed:
    """POSTs `body` to `url`/v1/completions as a stream with usage (and the node's token times) and reads it to its
    end. Raises RequestFailed with the node's message for an HTTP error, an error event or a lost connection."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_times": True}
    try:
        with httpx.Client(timeout=timeout) as client:
            request = client.build_request("POST", f"{url}/v1/completions", json=body)
            sent = time.perf_counter()
            response = client.send(request, stream=True)
            try:
                return _read(response, sent)
            finally:
                response.close()
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{type(exc).__name__} from {url}: {exc}") from exc


def _read(response: httpx.Response, sent: float) -> Streamed:
    """Reads a streamed completion to its end, stamping each text chunk as its line is read."""
    if response.status_code != 200:
        response.read()
        raise RequestFailed(f"HTTP {response.status_code}: {_message(response.text)}")
    text: list[str] = []
    arrivals: list[float] = []
    usage: dict[str, Any] | None = None
    for line in response.iter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # the blank line between events
        data = line[5:].strip()
        if data == "[DONE]":
            if usage is None:
                raise RequestFailed("the stream ended without its usage event")
            return Streamed("".join(text), usage, sent, arrivals, now - sent)
        try:
            event = json.loads(data)
        except ValueError:
            raise RequestFailed(f"the stream carried an event that is not JSON: {data[:200]}") from None
        if "error" in event:
            error = event["error"]
            raise RequestFailed(f"failed while streaming ({error.get('code')}): {error.get('message')}")
        for choice in event.get("choices") or []:
            # every token's chunk counts, text or not (vLLM's bench client: "text could be empty here, e.g. for
            # special tokens"); the closing chunk, empty with its finish reason, is no token
            if choice.get("text") or choice.get("finish_reason") is None:
                arrivals.append(now - sent)
                text.append(choice.get("text") or "")
        if event.get("usage"):
            usage = event["usage"]
    raise RequestFailed("the stream ended before [DONE]")


def _message(body: str) -> str:
    """The message of an OpenAI-style error body, else the body itself (cut)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]
