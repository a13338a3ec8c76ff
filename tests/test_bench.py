"""`smartgen bench --quick` end to end on real nodes: every output file exists and parses, every scheme appears, the
numbers agree with each other (TTST >= TTFT, CTL non-decreasing, full transfer moves exactly the prompt's KV, the
client's clock holds the node's). The streaming client against a scripted server. Performance itself is never
asserted here: that is what the benchmark reports."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from smartgen.apps.bench.config import BenchConfig, Point
from smartgen.apps.bench.stats import percentile
from smartgen.apps.cluster import split_cpus
from smartgen.cli.app import app
from smartgen.engine.kv_quant import SERVING_QUANT, packed_layer_bytes

SCHEMES = "full,partial,partial+profile,partial+profile+parallel,smartgen-paper,smartgen,proactive-only,quant2"
SAMPLE_KV_BYTES_PER_TOKEN = 2 * 6 * 2 * 32 * 4  # K and V, 6 layers, 2 KV heads, head dim 32, fp32


# what a prefill node's link carries, by the tag its lanes send under (lanes/link_timeline.py)
LINK_TAGS = {"full", "proactive", "speculative", "on_demand", "on_demand/low", "metadata", "control", "other"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench") / "out"
    command = [sys.executable, "-m", "smartgen", "bench", "--quick", "--lengths", "512", "--output-tokens", "6"]
    command += ["--blocks", "64", "--schemes", SCHEMES, "--strategies", "random,optimal", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


# slow: the bench end to end (about 45 s); CI runs these with `make test-slow`, and its GPU check's CPU half runs a bench too
@pytest.mark.slow
def test_quick_bench_writes_every_file(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["versions"] and data["config"]["schemes"]
    with (out / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    for name in ("ctl.png", "steps.png", "ttst_tbt.png", "link.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = [*SCHEMES.split(","), "smartgen[random]", "smartgen[optimal]"]
    assert [row["scheme"] for row in rows] == expected
    for scheme in expected:  # the table on the terminal shows every scheme, whole
        assert scheme in stdout
    assert max(len(line) for line in stdout.splitlines()) <= 80  # piped: 80 columns, folded where needed
    assert "rng" in stdout and "acc x" in stdout  # the rounds' spread, accuracy against full
    assert "the decode node's own clock" in " ".join(stdout.split()) and "join" in stdout.split()
    assert {"node_ttft_mean_s", "ttft_minus_node_max_s", "e2e_p50_s", "itl_p99_s", "joins"} <= set(rows[0])
    assert all(int(row["failed"]) == 0 for row in rows)


@pytest.mark.slow
def test_quick_bench_numbers_are_consistent(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    measured = [g for g in data["groups"] if not g["warmup"]]
    assert measured
    step_seconds = prefill_seconds = 0.0
    prefill_ms = 0  # the prefill thread's CPU in the rounds' cpu_timeline
    for group in measured:
        for request in group["requests"]:
            assert request["error"] is None
            assert request["ttst"] >= request["ttft"] > 0 and request["node_ttst"] >= request["node_ttft"] > 0
            ctl = request["node_ctl"]  # the node's token times
            assert len(ctl) == 6 and all(b >= a for a, b in zip(ctl, ctl[1:]))
            chunks = request["ctl"]  # the client's: a chunk per token with text of its own
            assert 2 <= request["client_tokens"] == len(chunks) <= 6 and chunks == sorted(chunks)
            assert chunks[0] == request["ttft"] and request["itl"] == pytest.approx(
                [b - a for a, b in zip(chunks, chunks[1:])]
            )
            assert request["e2e"] >= chunks[-1] and request["sent"] >= 0
            if request["client_tokens"] == 6:  # the client's clock starts before the node's and ends after it
                assert request["ttft"] >= request["node_ttft"] and request["ttst"] >= request["node_ttst"]
                if group["scheme"] == "partial":  # its first step fetches: the first token must not wait for it
                    assert request["ttft"] < request["node_ttst"], request
            union = request["selection_union_bytes"]  # distinct entries selected by each token: grows, within the KV
            assert len(union) == 6 and all(b >= a for a, b in zip(union, union[1:]))
            assert 0 <= union[-1] <= 4 / 6 * SAMPLE_KV_BYTES_PER_TOKEN * request["prompt_tokens"]
            # the decode node selects at its steps; tokens of the prefill node's head start select there, not here
            assert union[-1] > 0 or request["prefill_tokens"] == len(ctl), request
            assert ctl[0] == pytest.approx(request["node_ttft"]) and ctl[1] == pytest.approx(request["node_ttst"])
            if request["prefill_tokens"] < len(ctl):  # else the decode node ran no step: no first step to cover
                assert 0.0 <= request["first_step_coverage"] <= 1.0
            assert 0.0 <= request["first_step_wait"] <= request["fetch_wait"] < request["ttst"] + 6 * request["tbt"]
            # the node's timeline: each token's link wait sums to the request's, and a request its own steps decoded
            # joined the batch before its first such token
            waits, milestones = request["token_waits"], request["milestones"]
            assert len(waits) == 6 and sum(waits) == pytest.approx(request["fetch_wait"])
            assert all(0 <= at <= ctl[-1] for at in milestones.values()), milestones
            if request["prefill_tokens"] < len(ctl):
                assert milestones["joined"] <= ctl[request["prefill_tokens"]], milestones
        # the decode node's threads over the group, busiest first; /proc counts in 10 ms ticks, and a group whose
        # tokens all came from the prefill node's head start ran no decode step: the run as a whole shows the steps
        threads = group["decode_threads"]
        assert all(v > 0 for v in threads.values()) and list(threads.values()) == sorted(threads.values())[::-1]
        step_seconds += threads.get("decode-scheduler", 0.0)
        prefill_threads = group["prefill_threads"]  # the prefill node's, the same way
        assert all(v > 0 for v in prefill_threads.values())
        prefill_seconds += prefill_threads.get("prefill-work", 0.0)
        if group["scheme"] == "full":  # every block of every layer, once: exactly the prompt's KV
            prompt = sum(r["prompt_tokens"] for r in group["requests"])
            assert group["path_bytes"]["full"] == SAMPLE_KV_BYTES_PER_TOKEN * prompt
            assert group["path_bytes"]["proactive"] == 0
            assert group["path_bytes"]["on_demand"] == group["path_bytes"]["speculative"] == 0
        if group["scheme"] == "quant2":  # every layer packed: 2-bit codes, fp16 scales, a 128-token exact residual
            packed = sum(
                6 * packed_layer_bytes(r["prompt_tokens"], 2, 32, torch.float32, SERVING_QUANT)
                for r in group["requests"]
            )
            assert group["path_bytes"]["full"] == packed
            assert packed < 0.4 * SAMPLE_KV_BYTES_PER_TOKEN * sum(r["prompt_tokens"] for r in group["requests"])
        if group["scheme"] in ("full", "quant2"):  # the whole cache is local before decoding starts
            assert all(r["first_step_coverage"] == 1.0 for r in group["requests"])
        if group["scheme"] == "partial":  # layers >= 2 are never pushed: the first step has all of them to fetch
            assert all(r["first_step_coverage"] == 0.0 for r in group["requests"])
        if group["scheme"] == "proactive-only":
            assert group["path_bytes"]["on_demand"] == group["path_bytes"]["speculative"] == 0
        # the decode node counts each fetch it landed: none without on-demand bytes, and a reply takes time
        assert (group["fetches"] > 0) == (group["path_bytes"]["on_demand"] > 0)
        assert (group["fetch_s"] > 0) == (group["fetches"] > 0)
        assert sum(k[0] for k in group["fetch_kinds"].values()) == group["fetches"]  # every kind counted
        # the link's timeline over the round: every byte the prefill node's pacer booked toward the decode node, by
        # what it was (pushes, replies, messages), a second at a time
        timeline = group["link_timeline"]
        assert len({len(series) for series in timeline.values()}) == 1, timeline  # one length: the round's seconds
        booked = {tag: sum(series) for tag, series in timeline.items()}
        assert sum(booked.values()) > 0 and set(booked) <= LINK_TAGS, booked
        # a path counts what was posted, pushes still queued on a lane when the round ends included; a full transfer's
        # every byte crosses before its first decode step, so the round's timeline holds all of them and their frames'
        # (its first second may also hold the tail of the round before: the bins are whole seconds)
        if group["scheme"] in ("full", "quant2"):
            assert booked["full"] >= group["path_bytes"]["full"], (booked, group["path_bytes"])
        # each node's CPU over the same seconds, by thread role (sampled once a second: a short round may show its
        # prefill in the next round's first second, so only its length and the roles' names are certain)
        cpu = group["cpu_timeline"]
        assert set(cpu) == {"decode", "prefill"}, cpu
        for node, roles in cpu.items():
            assert all(len(series) == len(next(iter(timeline.values()))) for series in roles.values()), (node, roles)
            assert all(ms >= 0 for series in roles.values() for ms in series)
        prefill_ms += sum(cpu["prefill"].get("prefill-work", []))
        # the decode node's steps by batch size (batch 1 here): emulated compute and link waits within the wall
        # (none where the prefill node's head start gave every token)
        if not all(r["prefill_tokens"] == len(r["node_ctl"]) for r in group["requests"]):
            assert list(group["steps"]) == ["1"], group["steps"]
            steps, wall, cpu, emulated, wait, preempted = group["steps"]["1"]
            assert steps >= 1 and wall >= cpu > 0 and wall >= emulated + wait and emulated >= 0  # --quick: native
            assert preempted >= 0 and preempted == int(preempted)  # the step thread's involuntary switches, counted
        else:
            assert group["steps"] == {} and group["scheme"].startswith("smartgen"), group
    assert step_seconds > 0 and prefill_seconds > 0  # the step and prefill threads' CPU, over every scheme's round
    assert prefill_ms > 0  # and second by second
    for group in measured:  # the decode node's requests and notices back to the prefill node are counted
        assert group["link_bytes_back"] > 0 and group["link_bytes"] > group["link_bytes_back"]
    # every phase reports its progress: the model's without a count, the pilot per request, the rounds per group
    phases = data["phases"]
    assert [(p["phase"], p["total"]) for p in phases] == [("model", None), ("pilot", 4), ("rounds", 2 * 10)]
    assert all(p["done"] == (p["total"] or 0) and p["seconds"] > 0 for p in phases)
    for summary in data["summaries"]:
        rounds = summary["rounds"]["ttst"]  # one measured round (--quick): no spread, its median the request's
        assert rounds["per_round"] == [rounds["median"]] and rounds["min"] == rounds["max"] == rounds["median"]
        assert summary["link_utilisation_back"] > 0
        assert summary["ctl"] == sorted(summary["ctl"]) and summary["node_ctl"] == sorted(summary["node_ctl"])
        assert summary["minus_node"]["ttft"]["mean"] is not None and summary["joins"] == 0  # batch 1: no joins
        if summary["scheme"] == "full":
            assert summary["vs_full"]["ttst_speedup"] == pytest.approx(1.0)
        assert summary["ttst_bound"] > 0
        if summary["fetch_round_trip"] is not None:  # a paced link: no reply lands before its bytes have crossed
            assert summary["fetch_round_trip"] >= summary["fetch_link"] > 0
        assert summary["ttst_bound_selection"] >= summary["ttst_bound"]
        if summary["step_by_batch"] or not summary["scheme"].startswith("smartgen"):  # none after a whole head start
            assert list(summary["step_by_batch"]) == ["1"] and summary["step_by_batch"]["1"]["other_s"] >= 0
        bound = summary["ctl_bound"]
        assert len(bound) == len(summary["node_ctl"]) and bound == sorted(bound)


def test_bench_refuses_bad_input() -> None:
    for args, message in [
        (["--schemes", "smartgen"], "must include full"),
        (["--schemes", "full,warp"], "unknown scheme"),
        (["--strategies", "optimal", "--load-rate", "1"], "load and trace modes have not"),
        (["--batch", "two"], "comma-separated whole numbers"),
        (["--budget", "1.5"], "shares of the prompt"),
        (["--model", "random:x"], "random:LAYERS"),
        (["--model", "random:1"], "between 3 and 256 layers"),
        (["--model", "no/such/folder"], "no model folder there"),
        (["--lane", "carrier-pigeon"], "--lane must be one of"),
        (["--decode-emulation", "slept"], "--decode-emulation is one of added, floor"),
        (["--batch", "4", "--load-rate", "1", "--strategies", ""], "set how many decode at once with --max-batch"),
    ]:
        done = CliRunner().invoke(app, ["bench", *args])  # in-process: a process each took 5 s of imports
        assert done.exit_code == 2, (args, done.output)  # a usage error, like typer's own
        assert message in done.stderr and "Traceback" not in done.output + done.stderr, done.stderr


class _Scripted(BaseHTTPRequestHandler):
    """Answers a POST with the server's `script`: (status, [(seconds to wait, line), ...]), then closes (HTTP/1.0)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))  # type: ignore[attr-defined]
        status, lines = self.server.script  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
        self.end_headers()
        for wait, line in lines:
            time.sleep(wait)
            self.wfile.write(line.encode())
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _text(piece: str) -> str:
    return _event({"choices": [{"index": 0, "text": piece, "finish_reason": None}], "usage": None})


