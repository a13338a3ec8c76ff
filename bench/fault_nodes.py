"""bench/faults.py's node faults: kill, freeze, restart, disconnect, recompute, a full store; and their helpers."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

import httpx

from smartgen.apps.cluster import LocalCluster, get_json

SECRET = "faults-bench"
PROMPT = 200  # tokens; the sample model's KV is 3072 bytes a token
KV_BYTES = 3072 * PROMPT
COMMON = ("--lease", "3", "--handshake-timeout", "1")


class Trial(NamedTuple):
    ok: bool
    outcome: str
    detect_s: float | None = None
    recover_s: float | None = None


Fault = Callable[["LocalCluster", int], Trial]  # one try of a fault against running nodes


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(n)]


def wait_for(condition: Callable[[], Any], since: float | None = None, timeout: float = 60) -> float:
    """Seconds from `since` (default: now) until `condition()` is truthy (errors count as not yet)."""
    started = time.monotonic() if since is None else since
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return time.monotonic() - started
        except (OSError, httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"not within {timeout:g} s")


def health(cluster: LocalCluster) -> dict[str, Any]:
    return httpx.get(cluster.url + "/health", timeout=10).json()


def held(cluster: LocalCluster) -> int:
    """KV requests held on every prefill node that answers."""
    total = 0
    for address in cluster.prefill_status:
        try:
            total += get_json(f"http://{address}/status", timeout=5)["requests_held"]
        except OSError:
            pass
    return total


def complete(cluster: LocalCluster, seed: int, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": prompt(seed), "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)


def stream(cluster: LocalCluster, seed: int, fault: Callable[[], None], after: int = 3, **extra: Any) -> list[dict]:
    """Streams a long request (scheme partial: it needs its prefill node to the end), runs `fault()` after `after`
    events, reads to the end; returns the events (an error event last when the request failed)."""
    body = {"prompt": prompt(seed), "max_tokens": 300, "ignore_eos": True, "stream": True, "scheme": "partial", **extra}
    events: list[dict] = []
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events.append({**json.loads(line[5:]), "arrived": time.monotonic()})
                if len(events) == after:
                    fault()
    return events


def logged_after(cluster: LocalCluster, node: str, needle: str, since_wall: float) -> float | None:
    """Seconds from `since_wall` (time.time()) to the first line of `node`'s log with `needle` logged after it."""
    for line in cluster.log(node).splitlines():
        if needle in line:
            try:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            if stamp >= since_wall - 0.001:
                return stamp - since_wall
    return None


def text_of(events: list[dict]) -> str:
    return "".join(choice["text"] for event in events for choice in event.get("choices", []))


# -- faults against one prefill node, requests fail with the reason -------------------------------------
def kill_prefill(cluster: LocalCluster, seed: int) -> Trial:
    killed = [0.0]

    def kill() -> None:
        cluster.nodes["prefill0"].kill()
        killed[0] = time.monotonic()

    events = stream(cluster, seed, kill)
    detect = time.monotonic() - killed[0]
    failed = "prefill node connection lost" in json.dumps(events[-1])
    wait_for(lambda: not health(cluster)["ready"])
    started = time.monotonic()
    refused = complete(cluster, seed + 1)
    refuse_s = time.monotonic() - started
    cluster.nodes["prefill0"].wait()
    cluster.start_prefill(0)  # the same port, as an operator would
    recover = wait_for(lambda: health(cluster)["ready"])
    served = complete(cluster, seed + 2).status_code == 200
    ok = failed and refused.status_code == 503 and served
    return Trial(ok, f"stream error; new request 503 in {refuse_s:.2f} s; reconnected after restart", detect, recover)


def freeze_prefill(cluster: LocalCluster, seed: int) -> Trial:
    process = cluster.nodes["prefill0"]
    process.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        answer = complete(cluster, seed)  # dispatched to the frozen node before its lease ran out: fails, no hang
        failed_s = time.monotonic() - stopped
        detect = wait_for(lambda: not health(cluster)["ready"], since=stopped)
    finally:
        process.send_signal(signal.SIGCONT)
    recover = wait_for(lambda: health(cluster)["ready"])
    ok = answer.status_code == 503 and complete(cluster, seed + 1).status_code == 200
    return Trial(ok, f"request failed after {failed_s:.1f} s ({answer.status_code}); reconnected", detect, recover)


def freeze_decode(cluster: LocalCluster, seed: int) -> Trial:
    process = cluster.nodes["decode"]
    frozen = [0.0]

    def freeze() -> None:
        process.send_signal(signal.SIGSTOP)
        frozen[0] = time.monotonic()

    try:
        with httpx.stream(
            "POST",
            cluster.url + "/v1/completions",
            json={"prompt": prompt(seed), "max_tokens": 300, "ignore_eos": True, "stream": True, "scheme": "partial"},
            timeout=120,
        ) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data:"))
            freeze()
            detect = wait_for(lambda: held(cluster) == 0, since=frozen[0])
            process.send_signal(signal.SIGCONT)
            thawed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
    finally:
        process.send_signal(signal.SIGCONT)
    recover = wait_for(lambda: health(cluster)["ready"], since=thawed)
    ok = "connection lost" in " ".join(rest[-2:]) and complete(cluster, seed + 1).status_code == 200
    return Trial(ok, "prefill node freed its KV at lease expiry; stream ended with the reason", detect, recover)


