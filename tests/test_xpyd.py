"""xPyD: two prefill nodes and two decode nodes, each decode node on both prefill nodes, each prefill node serving
both decode nodes. Requests go through both decode nodes at once; then a prefill node goes, then a decode node.
Every request ends served (the in-process pipeline's text) or with a reason (503/504 and its message; a client of the
decode node that went sees its connection end; a decode node with `--on-prefill-failure recompute` serves them all),
nothing waits past a bound, and nothing is left held: the surviving prefill node's store is empty and the surviving
decode node's pool is free.

The default run starts the four nodes in this process (`start_node`, TCP between them, one decode node behind a shared
ingress link) and stops the two nodes gracefully; the slow run starts them as `smartgen serve` processes and kills
them with SIGKILL in the middle of requests (no goodbye: the others notice through their leases).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import Nodes, get_json, pipeline_text, wait_until
from tiny_models import save_tiny_model

from smartgen.roles.colocated import DecodeSettings
from smartgen.roles.launch import NodeSettings
from smartgen.roles.node_runner import RunningNode, start_node
from smartgen.roles.processes import stop_processes
from smartgen.roles.serve_settings import ServeSettings

SECRET = "xpyd-secret"
LEASE_S = 2.0  # the least `serve --lease` takes: a killed peer is noticed within it
BOUND_S = 30.0  # a lease, the listener's poll and a step or two, on a loaded shared machine
REQUEST_TIMEOUT_S = 120.0  # no request may take longer: a hang fails the test instead of stalling it
MAX_TOKENS = 6
MAX_BATCH = 8


def _prompt(seed: int, n: int = 96) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Outcomes:
    """What each request, (decode node url, prompt seed), ended with: served text, or (status, reason)."""

    served: dict[tuple[str, int], str] = field(default_factory=dict)
    refused: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)
    lost: dict[tuple[str, int], str] = field(default_factory=dict)  # the decode node itself went: the client's reason
    lock: threading.Lock = field(default_factory=threading.Lock)


def _request(url: str, seed: int, outcomes: Outcomes) -> None:
    body = {"prompt": _prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        answer = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    except httpx.TimeoutException as exc:  # a hang: never an acceptable end
        raise AssertionError(f"request {seed} to {url} hung past {REQUEST_TIMEOUT_S:g} s") from exc
    except httpx.TransportError as exc:
        with outcomes.lock:
            outcomes.lost[url, seed] = f"{type(exc).__name__}: {exc}"
        return
    with outcomes.lock:
        if answer.status_code == 200:
            outcomes.served[url, seed] = answer.json()["choices"][0]["text"]
        else:
            outcomes.refused[url, seed] = (answer.status_code, answer.json()["error"]["message"])


def _together(jobs: list[tuple[str, int]], outcomes: Outcomes, meanwhile: Callable[[], None] | None = None) -> None:
    """Sends every (url, seed) at once, runs `meanwhile` while they are in flight, waits for all of them."""
    threads = [threading.Thread(target=_request, args=(url, seed, outcomes)) for url, seed in jobs]
    for thread in threads:
        thread.start()
    if meanwhile is not None:
        meanwhile()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 10)
        assert not thread.is_alive(), "a request thread hung"


def _check_outcomes(outcomes: Outcomes, jobs: list[tuple[str, int]], expected: Callable[[int], str]) -> None:
    """Every request ended: served with the right text, or refused with a reason a client can read."""
    ended = outcomes.served.keys() | outcomes.refused.keys() | outcomes.lost.keys()
    assert ended == set(jobs)
    for (url, seed), text in outcomes.served.items():
        assert text == expected(seed), (url, seed)
    for job, (status, reason) in outcomes.refused.items():
        assert status in (503, 504) and reason.strip(), (job, status, reason)


def _summary(what: str, outcomes: Outcomes) -> None:
    """One line for `pytest -s`: how the requests of a phase ended."""
    reasons = sorted({reason.split(":")[0] for _, reason in outcomes.refused.values()} | set(outcomes.lost.values()))
    print(
        f"{what}: {len(outcomes.served)} served, {len(outcomes.refused)} refused, {len(outcomes.lost)} lost {reasons}"
    )


def _peer_states(url: str) -> list[str]:
    return [peer["state"] for peer in get_json(url + "/health")["peers"]]


def _idle_decode(url: str) -> bool:
    """The decode node holds nothing: no request in flight, every pool slot free."""
    health = get_json(url + "/health")
    busy = health["running"] + health["prefilling"] + health["parked"] + health["waiting"]
    return busy == 0 and health["free_slots"] == MAX_BATCH


def _idle_prefill(status_url: str, decode_nodes: int) -> dict[str, Any] | None:
    """The prefill node's status once it holds nothing and serves `decode_nodes` decode nodes (else None)."""
    status = get_json(status_url)
    held = status["requests_held"] or status["bytes_held"] or status["requests_open"]
    return status if not held and status["decode_nodes"] == decode_nodes else None


