"""The dashboard's model and /metrics against two real `smartgen serve` processes on 127.0.0.1."""

from __future__ import annotations

import threading
import time
import urllib.request

import httpx
import pytest
from conftest import Nodes, get_json, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import save_tiny_model

from smartgen.roles.live_state import path_label
from smartgen.tui.feed import HttpFeed
from smartgen.tui.model import DashboardModel


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")
    # a link slow enough (1 Mbit/s) that the tiny model's KV takes a few seconds to become local
    pair = Nodes(model_dir, tmp_path_factory.mktemp("nodes"), extra=("--blocks", "16", "--link-gbps", "0.001"))
    try:
        pair.wait_ready()
        yield pair
    finally:
        pair.stop()


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_the_dashboard_follows_a_request_until_its_kv_is_local(nodes):
    # without the head start, whose prefill node may decode the whole answer before the KV has landed
    body = {
        "prompt": list(range(3, 90)) * 3,
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "scheme": "smartgen-no-head-start",
    }
    answer: dict = {}
    worker = threading.Thread(
        target=lambda: answer.update(httpx.post(nodes.url + "/v1/completions", json=body, timeout=120).json())
    )
    model = DashboardModel()
    feed = HttpFeed(nodes.url, [nodes.status_url])
    seen_ids, rates, all_local = set(), [], False
    worker.start()
    while worker.is_alive():
        model.update(feed.poll())
        active = [r for r in model.requests() if r.active]
        seen_ids.update(r.request_id for r in active)
        rows = model.mask_rows(40)
        if active and rows and all(set(row.cells) <= {"L"} for row in rows):
            all_local = True
        rates.append(sum(p.current or 0 for p in model.path_rates()))
        time.sleep(0.1)
    worker.join()
    assert answer.get("usage", {}).get("completion_tokens") == 200, answer
    assert len(seen_ids) == 1, "the dashboard showed the request while it ran"
    assert all_local, "the request's mask rows reached all-local once speculation finished"
    assert max(rates) > 0, "the lanes showed non-zero rates while data moved"
    model.update(feed.poll())
    [row] = [r for r in model.requests() if r.request_id in seen_ids]
    assert not row.active and row.ttst is not None and row.tokens == 200


def test_metrics_parse_and_equal_the_engine_counters(nodes):
    body = {"prompt": list(range(5, 80)), "max_tokens": 12, "ignore_eos": True, "scheme": "full"}
    assert httpx.post(nodes.url + "/v1/completions", json=body, timeout=120).status_code == 200
    wait_until(lambda: get_json(nodes.status_url)["requests_held"] == 0, 20, "the prefill node to free the request")
    for status_url, metrics_url in (
        (nodes.url + "/status", nodes.url + "/metrics"),
        (nodes.status_url, nodes.status_url.removesuffix("/status") + "/metrics"),
    ):
        status, samples = get_json(status_url), _samples(metrics_url)
        paths = status["paths"]
        for engine_path, num_bytes in paths["bytes"].items():
            label = (("path", path_label(engine_path)),)
            assert samples[("smartgen:kv_transfer_bytes_total", label)] == num_bytes, engine_path
            assert samples[("smartgen:kv_transfers_total", label)] == paths["transfers"][engine_path]
            assert samples[("smartgen:kv_transfer_seconds_total", label)] == pytest.approx(
                paths["seconds"][engine_path]
            )
        assert samples[("smartgen:kv_selected_entries_total", ())] == paths["selected_entries"]
        assert samples[("smartgen:kv_remote_entries_total", ())] == paths["remote_entries"]
        posted = sum(link["push"]["num_descriptors"] + link["control"]["num_descriptors"] for link in status["links"])
        assert sum(v for (name, _), v in samples.items() if name == "smartgen:kv_descriptors_posted_total") == posted
        assert all(v == 1 for (name, _), v in samples.items() if name == "smartgen:link_up")
        assert samples[("smartgen:kv_fetch_latency_seconds_count", ())] == (
            paths["transfers"]["on_demand"] if status["role"] == "decode" else 0
        )
    decode = _samples(nodes.url + "/metrics")
    finished = get_json(nodes.url + "/status")["recent"]
    assert decode[("smartgen:time_to_first_token_seconds_count", ())] == len(finished)
    assert decode[("smartgen:requests_finished_total", (("reason", "length"),))] == len(finished)
    prefill = _samples(nodes.status_url.removesuffix("/status") + "/metrics")
    # pushes are timed from posting to applied at the decode node: full transfer's took real link time
    assert prefill[("smartgen:kv_transfer_seconds_total", (("path", "full"),))] > 0
    assert prefill[("smartgen:kv_transfer_bytes_total", (("path", "full"),))] > 0  # the full scheme's own path
    assert prefill[("smartgen:prefill_store_requests", ())] == 0


def test_the_grafana_dashboard_charts_only_metrics_the_nodes_export(nodes):
    import json
    import re
    from pathlib import Path

    exported = set()
    for url in (nodes.url + "/metrics", nodes.status_url.removesuffix("/status") + "/metrics"):
        exported |= {name for name, _ in _samples(url)}
    dashboard = (Path(__file__).parent.parent / "docs" / "grafana" / "smartgen.json").read_text()
    exprs = [t["expr"] for panel in json.loads(dashboard)["panels"] for t in panel["targets"]]
    charted = {name for expr in exprs for name in re.findall(r"smartgen:[a-z_]+", expr)}
    assert charted and charted <= exported, charted - exported
