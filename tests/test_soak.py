"""Soak (slow): 200 requests at concurrency 8 through two real nodes; every one completes, memory stays flat
after warm-up, and at the end neither node holds any KV."""

import threading
from pathlib import Path

import httpx
import pytest
import torch
from conftest import Nodes, get_json, wait_until
from tiny_models import save_tiny_model

NUM_REQUESTS = 200
CONCURRENCY = 8
WARM_UP = 40


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_200_requests_at_concurrency_8_all_complete_and_leave_no_kv(tmp_path):
    # a small prefix cache fills during warm-up, so the flat-memory check covers its eviction too
    extra = ("--blocks", "16", "--link-gbps", "1", "--prefix-cache-bytes", "2M")
    pair = Nodes(save_tiny_model(tmp_path / "tinym"), tmp_path / "run", extra=extra)
    try:
        pair.wait_ready()
        outcomes: list[tuple[int, str]] = []
        rss: dict[str, list[float]] = {"prefill": [], "decode": []}
        lock = threading.Lock()
        counter = iter(range(NUM_REQUESTS))

        def worker() -> None:
            with httpx.Client(timeout=120) as client:
                for i in counter:
                    n = 40 + (i * 37) % 120
                    prompt = torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(i)).tolist()
                    scheme = ("smartgen", "partial", "full")[i % 3]
                    body = {"prompt": prompt, "max_tokens": 6 + i % 10, "ignore_eos": True, "scheme": scheme}
                    if i % 4 == 0:
                        body["stream"] = True
                        with client.stream("POST", pair.url + "/v1/completions", json=body) as response:
                            text = "".join(response.iter_lines())
                        outcome = (response.status_code, "ok" if "[DONE]" in text and '"error"' not in text else text)
                    else:
                        response = client.post(pair.url + "/v1/completions", json=body)
                        ok = response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
                        outcome = (response.status_code, "ok" if ok else response.text)
                    with lock:
                        outcomes.append(outcome)
                        if len(outcomes) in (WARM_UP, NUM_REQUESTS):
                            rss["prefill"].append(_rss_mib(pair.prefill.pid))
                            rss["decode"].append(_rss_mib(pair.decode.pid))

        threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        failures = [o for o in outcomes if o != (200, "ok")]
        assert len(outcomes) == NUM_REQUESTS and not failures, failures[:3]
        wait_until(lambda: get_json(pair.status_url)["requests_held"] == 0, 10, "the prefill node to hold no KV")
        health = httpx.get(pair.url + "/health", timeout=5).json()
        assert health["free_slots"] == 8 and health["running"] == 0 and health["prefilling"] == 0
        assert get_json(pair.status_url)["bytes_held"] == 0
        for node, (warm, end) in rss.items():
            print(f"\n{node}: RSS {warm:.0f} MiB after {WARM_UP} requests, {end:.0f} MiB after {NUM_REQUESTS}")
            assert end < warm * 1.25 + 20, f"{node} memory grew after warm-up: {warm:.0f} -> {end:.0f} MiB"
    finally:
        pair.stop()
