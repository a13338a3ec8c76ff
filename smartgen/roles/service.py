"""What the decode node's front ends (HTTP API, `smartgen generate`) see: submit a prompt, stream its events.

The decode scheduler implements `DecodeService`; the HTTP layer only translates between
OpenAI-style JSON and these objects.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["GenerationParams", "TokenEvent", "FinishEvent", "RequestHandle", "DecodeService", "ServiceError"]


class ServiceError(RuntimeError):
    """A request the service refuses (bad parameters, queue full, too long); `status` is the HTTP code to use."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class GenerationParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False
    scheme: str | None = None  # transfer policy for this request (default: the node's --scheme)
    # [layers][prompt tokens]: a recorded run's selection counts, the "optimal" proactive set (benchmarks)
    proactive_counts: list[list[int]] | None = None
    return_selection_counts: bool = False  # usage.selection_counts: [layers][prompt tokens], summed over KV heads
    skip_special_tokens: bool = True  # special tokens (<s>, </s>, <pad>) add no text (as vLLM's default)


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (incremental detokenization; may be "")
    index: int  # 0 for the first generated token
    time: float  # monotonic arrival on the decode node


@dataclass(slots=True)
class FinishEvent:
    # "stop" | "length" | "error" | "aborted" | "overloaded" (a prefill node had no room: 503) | "unavailable" (its
    # prefill node was lost, or none was live: 503)
    reason: str
    error: str | None
    usage: dict[str, Any]  # prompt_tokens, completion_tokens, total_tokens, ttft, ttst, tbt (seconds), scheme


Event = TokenEvent | FinishEvent


class RequestHandle:
    """One submitted request: a queue of events, ending with exactly one FinishEvent."""

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.created = time.monotonic()
        self._events: queue.Queue[Event] = queue.Queue()
        self.cancelled = False
        self.cancel_reason = ""
        self.finished = False
        self._wake: Callable[[], None] | None = None  # an asyncio consumer's: wakes its loop when an event arrives

    # -- producer side (the scheduler) --
    def put(self, event: Event) -> None:
        if self.finished:
            return
        if isinstance(event, FinishEvent):
            self.finished = True
        self._events.put(event)
        wake = self._wake
        if wake is not None:
            wake()

    # -- consumer side (front ends) --
    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iterator over events until the FinishEvent (inclusive)."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if isinstance(event, FinishEvent):
                return

    async def aevents(self, fallback_s: float = 0.25) -> AsyncIterator[Event]:
        """The same for asyncio front ends (never blocks the event loop). The producer wakes the loop when it puts an
        event: polling the queue every few ms cost the decode node's one core a wake-up per stream each time (four
        streams: 800 a second, taken from the decode steps) and each token up to a poll's delay. `fallback_s` bounds
        the wait should a wake-up ever be lost."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

        self._wake = wake
        try:
            while True:
                ready.clear()  # before the check: an event put after it sets `ready` again
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    try:
                        await asyncio.wait_for(ready.wait(), fallback_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            self._wake = None

    def cancel(self, reason: str = "client went away") -> None:
        """Asks the scheduler to abort the request (it frees everything and emits FinishEvent 'aborted')."""
        self.cancelled = True
        self.cancel_reason = reason


class DecodeService(Protocol):
    model_name: str
    tokenizer: Any  # a transformers tokenizer (chat template, decode)

    def submit(self, prompt_ids: list[int], params: GenerationParams) -> RequestHandle:
        """Queues a request; raises ServiceError for a request it refuses (with the HTTP status to use)."""

    def health(self) -> dict[str, Any]:
        """Liveness and load: prefill nodes connected, running / waiting requests, pool use."""
