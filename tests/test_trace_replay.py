"""Trace replay and goodput: the trace's scaling and prompts, the goodput and percentile arithmetic on hand-made
records, every request accounted for, and (slow) a tiny trace replayed end to end whose caches hit as its ids say."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.bench.config import BenchConfig, TraceSpec
from smartgen.apps.bench.figures import goodput_figure, goodput_series
from smartgen.apps.bench.goodput import SLOs, serve_metrics, tpot
from smartgen.apps.bench.load import LoadRun, replay
from smartgen.apps.bench.results import BenchResult, Regime
from smartgen.apps.bench.tables import latency_table, load_table, nodes_table
from smartgen.apps.bench.trace import (
    MIN_OUTPUT_TOKENS,
    TraceRequest,
    block_tokens_for,
    expected_cached,
    prompt_tokens,
    read_trace,
)
from smartgen.apps.bench.watch import cache_counts, read_gauges
from smartgen.cli.app import app

# (timestamp ms, input_length, output_length, hash_ids): ids 10 and 11 open most prompts; 12 is only ever a partial
# last block (never cached whole); r5 repeats r1 exactly; r3 shares nothing
TINY = [
    (0, 1300, 40, [10, 11, 12]),
    (1500, 1536, 48, [10, 11, 13]),
    (3000, 2048, 8, [10, 11, 13, 14]),
    (4500, 600, 64, [20, 21]),
    (6000, 1300, 40, [10, 11, 12]),
    (7500, 1536, 48, [10, 11, 13]),
]
SCALE = 0.125  # 64 tokens per hash id


def _write(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) for t, n, o, ids in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_is_scaled_in_whole_blocks_with_its_last_one_partial(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path / "t.jsonl", TINY), length_scale=SCALE, time_scale=0.5)
    assert trace.block_tokens == block_tokens_for(SCALE) == 64
    # 1300 tokens = 2 blocks + 276 of 512: 128 + round(276 / 8) = 162; 600 = 1 block + 88: 64 + 11
    assert [r.input_tokens for r in trace.requests] == [162, 192, 256, 75, 162, 192]
    assert [r.output_tokens for r in trace.requests] == [5, 6, MIN_OUTPUT_TOKENS, 8, 5, 6]  # 8 x 0.125 = 1 -> 4
    assert [r.at_s for r in trace.requests] == [0.0, 0.75, 1.5, 2.25, 3.0, 3.75]
    assert trace.offered_rate == pytest.approx(5 / 3.75)
    assert trace.rescaled(2.0).span_s == pytest.approx(2.5) and trace.rescaled(2.0).offered_rate == pytest.approx(2)
    part = read_trace(tmp_path / "t.jsonl", length_scale=SCALE, start=2, max_requests=2)
    assert [r.index for r in part.requests] == [2, 3] and part.requests[0].at_s == 0.0  # times from the first kept


def test_long_prompts_are_clipped_or_refused_and_counted(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", TINY)
    clipped = read_trace(path, length_scale=SCALE, max_input=100)
    assert [r.input_tokens for r in clipped.requests] == [100, 100, 100, 75, 100, 100]
    assert clipped.num_clipped == 5 and clipped.num_refused == 0
    assert clipped.requests[2].hash_ids == (10, 11)  # the blocks it still covers
    refused = read_trace(path, length_scale=SCALE, max_input=100, over_length="refuse")
    assert refused.num_refused == 5 and [r.refused for r in refused.requests].count(False) == 1


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"timestamp": 0, "input_length": 10}', "not a Mooncake trace record"),
        ('{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1]}', "do not cover"),
        ("not json", "line 1"),
    ],
)
def test_a_file_that_is_not_such_a_trace_is_refused_with_its_line(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=says):
        read_trace(path)


def test_equal_hash_ids_give_equal_prompt_blocks() -> None:
    trace = [
        TraceRequest(i, 0.0, n, 4, tuple(ids))
        for i, (n, ids) in enumerate([(162, [10, 11, 12]), (192, [10, 11, 13]), (192, [10, 11, 12])])
    ]
    a, b, c = (prompt_tokens(r, 64, vocab=1000) for r in trace)
    assert len(a) == 162 and len(b) == 192
    assert a[:128] == b[:128] and a[128:162] != b[128:162]  # ids 10, 11 shared; 12 and 13 differ
    assert c[:162] == a  # a partial block is the head of the same id's whole block
    assert all(3 <= t < 1000 for t in a)
    assert prompt_tokens(trace[0], 64, vocab=1000, seed=1) != a  # another seed, other tokens


def test_expected_cache_hits_follow_the_ids_seen_whole_before(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path / "t.jsonl", TINY), length_scale=SCALE)
    # r1: 10, 11 whole in r0 (12 was partial); r2: 10, 11, 13 whole in r1; r4: 12 never whole; r5 = r1 entirely
    assert expected_cached(trace.requests, 64) == [0, 128, 192, 0, 128, 192]


def _served(ttft: float, ttst: float, tbt: float, tokens: int, itl: list[float], e2e: float) -> dict:
    return {"outcome": "served", "ttft": ttft, "ttst": ttst, "tbt": tbt, "output_tokens": tokens, "itl": itl,
            "e2e": e2e, "prompt_tokens": 100, "error": None}  # fmt: skip


RECORDS = [
    _served(0.1, 0.2, 0.01, 11, [0.1] + [0.01] * 9, 0.3),  # meets everything
    _served(0.5, 0.6, 0.01, 11, [0.1] + [0.01] * 9, 0.7),  # TTFT over 0.3
    _served(0.1, 0.9, 0.01, 11, [0.8] + [0.01] * 9, 1.0),  # TTST over 0.5
    _served(0.1, 0.2, 0.05, 11, [0.1] + [0.05] * 9, 0.65),  # TBT over 0.02
    {"outcome": "failed", "error": "failed while streaming (504): no first token"},
    {"outcome": "refused", "error": "HTTP 503: overloaded"},
]


@pytest.mark.parametrize(
    ("slos", "met"),
    [
        (SLOs(), 4),  # no objective: every served request counts
        (SLOs(ttft_s=0.3), 3),
        (SLOs(ttst_s=0.5), 2),  # the TTFT-late one is TTST-late too
        (SLOs(tbt_s=0.02), 3),
        (SLOs(ttft_s=0.3, ttst_s=0.5, tbt_s=0.02), 1),  # only a request meeting every one given
    ],
)
def test_goodput_counts_a_request_only_if_it_meets_every_objective_given(slos: SLOs, met: int) -> None:
    metrics = serve_metrics(RECORDS, duration_s=2.0, slos=slos)
    assert (metrics.requests, metrics.served, metrics.failed, metrics.refused) == (6, 4, 1, 1)
    assert metrics.met_slo == met and metrics.goodput == pytest.approx(met / 2.0)
    assert metrics.request_throughput == pytest.approx(2.0) and metrics.output_throughput == pytest.approx(22.0)
    assert metrics.total_token_throughput == pytest.approx(222.0)
    assert metrics.failures == {"failed: failed while streaming (504)": 1, "refused: HTTP 503": 1}


def test_percentiles_and_tpot_are_vllms() -> None:
    metrics = serve_metrics(RECORDS, duration_s=2.0, slos=SLOs())
    ttft = metrics.latencies["ttft"]  # 0.1, 0.1, 0.1, 0.5: linear between ranks, as numpy's default
    assert ttft["mean"] == pytest.approx(0.2) and ttft["p50"] == pytest.approx(0.1)
    assert ttft["p90"] == pytest.approx(0.1 + 0.7 * 0.4) and ttft["p99"] == pytest.approx(0.1 + 0.97 * 0.4)
    assert tpot(RECORDS[0]) == pytest.approx(0.02)  # (0.3 - 0.1) / 10: the stall included, unlike TBT
    assert metrics.latencies["tpot"]["p50"] == pytest.approx((0.02 + 0.055) / 2)
    itl = metrics.latencies["itl"]  # 40 gaps pooled: 30 short, 10 long
    assert itl["mean"] == pytest.approx((3 * 0.1 + 0.8 + 27 * 0.01 + 9 * 0.05) / 40)
    with pytest.raises(ValueError, match="outcomes"):
        serve_metrics([{"outcome": "lost"}], 1.0, SLOs())


def test_every_request_of_a_replay_is_accounted_for() -> None:
    def send(i: int) -> dict:
        if i == 1:
            raise RuntimeError("HTTP 400: prompt too long")
        if i == 2:
            raise RuntimeError("connection reset")
        return {"ttft": 0.01, "ctl": [0.01], "node_ttft": 0.005}

    records, wall = replay(send, [0.0, 0.01, 0.02, 0.03, 0.04], skipped={3: "over --max-input"})
    assert [r["outcome"] for r in records] == ["served", "refused", "failed", "refused", "served"]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4] and records[3]["sent"] is None
    assert "ctl" not in records[0] and records[0]["node_ttft"] == 0.005  # per-token curves are not kept
    assert wall >= 0.04


def test_the_nodes_figures_come_from_their_status_and_metrics() -> None:
    text = "# HELP x\nsmartgen:num_requests_waiting 3.0\nsmartgen:requests_queued 1.0\nsmartgen:other 5\n"
    assert read_gauges(text, ("smartgen:num_requests_waiting", "smartgen:requests_queued")) == {
        "smartgen:num_requests_waiting": 3.0,
        "smartgen:requests_queued": 1.0,
    }
    link = {"push": {"bytes_sent": 100}, "control": {"bytes_sent": 10}}
    status = {
        "decode": {"prefix_cache": {"lookup_tokens": 50, "hit_tokens": 20}, "links": [link]},
        "prefill": [{"prefix_cache": {"lookup_tokens": 40, "hit_tokens": 10}, "links": [link, link]}],
    }
    assert cache_counts(status) == {
        "decode_lookup": 50, "decode_hit": 20, "prefill_lookup": 40, "prefill_hit": 10, "ingress": 220, "egress": 110,
    }  # fmt: skip


runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["--slo-from-full", "2"], "give --trace too"),
        (["--trace", "TRACE", "--over-length", "drop"], "--over-length must be one of clip, refuse"),
        (["--trace", "TRACE", "--prefix-hit", "50"], "does not combine with --load-rate or --trace"),
        (["--trace", "TRACE", "--load-rate", "1,x"], "--load-rate takes comma-separated numbers"),
    ],
)
def test_bench_refuses_bad_trace_options_in_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    trace = _write(tmp_path / "t.jsonl", TINY)
    args = [str(trace) if a == "TRACE" else a for a in args]
    result = runner.invoke(app, ["bench", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()) and "Traceback" not in result.output


def _cached_by_ended(requests: list[TraceRequest], records: list[dict[str, float]]) -> list[int]:
    """Per request, the tokens a prefix cache holds for it from the requests whose streams ended before it was sent
    (both nodes cache a request's blocks before its stream ends)."""
    least = []
    for i, record in enumerate(records):
        ended = [requests[j] for j in range(i) if records[j]["sent"] + records[j]["e2e"] < record["sent"]]
        least.append(expected_cached([*ended, requests[i]], 64)[-1])
    return least


@pytest.mark.slow  # fresh nodes per scheme and a pilot: about a minute here
def test_a_tiny_trace_replays_end_to_end_with_the_hits_its_ids_say(tmp_path: Path) -> None:
    """The caches hold the whole blocks of the requests before: the prefill node's hit is that run of blocks (less the
    one token it computes), and full transfer's decode node holds the same run; every request is served, and goodput
    is what its records say. Arrivals are 1.5 s apart, which a busy machine may not keep up with, so a request is held
    to at least what the requests that ended before it was sent had cached and at most what all before it had."""
    trace = _write(tmp_path / "t.jsonl", TINY)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "smartgen", "bench", "--trace", str(trace), "--length-scale", str(SCALE)]
    command += ["--blocks", "64", "--schemes", "full,smartgen", "--strategies", "", "--output-tokens", "8"]
    command += ["--slo-ttft", "5", "--slo-tbt", "1", "--slo-ttst", "5", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    flat = " ".join(done.stdout.split())
    assert "trace t.jsonl: 6 requests (0 clipped, 0 refused over --max-input), 64 tokens per hash id" in flat
    data = json.loads((out / "results.json").read_text())
    requests = read_trace(trace, length_scale=SCALE).requests
    most = expected_cached(requests, 64)
    assert [run["scheme"] for run in data["loads"]] == ["full", "smartgen"]
    for run in data["loads"]:
        records = run["requests"]
        assert [r["outcome"] for r in records] == ["served"] * 6, [r.get("error") for r in records]
        assert [r["prompt_tokens"] for r in records] == [r.input_tokens for r in requests]
        assert [r["output_tokens"] for r in records] == [r.output_tokens for r in requests]
        least = _cached_by_ended(requests, records)
        cached = [r["cached_tokens"] for r in records]
        assert all(min(lo, r.input_tokens - 1) <= c <= min(hi, r.input_tokens - 1)
                   for lo, c, hi, r in zip(least, cached, most, requests)), (least, cached, most)  # fmt: skip
        if run["scheme"] == "full":  # whole prompt local at its end: the decode node caches every whole block
            held = [r["held_tokens"] for r in records]
            assert all(lo <= h <= hi for lo, h, hi in zip(least, held, most)), (least, held, most)
        assert sum(cached) > 0 and (run["scheme"] != "full" or sum(held) > 0)
        metrics = run["metrics"]
        met = sum(r["ttft"] <= 5 and r["ttst"] <= 5 and r["tbt"] <= 1 for r in records)
        assert metrics["met_slo"] == met and metrics["goodput"] == pytest.approx(met / run["wall_s"])
        assert metrics["served"] + metrics["failed"] + metrics["refused"] == 6
        hit = run["nodes"]["prefix_hit_tokens"]
        assert hit["prefill"] == sum(r["cached_tokens"] for r in records)
    with (out / "load.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["scheme"] for row in rows] == ["full", "smartgen"] and rows[0]["mode"] == "trace"


def _swept_result(tmp_path: Path) -> BenchResult:
    """A trace run's result at two rates, full and smartgen, from the hand-made records."""
    config = BenchConfig(schemes=("full", "smartgen"), strategies=(), load_rate=(1.0, 2.0), trace=TraceSpec(tmp_path))
    regime = Regime(0.03, 4.7, 1024, {1024: 0.3}, {1024: 0.008}, 0.0, 0.02, 3072, 6)
    result = BenchResult(config, "m", False, config.points(), [regime])
    result.trace = {"path": "t.jsonl", "block_tokens": 64, "requests": 6, "clipped": 1, "refused": 0}
    nodes = {"queue_s": {"decode": 0.5, "prefill": 0.25}, "link_utilisation": 0.9, "link_utilisation_back": 0.01,
             "prefix_hit_rate": {"prefill": 0.3, "decode": None}}  # fmt: skip
    for rate in (1.0, 2.0):
        for scheme in ("full", "smartgen"):
            run = LoadRun(0, scheme, rate, 5.0, 2.0 * rate, SLOs(ttft_s=0.3), RECORDS, mode="trace", nodes=nodes)
            result.loads.append(run)
    return result


def test_the_load_tables_fit_80_columns_and_name_each_rate(tmp_path: Path) -> None:
    result = _swept_result(tmp_path)
    console = Console(width=80, file=io.StringIO(), record=True)
    for table in (load_table(result, 0), latency_table(result, 0), nodes_table(result, 0)):
        console.print(table)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80 and not any("…" in line for line in lines)
    flat = " ".join(" ".join(lines).split())
    assert "trace t.jsonl: 6 requests (1 clipped, 0 refused over --max-input), 64 tokens per hash id" in flat
    row = next(line.split() for line in lines if line.split()[:1] == ["smartgen@2"])
    # rate, sent, ok, fail, ref, good/s (3 within TTFT 0.3 s over 4 s), req/s, tok/s, Δ (no node clock: -)
    assert row[1:] == ["2", "6", "4", "1", "1", "0.75", "1.00", "11.0", "-"]
    nodes_row = [line.split() for line in lines if line.split()[:1] == ["full@1"]][-1]  # the last table's
    assert nodes_row[1:] == ["500", "250", "90.0", "1.0", "30.0", "-"]
    assert any(line.split()[:2] == ["smartgen@1", "TTFT"] for line in lines)


def test_a_rate_sweep_draws_goodput_against_the_offered_rate(tmp_path: Path) -> None:
    result = _swept_result(tmp_path)
    assert goodput_series(result) == {0: {"full": [(1.0, 1.5), (2.0, 0.75)], "smartgen": [(1.0, 1.5), (2.0, 0.75)]}}
    pytest.importorskip("matplotlib")
    assert goodput_figure(result, tmp_path) == [tmp_path / "goodput.png"]
    result.loads = result.loads[:2]  # one rate: no curve
    assert goodput_figure(result, tmp_path / "one") == []
