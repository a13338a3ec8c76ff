"""`smartgen serve --role prefill|decode|both`: the long-running nodes of a disaggregated deployment.

Only the options are here: `smartgen.roles.node_runner.run_node` runs the node (and is what a Python caller calls).
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Annotated

import typer

from .errors import fail
from .lane_options import GidIndex, Lane, RdmaDevice, RdmaPort, check_rdma
from .node_options import (
    ConfirmTimeout,
    FetchStallMs,
    FetchTimeout,
    FirstTokenTimeout,
    FlushTimeout,
    HandshakeTimeout,
    Insecure,
    Lease,
    QueueTimeout,
    Secret,
    StepShare,
    TlsCa,
    TlsCert,
    TlsKey,
    WriteTimeout,
)
from .options import MODEL, Blocks, Budget, DelayMs, Device, LinkGbps, ModelFolder, Selector, SpeculativeRatio, option
from .sizes import half_of_memory, parse_size
from .store_options import Db

PREFILL, DECODE, CACHE, PROCESS = "Prefill node", "Decode node", "Prefix caching", "Node process"
EVENTS = "KV events"


class Role(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"
    both = "both"


RoleOption = Annotated[
    Role,
    typer.Option(
        help="Which node to run: prefill (runs prefill, pushes KV), decode (the entry point: HTTP API, decoding), "
        "or both in one process over the in-process lane (`--lane inproc`; one model loaded, no node-to-node "
        "sockets, no secret needed): --http and --status as for the two roles, --link-gbps paces both directions; "
        "--listen and --prefill are refused."
    ),
]
Dtype = Annotated[str, option(MODEL, "Weights and KV dtype: float32, bfloat16 or float16.")]
Listen = Annotated[str, option(PREFILL, "HOST:PORT to accept decode nodes on.")]
Status = Annotated[
    str, option(PREFILL, "HOST:PORT for a JSON status endpoint (GET /status) the monitor reads; empty = off.")
]
MaxStoreBytes = Annotated[
    str,
    option(
        PREFILL,
        "Most KV (bytes; 512M, 8G...) held for decode nodes at once; a request that would go over it is "
        "refused and its client gets 503 with the reason. auto = half of this machine's memory.",
    ),
]
MaxQueue = Annotated[int, option(PREFILL, "OPEN requests queued before new ones are refused.", min=1)]
Fallback = Annotated[
    str, option(PREFILL, "Proactive-set strategy when no profile matches: streaming, sequential or random.")
]
Prefill = Annotated[
    str,
    option(
        DECODE,
        "Prefill nodes, HOST:PORT[,HOST:PORT...]; each request goes to the one with the least queued prompt tokens, "
        "counting those it likely has in its prefix cache (a prompt goes back to the node that prefilled its prefix).",
    ),
]
IngressGbps = Annotated[
    float,
    option(
        DECODE,
        "Pace what this decode node receives at this rate (Gbit/s) on one link shared by all its prefill nodes, as "
        "their bytes share its one NIC (the paper's DP 6 -> 1); --link-gbps still paces each prefill node's own "
        "sends. tcp lane only. 0 = off.",
        min=0.0,
    ),
]
Http = Annotated[str, option(DECODE, "HOST:PORT of the OpenAI-compatible HTTP API.")]
Scheme = Annotated[
    str,
    option(
        DECODE,
        "Default transfer scheme: smartgen (the paper's three paths with hints, prefetch, chained speculation "
        "scheduled behind proactive sets, the first step's forecast, whose token is the second, and the prefill node decoding on while idle: its head start), smartgen-no-forecast, "
        "smartgen-no-second-token, smartgen-no-head-start, smartgen-eager-proactive, smartgen-unscheduled, smartgen-no-prefetch and smartgen-no-hints (its ablations), smartgen-attend (its misses attended where the KV is, not fetched), smartgen-paper (the paper's paths only), smartgen-paper+hints, full, "
        "partial, partial+profile, partial+profile+parallel, proactive-only, quant2 (full transfer of 2-bit "
        "quantized KV: lossy); a request may ask for another.",
    ),
]
MaxBatch = Annotated[int, option(DECODE, "Requests decoding at once (pool slots).", min=1)]
MaxTokens = Annotated[int, option(DECODE, "Tokens per pool slot (prompt + output).", min=16)]
MaxWaiting = Annotated[int, option(DECODE, "Requests waiting for a slot before new ones get 503 (overloaded).", min=1)]
OnPrefillFailure = Annotated[
    str,
    option(
        DECODE,
        "What happens to requests of a lost prefill node: fail (a clear error) or recompute (they are "
        "prefilled again on another prefill node, which sends only what the decode node lacks; decoding ones wait "
        "outside the batch meanwhile and go on with the tokens they would have had).",
    ),
]
MaxBodyBytes = Annotated[
    int, option(DECODE, "Largest HTTP request body; larger ones get 413 before they are read.", min=1024)
]
EmulateLayerMs = Annotated[
    float,
    option(
        DECODE,
        "Benchmarks only: add this many ms of emulated compute to every layer of every decode step, to stand "
        "in for a slower decode device (`smartgen bench --decode-ratio` sets it); on a prefill node, to the decode "
        "steps it runs (the forecast, a head start). A batch's step costs this CPU's compute for the batch plus the "
        "emulation. 0 = off.",
        min=0.0,
    ),
]
EmulateLayerFloorMs = Annotated[
    float,
    option(
        DECODE,
        "Benchmarks only, instead of --emulate-layer-ms: every layer of every decode step takes at least this many ms "
        "of compute (the step thread's own CPU, topped up with sleep), so a batch's step costs what one request's "
        "does while this CPU fits under the floor, as on a GPU, whose decode step hardly grows with a small batch; "
        "link waits come on top (`smartgen bench --decode-emulation floor` sets it). 0 = off.",
        min=0.0,
    ),
]
PrefixCacheBytes = Annotated[
    str,
    option(
        CACHE,
        "KV of recent prompts kept by token blocks, up to this size (K/M/G suffixes; 0 = off). Prefill node: a prompt "
        "starting with cached blocks prefills only the rest. Decode node: finished requests' prompt KV is kept, and a "
        "new request's cached leading blocks are never transferred. Eviction by --prefix-retention; blocks in use are never "
        "evicted.",
    ),
]
PrefixBlockTokens = Annotated[
    int,
    option(
        CACHE,
        "Tokens per prefix-cache block (a prompt's cached part is a whole number of blocks); the same on both nodes.",
        min=1,
        max=4096,
    ),
]
PrefixRetention = Annotated[
    str,
    option(
        CACHE,
        "Which prefix-cache blocks stay when room is needed: lru (least recently used first) or cost (the most "
        "expected saved seconds per byte: reuse rate learned from the cache's own hit history by hit count and age, "
        "times what a miss costs here: link time on a decode node, recompute time on a prefill node, where later "
        "blocks cost more; stale blocks age out, and a new block worth less than all it would evict is not stored). "
        "Either way a block is evicted only after every cached block that extends it.",
    ),
]
KvEventsEndpoint = Annotated[
    str,
    option(
        EVENTS,
        "Publish this node's prefix-cache events in vLLM's KV-events format (ZMQ PUB, msgpack KVEventBatch of "
        "BlockStored / BlockRemoved / AllBlocksCleared) for routers that score prefix overlap (Dynamo, llm-d). As "
        "vLLM: tcp://*:5557 binds, tcp://HOST:PORT connects; tcp://127.0.0.1:* binds a free port (the ready file says "
        "which). --role both publishes its decode half. Empty = off. Needs pyzmq and msgpack (smartgen[events]).",
    ),
]
KvEventsReplay = Annotated[
    str,
    option(
        EVENTS,
        "Bind a ROUTER here (tcp://*:5558) that answers a start sequence number (8 bytes, big-endian) with the "
        "buffered event batches from it on, then -1, as vLLM's replay endpoint does. Empty = no replay.",
    ),
]
KvEventsTopic = Annotated[str, option(EVENTS, "The topic frame of every published batch (vLLM's default: empty).")]
KvEventsEncoding = Annotated[
    str,
    option(
        EVENTS,
        "How each event is encoded: array (tagged arrays, msgspec array_like: vLLM up to 0.23 and every subscriber "
        "written for it) or map (tagged maps with field names: vLLM since 0.24). The batch is an array either way.",
    ),
]
ReadyFile = Annotated[
    Path | None,
    option(
        PROCESS,
        'Once listening, write the bound addresses here as JSON ({"listen"|"http": "HOST:PORT", ...}; --role both: '
        '{"role": "both", "http": ..., "status": ...}); with port 0 the system picks free ports and this file says '
        "which.",
    ),
]
Record = Annotated[
    Path | None,
    option(
        PROCESS,
        "Append this node's /status to FILE once a second (JSON lines) for `smartgen monitor --replay FILE` (--role "
        "both: both halves in each frame).",
    ),
]


def serve(
    ctx: typer.Context,
    role: RoleOption,
    model: ModelFolder,
    dtype: Dtype = "float32",
    device: Device = "cpu",
    selector: Selector = "quest",
    budget: Budget = 0.1,
    blocks: Blocks = 1024,
    speculative_ratio: SpeculativeRatio = 0.1,
    listen: Listen = "127.0.0.1:7100",
    status: Status = "",
    max_store_bytes: MaxStoreBytes = "auto",
    max_queue: MaxQueue = 64,
    fallback_strategy: Fallback = "streaming",
    prefill: Prefill = "127.0.0.1:7100",
    ingress_gbps: IngressGbps = 0.0,
    http: Http = "127.0.0.1:8000",
    scheme: Scheme = "smartgen",
    max_batch: MaxBatch = 8,
    max_tokens: MaxTokens = 8192,
    max_waiting: MaxWaiting = 64,
    on_prefill_failure: OnPrefillFailure = "fail",
    max_body_bytes: MaxBodyBytes = 4 * 2**20,
    emulate_layer_ms: EmulateLayerMs = 0.0,
    emulate_layer_floor_ms: EmulateLayerFloorMs = 0.0,
    link_gbps: LinkGbps = 0.0,
    delay_ms: DelayMs = 0.0,
    lane: Lane = "",
    rdma_device: RdmaDevice = None,
    rdma_port: RdmaPort = None,
    gid_index: GidIndex = None,
    lease: Lease = 3.0,
    handshake_timeout: HandshakeTimeout = 5.0,
    confirm_timeout: ConfirmTimeout = 10.0,
    write_timeout: WriteTimeout = 30.0,
    first_token_timeout: FirstTokenTimeout = 120.0,
    queue_timeout: QueueTimeout = 300.0,
    fetch_timeout: FetchTimeout = 30.0,
    fetch_stall_ms: FetchStallMs = 1000.0,
    step_share: StepShare = True,
    flush_timeout: FlushTimeout = 120.0,
    secret: Secret = "",
    insecure: Insecure = False,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    db: Db = None,
    prefix_cache_bytes: PrefixCacheBytes = "1G",
    prefix_block_tokens: PrefixBlockTokens = 16,
    prefix_retention: PrefixRetention = "lru",
    kv_events_endpoint: KvEventsEndpoint = "",
    kv_events_replay: KvEventsReplay = "",
    kv_events_topic: KvEventsTopic = "",
    kv_events_encoding: KvEventsEncoding = "array",
    ready_file: ReadyFile = None,
    record: Record = None,
) -> None:
    """Run a prefill node, a decode node, or both in one process (--role both), until Ctrl-C (or SIGTERM)."""
    from smartgen.lanes.backends import INPROC
    from smartgen.lanes.thread_priority import batch_this_thread, unbatch_this_thread
    from smartgen.lanes.tls import TlsFiles
    from smartgen.lanes.wire import HandshakeError
    from smartgen.roles.colocated import DecodeSettings
    from smartgen.roles.kv_events import KvEventsSettings
    from smartgen.roles.launch import NodeSettings
    from smartgen.roles.limits import DecodeLimits, PrefillLimits
    from smartgen.roles.node_runner import run_node
    from smartgen.roles.serve_settings import ServeSettings
    from smartgen.runtime.models import ModelLoadError

    lane = lane or (INPROC if role == Role.both else "tcp")
    if kv_events_replay and not kv_events_endpoint:
        fail("--kv-events-replay replays what --kv-events-endpoint publishes: give both")
    if emulate_layer_ms and emulate_layer_floor_ms:
        fail("--emulate-layer-ms adds to each layer, --emulate-layer-floor-ms tops it up: give one of the two")
    if role == Role.both:
        _refuse_socket_options(ctx, tls_cert or tls_key or tls_ca)
    rdma = check_rdma(lane, rdma_device, rdma_port, gid_index)  # a wrong device is a one-line error now
    store_cap = half_of_memory() if max_store_bytes == "auto" else parse_size(max_store_bytes, "--max-store-bytes")
    try:
        node = NodeSettings(
            model,
            dtype,
            device,
            selector,
            budget,
            blocks,
            secret,
            link_gbps or None,
            delay_ms,
            lane,
            rdma if lane == "rdma" else None,
            lease,
            tls=TlsFiles(tls_cert, tls_key, tls_ca) if (tls_cert or tls_key or tls_ca) else None,
            prefix_cache_bytes=parse_size(prefix_cache_bytes, "--prefix-cache-bytes", minimum=0),
            prefix_block_tokens=prefix_block_tokens,
            prefix_retention=prefix_retention,
            kv_events=KvEventsSettings(
                kv_events_endpoint, kv_events_replay or None, kv_events_topic, kv_events_encoding
            )
            if kv_events_endpoint
            else None,
            db=db,
        )
        timeouts = dict(
            handshake_timeout_s=handshake_timeout, confirm_timeout_s=confirm_timeout, write_timeout_s=write_timeout
        )
        decode_limits = DecodeLimits(
            lease,
            first_token_timeout,
            fetch_timeout,
            on_prefill_failure,
            max_body_bytes,
            fetch_stall_s=fetch_stall_ms / 1e3 or None,
            queue_timeout_s=queue_timeout,
            step_share=step_share,
            **timeouts,
        )
        prefill_limits = PrefillLimits(
            lease, flush_timeout_s=flush_timeout, max_queue=max_queue, max_store_bytes=store_cap, **timeouts
        )
        decode = DecodeSettings(
            scheme,
            speculative_ratio,
            max_batch,
            max_tokens,
            max_waiting,
            emulate_layer_ms,
            emulate_layer_floor_ms,
            decode_limits,
        )
        settings = ServeSettings(
            role.value,
            node,
            listen,
            prefill,
            http,
            status,
            fallback_strategy,
            decode,
            prefill_limits,
            ready_file,
            record,
            insecure,
            ingress_gbps=ingress_gbps or None,
        )
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
        # before any thread starts: they inherit SCHED_BATCH, and the step thread alone goes back (thread_priority)
        batched = role == Role.decode and batch_this_thread()
        try:
            run_node(settings, say=lambda line: typer.echo(line, err=True))
        finally:
            if batched:  # a caller in this process (a test's CliRunner) gets its thread back as it was
                unbatch_this_thread()
    except (ModelLoadError, ValueError, HandshakeError, ConnectionError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"network error: {exc}")


def _refuse_socket_options(ctx: typer.Context, tls: object) -> None:
    """--role both has no socket between its halves: options for one, given anyway, would be silently ignored."""
    given = [f"--{name}" for name in ("listen", "prefill") if _given(ctx, name)]
    if given:  # ignoring them would leave a user waiting for a connection that never comes
        fail(
            f"{' and '.join(given)} {'connect' if len(given) > 1 else 'connects'} separate nodes; --role both runs "
            "both halves in one process over the in-process lane (leave it out, or run --role prefill and --role decode)"
        )
    if tls:
        fail("--tls-cert, --tls-key and --tls-ca secure node-to-node sockets; --role both has none")


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set option `name` (on the command line or through its environment variable)."""
    source = ctx.get_parameter_source(name)  # typer's own click enum: compared by name, not by click's class
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
