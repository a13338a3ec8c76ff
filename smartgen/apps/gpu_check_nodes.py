"""GPU checks from outside: `smartgen serve --role both` answering the OpenAI API with every scheme, `smartgen bench`,
and GPUDirect RDMA registration of GPU memory (with `smartgen info`'s report of it).

Every process started here is stopped before the check returns, on failure too (and dies with this one if it is
killed: `die_with_parent`); the runner kills the check's process group past its budget as well.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from smartgen.apps.gpu_check_base import Context, Row
from smartgen.roles.processes import die_with_parent, read_ready_file, smartgen_command, smartgen_env

__all__ = ["check_serve", "check_serve_tcp", "check_bench", "check_gpudirect"]

# lossy (2-bit KV; what was not pushed is never attended): their text may differ from full transfer's
EXACT_BUT_NOT = ("quant2", "proactive-only")


def _smartgen(*args: str) -> list[str]:
    return smartgen_command(*args)


def _env(ctx: Context) -> dict[str, str]:
    """The nodes' environment: a profile database of this run only (nothing is added to the user's)."""
    env = {**os.environ, "SMARTGEN_DB": str(ctx.workdir / "profiles.db"), "TOKENIZERS_PARALLELISM": "false"}
    return smartgen_env(env)


def _tail(path: Path, lines: int = 2) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:]) or "no output"


# -- serve --role both ----------------------------------------------------------------------------
def check_serve(ctx: Context) -> None:
    """One `serve --role both` process on the device; one greedy request per scheme, each a 200 with every token
    asked for and the scheme it asked for; then SIGTERM, and a clean exit."""
    from smartgen.apps.bench.models import SAMPLE_MODEL, SAMPLE_MODEL_16

    cuda = ctx.cuda
    model, name = (SAMPLE_MODEL_16, "sample16") if cuda else (SAMPLE_MODEL, "sample")
    prompt_tokens, new_tokens, blocks = (1024, 16, 64) if cuda else (120, 8, 16)
    ready_file, log_path = ctx.workdir / "serve-ready.json", ctx.workdir / "serve.log"
    command = _smartgen("serve", "--role", "both", "--model", str(model), "--device", ctx.device_name)
    command += ["--http", "127.0.0.1:0", "--ready-file", str(ready_file), "--blocks", str(blocks)]
    command += ["--link-gbps", "1", "--max-tokens", str(prompt_tokens + new_tokens + 64)]
    shape = f"{name} prompt {prompt_tokens} + {new_tokens} new"
    began = time.monotonic()
    with log_path.open("w") as log:
        node = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_env(ctx), preexec_fn=die_with_parent
        )
    try:
        try:
            info = read_ready_file(ready_file, max(5.0, ctx.left() - 20), alive=lambda: node.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            ctx.add(Row("serve", ctx.device_name, "start", "fp32", "fail", note=f"{exc}; log: {_tail(log_path)}"))
            return
        up_ms = (time.monotonic() - began) * 1e3
        ctx.add(Row("serve", ctx.device_name, "start", "fp32", "pass", ours_ms=up_ms, note=f"http {info['http']}"))
        _each_scheme(
            ctx, "serve", f"http://{info['http']}/v1/completions", shape, new_tokens, prompt_tokens, [log_path]
        )
    finally:
        _stop(ctx, node, log_path)


# -- a prefill node and a decode node over TCP ----------------------------------------------------------------------
def check_serve_tcp(ctx: Context) -> None:
    """`serve --role prefill` and `--role decode` as two processes on the device over the TCP lane (as deployed: every
    byte the decode node gets crosses a socket into host memory before its pool on the GPU), one greedy request per
    scheme; then both stopped."""
    from smartgen.apps.bench.models import SAMPLE_MODEL, SAMPLE_MODEL_16
    from smartgen.apps.cluster import ClusterSpec, LocalCluster

    model, name = (SAMPLE_MODEL_16, "sample16") if ctx.cuda else (SAMPLE_MODEL, "sample")
    prompt_tokens, new_tokens, blocks = (1024, 16, 64) if ctx.cuda else (120, 8, 16)
    spec = ClusterSpec(
        model=model,
        link_gbps=1.0,
        blocks=blocks,
        max_batch=2,
        max_tokens=prompt_tokens + new_tokens + 64,
        db=ctx.workdir / "profiles.db",
        device=ctx.device_name,
    )
    run_dir = ctx.workdir / "tcp-nodes"
    logs = [run_dir / "decode.log", run_dir / "prefill0.log"]
    began = time.monotonic()
    try:
        cluster = LocalCluster(spec, run_dir=run_dir).__enter__()
    except Exception as exc:
        note = f"{exc}" + (f" | {trace}" if (trace := _last_traceback(logs)) else "")
        ctx.add(Row("serve.tcp", ctx.device_name, "start", "fp32", "fail", note=note))
        return
    try:
        up_ms = (time.monotonic() - began) * 1e3
        ctx.add(Row("serve.tcp", ctx.device_name, "start", "fp32", "pass", ours_ms=up_ms, note=f"http {cluster.http}"))
        url = f"http://{cluster.http}/v1/completions"
        _each_scheme(
            ctx, "serve.tcp", url, f"{name} prompt {prompt_tokens} + {new_tokens} new", new_tokens, prompt_tokens, logs
        )
    finally:
        cluster.__exit__(None, None, None)


def _each_scheme(
    ctx: Context, check: str, url: str, shape: str, new_tokens: int, prompt_tokens: int, logs: list[Path]
) -> None:
    """One greedy request per scheme to `url`, a row each; a failed one's row ends with the traceback the nodes
    logged (`logs`), since on a lent machine that is all that comes back."""
    import httpx

    from smartgen.engine.policy import POLICIES

    ids = torch.randint(3, 90, (prompt_tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    texts: dict[str, str] = {}
    for scheme in POLICIES:
        if ctx.over_time(check, f"{shape}, {scheme}", "fp32", reserve_s=15):
            continue
        body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "scheme": scheme}
        sent = time.monotonic()
        try:
            response = httpx.post(url, json=body, timeout=max(5.0, min(60.0, ctx.left() - 15)))
        except httpx.HTTPError as exc:
            ctx.add(Row(check, ctx.device_name, f"{shape}, {scheme}", "fp32", "fail", note=f"{exc!r}"))
            continue
        took = (time.monotonic() - sent) * 1e3
        row = _served(ctx, check, f"{shape}, {scheme}", scheme, response, new_tokens, took, texts)
        if row.result == "fail" and (trace := _last_traceback(logs)):
            row.note += f" | {trace}"
        ctx.add(row)


def _last_traceback(logs: list[Path], lines: int = 12) -> str:
    """The last traceback in the first of `logs` that holds one, its last lines joined (empty when none holds one)."""
    for path in logs:
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        starts = [i for i, line in enumerate(text) if line.startswith("Traceback")]
        if starts:
            return f"{path.name}: " + " | ".join(line.strip() for line in text[starts[-1] :][-lines:])
    return ""


def _served(
    ctx: Context,
    check: str,
    shape: str,
    scheme: str,
    response: Any,
    new_tokens: int,
    took_ms: float,
    texts: dict[str, str],
) -> Row:
    if response.status_code != 200:
        return Row(
            check, ctx.device_name, shape, "fp32", "fail", note=f"HTTP {response.status_code}: {response.text[:200]}"
        )
    body = response.json()
    usage, text = body.get("usage", {}), body["choices"][0]["text"]
    problems = []
    if usage.get("completion_tokens") != new_tokens:
        problems.append(f"{usage.get('completion_tokens')} tokens, asked for {new_tokens}")
    if str(usage.get("scheme", "")).partition("[")[0] != scheme:
        problems.append(f"served as {usage.get('scheme')!r}")
    texts[scheme] = text
    note = "ttft {:.0f} ms, ttst {:.0f} ms, tbt {:.1f} ms".format(
        *(1e3 * (usage.get(k) or 0) for k in ("ttft", "ttst", "tbt"))
    )
    if scheme != "full" and scheme not in EXACT_BUT_NOT and "full" in texts:
        note += "; same text as full" if text == texts["full"] else "; text differs from full's (exact: a near tie?)"
    if problems:
        note = "; ".join(problems) + "; " + note
    return Row(check, ctx.device_name, shape, "fp32", "fail" if problems else "pass", ours_ms=took_ms, note=note)


def _stop(ctx: Context, node: subprocess.Popen, log_path: Path) -> None:
    """SIGTERM, as an operator stops a node; it must exit 0 within 30 s (else it is killed and the row fails)."""
    if node.poll() is not None:
        ctx.add(
            Row(
                "serve",
                ctx.device_name,
                "stop",
                "-",
                "fail",
                note=f"exited early ({node.returncode}): {_tail(log_path)}",
            )
        )
        return
    node.send_signal(signal.SIGTERM)
    try:
        rc = node.wait(30)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait()
        ctx.add(Row("serve", ctx.device_name, "stop (SIGTERM)", "-", "fail", note="still running 30 s on: killed"))
        return
    result = "pass" if rc == 0 else "fail"
    ctx.add(
        Row(
            "serve",
            ctx.device_name,
            "stop (SIGTERM)",
            "-",
            result,
            note=f"exit {rc}" + ("" if rc == 0 else f": {_tail(log_path)}"),
        )
    )


# -- smartgen bench -------------------------------------------------------------------------------
CPU_BENCH = (
    *("--schemes", "full,smartgen", "--strategies", "", "--lengths", "1024", "--blocks", "64"),
    *("--output-tokens", "4", "--reps", "1", "--warmup", "0", "--lane", "inproc"),
)


def check_bench(ctx: Context) -> None:
    """CUDA: `smartgen bench --quick` as `make bench` runs it. CPU half: full and smartgen only, 4 tokens, one
    process (about 40 s here, profiling included; --quick takes 74 s and `make bench` runs it)."""
    out, log_path = ctx.workdir / "bench", ctx.workdir / "bench.log"
    args = ("--quick", "--device", str(ctx.device)) if ctx.cuda else CPU_BENCH
    shape = "--quick (sample, 1024 tokens, every scheme)" if ctx.cuda else "sample, 1024 tokens, full + smartgen, 4 new"
    began = time.monotonic()
    with log_path.open("w") as log:
        bench = subprocess.Popen(
            _smartgen("bench", *args, "--out", str(out)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(ctx),
            preexec_fn=die_with_parent,
        )
    try:
        rc = bench.wait(max(5.0, ctx.left()))
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if bench.poll() is None:
            bench.send_signal(signal.SIGTERM)  # its nodes die with it (die_with_parent)
            try:
                bench.wait(15)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
    wall = time.monotonic() - began
    if rc != 0:
        why = "over its budget: stopped" if rc is None else f"exit {rc}"
        ctx.add(
            Row("bench", ctx.device_name, shape, "fp32", "fail", note=f"{why} after {wall:.0f} s: {_tail(log_path)}")
        )
        return
    ctx.add(_bench_row(ctx, shape, json.loads((out / "results.json").read_text()), wall))


def _bench_row(ctx: Context, shape: str, results: dict[str, Any], wall: float) -> Row:
    summaries = {s["scheme"]: s for s in results["summaries"]}
    requests = sum(s["requests"] for s in summaries.values())
    failed = sum(s["failed"] for s in summaries.values())
    full, ours = summaries.get("full"), summaries.get("smartgen")
    note = f"{len(summaries)} schemes, {requests} requests, {failed} failed, {wall:.0f} s"
    ref_ms = ours_ms = None
    if full and ours:
        ref_ms, ours_ms = 1e3 * full["ttst"]["p50"], 1e3 * ours["ttst"]["p50"]
        note += f"; smartgen TTST {ours['vs_full']['ttst_speedup']:.2f}x full's, TBT {ours['vs_full']['tbt']:.2f}x"
    result = "pass" if requests and not failed and full and ours else "fail"
    return Row("bench", ctx.device_name, shape, "fp32", result, ref_ms=ref_ms, ours_ms=ours_ms, note=note)


# -- GPUDirect RDMA -------------------------------------------------------------------------------
def check_gpudirect(ctx: Context) -> None:
    """`smartgen info --json` (CUDA, RDMA and GPUDirect probes); on CUDA with an RDMA device and a GPUDirect route,
    1 MiB of GPU memory registered through the RDMA lane's endpoint, else a skip with the reason."""
    from smartgen.lanes.backends import lands_in_device_memory

    said = subprocess.run(_smartgen("info", "--json"), capture_output=True, text=True, timeout=max(5.0, ctx.left()))
    if said.returncode != 0:
        ctx.add(Row("gpudirect", ctx.device_name, "smartgen info", "-", "fail", note=said.stderr.strip()[-300:]))
        return
    info = json.loads(said.stdout)
    rdma, routes = info["rdma"], info["gpudirect"]
    note = f"cuda: {info['cuda']['status']}; rdma: {rdma['status']}; gpudirect: {routes['status']}"
    try:  # what the decode node decides from it (roles.decode_node.staged_pool)
        staged = not lands_in_device_memory("rdma", ctx.device)
        note += f"; a pool on {ctx.device_name} over the rdma lane: {'staged through host memory' if staged else 'registered'}"
    except Exception as exc:  # the lane's module needs what the probes found missing
        note += f"; the rdma lane cannot say where a pool lands ({type(exc).__name__}: {exc})"
    if not ctx.cuda:
        ctx.add(Row("gpudirect", "cpu", "probes", "-", "pass", note="cpu half: `smartgen info` probes ran; " + note))
        return
    if not rdma["devices"] or not routes["routes"]:
        why = "no RDMA device" if not rdma["devices"] else "no GPUDirect RDMA route"
        ctx.add(Row("gpudirect", ctx.device_name, "register 1 MiB", "uint8", "skip", note=f"{why}: {note}"))
        return
    from smartgen.lanes.rdma.verbs import VerbsEndpoint

    endpoint = VerbsEndpoint()
    try:
        region = torch.zeros(1 << 20, dtype=torch.uint8, device=ctx.device)
        began = time.perf_counter()
        mr = endpoint.register(region.data_ptr(), region.numel(), ctx.device.index or 0)
        took = (time.perf_counter() - began) * 1e3
        note = f"registered by {mr.route} (rkey {mr.rkey:#x}); " + note
        mr.close()
    finally:
        endpoint.close()
    ctx.add(Row("gpudirect", ctx.device_name, "register 1 MiB", "uint8", "pass", ours_ms=took, note=note))
