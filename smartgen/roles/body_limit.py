"""An ASGI middleware that refuses request bodies over a size limit before reading them (413, JSON error)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BodyLimit"]


class BodyLimit:
    """Checks Content-Length first (nothing read); a chunked body is counted as it streams in."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._refuse(send, 400, "invalid Content-Length header")
                return
            if size > self.max_bytes:
                await self._refuse(send, 413, self._message(size))
                return
        seen = 0
        over = False  # once over the limit the app's own answer is dropped and 413 goes out instead

        async def counted_receive() -> Any:
            nonlocal seen, over
            if over:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True  # the app sees an empty end of body; FastAPI would turn an exception into a 400
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Any) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        finally:
            if over:
                await self._refuse(send, 413, self._message(seen))

    def _message(self, size: int) -> str:
        return f"request body of {size} bytes is over the {self.max_bytes}-byte limit (--max-body-bytes)"

    @staticmethod
    async def _refuse(send: Any, status: int, message: str) -> None:
        kind = "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
