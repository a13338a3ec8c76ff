"""`smartgen serve --role both`: a prefill and a decode node in one real process over the in-process lane."""

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from conftest import _drain, get_json, pipeline_text, wait_until
from tiny_models import save_tiny_model
from typer.testing import CliRunner

from smartgen.apps.cluster import ClusterSpec, LocalCluster, post_json
from smartgen.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def _prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_process_serves_the_in_process_pipeline_tokens_frees_them_and_stops_cleanly(model_dir, tmp_path):
    ready_file = tmp_path / "both.json"
    args = [sys.executable, "-m", "smartgen", "serve", "--role", "both", "--model", str(model_dir)]
    args += ["--http", "127.0.0.1:0", "--status", "127.0.0.1:0", "--ready-file", str(ready_file)]
    args += ["--blocks", "16", "--link-gbps", "1", "--max-tokens", "512", "--record", str(tmp_path / "rec.jsonl")]
    env = {**os.environ, "SMARTGEN_DB": str(tmp_path / "none.db")}
    node = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=_drain, args=(node, lines), daemon=True).start()
    try:

        def ready() -> dict | None:
            assert node.poll() is None, "".join(lines)
            return json.loads(ready_file.read_text()) if ready_file.exists() else None

        info = wait_until(ready, 60, "the colocated node's ready file")
        assert info["role"] == "both" and info["lane"] == "inproc" and info["pid"] == node.pid
        url, status_url = f"http://{info['http']}", f"http://{info['status']}/status"
        ids = _prompt_ids(1, 120)
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "scheme": "smartgen"}
        served = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert served["choices"][0]["text"] == pipeline_text(model_dir, ids, 8)
        assert served["usage"]["completion_tokens"] == 8
        # everything freed on both halves; the prefill half's counters are what `smartgen bench` reads
        wait_until(lambda: get_json(status_url)["requests_held"] == 0, 10, "the prefill half to free the request")
        health = get_json(url + "/health")
        assert health["running"] == 0 and health["free_slots"] == 8 and health["peers"][0]["state"] == "up"
        status = get_json(status_url)
        assert status["role"] == "prefill" and status["prefilled"] == 1 and status["decode_nodes"] == 1
        link = status["links"][0]
        assert link["push"]["bytes_sent"] > 0 and link["push"]["busy_seconds"] > 0  # paced: the link took time
        # the in-process link's timeline, as a prefill node's listener shows its own
        tags = {tag for _, counts in status["link"]["timeline"]["bins"] for tag in counts}
        assert {"proactive", "metadata"} <= tags, status["link"]

        # --record: every frame holds both halves, as the monitor's own recordings do
        def recorded() -> list[dict] | None:
            text = (tmp_path / "rec.jsonl").read_text() if (tmp_path / "rec.jsonl").exists() else ""
            return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()] or None  # whole lines

        frames = wait_until(recorded, 10, "a recorded frame")
        assert all(f["decode"]["role"] == "decode" and f["prefill"][0]["role"] == "prefill" for f in frames)
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0
        wait_until(lambda: any("prefill node stopped" in line for line in lines), 5, "the prefill half to stop")
        assert "Traceback" not in "".join(lines)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_local_cluster_on_the_inproc_lane_is_one_process(model_dir):
    spec = ClusterSpec(model=model_dir, link_gbps=1.0, lane="inproc", blocks=16, max_batch=2, max_tokens=512)
    with LocalCluster(spec) as cluster:
        assert list(cluster.nodes) == ["both"] and len(cluster.prefill_status) == 1
        body = {"prompt": _prompt_ids(2, 100), "max_tokens": 4, "ignore_eos": True, "scheme": "full"}
        assert post_json(f"{cluster.url}/v1/completions", body)["usage"]["completion_tokens"] == 4
        status = cluster.status()
        assert status["decode"] and status["prefill"][0]["paths"]["bytes"]["full"] > 0
        process = cluster.nodes["both"]
    assert process.poll() == 0  # stopped with SIGINT, cleanly
    with pytest.raises(ValueError, match="one prefill node"):
        LocalCluster(ClusterSpec(model=model_dir, lane="inproc", prefill_nodes=2)).__enter__()


SERVE = ["serve", "--model", "samples/sample-model", "--insecure"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([*SERVE, "--role", "both", "--lane", "tcp"], "--lane tcp cannot join the nodes of --role both"),
        ([*SERVE, "--role", "prefill", "--lane", "inproc"], "use it with --role both, not --role prefill"),
        ([*SERVE, "--role", "both", "--tls-ca", "ca.pem"], "--role both has none"),
        ([*SERVE, "--role", "both", "--listen", "127.0.0.1:7200"], "--listen connects separate nodes"),
        ([*SERVE, "--role", "both", "--prefill", "h:1", "--listen", "h:2"], "--listen and --prefill connect"),
        ([*SERVE, "--role", "decode", "--lane", "pigeon"], "--lane must be one of tcp"),
        (["bench", "--lane", "inproc", "--prefill-nodes", "2"], "--prefill-nodes must be 1"),
        (["bench", "--lane", "pigeon"], "--lane must be one of tcp"),
        (["demo", "--lane", "pigeon"], "--lane must be one of tcp"),
    ],
)
def test_lane_and_role_mistakes_are_one_line_errors(args, says):
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code != 0, result.output
    assert says in result.stderr and "Traceback" not in result.output + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    if hasattr(os, "sched_getscheduler"):
        # `serve --role decode` batches the thread it runs on; an in-process caller gets it back as it was (else
        # every node this test process starts later inherits SCHED_BATCH: test_serve's policy test failed after it)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_serve_help_explains_the_colocated_node():
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())  # the help as one line, without rich's frame
    assert "or both in one process over the in-process lane (`--lane inproc`" in text
    assert "inproc, the in-process lane of --role both" in text and "smartgen[mooncake]" in text