def test_the_streaming_client_times_each_chunk_and_keeps_the_nodes_usage() -> None:
    from smartgen.apps.bench.client import RequestFailed, stream_completion

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    usage = {"prompt_tokens": 4, "completion_tokens": 4, "ttft": 0.01, "ttst": 0.3, "tbt": 0.1, "ctl": [0.01, 0.3]}
    try:
        finish = _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None})
        server.script = (200, [(0, _text("a")), (0.3, _text("b")), (0, _text("")), (0.1, _text("c")), (0, finish),  # type: ignore[attr-defined]
                               (0, _event({"choices": [], "usage": usage})), (0, _event("[DONE]"))])  # fmt: skip
        streamed = stream_completion(url, {"prompt": [1, 2], "max_tokens": 4})
        body = server.bodies[-1]  # type: ignore[attr-defined]
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["return_token_times"]
        assert streamed.text == "abc" and streamed.usage == usage
        timings = streamed.timings()
        # four token chunks: an empty one is a token whose text waits (vLLM's client counts it too); the closing
        # chunk, empty with its finish reason, is none; the second sent 0.3 s after the first
        chunks = timings["ctl"]
        assert timings["client_tokens"] == 4 and chunks == streamed.arrivals
        assert 0 <= timings["ttft"] < timings["ttst"] and timings["ttst"] >= 0.3
        assert timings["itl"] == pytest.approx([chunks[1] - chunks[0], chunks[2] - chunks[1], chunks[3] - chunks[2]])
        # TBT per token after the second: the node's four tokens, two of them from the second chunk to the last
        # (0.1 s apart as sent: a chunk read a few ms late on a busy machine shortens the gap it closes, so not >= 0.05)
        assert timings["tbt"] == pytest.approx((chunks[3] - chunks[1]) / 2) and timings["tbt"] >= 0.04
        assert timings["e2e"] >= timings["ctl"][-1]
        assert (timings["node_ttft"], timings["node_ttst"], timings["node_ctl"]) == (0.01, 0.3, [0.01, 0.3])
        failures = [
            ((503, [(0, json.dumps({"error": {"message": "overloaded: no pool slot", "code": 503}}))]),
             "HTTP 503: overloaded: no pool slot"),
            ((200, [(0, _text("a")), (0, _event({"error": {"message": "aborted", "code": 503}}))]),
             r"failed while streaming \(503\): aborted"),
            ((200, [(0, _text("a"))]), r"ended before \[DONE\]"),
            ((200, [(0, _text("a")), (0, _event("[DONE]"))]), "without its usage"),
            ((200, [(0, _event("{not json"))]), "not JSON"),
        ]  # fmt: skip
        for script, message in failures:
            server.script = script  # type: ignore[attr-defined]
            with pytest.raises(RequestFailed, match=message):
                stream_completion(url, {"prompt": "x"})
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(RequestFailed, match="ConnectError"):  # nobody listens there now
        stream_completion(url, {"prompt": "x"})


