"""`smartgen serve --role prefill|decode|both`: the long-running nodes of a disaggregated deployment."""

from __future__ import annotations

import enum
import logging
import math
from pathlib import Path
from typing import Annotated

import typer

from .errors import fail
from .rdma_options import check_rdma, device_option, gid_option, port_option
from .sizes import half_of_memory, parse_size

PANEL_MODEL = "Model and selection"
PANEL_NET = "Network"
PANEL_DECODE = "Decode node"
PANEL_PREFILL = "Prefill node"
PANEL_FAULTS = "Failures and limits"
PANEL_CACHE = "Prefix caching"

log = logging.getLogger("smartgen.serve")


class Role(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"
    both = "both"


def serve(
    ctx: typer.Context,
    role: Annotated[
        Role,
        typer.Option(
            help="Which node to run: prefill (runs prefill, pushes KV), decode (the entry point: HTTP API, decoding), "
            "or both in one process over the in-process lane (`--lane inproc`; one model loaded, no node-to-node "
            "sockets, no secret needed): --http and --status as for the two roles, --link-gbps paces both directions; "
            "--listen and --prefill are refused."
        ),
    ],
    model: Annotated[
        Path,
        typer.Option(
            help="Local folder of a Hugging Face causal LM (config, weights, tokenizer).", rich_help_panel=PANEL_MODEL
        ),
    ],
    selector: Annotated[
        str,
        typer.Option(
            help="KV selector on the decode node: quest, infinigen, hata (hash weights from the profile store: "
            "`smartgen profile --selector hata`), topk or dense.",
            rich_help_panel=PANEL_MODEL,
        ),
    ] = "quest",
    budget: Annotated[
        float,
        typer.Option(
            min=0.0001,
            help="Selection budget: a share of the prompt (<= 1) or a token count (> 1).",
            rich_help_panel=PANEL_MODEL,
        ),
    ] = 0.1,
    blocks: Annotated[
        int, typer.Option(min=1, help="KV blocks M per layer (must match the profile's).", rich_help_panel=PANEL_MODEL)
    ] = 1024,
    dtype: Annotated[
        str, typer.Option(help="Weights and KV dtype: float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)
    ] = "float32",
    device: Annotated[
        str, typer.Option(help="Torch device for the model (cpu, cuda, cuda:1).", rich_help_panel=PANEL_MODEL)
    ] = "cpu",
    listen: Annotated[
        str, typer.Option(help="Prefill node: HOST:PORT to accept decode nodes on.", rich_help_panel=PANEL_PREFILL)
    ] = "127.0.0.1:7100",
    db: Annotated[
        Path | None,
        typer.Option(
            help="Prefill node: profile database (default: $SMARTGEN_DB or the XDG data dir).",
            rich_help_panel=PANEL_PREFILL,
        ),
    ] = None,
    fallback_strategy: Annotated[
        str,
        typer.Option(
            help="Prefill node: proactive-set strategy when no profile matches: streaming, sequential or random.",
            rich_help_panel=PANEL_PREFILL,
        ),
    ] = "streaming",
    status: Annotated[
        str,
        typer.Option(
            help="Prefill node: HOST:PORT for a JSON status endpoint (GET /status) the monitor reads; empty = off.",
            rich_help_panel=PANEL_PREFILL,
        ),
    ] = "",
    max_queue: Annotated[
        int,
        typer.Option(
            min=1, help="Prefill node: OPEN requests queued before new ones are refused.", rich_help_panel=PANEL_PREFILL
        ),
    ] = 64,
    max_store_bytes: Annotated[
        str,
        typer.Option(
            help="Prefill node: most KV (bytes; 512M, 8G...) held for decode nodes at once; a request that would go "
            "over it is refused and its client gets 503 with the reason. auto = half of this machine's memory.",
            rich_help_panel=PANEL_PREFILL,
        ),
    ] = "auto",
    prefill: Annotated[
        str,
        typer.Option(
            help="Decode node: prefill nodes, HOST:PORT[,HOST:PORT...]; each request goes to the least loaded.",
            rich_help_panel=PANEL_DECODE,
        ),
    ] = "127.0.0.1:7100",
    http: Annotated[
        str,
        typer.Option(help="Decode node: HOST:PORT of the OpenAI-compatible HTTP API.", rich_help_panel=PANEL_DECODE),
    ] = "127.0.0.1:8000",
    scheme: Annotated[
        str,
        typer.Option(
            help="Decode node: default transfer scheme: smartgen (the paper's three paths with hints and prefetch), smartgen-paper (the paper's paths only), smartgen-paper+hints, full, partial, partial+profile, partial+profile+parallel, proactive-only, quant2 (full transfer of 2-bit quantized KV: lossy); a request may ask for another.",
            rich_help_panel=PANEL_DECODE,
        ),
    ] = "smartgen",
    speculative_ratio: Annotated[
        float,
        typer.Option(
            min=0.001,
            max=1.0,
            help="Decode node: share of all blocks pushed per idle notice.",
            rich_help_panel=PANEL_DECODE,
        ),
    ] = 0.1,
    max_batch: Annotated[
        int,
        typer.Option(min=1, help="Decode node: requests decoding at once (pool slots).", rich_help_panel=PANEL_DECODE),
    ] = 8,
    max_tokens: Annotated[
        int,
        typer.Option(min=16, help="Decode node: tokens per pool slot (prompt + output).", rich_help_panel=PANEL_DECODE),
    ] = 8192,
    max_waiting: Annotated[
        int,
        typer.Option(
            min=1,
            help="Decode node: requests waiting for a slot before new ones get 503 (overloaded).",
            rich_help_panel=PANEL_DECODE,
        ),
    ] = 64,
    link_gbps: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Cap this node's outgoing traffic at this many Gbit/s (0 = unpaced), to reproduce a cloud link.",
            rich_help_panel=PANEL_NET,
        ),
    ] = 0.0,
    delay_ms: Annotated[
        float,
        typer.Option(
            min=0.0, help="Emulated one-way link delay in milliseconds (same-host clocks).", rich_help_panel=PANEL_NET
        ),
    ] = 0.0,
    lane: Annotated[
        str,
        typer.Option(
            help="Transport for KV and messages, the same on both nodes: tcp, mooncake (smartgen\\[mooncake]), "
            "nixl (smartgen\\[nixl]) or rdma (smartgen\\[rdma]; needs an RDMA device); or inproc, the in-process "
            "lane of --role both (and only of it). See docs/lanes.md. Default: tcp; inproc with --role both.",
            rich_help_panel=PANEL_NET,
            show_default=False,
        ),
    ] = "",
    rdma_device: Annotated[str | None, device_option(PANEL_NET)] = None,
    rdma_port: Annotated[int | None, port_option(PANEL_NET)] = None,
    gid_index: Annotated[int | None, gid_option(PANEL_NET)] = None,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            help='Once listening, write the bound addresses here as JSON ({"listen"|"http": "HOST:PORT", ...}; '
            '--role both: {"role": "both", "http": ..., "status": ...}); with port 0 the system picks free ports and '
            "this file says which.",
            rich_help_panel=PANEL_NET,
        ),
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(
            help="Append this node's /status to FILE once a second (JSON lines) for `smartgen monitor --replay FILE` "
            "(--role both: both halves in each frame).",
            rich_help_panel=PANEL_NET,
        ),
    ] = None,
    secret: Annotated[
        str,
        typer.Option(
            envvar="SMARTGEN_SECRET",
            help="Shared secret both nodes must hold (or $SMARTGEN_SECRET); required unless --insecure or --role both.",
            rich_help_panel=PANEL_NET,
        ),
    ] = "",
    lease: Annotated[
        float,
        typer.Option(
            min=2.0,
            help="Seconds a peer may stay silent before it is declared dead; heartbeats go every lease/4 on every "
            "connection. The same on both nodes. At least 2 (a bulk push may pause up to 1 s for urgent traffic).",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 3.0,
    first_token_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Decode node: seconds from dispatch to the first token (and, under full transfer, to the last block; "
            "for a request prefilled again elsewhere, to the new node's prefill) before the request fails.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 120.0,
    queue_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Decode node: seconds a request may wait for a free pool slot; past it, 503 with the reason.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 300.0,
    fetch_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Decode node: seconds one request may wait for an on-demand fetch before it fails (the rest of the "
            "batch goes on).",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 30.0,
    fetch_stall_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Decode node: a decode step waits this many ms for one request's fetch, then goes on without it: "
            "that request leaves the batch (its step is redone) until the fetch lands, so a stalled prefill node "
            "never holds up requests that do not need it. 0 = wait up to --fetch-timeout.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 1000.0,
    on_prefill_failure: Annotated[
        str,
        typer.Option(
            help="Decode node: what happens to requests of a lost prefill node: fail (a clear error) or recompute "
            "(they are prefilled again on another prefill node, which sends only what the decode node lacks; "
            "decoding ones wait outside the batch meanwhile and go on with the tokens they would have had).",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = "fail",
    handshake_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a connection may take to connect and authenticate (the decode node's connect and handshake "
            "with a prefill node; the prefill node closes a connection not authenticated by then).",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 5.0,
    confirm_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="One-sided lanes (mooncake, nixl, rdma): seconds the peer has to answer LANE_INFO and to confirm "
            "that it accepts or revokes a request's writes; past it the link is declared broken.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 10.0,
    write_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="One-sided lanes (nixl, rdma): seconds one list of KV writes may take to complete; past it the link "
            "is declared broken and the requests that needed it fail (or are recomputed).",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 30.0,
    flush_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Prefill node: seconds a proactive-only request's proactive set may take to land before its first "
            "token goes out; past it the request fails.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 120.0,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            min=1024,
            help="Decode node: largest HTTP request body; larger ones get 413 before they are read.",
            rich_help_panel=PANEL_FAULTS,
        ),
    ] = 4 * 2**20,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            help="TLS on the node-to-node TCP connections: this node's certificate (PEM). A prefill node needs it "
            "(with --tls-key) to serve TLS; a decode node only for mutual TLS.",
            rich_help_panel=PANEL_NET,
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(help="The private key of --tls-cert (PEM).", rich_help_panel=PANEL_NET),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option(
            help="CA certificate (PEM) the peer's certificate must chain to: a decode node verifies its prefill nodes "
            "with it (and turns TLS on); a prefill node given one requires decode nodes to present certificates.",
            rich_help_panel=PANEL_NET,
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Run without a shared secret: any peer that can reach the port is accepted. Loopback trials only.",
            rich_help_panel=PANEL_NET,
        ),
    ] = False,
    prefix_cache_bytes: Annotated[
        str,
        typer.Option(
            help="KV of recent prompts kept by token blocks, up to this size (K/M/G suffixes; 0 = off). Prefill node: "
            "a prompt starting with cached blocks prefills only the rest. Decode node: finished requests' prompt KV "
            "is kept, and a new request's cached leading blocks are never transferred. LRU eviction; blocks in use "
            "are never evicted.",
            rich_help_panel=PANEL_CACHE,
        ),
    ] = "1G",
    prefix_block_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            max=4096,
            help="Tokens per prefix-cache block (a prompt's cached part is a whole number of blocks); the same on "
            "both nodes.",
            rich_help_panel=PANEL_CACHE,
        ),
    ] = 16,
    emulate_layer_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Decode node, benchmarks only: add this many ms of emulated compute to every layer of every step, "
            "to stand in for a slower decode device (`smartgen bench --decode-ratio` sets it). 0 = off.",
            rich_help_panel=PANEL_DECODE,
        ),
    ] = 0.0,
) -> None:
    """Run a prefill node, a decode node, or both in one process (--role both), until Ctrl-C (or SIGTERM)."""
    from smartgen.lanes.backends import INPROC
    from smartgen.lanes.tls import TlsFiles
    from smartgen.lanes.wire import HandshakeError
    from smartgen.roles.colocated import DecodeSettings
    from smartgen.roles.launch import NodeSettings
    from smartgen.roles.limits import DecodeLimits, PrefillLimits
    from smartgen.roles.node_runner import run_node
    from smartgen.roles.serve_settings import ServeSettings
    from smartgen.runtime.models import ModelLoadError

    waits = {
        "--lease": lease,
        "--first-token-timeout": first_token_timeout,
        "--queue-timeout": queue_timeout,
        "--fetch-timeout": fetch_timeout,
        "--fetch-stall-ms": fetch_stall_ms,
        "--handshake-timeout": handshake_timeout,
        "--confirm-timeout": confirm_timeout,
        "--write-timeout": write_timeout,
        "--flush-timeout": flush_timeout,
    }
    for option, value in waits.items():
        if not math.isfinite(value):  # nan passes the range checks and inf means never: neither is a bound
            fail(f"{option} must be a finite number, got {value}")
    lane = lane or (INPROC if role == Role.both else "tcp")
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
            **timeouts,
        )
        prefill_limits = PrefillLimits(
            lease, flush_timeout_s=flush_timeout, max_queue=max_queue, max_store_bytes=store_cap, **timeouts
        )
        decode = DecodeSettings(
            scheme, speculative_ratio, max_batch, max_tokens, max_waiting, emulate_layer_ms, decode_limits
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
        )
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
        run_node(settings, say=lambda line: typer.echo(line, err=True))
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