class _Texts:
    """The pipeline's text per prompt seed, computed once."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._texts: dict[int, str] = {}

    def __call__(self, seed: int) -> str:
        if seed not in self._texts:
            self._texts[seed] = pipeline_text(self.model_dir, _prompt(seed), MAX_TOKENS)
        return self._texts[seed]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


# -- in this process, stopped gracefully (the default run) ----------------------------------------------------------


def _node(model_dir: Path, prefix_cache_bytes: int = 0) -> NodeSettings:
    return NodeSettings(
        model_dir, blocks=16, secret=SECRET, link_gbps=1.0, lease_s=LEASE_S, prefix_cache_bytes=prefix_cache_bytes
    )


def _quiet(line: str) -> None:
    pass


@contextmanager
def _inproc_nodes(
    model_dir: Path, ingresses: tuple[float | None, ...], prefix_cache_bytes: int = 0
) -> Iterator[dict[str, Any]]:
    """Two prefill nodes and a decode node per entry of `ingresses` (its --ingress-gbps), all on both prefill nodes."""
    started: list[RunningNode] = []
    try:
        for _ in range(2):
            node = _node(model_dir, prefix_cache_bytes)
            started.append(
                start_node(ServeSettings("prefill", node, listen="127.0.0.1:0", status="127.0.0.1:0"), _quiet)
            )
        prefill = ",".join(running.addresses["listen"] for running in started)
        for ingress in ingresses:
            settings = ServeSettings(
                "decode",
                _node(model_dir, prefix_cache_bytes),
                prefill=prefill,
                http="127.0.0.1:0",
                decode=DecodeSettings(max_batch=MAX_BATCH, max_tokens=512),
                ingress_gbps=ingress,
            )
            started.append(start_node(settings, say=_quiet))
        urls = [f"http://{running.addresses['http']}" for running in started[2:]]
        wait_until(lambda: all(get_json(u + "/health")["ready"] for u in urls), BOUND_S, "the decode nodes' readiness")
        yield {
            "prefills": started[:2],
            "decodes": started[2:],
            "status": [f"http://{running.addresses['status']}" for running in started[:2]],
            "urls": urls,
        }
    finally:
        for running in reversed(started):
            running.stop()


@pytest.fixture
def inproc_cluster(model_dir) -> Iterator[dict[str, Any]]:
    with _inproc_nodes(model_dir, (2.0, None)) as nodes:  # decode 1 behind a shared ingress link, decode 2 without
        yield nodes


def test_a_conversations_next_turn_goes_to_the_prefill_node_that_prefilled_its_prefix(model_dir):
    with _inproc_nodes(model_dir, (None,), prefix_cache_bytes=64 * 2**20) as nodes:
        url = nodes["urls"][0]
        turn = _prompt(1, 160)
        for n, more in enumerate((0, 40, 40)):  # each turn: the conversation so far, and 40 tokens more
            turn = turn + _prompt(100 + n, more)
            body = {"prompt": turn, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            assert answer.status_code == 200, answer.text
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached > 0) == (n > 0), cached  # the node it went to had the prefix: a prefill cache hit
        peers = get_json(url + "/health")["peers"]
        assert [(p["sent"], p["affine"]) for p in peers] == [(3, 2), (0, 0)]


def test_two_by_two_in_process_serve_together_and_survive_a_prefill_then_a_decode_node_going(inproc_cluster, model_dir):
    urls, status = inproc_cluster["urls"], inproc_cluster["status"]
    texts = _Texts(model_dir)
    # the shared ingress link is said where the bench reads it, and so is each prefill node's own pacing
    assert get_json(urls[0] + "/status")["link"] == {
        "pacing": "shared ingress",
        "ingress_gbps": 2.0,
        "egress_gbps": 1.0,
        "delay_ms": 0.0,
        "prefill_nodes": 2,
    }
    assert get_json(urls[1] + "/status")["link"]["pacing"] == "per prefill node"
    assert get_json(status[0] + "/status")["link"]["pacing"] == "per prefill node"

    jobs = [(url, seed) for seed in range(4) for url in urls]  # each prompt through both decode nodes
    outcomes = Outcomes()
    _together(jobs, outcomes)
    _check_outcomes(outcomes, jobs, texts)
    assert len(outcomes.served) == len(jobs)
    for prefill in status:  # each prefill node serves both decode nodes
        wait_until(lambda s=prefill: _idle_prefill(s + "/status", 2), BOUND_S, "the prefill nodes to free all")
    sent = [[peer["sent"] for peer in get_json(url + "/health")["peers"]] for url in urls]
    assert [sum(row) for row in sent] == [4, 4]
    assert sum(row[0] for row in sent) and sum(row[1] for row in sent), sent  # both prefill nodes were used

    inproc_cluster["prefills"][1].stop()  # prefill 2 goes: both decode nodes go on with prefill 1
    for url in urls:
        wait_until(lambda u=url: _peer_states(u) == ["up", "down"], BOUND_S, "the decode nodes to see it gone")
    outcomes = Outcomes()
    jobs = [(url, seed) for seed in range(4, 7) for url in urls]
    _together(jobs, outcomes)
    _check_outcomes(outcomes, jobs, texts)
    assert len(outcomes.served) == len(jobs)  # it was known gone before they came: all go to prefill 1

    inproc_cluster["decodes"][1].stop()  # decode 2 goes: prefill 1 frees what it held for it
    _check_outcomes(outcomes, jobs, texts)
    wait_until(lambda: _idle_prefill(status[0] + "/status", 1), BOUND_S, "prefill 1 to drop decode 2")
    outcomes = Outcomes()
    _together([(urls[0], 7)], outcomes)
    assert outcomes.served == {(urls[0], 7): texts(7)}
    wait_until(lambda: _idle_decode(urls[0]), BOUND_S, "decode 1's pool to be free")


# -- as processes, killed (slow) --------------------------------------------------------------------------------


def _start_decode(model_dir: Path, run_dir: Path, name: str, prefill: str, extra: tuple[str, ...]) -> subprocess.Popen:
    """A decode node as Nodes starts one (same flags), on the prefill nodes `prefill` ("host:port,...")."""
    with (run_dir / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "smartgen", "serve", "--role", "decode", "--model", str(model_dir)]
            + ["--prefill", prefill, "--http", "127.0.0.1:0", "--ready-file", str(run_dir / f"{name}.json")]
            + ["--secret", SECRET, "--max-tokens", "512", "--max-batch", str(MAX_BATCH), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SMARTGEN_DB": str(run_dir / "none.db")},
        )


@pytest.fixture
def process_cluster(model_dir, tmp_path) -> Iterator[dict[str, Any]]:
    extra = ("--blocks", "16", "--link-gbps", "1", "--lease", str(LEASE_S))
    nodes = Nodes(model_dir, tmp_path, secret=SECRET, extra=extra, num_prefills=2, decode_extra=("--max-batch", "8"))
    decode2: subprocess.Popen | None = None
    try:
        prefill = ",".join(listen for _, listen, _ in nodes.prefills.values())
        # decode 2 prefills a lost prefill node's requests again on the other; decode 1 fails them with the reason
        recompute = ("--on-prefill-failure", "recompute")
        decode2 = _start_decode(model_dir, tmp_path, "decode2", prefill, (*extra, "--lane", "tcp", *recompute))
        nodes.wait_ready()

        def written() -> bool:
            assert decode2 is not None and decode2.poll() is None, (tmp_path / "decode2.log").read_text()
            return (tmp_path / "decode2.json").exists()

        wait_until(written, 120, "decode 2's ready file")
        url2 = "http://" + json.loads((tmp_path / "decode2.json").read_text())["http"]
        wait_until(lambda: get_json(url2 + "/health")["ready"], 60, "decode 2 to be ready")
        yield {"nodes": nodes, "decode2": decode2, "urls": [nodes.url, url2]}
    finally:
        stop_processes([decode2] if decode2 is not None else [])
        nodes.stop()


def _when_streaming(url: str, then: Callable[[], None]) -> Callable[[], None]:
    """A `meanwhile` for `_together`: once the decode node at `url` has requests in flight, `then()`."""

    def meanwhile() -> None:
        def busy() -> bool:
            health = get_json(url + "/health")
            return health["running"] + health["prefilling"] > 0

        wait_until(busy, BOUND_S, "requests in flight", interval=0.005)
        then()

    return meanwhile


@pytest.mark.slow
def test_two_by_two_processes_survive_a_prefill_then_a_decode_node_killed(process_cluster, model_dir):
    nodes: Nodes = process_cluster["nodes"]
    urls = process_cluster["urls"]
    texts = _Texts(model_dir)
    prefill1_status = "http://" + nodes.prefills["prefill"][2] + "/status"
    prefill2 = nodes.prefills["prefill2"][0]

    # both decode nodes at once, on both prefill nodes
    jobs = [(url, seed) for seed in range(6) for url in urls]
    outcomes = Outcomes()
    _together(jobs, outcomes)
    _check_outcomes(outcomes, jobs, texts)
    assert len(outcomes.served) == len(jobs)
    sent = [[peer["sent"] for peer in get_json(url + "/health")["peers"]] for url in urls]
    assert sum(row[0] for row in sent) and sum(row[1] for row in sent), sent  # both prefill nodes were used

    # prefill 2 killed while requests are in flight: each ends served (prefill 1's, or before the loss) or with a 503;
    # decode 2's are all served, those of prefill 2 prefilled again on prefill 1
    jobs = [(url, seed) for seed in range(6, 14) for url in urls]
    outcomes = Outcomes()
    _together(jobs, outcomes, _when_streaming(urls[0], lambda: prefill2.send_signal(signal.SIGKILL)))
    _summary("prefill 2 killed", outcomes)
    _check_outcomes(outcomes, jobs, texts)
    assert not outcomes.lost
    assert all(job in outcomes.served for job in jobs if job[0] == urls[1]), outcomes.refused
    for url in urls:
        wait_until(lambda u=url: _peer_states(u) == ["up", "down"], BOUND_S, "the decode nodes to see prefill 2 gone")
        wait_until(lambda u=url: _idle_decode(u), BOUND_S, "the decode nodes to free the failed requests")
    wait_until(lambda: _idle_prefill(prefill1_status, 2), BOUND_S, "prefill 1 to hold nothing")
    outcomes = Outcomes()
    jobs = [(url, 14) for url in urls]
    _together(jobs, outcomes)
    assert outcomes.served == {(url, 14): texts(14) for url in urls}  # both decode nodes serve on with prefill 1

    # decode 2 killed while requests are in flight on both: decode 1's end served or with a reason, decode 2's
    # clients see their connection end; prefill 1 frees what it held for decode 2
    decode2 = process_cluster["decode2"]
    jobs = [(url, seed) for seed in range(15, 21) for url in urls]
    outcomes = Outcomes()
    _together(jobs, outcomes, _when_streaming(urls[1], lambda: decode2.send_signal(signal.SIGKILL)))
    _summary("decode 2 killed", outcomes)
    _check_outcomes(outcomes, jobs, texts)
    assert all(url == urls[1] for url, _ in outcomes.lost)
    assert all(job in outcomes.served for job in jobs if job[0] == urls[0]), outcomes.refused
    wait_until(lambda: _idle_prefill(prefill1_status, 1), BOUND_S, "prefill 1 to drop decode 2 and free its requests")
    wait_until(lambda: _idle_decode(urls[0]), BOUND_S, "decode 1's pool to be free")
    outcomes = Outcomes()
    _together([(urls[0], 21)], outcomes)
    assert outcomes.served == {(urls[0], 21): texts(21)}
