"""Monitoring parts without a model: block maps, rate history, Prometheus names, recordings and their replay."""

from __future__ import annotations

import json
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.engine.metrics import PathCounters
from smartgen.roles.live_state import RateHistory, block_map
from smartgen.roles.prometheus import NodeMetrics, NodeSources, exposition
from smartgen.roles.recorder import StatusRecorder
from smartgen.tui.feed import ReplayFeed, status_url


def test_block_map_cells_are_local_only_when_every_token_is():
    mask = torch.tensor([1, 1, 1, 2, 2, 2, 1, 2, 0, 0], dtype=torch.int8)
    assert block_map(mask, width=5) == "LMRM."
    assert block_map(mask, width=100) == "LLLRRRLR.."
    assert block_map(torch.zeros(0, dtype=torch.int8)) == ""


def test_rate_history_gives_per_second_rates():
    value = {"x": 0.0}
    history = RateHistory(lambda: dict(value), interval_s=60)  # the thread stays out of the way
    history.sample()
    value["x"] = 1000.0
    time.sleep(0.05)
    history.sample()
    [rate] = history.series()["x"]
    assert 1000 / 0.5 < rate < 1000 / 0.04


def test_two_nodes_in_one_process_keep_separate_registries():
    counters = [PathCounters(), PathCounters()]
    metrics = [NodeMetrics(NodeSources("decode", "m", c, lambda: [], dict)) for c in counters]
    counters[0].add("on_demand", 100, 0.01)
    counters[1].add("proactive", 7)
    parsed = [
        {
            s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(exposition(m.registry)[0].decode())
            for s in f.samples
        }
        for m in metrics
    ]
    fetched = "smartgen:kv_transfer_bytes_total[('path', 'fetch_remote')]"
    assert parsed[0][fetched] == 100 and parsed[1][fetched] == 0
    assert parsed[0]["smartgen:kv_fetch_latency_seconds_count[]"] == 1
    assert parsed[1]["smartgen:kv_transfer_bytes_total[('path', 'proactive')]"] == 7


def _samples(metrics: NodeMetrics) -> dict[str, float]:
    """Every sample the node's registry exposes, by its name and sorted labels."""
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(exposition(metrics.registry)[0].decode())
        for s in f.samples
    }


def test_deferred_steps_are_counted_by_reason():
    counters = PathCounters()
    metrics = NodeMetrics(NodeSources("decode", "m", counters, lambda: [], dict))
    counters.add_deferral("share")
    counters.add_deferral("share")
    counters.add_deferral("stall")
    assert counters.snapshot()["deferred_steps"] == {"share": 2, "stall": 1}
    samples = _samples(metrics)
    assert samples["smartgen:deferred_steps_total[('reason', 'share')]"] == 2
    assert samples["smartgen:deferred_steps_total[('reason', 'stall')]"] == 1


def test_fetch_waits_are_counted_by_the_kind_waited_for():
    counters = PathCounters()
    metrics = NodeMetrics(NodeSources("decode", "m", counters, lambda: [], dict))
    counters.add_fetch_wait("step", 0.25)
    counters.add_fetch_wait("step", 0.5)
    counters.add_fetch_wait("prefetch", 0.125)
    fetches = counters.snapshot()["fetches"]
    assert {kind: f["waited"] for kind, f in fetches.items()} == {"step": 0.75, "prefetch": 0.125, "forecast": 0.0}
    samples = _samples(metrics)
    assert samples["smartgen:fetch_wait_seconds_total[('kind', 'step')]"] == 0.75
    assert samples["smartgen:fetch_wait_seconds_total[('kind', 'prefetch')]"] == 0.125
    assert samples["smartgen:fetch_wait_seconds_total[('kind', 'forecast')]"] == 0.0


def test_a_recording_replays_frame_by_frame(tmp_path):
    path = tmp_path / "run.jsonl"
    n = {"i": 0}

    def snapshot():
        n["i"] += 1
        return {"role": "prefill", "requests_held": n["i"]}

    recorder = StatusRecorder(path, "prefill", snapshot, interval_s=0.02)
    time.sleep(0.15)
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 3 and all("t" in line and line["prefill"][0]["role"] == "prefill" for line in lines)
    feed = ReplayFeed(path)
    held = [feed.poll().prefill[0]["requests_held"] for _ in range(len(lines) + 2)]
    assert held[: len(lines)] == sorted(held[: len(lines)]) and held[-1] == held[-2]  # the last frame repeats
    assert feed.done


def test_a_bad_recording_is_refused_with_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 1, "decode": {"requests": []}}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        ReplayFeed(path)
    result = CliRunner().invoke(app, ["monitor", "--replay", str(path)])
    assert result.exit_code != 0 and "bad.jsonl:2" in result.output


@pytest.mark.parametrize(
    "given, url",
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000/status"),
        ("http://h:1/", "http://h:1/status"),
        ("http://h:1/status", "http://h:1/status"),
    ],
)
def test_status_urls(given, url):
    assert status_url(given) == url
