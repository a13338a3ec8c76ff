"""The decode node's OpenAI-compatible HTTP API: translates JSON and server-sent events to and from a DecodeService.

A request's life here:
1. The body is validated (pydantic; any mistake is a 400 in OpenAI's error format) and turned into prompt ids
   (the tokenizer, or the chat template for chat) and GenerationParams.
2. `service.submit()` queues it; a refusal (ServiceError) becomes an error response with the service's status.
3. Events are read with `handle.aevents()`; `_Generation` turns them into final text (holding back what may
   be the start of a stop string) and, at the end, a `_Done` with finish reason and usage (timings included).
4. Stream: each token is one `data: {chunk}` event (its text; empty while the text waits: a special token, half a
   character, the possible start of a stop string, as vLLM streams them), then the finish chunk, the usage chunk
   when asked, `[DONE]`.
   Non-stream: one JSON body. A client that goes away, or a stop string, cancels the request in the service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from smartgen.roles.body_limit import BodyLimit
from smartgen.roles.server_info import NodeInfo, describe_service, load_report
from smartgen.roles.service import DecodeService, FinishEvent, GenerationParams, RequestHandle, ServiceError

__all__ = ["create_app"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 * 2**20  # bytes; `smartgen serve --max-body-bytes`
STOP_DRAIN_S = 2.0  # how long to wait for the service's own FinishEvent (its usage) after a stop string cancels
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "gateway_timeout",
}
_FIELD_HINTS = {"prompt": "must be a string or a list of token ids (ints >= 0)"}  # clearer than a union's errors
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict"}  # pydantic's union-member tags in error locations


class _Sampling(BaseModel):
    # unknown OpenAI fields (user, presence_penalty, ...) are ignored; known ones are strict: "stream": "yes"
    # and "max_tokens": true are refused rather than coerced
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    # SmartGen extras
    scheme: str | None = None
    ignore_eos: bool = False
    return_token_times: bool = False  # usage.ctl: each token's arrival, seconds from the request's (benchmarks)
    # usage.selection_counts: [layers][prompt tokens], how many steps selected each token (summed over KV heads)
    return_selection_counts: bool = False
    # a recorded run's selection_counts, for scheme "...[optimal]": the proactive set that run says was needed
    proactive_counts: list[list[Annotated[int, Field(ge=0)]]] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True  # vLLM's: false renders special tokens (<s>, </s>) as text, so each streams


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None


def create_app(
    service: DecodeService,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    info: NodeInfo | None = None,
) -> FastAPI:
    """The FastAPI app serving `service` (run it with uvicorn; `smartgen serve --role decode` does).

    `metrics` renders the node's Prometheus registry (body, content type) for GET /metrics. `info`: the node's facts
    for the endpoints a router reads (`/server_info`, `/model_info`; roles.server_info); None: what `service` says.
    """
    node = info if info is not None else describe_service(service)
    app = FastAPI(title="SmartGen decode node", version="1")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # before any byte of an oversized body is read
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            report = dict(service.health())
        except Exception as exc:  # a health probe must answer, not crash
            return JSONResponse({"ready": False, "error": str(exc)}, status_code=503)
        return JSONResponse(report, status_code=503 if report.get("ready") is False else 200)

    @app.get("/status")
    async def status() -> JSONResponse:
        """Live engine state for the monitor: bytes and time per path, lanes, requests and their masks."""
        snapshot = getattr(service, "status", None)
        if snapshot is None:
            return JSONResponse(
                {"error": {"message": "this service has no status", "type": "not_found", "code": 404}}, 404
            )
        return JSONResponse(snapshot())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text format: bytes and time per path, latencies, requests, pool, links."""
        if metrics is None:
            return JSONResponse({"error": {"message": "no metrics here", "type": "not_found", "code": 404}}, 404)
        body, content_type = await run_in_threadpool(metrics)
        return Response(body, media_type=content_type)

    @app.get("/server_info")
    @app.get("/get_server_info")  # the older name, which routers fall back to
    async def server_info() -> dict[str, Any]:
        """The node's model and limits in SGLang's names: what the SGLang router reads to register a worker."""
        return node.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return node.model_info()

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        """Requests and tokens on the node, as SGLang's (the SGLang router's power-of-two policy compares tokens)."""
        try:
            return JSONResponse(load_report(dict(service.health())))
        except Exception as exc:  # like /health: answer, do not crash
            return _error(f"the node cannot report its load: {exc}", 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "smartgen"}
        card.update({"root": node.model_path, "max_model_len": node.max_req_len})  # as vLLM's card
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.echo or body.logprobs is not None:
            raise ServiceError("echo and logprobs are not supported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ServiceError("batched prompts are not supported: send one prompt per request")
            prompt = prompt[0]
        if not prompt:  # "" and [] alike: a text prompt is never silently turned into just a start token
            raise ServiceError("the prompt is empty")
        encode = (lambda: list(prompt)) if isinstance(prompt, list) else (lambda: service.tokenizer.encode(prompt))
        return await _serve(service, request, body, encode, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        if body.logprobs:
            raise ServiceError("logprobs are not supported")
        if getattr(service.tokenizer, "chat_template", None) is None:
            raise ServiceError(f"model {service.model_name!r} has no chat template: use /v1/completions instead")
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        return await _serve(
            service, request, body, lambda: _apply_chat_template(service.tokenizer, messages), chat=True
        )

    return app


async def _serve(service: DecodeService, request: Request, body: Any, encode: Any, *, chat: bool) -> Any:
    if body.n != 1:
        raise ServiceError("n must be 1: SmartGen generates one completion per request")
    if body.model is not None and body.model != service.model_name:
        raise ServiceError(f"model {body.model!r} is not served here; this node serves {service.model_name!r}", 404)
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    params = GenerationParams(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop_token_ids=list(body.stop_token_ids or []),
        scheme=body.scheme,
        proactive_counts=body.proactive_counts,
        return_selection_counts=body.return_selection_counts,
        skip_special_tokens=body.skip_special_tokens,
    )
    if max_tokens is not None:  # else the service's default
        params.max_tokens = max_tokens
    stops = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or [] if s]
    prompt_ids = await run_in_threadpool(encode)  # tokenizing a long prompt takes a while: not on the event loop
    if not prompt_ids:
        raise ServiceError("the prompt is empty")
    handle = service.submit(prompt_ids, params)
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{handle.request_id}",
        "created": int(time.time()),
        "model": service.model_name,
    }
    gen = _Generation(handle, stops, params.scheme, token_times=body.return_token_times)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _EventStream(
            _sse(gen, head, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
    try:
        pieces = [piece async for piece in gen.pieces()]
    finally:
        watcher.cancel()
        if gen.done is None:  # this handler was cancelled (server shutting down): free the request
            handle.cancel("request cancelled")
    done = gen.done
    assert done is not None  # set when gen.pieces() ran to its end
    if done.error is not None:
        return _error(done.error, _failure_status(done.reason))
    text = "".join(pieces)
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.reason, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    kind = "chat.completion" if chat else "text_completion"
    return {**head, "object": kind, "choices": [choice], "usage": done.usage}


async def _sse(gen: _Generation, head: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's server-sent events; the finally cancels the request when the client goes away mid-stream."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(payload: dict[str, Any] | str, finish: str | None = None) -> str:
        choice = {"index": 0, ("delta" if chat else "text"): payload, "logprobs": None, "finish_reason": finish}
        event = {**head, "object": kind, "choices": [choice]}
        if include_usage:
            event["usage"] = None
        return f"data: {json.dumps(event)}\n\n"

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        async for piece in gen.pieces():
            yield chunk({"content": piece} if chat else piece)
        done = gen.done
        assert done is not None  # set when gen.pieces() ran to its end
        if done.error is not None:
            error = _error_body(done.error, _failure_status(done.reason))
            yield f"data: {json.dumps(error)}\n\n"
        else:
            yield chunk({} if chat else "", finish=done.reason)
            if include_usage:
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': done.usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if gen.done is None:
            gen.handle.cancel("client went away")


@dataclass(slots=True)
class _Done:
    reason: str  # OpenAI finish_reason: "stop" | "length"; or the service's failures (FinishEvent.reason)
    usage: dict[str, Any]
    error: str | None = None


class _Generation:
    """One request's events as final text pieces (stop strings applied), then `done`."""

    def __init__(
        self, handle: RequestHandle, stops: list[str], scheme: str | None, *, token_times: bool = False
    ) -> None:
        self.handle, self.stops, self.scheme = handle, stops, scheme
        self.return_token_times = token_times
        self.text, self.sent = "", 0  # all text so far; how much of it was released
        self.token_times: list[float] = []
        self.stopped = False  # a stop string matched
        self.done: _Done | None = None

    async def pieces(self) -> AsyncIterator[str]:
        events = self.handle.aevents()
        finish: FinishEvent | None = None
        while finish is None:
            try:
                if self.stopped:  # the service should answer the cancel promptly; don't hang if it doesn't
                    event = await asyncio.wait_for(events.__anext__(), STOP_DRAIN_S)
                else:
                    event = await events.__anext__()
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
            if isinstance(event, FinishEvent):
                finish = event
            elif not self.stopped:
                self.token_times.append(event.time)
                piece = self._add(event.text)
                if piece or not self.stopped:  # a token whose text waits still streams (as vLLM's, empty)
                    yield piece
        if not self.stopped and (finish is None or finish.reason in ("stop", "length")) and self.sent < len(self.text):
            yield self.text[self.sent :]  # the held-back tail was not a stop string after all
        self.done = self._finish(finish)

    def _add(self, piece: str) -> str:
        """Appends a token's text; returns what is now final (never the start of a possible stop string)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:  # matches never start in released text: its possible stop prefixes were held back
            self.stopped, end = True, min(hits)
            self.text = self.text[:end]
            self.handle.cancel("stop string")
        else:
            end = len(self.text) - self._held_back()
        released, self.sent = self.text[self.sent : end], max(self.sent, end)
        return released

    def _held_back(self) -> int:
        longest = min(max((len(s) for s in self.stops), default=1) - 1, len(self.text) - self.sent)
        for k in range(longest, 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stops):
                return k
        return 0

    def _finish(self, finish: FinishEvent | None) -> _Done:
        times, created = self.token_times, self.handle.created
        usage: dict[str, Any] = {  # computed here as a fallback; the service's own numbers win below
            "prompt_tokens": self.handle.prompt_tokens,
            "completion_tokens": len(times),
            "ttft": times[0] - created if times else None,
            "ttst": times[1] - created if len(times) > 1 else None,
            "tbt": (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else None,
            "scheme": self.scheme,
        }
        usage.update({k: v for k, v in (finish.usage if finish else {}).items() if v is not None})
        if not self.return_token_times:
            usage.pop("ctl", None)
            usage.pop("selection_union_bytes", None)
            usage.pop("milestones", None)
            usage.pop("token_waits", None)
        if self.stopped:  # tokens generated after the stop string are not part of the answer
            usage["completion_tokens"] = len(times)
        counts = {"prompt_tokens": usage.pop("prompt_tokens"), "completion_tokens": usage.pop("completion_tokens")}
        usage.pop("total_tokens", None)  # recomputed: a stop string may have cut the completion
        usage = {**counts, "total_tokens": sum(counts.values()), **usage}
        if self.stopped:
            return _Done("stop", usage)
        if finish is None:
            return _Done("error", usage, "the decode node ended the request without finishing it")
        if finish.reason in ("stop", "length"):
            return _Done(finish.reason, usage)
        default = "request aborted by the decode node" if finish.reason == "aborted" else "generation failed"
        return _Done(finish.reason, usage, finish.error or default)


class _EventStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away and then closes the generator.

    Starlette only watches on ASGI spec < 2.4 and otherwise notices a gone client at the next send; closing the
    generator is what runs `_sse`'s finally, which cancels the request.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the client is gone (ASGI >= 2.4 servers raise on send)
                    pass
                finally:
                    group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """For non-stream requests: the body is read, so the next ASGI message is the client going away."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that raises instead of sending http.disconnect: the client is gone all the same
        pass
    handle.cancel("client went away")


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise ServiceError(f"the chat template rejected the messages: {exc}") from exc
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 returns a BatchEncoding
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def _message_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.get("type") != "text" for part in content):
        raise ServiceError("only text content parts are supported")
    return "".join(str(part.get("text", "")) for part in content)


def _failure_status(reason: str) -> int:
    """A request the nodes ended: aborted, refused for lack of room, failed because its prefill node was lost (dead,
    silent past its lease; or none was live) or because the decode node is stopping is 503: try again. One whose KV
    did not arrive within its bound from a prefill node still alive is 504. Anything else is ours: 500."""
    if reason == "timeout":
        return 504
    return 503 if reason in ("aborted", "overloaded", "unavailable") else 500


def _error_body(message: str, status: int) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(_error_body(message, status), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def refused(request: Request, exc: ServiceError) -> JSONResponse:
        return _error(str(exc), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems: dict[str, str] = {}  # first problem per field: a union's members each report one
        for e in exc.errors():
            if e.get("type") == "json_invalid":
                return _error("invalid request: the body is not valid JSON", 400)
            loc = [str(p) for p in e.get("loc", ()) if p != "body"]
            path = ".".join(p for p in loc if "[" not in p and p not in _TYPE_TAGS) or "body"
            field = loc[0] if loc else "body"
            hint = _FIELD_HINTS.get(field) if e.get("type") != "missing" else None
            problems.setdefault(field, f"{path}: {hint or e.get('msg', 'invalid')}")
        return _error(f"invalid request: {'; '.join(problems.values())}", 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)
