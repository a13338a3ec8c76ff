"""Where the dashboard's frames come from: live nodes over HTTP, or a recording replayed frame by frame."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Protocol

from smartgen.roles.recorder import frame, write_frame
from smartgen.tui.model import Frame

__all__ = ["Feed", "HttpFeed", "ReplayFeed", "FeedError", "status_url"]


class FeedError(ConnectionError):
    """A node did not answer; the message says which and why."""


class Feed(Protocol):
    """What the app polls: `poll()` returns the next frame or raises FeedError."""

    label: str

    def poll(self) -> Frame: ...


def status_url(url: str) -> str:
    """`host:port`, `http://host:port` or a full /status URL -> the /status URL."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/status") else url + "/status"


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:  # URLError, refused, timed out, not JSON
        reason = getattr(exc, "reason", None) or exc
        raise FeedError(f"{url}: {reason}") from exc


class HttpFeed:
    """Polls the decode node's /status and each prefill node's; `record` appends every frame to a file."""

    def __init__(
        self,
        decode: str | None,
        prefill: list[str],
        timeout: float = 2.0,
        record: IO[str] | None = None,
        name: str = "",
    ) -> None:
        if not decode and not prefill:
            raise ValueError("give a decode node (--decode URL) or a prefill node (--prefill URL) to watch")
        self.decode = status_url(decode) if decode else None
        # what the nodes strip of a several-node dashboard calls it: given, else the decode node's HOST:PORT
        self.name = name or (self.decode or "").removesuffix("/status").split("://")[-1]
        self.prefill = [status_url(u) for u in prefill]
        self.timeout = timeout
        self.record = record
        self.label = " ".join(u.removesuffix("/status") for u in ([self.decode] if self.decode else []) + self.prefill)

    def poll(self) -> Frame:
        decode = _get_json(self.decode, self.timeout) if self.decode else None
        prefill = [_get_json(url, self.timeout) for url in self.prefill]
        record = frame(decode, prefill)
        if self.record is not None:
            write_frame(self.record, record)
        return Frame(record["t"], decode, prefill, sources=[u for u in [self.decode, *self.prefill] if u])


class ReplayFeed:
    """Frames of a recording (`serve --record`, `monitor --record`), one per poll; the last one repeats."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.frames: list[Frame] = []
        with path.open() as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    self.frames.append(Frame.from_record(json.loads(line)))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a status frame ({exc})") from None
        if not self.frames:
            raise ValueError(f"{path} holds no frames")
        self.position = 0  # index of the next frame poll() returns
        self.label = f"replay {path.name}"

    def poll(self) -> Frame:
        at = min(self.position, len(self.frames) - 1)
        self.position = min(self.position + 1, len(self.frames))
        return self.frames[at]

    @property
    def done(self) -> bool:
        return self.position >= len(self.frames)