def test_points_cover_every_sweep_and_group_by_nodes() -> None:
    config = BenchConfig(batch=(1, 2), lengths=(512, 1024), stall_ratio=(2.0, 4.7), budget=(0.1,))
    points = config.points()
    assert len(points) == 8
    assert {(p.batch, p.length, p.link) for p in points} == {
        (b, n, r) for b in (1, 2) for n in (512, 1024) for r in (2.0, 4.7)
    }
    keys = [p.node_key() for p in points]
    assert keys == sorted(keys, key=keys.index)  # points sharing nodes are adjacent
    assert Point(1, 512, 4.7, 1024, 0.2, 0.1, 1).label("stall").startswith("batch 1, 512 tokens, stall 4.7x")
    assert config.all_schemes[-4:] == (
        "smartgen[random]",
        "smartgen[sequential]",
        "smartgen[streaming]",
        "smartgen[optimal]",
    )


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_load_mode_counts_goodput_against_both_objectives():
    from smartgen.apps.bench.client import RequestFailed
    from smartgen.apps.bench.load import LoadSpec, run_load

    answers = [
        {"ttft": 0.5, "tbt": 0.05, "node_ttft": 0.49},  # meets both
        {"ttft": 3.0, "tbt": 0.05, "node_ttft": 2.99},  # TTFT too slow
        {"ttft": 0.5, "tbt": 0.5, "node_ttft": 0.49},  # TBT too slow
    ]

    def send(i: int) -> dict:
        if i % 8 == 3:
            raise RequestFailed("HTTP 503: overloaded: no pool slot")  # refused before streaming
        if i % 8 == 7:
            raise RequestFailed("failed while streaming (504): no first token")
        return answers[i % 4]

    spec = LoadSpec(rate=200.0, duration_s=0.5, slo_ttft_s=2.0, slo_tbt_s=0.2)
    run = run_load(send, spec, point=0, scheme="full", seed=1)
    assert run.arrivals > 20  # Poisson at 200/s over 0.5 s: about 100
    assert run.completed + run.failed + run.refused == run.arrivals == len(run.requests)
    assert run.refused == (run.arrivals + 4) // 8 and run.failed == run.arrivals // 8
    assert run.metrics.failures == {
        "refused: HTTP 503": run.refused,
        "failed: failed while streaming (504)": run.failed,
    }
    metrics = run.metrics
    assert metrics.met_slo == (run.arrivals + 3) // 4  # requests 0, 4, 8, ...
    assert run.goodput == pytest.approx(metrics.met_slo / run.wall_s)  # per second of the run, as vLLM's
    assert run.percentiles("ttft")["p50"] == 0.5 and run.percentiles("node_ttft")["p50"] == 0.49
    assert run.ttft_minus_node()["max"] == pytest.approx(0.01)
    assert all(r.get("node_ttft") is None for r in run.requests if r["error"])
    with pytest.raises(ValueError, match="positive"):
        LoadSpec(rate=0)
    with pytest.raises(ValueError, match="--slo-ttft"):
        BenchConfig(load_rate=(1.0,), slo_ttft_s=0, strategies=())


