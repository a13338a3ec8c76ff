"""What the monitor reads beyond the engine's counters: down-sampled block maps and per-second throughput series."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

import torch

from smartgen.engine.mask import LOCAL, PAD, REMOTE

__all__ = ["MAP_WIDTH", "MAP_CHARS", "block_map", "RateHistory", "PATH_LABELS", "path_label"]

MAP_WIDTH = 128  # block-map cells per layer in /status; the dashboard down-samples again to its width
# one character per cell: every token local, every token remote, some of each, padding only
MAP_CHARS = {"local": "L", "remote": "R", "mixed": "M", "pad": "."}

# engine path names -> the `path` label operators chart (vLLM / SGLang naming)
PATH_LABELS = {
    "proactive": "proactive",
    "full": "full",
    "speculative": "speculative",
    "on_demand": "fetch_remote",
    "local": "fetch_local",
    "metadata": "metadata",
}


def path_label(engine_path: str) -> str:
    return PATH_LABELS.get(engine_path, engine_path)


def block_map(mask: torch.Tensor, width: int = MAP_WIDTH) -> str:
    """A mask row ([n] int8: 0 pad, 1 local, 2 remote) as at most `width` cells of MAP_CHARS, in token order.

    Each cell covers an equal share of the tokens (the last ones may cover one fewer), so a
    cell is "L" only when every token in it is local.
    """
    n = int(mask.numel())
    if n == 0:
        return ""
    cells = min(width, n)
    edges = torch.linspace(0, n, cells + 1).round().long()
    ids = torch.bucketize(torch.arange(n), edges[1:], right=True).clamp_(max=cells - 1)  # [n] cell of each token
    values = mask.long().cpu()
    local = torch.zeros(cells, dtype=torch.long).index_add_(0, ids, (values == LOCAL).long())
    remote = torch.zeros(cells, dtype=torch.long).index_add_(0, ids, (values == REMOTE).long())
    out = []
    for num_local, num_remote in zip(local.tolist(), remote.tolist()):
        if num_local and num_remote:
            out.append(MAP_CHARS["mixed"])
        elif num_local:
            out.append(MAP_CHARS["local"])
        elif num_remote:
            out.append(MAP_CHARS["remote"])
        else:
            out.append(MAP_CHARS["pad"])
    assert PAD == 0  # padding is what is neither local nor remote
    return "".join(out)


class RateHistory:
    """Samples cumulative counters once per `interval_s` in a thread; `series()` gives per-second rates.

    The series cover the last `window_s` seconds (the newest rate last), so a monitor that
    connects late still sees the last minute.
    """

    def __init__(
        self, read: Callable[[], Mapping[str, float]], interval_s: float = 1.0, window_s: float = 60.0
    ) -> None:
        self.interval_s = interval_s
        self._read = read
        self._samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=int(window_s / interval_s) + 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rate-history", daemon=True)

    def start(self) -> RateHistory:
        self.sample()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a counter read racing a closing link must not end the history
                pass

    def sample(self) -> None:
        values = dict(self._read())
        with self._lock:
            self._samples.append((time.monotonic(), values))

    def series(self) -> dict[str, list[float]]:
        """Name -> rates per second between consecutive samples, oldest first."""
        with self._lock:
            samples = list(self._samples)
        out: dict[str, list[float]] = {}
        for (t0, before), (t1, after) in zip(samples, samples[1:]):
            dt = max(t1 - t0, 1e-9)
            for name, value in after.items():
                out.setdefault(name, []).append(max(0.0, (value - before.get(name, 0.0)) / dt))
        return out