def kill_decode(cluster: LocalCluster, seed: int) -> Trial:
    killed = [0.0]

    def kill() -> None:
        cluster.nodes["decode"].kill()
        killed[0] = time.monotonic()

    try:
        stream(cluster, seed, kill)
    except httpx.HTTPError:
        pass  # the server went away mid-stream: expected
    detect = wait_for(lambda: held(cluster) == 0, since=killed[0])
    cluster.nodes["decode"].wait()
    cluster.start_decode()
    recover = wait_for(lambda: health(cluster)["ready"])  # from its HTTP port listening to its prefill link up
    ok = complete(cluster, seed + 1).status_code == 200
    return Trial(ok, "prefill node freed its KV; restarted decode node served", detect, recover)


def client_disconnect(cluster: LocalCluster, seed: int) -> Trial:
    def leave() -> None:
        raise ConnectionAbortedError  # leaves the `with`: the client closes the connection mid-stream

    gone = time.monotonic()
    try:
        stream(cluster, seed, leave)
    except ConnectionAbortedError:
        gone = time.monotonic()
    detect = wait_for(lambda: held(cluster) == 0 and health(cluster)["running"] == 0, since=gone)
    return Trial(True, "KV freed on both nodes", detect, None)


# -- faults with two prefill nodes and --on-prefill-failure recompute -------------------------------------
def _holder(cluster: LocalCluster) -> int:
    counts = [get_json(f"http://{a}/status")["requests_held"] for a in cluster.prefill_status]
    return counts.index(max(counts))


def _recomputed(cluster: LocalCluster, seed: int, how: str) -> Trial:
    """Streams a request, then kills (`how` = "kill") or freezes ("stop") the prefill node holding it mid-decode;
    with recompute it finishes on the other node. Detect: the fault to the decode node opening it again (its log);
    recover: the fault to the first token the request got after that."""
    reference = text_of(stream(cluster, seed, lambda: None, after=-1))
    wait_for(lambda: held(cluster) == 0)
    victim = [0]
    faulted = [0.0, 0.0]

    def fault() -> None:
        victim[0] = _holder(cluster)
        process = cluster.nodes[f"prefill{victim[0]}"]
        if how == "kill":
            process.kill()
        else:
            process.send_signal(signal.SIGSTOP)
        faulted[:] = [time.monotonic(), time.time()]

    try:
        events = stream(cluster, seed, fault)
    finally:
        if how == "stop":
            cluster.nodes[f"prefill{victim[0]}"].send_signal(signal.SIGCONT)
    detect = logged_after(cluster, "decode", "opened again on another prefill node", faulted[1])
    reopened = faulted[0] + (detect if detect is not None else 0.0)
    recover = next((e["arrived"] - faulted[0] for e in events if e["arrived"] > reopened), None)
    equal = text_of(events) == reference and "error" not in events[-1]
    if how == "kill":
        cluster.nodes[f"prefill{victim[0]}"].wait()
        cluster.start_prefill(victim[0])
    wait_for(lambda: health(cluster)["prefill_nodes"] == 2)
    outcome = "finished on the other node, tokens equal an undisturbed run" if equal else "tokens differ or failed"
    return Trial(equal, outcome, detect, recover)


def kill_prefill_recompute(cluster: LocalCluster, seed: int) -> Trial:
    return _recomputed(cluster, seed, "kill")


def freeze_prefill_recompute(cluster: LocalCluster, seed: int) -> Trial:
    return _recomputed(cluster, seed, "stop")


# -- admission: a full prefill store -----------------------------------------------------------------
def store_full(cluster: LocalCluster, seed: int) -> Trial:
    result: dict[str, Any] = {}

    def second() -> None:
        started = time.monotonic()
        result["refused"] = complete(cluster, seed + 1)
        result["detect"] = time.monotonic() - started
        raise ConnectionAbortedError  # free the first request's KV

    try:
        stream(cluster, seed, second)
    except ConnectionAbortedError:
        pass
    freed = time.monotonic()
    wait_for(lambda: held(cluster) == 0)
    served = complete(cluster, seed + 2)
    recover = time.monotonic() - freed
    refused = result["refused"]
    reason = refused.json().get("error", {}).get("message", "")
    ok = refused.status_code == 503 and "prefill store full" in reason and served.status_code == 200
    return Trial(ok, f"{refused.status_code} '{reason[:24]}...'; served once freed", result["detect"], recover)
