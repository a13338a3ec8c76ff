"""A decode node's OpenAI-compatible API, served by uvicorn on a thread of its own until `stop()`."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from smartgen.roles.decode_node import DecodeNode
from smartgen.roles.http_api import create_app
from smartgen.roles.server_info import describe_node

__all__ = ["HttpServer"]

GRACEFUL_S = 3  # open connections get this long to finish once the server stops


class HttpServer:
    """Binds `host:port` at once (port 0: the system picks; `address` says which); `start()` serves and returns
    once uvicorn accepts requests. Off the main thread uvicorn installs no signal handlers: the caller owns them."""

    def __init__(self, node: DecodeNode, host: str, port: int, max_body_bytes: int, role: str = "decode") -> None:
        """`role`: what /server_info says the node is ("both" for `serve --role both`)."""
        info = describe_node(node, role)
        app = create_app(node.scheduler, metrics=node.monitoring.exposition, max_body_bytes=max_body_bytes, info=info)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S)
        self._server = uvicorn.Server(config)
        self._socket = socket.create_server((host, port))
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="http-api", daemon=True
        )

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the HTTP API on {self.address[0]}:{self.address[1]} did not start")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, force: bool = False) -> None:
        """Stops accepting, lets open connections finish (up to GRACEFUL_S; `force`: not at all), and waits."""
        self._server.should_exit = True
        self._server.force_exit = force
        if self._thread.is_alive():
            self._thread.join(GRACEFUL_S + 10)
        self._socket.close()
