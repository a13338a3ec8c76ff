"""What a router reads from a decode node: /server_info, /model_info, /get_load in SGLang's names, and the metrics
named as vLLM's (a fake service for the JSON, then a real `serve --role both` node in this process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import get_json, serve_in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_http_api import FakeService
from tiny_models import save_tiny_model

from smartgen.engine.metrics import PathCounters, RequestMetrics
from smartgen.roles.colocated import DecodeSettings
from smartgen.roles.http_api import create_app
from smartgen.roles.launch import NodeSettings
from smartgen.roles.node_runner import start_node
from smartgen.roles.prometheus import NodeMetrics, NodeSources, exposition
from smartgen.roles.serve_settings import ServeSettings
from smartgen.roles.server_info import NodeInfo

INFO = NodeInfo(
    "fake-model",
    "/models/fake-model",
    "/models/fake-model",
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    vocab_size=97,
    context_length=4096,
    slot_tokens=1024,
    max_running_requests=8,
    max_queued_requests=64,
    scheme="smartgen",
)


def router_model_id(server_info: dict[str, Any]) -> str:
    """The SGLang router's choice of a worker's model id: served_model_name, else model_path, else "unknown"."""
    assert not {"model", "model_id"} <= set(server_info), "the router refuses both (one is an alias of the other)"
    return server_info.get("served_model_name") or server_info.get("model_path") or "unknown"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_metadata_endpoints_answer_in_sglang_s_names():
    service = FakeService()
    with serve_in_thread(create_app(service, info=INFO)) as url:
        info = httpx.get(url + "/server_info").json()
        assert httpx.get(url + "/get_server_info").json() == info  # the older name routers fall back to
        assert router_model_id(info) == "fake-model"
        assert info["model_path"] == "/models/fake-model" and info["tokenizer_path"] == "/models/fake-model"
        assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
        assert info["max_running_requests"] == 8 and info["max_queued_requests"] == 64
        assert info["max_total_tokens"] == 8 * 1024 and info["max_req_len"] == 1024  # a slot is under the context
        assert info["smartgen"] == {"role": "decode", "scheme": "smartgen", "slot_tokens": 1024}
        assert isinstance(info["version"], str) and info["version"]
        model = httpx.get(url + "/model_info").json()
        assert httpx.get(url + "/get_model_info").json() == model
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
        assert model["is_generation"] is True and model["max_context_length"] == 4096
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert card["id"] == "fake-model" and card["max_model_len"] == 1024 and card["root"] == "/models/fake-model"


def test_without_node_facts_the_endpoints_say_what_the_service_knows():
    service = FakeService()
    with serve_in_thread(create_app(service)) as url:
        info = httpx.get(url + "/server_info").json()
        assert router_model_id(info) == "fake-model" and info["dp_size"] == 1
        assert info["max_req_len"] is None and info["max_total_tokens"] is None
        assert httpx.get(url + "/model_info").json()["architectures"] == []


def test_get_load_counts_requests_holding_and_waiting_for_a_slot():
    class Busy(FakeService):
        def health(self) -> dict[str, Any]:
            return {"ready": True, "running": 2, "prefilling": 1, "parked": 1, "waiting": 3, "active_tokens": 900}

    class Broken(FakeService):
        def health(self) -> dict[str, Any]:
            raise RuntimeError("scheduler gone")

    with serve_in_thread(create_app(Busy())) as url:
        load = [{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 3, "num_tokens": 900}]  # one entry per DP rank
        assert httpx.get(url + "/get_load").json() == load
    with serve_in_thread(create_app(Broken())) as url:
        response = httpx.get(url + "/get_load")
        assert response.status_code == 503 and "scheduler gone" in response.json()["error"]["message"]


def test_a_node_info_needs_a_model_name():
    with pytest.raises(ValueError, match="served model name"):
        NodeInfo("", "/m", "/m")


def test_request_histograms_follow_vllm_s_definitions():
    metrics = NodeMetrics(NodeSources("decode", "m", PathCounters(), lambda: [], dict))
    request = RequestMetrics("r1", prompt_tokens=50, created=100.0)
    for at in (100.5, 101.5, 101.75, 102.0):  # TTFT 0.5, a 1 s stall, then 0.25 s gaps
        request.record_token(at)
    metrics.request_finished("length", request)
    metrics.request_finished("unavailable", None)  # refused before the engine took it: counted by reason only
    got = samples(exposition(metrics.registry)[0].decode())
    assert got[("smartgen:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert got[("smartgen:inter_token_latency_seconds_count", ())] == 3  # every gap, the stall included
    assert got[("smartgen:inter_token_latency_seconds_sum", ())] == pytest.approx(1.5)
    assert got[("smartgen:time_between_tokens_seconds_count", ())] == 2  # the older TBT leaves the stall out
    assert got[("smartgen:request_time_per_output_token_seconds_sum", ())] == pytest.approx(1.5 / 3)
    assert got[("smartgen:e2e_request_latency_seconds_count", ())] == 1
    assert got[("smartgen:prompt_tokens_total", ())] == 50 and got[("smartgen:generation_tokens_total", ())] == 4
    assert got[("smartgen:requests_finished_total", (("reason", "unavailable"),))] == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def test_a_real_node_describes_its_model_and_exports_the_router_metrics(model_dir: Path):
    node = NodeSettings(model_dir, blocks=16, lane="inproc", link_gbps=1.0)
    settings = ServeSettings(
        "both", node, http="127.0.0.1:0", status="127.0.0.1:0", decode=DecodeSettings(max_tokens=512)
    )
    running = start_node(settings, say=lambda line: None)
    try:
        url = f"http://{running.addresses['http']}"
        info = get_json(url + "/server_info")
        assert router_model_id(info) == "tinym" and info["model_path"] == str(model_dir)
        assert info["tokenizer_path"] == str(model_dir) and info["smartgen"]["role"] == "both"
        assert info["context_length"] == 512 and info["max_req_len"] == 512  # the tiny model's context
        assert info["max_running_requests"] == DecodeSettings().max_batch
        model = get_json(url + "/model_info")
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
        body = {"prompt": list(range(3, 60)), "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 3:  # mid-stream: one request holds a slot with its prompt and tokens so far
                    [load] = get_json(url + "/get_load")
                    assert load["num_reqs"] == 1 and load["num_tokens"] >= 57 + 1, load
                    break
        wait_until(lambda: get_json(url + "/health")["running"] == 0, 30, "the streamed request to end")
        body = {"prompt": list(range(3, 60)), "max_tokens": 5, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        got = samples(httpx.get(url + "/metrics").text)
        assert got[("smartgen:e2e_request_latency_seconds_count", ())] == 2  # the stream, cancelled, and this one
        assert (
            got[("smartgen:generation_tokens_total", ())] - got[("smartgen:inter_token_latency_seconds_count", ())] == 2
        )
        assert got[("smartgen:prompt_tokens_total", ())] == 2 * 57
        assert got[("smartgen:num_requests_running", ())] == 0 and got[("smartgen:num_requests_waiting", ())] == 0
        assert got[("smartgen:kv_cache_usage_perc", ())] == 0
        assert get_json(url + "/get_load") == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    finally:
        running.stop()
