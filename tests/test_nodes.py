"""Prefill and decode nodes in one process over real sockets: several prefill nodes, concurrent requests, batching;
over every lane this machine has (the lanes beyond TCP with `make test-lanes`)."""

import threading
import time

import pytest
import torch
from conftest import SOCKET_LANES, SOFT_RDMA, lane_available, lane_params, soft_rdma_nodes
from inproc_nodes import decode_node, prefill_node, tiny_parts
from tiny_models import IdTokenizer

from smartgen.engine.policy import get_policy
from smartgen.roles.service import FinishEvent, GenerationParams, ServiceError


@pytest.fixture(scope="module", params=[*lane_params(*SOCKET_LANES), SOFT_RDMA])
def cluster(request):
    lane = lane_available(request.param)
    with soft_rdma_nodes():  # rdma-soft: the RDMA lane over software verbs endpoints (tests/softverbs.py)
        parts = tiny_parts()
        prefills = [prefill_node(parts, lane=lane) for _ in range(2)]
        decode = decode_node(parts, prefills, scheme="smartgen", max_waiting=16, lane=lane)
        yield prefills, decode
        decode.stop()
        for node in prefills:
            node.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(decode, prompt, scheme="smartgen", max_tokens=6):
    handle = decode.scheduler.submit(prompt, GenerationParams(max_tokens=max_tokens, scheme=scheme))
    events = list(handle.events(timeout=60))
    assert isinstance(events[-1], FinishEvent) and events[-1].error is None, events[-1]
    return [e.token_id for e in events[:-1]], events[-1]


def _run_concurrently(decode, prompts, schemes, max_tokens=6) -> list:
    """Submits every prompt at once (so they share decode batches); returns each one's tokens."""
    results: list = [None] * len(prompts)

    def worker(i):
        results[i] = _run(decode, prompts[i], schemes[i], max_tokens=max_tokens)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_requests_batch_together_and_match_running_alone(cluster):
    prefills, decode = cluster
    prompts = [_prompt(i, n) for i, n in enumerate((70, 45, 90, 30))]
    alone = [_run(decode, p)[0] for p in prompts]
    results = _run_concurrently(decode, prompts, ["smartgen"] * len(prompts))
    assert results == alone, "continuous batching must not change a request's tokens"
    # the decode node spread the requests over both prefill nodes (least loaded first)
    assert all(node.num_prefilled > 0 for node in prefills)


def test_every_scheme_serves_and_frees_everything(cluster):
    prefills, decode = cluster
    tokens = {
        scheme: _run(decode, _prompt(7, 80), scheme)[0]
        for scheme in ("full", "partial", "partial+profile+parallel", "smartgen")
    }
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens  # the scheme moves bytes, never changes tokens
    deadline = time.monotonic() + 10
    while any(node.engine.store.num_requests for node in prefills) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(node.engine.store.num_requests == 0 for node in prefills)
    assert decode.engine.pool.num_free == 4


def test_refusals_are_clear(cluster):
    _, decode = cluster
    with pytest.raises(ServiceError, match="exceeds"):
        decode.scheduler.submit(_prompt(1, 250), GenerationParams(max_tokens=10))
    with pytest.raises(ServiceError, match="unknown scheme"):
        decode.scheduler.submit(_prompt(1, 20), GenerationParams(scheme="fastest"))
    with pytest.raises(ServiceError, match="future selections") as unservable:  # was a 500 from the prefill node
        decode.scheduler.submit(_prompt(1, 20), GenerationParams(scheme="smartgen[optimal]"))
    assert unservable.value.status == 400
    with pytest.raises(ServiceError, match="empty"):
        decode.scheduler.submit([], GenerationParams())
    # a scheduler whose loop is not running: its bounded queue fills and then refuses with 503 and the reason
    from smartgen.roles.scheduler import DecodeScheduler

    idle = DecodeScheduler(decode.runner, IdTokenizer(), get_policy("smartgen"), "tiny", max_waiting=2)
    for _ in range(2):
        idle.submit(_prompt(2, 20), GenerationParams())
    with pytest.raises(ServiceError) as refused:
        idle.submit(_prompt(2, 20), GenerationParams())
    assert refused.value.status == 503 and "overloaded: 2 requests already wait" in str(refused.value)