def test_the_decode_nodes_batch_follows_the_mode() -> None:
    """Rounds decode their largest batch at once; load mode's arrivals get serve's own default (not one slot that
    queues every arrival behind the one decoding), and --max-batch wins in both."""
    assert BenchConfig(batch=(1, 4), strategies=()).node_batch == 4
    assert BenchConfig(load_rate=(1.0,), strategies=()).node_batch == 8
    assert BenchConfig(load_rate=(1.0,), strategies=(), max_batch=3).node_batch == 3
    assert BenchConfig(batch=(1, 4), strategies=(), max_batch=2).node_batch == 2


@pytest.mark.slow  # real nodes with prefix caches, about 50 s: `make test-slow`
def test_a_prefix_hit_sweep_hits_exactly_the_asked_share_on_both_nodes(tmp_path: Path) -> None:
    """With both caches on, a request hits its shared prefix and nothing more: the prefill node computes only the
    rest, and full transfer moves only the KV of the tokens the decode node lacks."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "smartgen", "bench", "--quick", "--lengths", "512", "--output-tokens", "4"]
    command += ["--blocks", "64", "--schemes", "full,smartgen", "--strategies", "", "--reps", "1"]
    command += ["--prefix-hit", "0,75", "--prefix-cache", "both", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prefix hit sweep (both cache)" in done.stdout
    data = json.loads((out / "results.json").read_text())
    hits = [point["prefix_hit"] for point in data["points"]]
    assert hits == [0.0, 0.75]
    split = split_cpus()  # two processes: each node on its own CPUs, unless this machine has one
    prefill_cpus, decode_cpus = ([",".join(map(str, cpus)) for cpus in split]) if split else ("", "")
    expected_cpus = f"prefill {prefill_cpus}, decode {decode_cpus}" if split else "shared"
    assert data["points"][0]["regime"]["cpus"] == expected_cpus
    assert f"CPUs {expected_cpus}" in " ".join(done.stdout.split())
    for group in data["groups"]:
        for request in group["requests"]:
            assert request["error"] is None
            expected = int(hits[group["point"]] * request["prompt_tokens"]) // 16 * 16
            assert request["cached_tokens"] == request["held_tokens"] == expected
        if group["scheme"] == "full":
            lacking = sum(r["prompt_tokens"] - r["held_tokens"] for r in group["requests"])
            assert group["path_bytes"]["full"] == SAMPLE_KV_BYTES_PER_TOKEN * lacking
    for args, message in [(["--prefix-hit", "100"], "in [0, 100)"), (["--prefix-cache", "gpu"], "--prefix-cache")]:
        bad = subprocess.run([sys.executable, "-m", "smartgen", "bench", *args], capture_output=True, text=True)
        assert bad.returncode != 0 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_bench_on_the_inproc_lane_runs_one_process_and_pays_the_link(tmp_path: Path) -> None:
    """`--lane inproc`: one `serve --role both` process; the prefill half's counters still reach the results, and
    full transfer's KV takes at least its wire time at the paced rate (the pacer charges the in-process lane)."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "smartgen", "bench", "--quick", "--lane", "inproc", "--lengths", "512"]
    command += ["--output-tokens", "6", "--blocks", "64", "--schemes", "full,smartgen", "--strategies", "", "--out"]
    done = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "inproc lane (one process)" in " ".join(done.stdout.split())
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["lane"] == "inproc"
    with (out / "summary.csv").open() as handle:
        assert {row["lane"] for row in csv.DictReader(handle)} == {"inproc"}
    rate = data["points"][0]["regime"]["link_gbps"] * 1e9 / 8
    assert data["points"][0]["regime"]["cpus"] == "shared"  # one process cannot be split
    for group in data["groups"]:
        assert group["link_bytes"] > 0
        # the in-process lane counts a push's posting as it lands: full transfer waits for every one, while smartgen's
        # answer may end inside its prefill node's head start, before any of its pushes has landed
        assert group["posting_s"] > 0 or group["scheme"] != "full"
        for request in group["requests"]:
            assert request["error"] is None
        if group["scheme"] == "full":
            [request] = group["requests"]
            assert group["path_bytes"]["full"] == SAMPLE_KV_BYTES_PER_TOKEN * request["prompt_tokens"]
            # a lower bound only (5% slack: a busy pacer may run its clock slightly in the past): the last block
            # cannot land before the KV's wire time
            assert request["ttst"] >= 0.95 * group["path_bytes"]["full"] / rate


