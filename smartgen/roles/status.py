"""A small HTTP endpoint for a node: JSON live state on `/status`, Prometheus metrics on `/metrics`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["StatusServer"]


class StatusServer:
    """Serves `snapshot()` as JSON on GET /status (and `metrics()` on GET /metrics) in a background thread."""

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: Callable[[], dict[str, Any]],
        metrics: Callable[[], tuple[bytes, str]] | None = None,
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?")[0].rstrip("/")
                if path == "/metrics" and metrics is not None:
                    body, content_type = metrics()
                elif path == "/status":
                    body, content_type = json.dumps(snapshot()).encode(), "application/json"
                else:
                    self.send_error(404, "only /status and /metrics are served here")
                    return
                self.send_response(200)
                self.send_header("Content-Type", content_type)
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