def test_status_shows_paths_lanes_and_recent_requests(cluster):
    _, decode = cluster
    _run(decode, _prompt(11, 60))
    status = decode.scheduler.status()
    assert status["role"] == "decode" and status["health"]["ready"]
    assert status["paths"]["selected_entries"] > 0
    assert len(status["links"]) == 2
    assert status["recent"][-1]["completion_tokens"] == 6 and status["recent"][-1]["ttst"] is not None


def test_requests_of_different_schemes_decode_together_as_they_do_alone(cluster):
    _, decode = cluster
    schemes = ("proactive-only", "smartgen", "partial", "proactive-only")
    prompts = [_prompt(20 + i, n) for i, n in enumerate((80, 64, 72, 90))]
    alone = [_run(decode, p, s, max_tokens=8)[0] for p, s in zip(prompts, schemes)]
    results = _run_concurrently(decode, prompts, schemes, max_tokens=8)
    assert results == alone, "a request's tokens must not depend on the schemes it is batched with"


def test_stopping_a_decode_node_closes_its_link_to_every_prefill_node():
    """Each link's listener drops the link from the engine's list once it sees it closed, so closing must walk a
    copy: walking the list itself skipped the link after each one dropped, which stayed up (and stopping waited 5 s
    for its listener)."""
    parts = tiny_parts()
    prefills = [prefill_node(parts) for _ in range(3)]
    decode = decode_node(parts, prefills)
    links = decode.links
    try:
        decode.stop()
        assert [link.alive for link in links] == [False, False, False]
    finally:
        for node in prefills:
            node.stop()


def test_the_optimal_set_replays_a_recorded_run(cluster):
    """usage.selection_counts of a run, sent back as proactive_counts, plans the "optimal" proactive set: the same
    tokens come out, and a bad replay is refused with the reason (400) before anything is queued."""
    _, decode = cluster
    prompt = _prompt(7, 80)
    layers = decode.engine.layout.num_layers

    def run(params):
        events = list(decode.scheduler.submit(prompt, params).events(timeout=60))
        assert isinstance(events[-1], FinishEvent) and events[-1].error is None, events[-1]
        return [e.token_id for e in events[:-1]], events[-1].usage

    tokens, usage = run(GenerationParams(max_tokens=6, scheme="full", return_selection_counts=True))
    counts = usage["selection_counts"]
    assert len(counts) == layers and all(len(row) == len(prompt) for row in counts)
    assert not any(counts[0]) and not any(counts[1])  # layers 0-1 move whole: nothing to predict there
    assert sum(map(sum, counts[2:])) > 0
    assert max(map(max, counts[2:])) <= 5 * decode.engine.layout.num_kv_heads  # 5 decode steps, every head
    replayed, usage = run(GenerationParams(max_tokens=6, scheme="smartgen[optimal]", proactive_counts=counts))
    assert replayed == tokens and usage["scheme"] == "smartgen[optimal]"
    assert "selection_counts" not in usage  # only when asked for
    for params, message in [
        (GenerationParams(scheme="smartgen[optimal]", proactive_counts=counts[:-1]), "proactive_counts must be"),
        (GenerationParams(scheme="smartgen[optimal]", proactive_counts=[r[:-1] for r in counts]), "one per prompt"),
        (GenerationParams(scheme="smartgen", proactive_counts=counts), "for the optimal proactive set"),
    ]:
        with pytest.raises(ServiceError, match=message) as refused:
            decode.scheduler.submit(prompt, params)
        assert refused.value.status == 400


def test_a_crashed_scheduler_refuses_every_request_and_says_so_on_health(monkeypatch):
    """A bug that escapes the decode loop fails what was in flight; then the node must not look ready and take
    requests nothing will ever serve (they waited for the client's timeout): 503 with the reason, until restarted."""
    parts = tiny_parts()
    prefill = prefill_node(parts)
    decode = decode_node(parts, [prefill])
    try:

        def broken() -> list:
            raise RuntimeError("a bug in the step")

        monkeypatch.setattr(decode.scheduler.driver, "step", broken)
        handle = decode.scheduler.submit(_prompt(3, 40), GenerationParams(max_tokens=4))
        events = list(handle.events(timeout=60))
        assert isinstance(events[-1], FinishEvent) and "a bug in the step" in events[-1].error
        health = decode.scheduler.health()
        assert health["ready"] is False and "decode scheduler failed: a bug in the step" in health["error"]
        with pytest.raises(ServiceError) as refused:
            decode.scheduler.submit(_prompt(4, 40), GenerationParams(max_tokens=4))
        assert refused.value.status == 503 and "restart it" in str(refused.value)
    finally:
        decode.stop()
        prefill.stop()
