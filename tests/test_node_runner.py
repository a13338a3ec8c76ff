"""`smartgen.roles.node_runner`: a node started from its settings by a Python caller, no command line involved."""

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from conftest import get_json, pipeline_text, wait_until
from tiny_models import save_tiny_model

from smartgen.roles.colocated import DecodeSettings
from smartgen.roles.launch import NodeSettings
from smartgen.roles.node_runner import run_node, start_node
from smartgen.roles.serve_settings import ServeSettings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def _both(model_dir: Path, **more) -> ServeSettings:
    node = NodeSettings(model_dir, blocks=16, lane="inproc", link_gbps=1.0)
    return ServeSettings(
        "both", node, http="127.0.0.1:0", status="127.0.0.1:0", decode=DecodeSettings(max_tokens=512), **more
    )


def test_run_node_serves_a_both_node_until_its_stop_event_and_stops_both_halves(model_dir, tmp_path):
    ready_file = tmp_path / "ready.json"
    stop, lines = threading.Event(), []
    thread = threading.Thread(target=run_node, args=(_both(model_dir, ready_file=ready_file), stop, lines.append))
    thread.start()
    try:
        info = wait_until(lambda: ready_file.exists() and json.loads(ready_file.read_text()), 60, "the ready file")
        assert info["role"] == "both" and info["lane"] == "inproc" and {"http", "status"} <= set(info)
        ids = torch.randint(3, 90, (100,), generator=torch.Generator().manual_seed(5)).tolist()
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "scheme": "smartgen"}
        served = httpx.post(f"http://{info['http']}/v1/completions", json=body, timeout=60).json()
        assert served["choices"][0]["text"] == pipeline_text(model_dir, ids, 6)
        status_url = f"http://{info['status']}/status"
        wait_until(lambda: get_json(status_url)["requests_held"] == 0, 10, "the prefill half to free the request")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert any(line.startswith("decode node: OpenAI API on http://") for line in lines), lines
    assert lines[-2:] == ["decode node stopped", "prefill node stopped"]
    with pytest.raises(httpx.TransportError):  # the API is gone with the node
        httpx.get(f"http://{info['http']}/health", timeout=2)


def test_start_node_returns_a_serving_node_that_stop_stops(model_dir):
    running = start_node(_both(model_dir), say=lambda line: None)
    try:
        health = get_json(f"http://{running.addresses['http']}/health")
        assert health["peers"][0]["state"] == "up" and running.serving
    finally:
        running.stop()
    assert not running.serving


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"role": "router"}, "--role must be one of prefill, decode, both"),
        ({"lane": "tcp"}, "--lane tcp cannot join the nodes of --role both"),
        ({"role": "prefill"}, "--lane inproc joins a prefill and a decode node in one process"),
        ({"role": "decode", "lane": "tcp"}, "no shared secret"),
        ({"ready_file": Path("/nonexistent/ready.json")}, "cannot write --ready-file"),
        ({"dtype": "int4"}, "--dtype must be one of"),
    ],
)
def test_settings_that_cannot_run_fail_before_any_model_loads(change, says):
    settings = _both(Path("no-such-model"))
    for name, value in change.items():
        setattr(settings.node if hasattr(settings.node, name) else settings, name, value)
    with pytest.raises(ValueError, match=says):
        start_node(settings)


def test_a_node_that_cannot_bind_its_status_address_raises_and_leaves_nothing_serving(model_dir):
    import socket
    import threading as th

    before = {t.name for t in th.enumerate()}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        settings = _both(model_dir)
        settings.status = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError):
            start_node(settings, say=lambda line: None)
    left = {t.name for t in th.enumerate() if t.is_alive()} - before
    assert not {"prefill-work", "http-api", "status-http"} & left, left