def test_the_bundled_models_resolve_by_name() -> None:
    from smartgen.apps.bench.models import resolve_model

    for name, layers in (("sample", 6), ("sample16", 16)):
        folder, trained = resolve_model(name)
        config = json.loads((folder / "config.json").read_text())
        assert trained and config["num_hidden_layers"] == layers
        assert (folder / "model.safetensors").stat().st_size <= 25 * 10**6  # what a clone may carry
    with pytest.raises(ValueError, match="sample, sample16 or random:LAYERS"):
        resolve_model("no-such-folder")


def test_ttst_bounds_add_only_what_prefill_cannot_hide() -> None:
    from smartgen.apps.bench.runner import Regime
    from smartgen.apps.bench.stats import Summary, ctl_bound, ttst_bound
    from smartgen.lanes.rate import bytes_per_second

    def summary(ttft: float, tbt: float, metadata: float) -> Summary:
        timing = {"mean": ttft}
        return Summary(0, "x", 1, 0, timing, timing, {"mean": tbt}, [], None, None, None, None, None,
                       {"metadata": metadata}, 0.0, 0.0, None, None)  # fmt: skip

    token_bytes, length, layers = 1000, 1000, 10
    rate = bytes_per_second(0.008)  # 1 MB/s
    regime = Regime(0.008, 4.7, length, {}, {}, 0.0, 0.1, token_bytes, layers)
    full = summary(ttft=0.5, tbt=0.01, metadata=0.0)
    scheme = summary(ttft=0.5, tbt=0.02, metadata=0.05 * rate)
    # layers 0-1 (0.2 MB) and metadata (0.05 MB) in the 0.45 s of prefill after layer 0: nothing exposed
    assert ttst_bound(length, regime, full, scheme) == pytest.approx(0.5 + 0.01)
    # plus a 20% selection of layers 2-9 (0.16 MB): 0.41 MB in 0.45 s still hides
    assert ttst_bound(length, regime, full, scheme, selection_budget=0.2) == pytest.approx(0.5 + 0.01)
    # a 50% selection (0.4 MB): 0.65 MB, 0.2 s past the prefill
    assert ttst_bound(length, regime, full, scheme, selection_budget=0.5) == pytest.approx(0.5 + 0.2 + 0.01)
    # per token: all-local steps after the prefill, or the link's time for layers 0-1, metadata and the union
    scheme.selection_union = [0.0, 0.1e6, 0.15e6, 0.9e6]
    assert ctl_bound(length, regime, full, scheme) == pytest.approx([0.5, 0.51, 0.52, 1.15])
    # a batch of two on one prefill node: both requests' bytes cross the one link
    assert ttst_bound(length, regime, full, scheme, sharing=2) == pytest.approx(0.5 + 0.05 + 0.01)  # 0.5 MB
    assert ctl_bound(length, regime, full, scheme, sharing=2) == pytest.approx([0.5, 0.7, 0.8, 2.3])


def test_a_batch_shares_its_prefill_nodes_links() -> None:
    from smartgen.apps.bench.config import Point
    from smartgen.apps.bench.stats import link_sharing

    def point(batch: int, nodes: int) -> Point:
        return Point(batch, 1024, 4.7, 256, 0.1, 0.1, nodes)

    assert [link_sharing(point(b, 1)) for b in (1, 2, 4)] == [1, 2, 4]
    assert link_sharing(point(4, 2)) == 2 and link_sharing(point(3, 2)) == 2 and link_sharing(point(1, 4)) == 1
