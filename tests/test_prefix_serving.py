"""Prefix caching with real nodes: a multi-turn chat over HTTP, what /status and /metrics show, a prefill node
restarted with an empty cache, and bad cache options."""

import subprocess
import sys

import httpx
import pytest
import torch
from conftest import Nodes, get_json, wait_until
from tiny_models import save_tiny_model

from smartgen.engine.policy import get_policy
from smartgen.runtime.models import load_model
from smartgen.runtime.pipeline import InprocPipeline

CACHE = ("--blocks", "16", "--link-gbps", "1", "--prefix-cache-bytes", "64M", "--prefix-block-tokens", "8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(url: str, prompt: list[int], scheme: str = "smartgen") -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "scheme": scheme}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _uncached(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    with InprocPipeline(
        load_model(model_dir), get_policy("smartgen", strategy="streaming"), "quest", {"budget": 0.1}, num_blocks=16
    ) as pipeline:
        return [pipeline.generate([p], 8)[0].tokens for p in prompts]


def test_a_multi_turn_chat_reuses_both_caches_with_the_uncached_tokens(model_dir, tmp_path):
    pair = Nodes(model_dir, tmp_path, extra=CACHE)
    try:
        pair.wait_ready()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        turn1 = _ids(1, 120)
        # the decode node caches the prompt blocks local in every layer when a request finishes; under smartgen that
        # depends on how far speculation got in 8 steps (on a loaded CI machine, not all the way: 0 held tokens),
        # so turn 1 moves its KV whole (same tokens: transfers are lossless) and turn 2 is smartgen
        first = _complete(pair.url, turn1, scheme="full")
        answer = tokenizer.encode(first["choices"][0]["text"], add_special_tokens=False)
        turn2 = turn1 + answer + _ids(2, 30)  # the client sends the whole conversation again
        second = _complete(pair.url, turn2)
        usage = second["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 120  # prefill computed only the rest
        assert usage["held_tokens"] == 120  # and the decode node already had turn 1's prompt KV
        assert first["usage"]["held_tokens"] == 0 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        expected = _uncached(model_dir, [turn1, turn2])
        assert [first["choices"][0]["text"], second["choices"][0]["text"]] == [
            tokenizer.decode(t, skip_special_tokens=True) for t in expected
        ]

        decode_status = get_json(pair.url + "/status")
        prefill_status = get_json(pair.status_url)
        assert decode_status["prefix_cache"]["hit_tokens"] == 120 and decode_status["prefix_cache"]["bytes"] > 0
        assert decode_status["prefix_cache"]["saved_bytes"]["held"] > 0
        assert prefill_status["prefix_cache"]["hit_tokens"] == 120 and prefill_status["prefix_cache"]["blocks"] > 0
        assert (
            sum(prefill_status["prefix_cache"]["saved_bytes"].values())
            == decode_status["prefix_cache"]["saved_bytes"]["held"]
        )  # every held byte is one the prefill node did not push
        metrics = httpx.get(pair.url + "/metrics", timeout=5).text
        assert "smartgen:prefix_cache_hit_tokens_total 120.0" in metrics
        assert 'smartgen:prefix_saved_bytes_total{path="held"}' in metrics
        prefill_metrics = httpx.get(f"http://{pair.status_address}/metrics", timeout=5).text
        assert "smartgen:prefix_cache_bytes" in prefill_metrics

        # a restarted prefill node starts with an empty cache; the decode node's still spares the transfer
        pair.prefill.kill()
        pair.prefill.wait(10)
        pair.start_prefill(pair.prefill_address)
        wait_until(lambda: get_json(pair.url + "/health")["ready"], 30, "the decode node to reconnect")
        again = _complete(pair.url, turn2)
        assert again["choices"][0]["text"] == second["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["held_tokens"] >= 120
        wait_until(lambda: get_json(pair.status_url)["requests_held"] == 0, 10, "the prefill node to free it")
    finally:
        pair.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--prefix-cache-bytes", "lots"), "--prefix-cache-bytes takes a byte size"),
        (("--prefix-cache-bytes", "-1G"), "--prefix-cache-bytes takes a byte size"),
        (("--prefix-block-tokens", "0"), "--prefix-block-tokens"),
    ],
)
def test_bad_cache_options_are_refused_without_a_traceback(model_dir, flags, message):
    command = [sys.executable, "-m", "smartgen", "serve", "--role", "prefill", "--model", str(model_dir), "--insecure"]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr and "Traceback" not in result.stderr
