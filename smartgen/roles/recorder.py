"""Records a node's /status snapshots as JSON lines (`serve --record`), the frames `monitor --replay` reads.

A frame is one JSON object per line: {"t": unix time, "decode": snapshot} or {"t": ..., "prefill": [snapshots]};
the dashboard's own recordings hold both at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["StatusRecorder", "frame", "write_frame"]

log = logging.getLogger(__name__)


def frame(decode: dict[str, Any] | None, prefill: list[dict[str, Any]], t: float | None = None) -> dict[str, Any]:
    """One recorded moment of a deployment: the decode node's snapshot and the prefill nodes'."""
    out: dict[str, Any] = {"t": time.time() if t is None else t}
    if decode is not None:
        out["decode"] = decode
    if prefill:
        out["prefill"] = prefill
    return out


def write_frame(file: IO[str], record: dict[str, Any]) -> None:
    file.write(json.dumps(record, separators=(",", ":")) + "\n")
    file.flush()  # a recording cut short (Ctrl-C, crash) keeps every whole frame


class StatusRecorder:
    """Appends `snapshot()` of one node to `path` every `interval_s` seconds, in a thread."""

    def __init__(
        self,
        path: Path,
        role: str,
        snapshot: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
        prefill_snapshot: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`prefill_snapshot`: a decode node's prefill half in the same process (`serve --role both`): each frame
        then holds both halves, as the dashboard's own recordings do."""
        self.path, self.role, self.interval_s = path, role, interval_s
        self._snapshot = snapshot
        self._prefill_snapshot = prefill_snapshot
        self._file = path.open("w")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.record()

    def record(self) -> None:
        try:
            snap = self._snapshot()
            prefill = [self._prefill_snapshot()] if self._prefill_snapshot is not None else []
        except Exception:  # a snapshot racing shutdown: skip this frame, keep recording
            log.debug("status snapshot failed", exc_info=True)
            return
        record = frame(snap, prefill) if self.role == "decode" else frame(None, [snap])
        write_frame(self._file, record)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.record()  # the last moment, so a replay ends where the run ended
        self._file.close()
