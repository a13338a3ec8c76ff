"""A small JSON status endpoint for a node (`/status`): what the monitor and the tests read."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["StatusServer"]


class StatusServer:
    """Serves `snapshot()` as JSON on GET /status in a background thread."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict[str, Any]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.rstrip("/") != "/status":
                    self.send_error(404, "only /status is served here")
                    return
                body = json.dumps(snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # keep the node's log for the node
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
