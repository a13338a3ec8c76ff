"""Serving figures of a load or trace run from its request records, named and defined as `vllm bench serve` does.

A record is one request: `outcome` "served", "failed" (sent, and ended with an error: the reason in `error`) or
"refused" (a node refused it before streaming, e.g. 503 overloaded, or the bench did not send it: over --max-input
with --over-length refuse), and for a served one the streaming client's timings (client.py): `ttft`, `ttst`, `tbt`
(mean gap after the second token), `e2e`, `itl` (every gap between text chunks) and `output_tokens`.

- duration: seconds from the first request sent to the last one ended (vLLM's benchmark duration).
- request_throughput = served / duration; output_throughput = output tokens of served requests / duration.
- goodput = served requests meeting every objective given / duration; an objective left out (None) is not
  checked. TTFT and TTST as the client saw them; TBT is the mean gap from the second token on (the stall before
  the second token is TTST's, not TBT's). A request without the timing an objective needs (too few tokens) fails
  that objective.
- tpot: vLLM's time per output token, (e2e - ttft) / (output_tokens - 1): it includes the second token's stall.
- itl: every gap between chunks, pooled over requests (vLLM's ITL).
- percentiles: mean, p50, p90, p99 (linear between ranks, as numpy's default and vLLM's).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from smartgen.apps.bench.percentiles import percentile

__all__ = ["SLOs", "ServeMetrics", "serve_metrics", "meets", "OUTCOMES", "LATENCIES", "PERCENTILES"]

OUTCOMES = ("served", "failed", "refused")
LATENCIES = ("ttft", "ttst", "tbt", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLOs:
    """Service-level objectives in seconds; None: not checked."""

    ttft_s: float | None = None
    ttst_s: float | None = None
    tbt_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft_s), ("ttst", self.ttst_s), ("tbt", self.tbt_s)):
            if value is not None and not value > 0:
                raise ValueError(f"--slo-{name} must be positive")

    def words(self) -> str:
        parts = [f"{name} <= {value * 1e3:.4g} ms" for name, value in self.items()]
        return " and ".join(parts) if parts else "no objective (every served request counts)"

    def items(self) -> list[tuple[str, float]]:
        named = (("TTFT", self.ttft_s), ("TTST", self.ttst_s), ("TBT", self.tbt_s))
        return [(name, value) for name, value in named if value is not None]


def meets(record: dict[str, Any], slos: SLOs) -> bool:
    """Whether a record was served within every objective given."""
    if record.get("outcome") != "served":
        return False
    for key, limit in (("ttft", slos.ttft_s), ("ttst", slos.ttst_s), ("tbt", slos.tbt_s)):
        if limit is not None and (record.get(key) is None or record[key] > limit):
            return False
    return True


def tpot(record: dict[str, Any]) -> float | None:
    """vLLM's TPOT of one served request: (e2e - ttft) / (output tokens - 1)."""
    tokens = record.get("output_tokens") or 0
    if record.get("e2e") is None or record.get("ttft") is None or tokens < 2:
        return None
    return (record["e2e"] - record["ttft"]) / (tokens - 1)


@dataclass(slots=True)
class ServeMetrics:
    """One scheme's run: counts, throughputs, goodput and latency percentiles (seconds)."""

    requests: int
    served: int
    failed: int
    refused: int
    met_slo: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    latencies: dict[str, dict[str, float | None]]  # per LATENCIES: mean, p50, p90, p99
    failures: dict[str, int]  # reason (first words of the error) -> count, for failed and refused requests

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None} | {
        f"p{q}": percentile(values, q) for q in PERCENTILES
    }


def _reason(error: str | None) -> str:
    """An error's kind, for counting: its text up to the first colon (HTTP 503, failed while streaming (504), ...)."""
    return (error or "unknown").split(":")[0].strip()[:60]


def serve_metrics(records: list[dict[str, Any]], duration_s: float, slos: SLOs) -> ServeMetrics:
    """The figures of one run from its records (see the module's docstring); `duration_s` as vLLM's."""
    unknown = {r.get("outcome") for r in records} - set(OUTCOMES)
    if unknown:
        raise ValueError(f"request records with outcomes {sorted(map(str, unknown))}: every one must be {OUTCOMES}")
    served = [r for r in records if r["outcome"] == "served"]
    met = sum(meets(r, slos) for r in served)
    output = sum(int(r.get("output_tokens") or 0) for r in served)
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in served)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)

    def values(key: str) -> list[float]:
        if key == "itl":
            return [float(g) for r in served for g in r.get("itl") or []]
        if key == "tpot":
            return [v for r in served if (v := tpot(r)) is not None]
        return [float(r[key]) for r in served if r.get(key) is not None]

    failures: dict[str, int] = {}
    for r in records:
        if r["outcome"] != "served":
            reason = f"{r['outcome']}: {_reason(r.get('error'))}"
            failures[reason] = failures.get(reason, 0) + 1
    return ServeMetrics(
        requests=len(records),
        served=len(served),
        failed=sum(r["outcome"] == "failed" for r in records),
        refused=sum(r["outcome"] == "refused" for r in records),
        met_slo=met,
        duration_s=duration_s,
        request_throughput=per_s(len(served)),
        output_throughput=per_s(output),
        total_token_throughput=per_s(output + prompt),
        goodput=per_s(met),
        latencies={key: _stats(values(key)) for key in LATENCIES},
        failures=failures,
    )
