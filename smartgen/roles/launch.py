"""Builds a prefill node or a decode node from its settings (what `node_runner.run_node` calls for `smartgen serve`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from smartgen.engine.policy import check_servable, get_policy
from smartgen.engine.prefix_cache import DEFAULT_BLOCK_TOKENS, PrefixCache
from smartgen.engine.retention import ComputeCost, LinkCost, MissCost, make_retention
from smartgen.lanes.liveness import DEFAULT_LEASE_S
from smartgen.lanes.rate import transfer_seconds
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.tls import TlsFiles
from smartgen.roles.decode_node import DecodeNode
from smartgen.roles.kv_events import KvEventsSettings
from smartgen.roles.limits import DecodeLimits, PrefillLimits
from smartgen.roles.peers import Connect
from smartgen.roles.planner import NodePlanner, ProfileMatch
from smartgen.roles.prefill_node import PrefillNode
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.fingerprint import model_fingerprint
from smartgen.runtime.models import kv_layout, load_model, model_info
from smartgen.selectors import make_selector, selector_kind
from smartgen.sysinfo import default_db_path

__all__ = ["NodeSettings", "build_prefill_node", "build_decode_node", "DTYPES"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class NodeSettings:
    model: Path
    dtype: str = "float32"
    device: str = "cpu"
    selector: str = "quest"
    budget: float = 0.1
    blocks: int = 1024
    secret: str = ""
    link_gbps: float | None = None
    delay_ms: float = 0.0
    lane: str = "tcp"  # a name in smartgen.lanes.backends
    rdma: RdmaOptions | None = None  # --lane rdma: the device, port and GID index asked for (None: chosen here)
    lease_s: float = DEFAULT_LEASE_S  # a peer silent this long is declared dead (heartbeats every lease / 4)
    prefix_cache_bytes: int = 0  # this node's prefix cache (prefill: skips prefill; decode: skips transfer); 0 = off
    prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefix_retention: str = "lru"  # which cached blocks stay (smartgen.engine.retention): lru or cost
    kv_events: KvEventsSettings | None = None  # publish the prefix cache's block events (vLLM's format); None: off

    def prefix_cache(self, cost: MissCost) -> PrefixCache:
        """This node's prefix cache; `cost` is what a miss costs here (the cost retention policy weighs it)."""
        retention = make_retention(self.prefix_retention, cost)
        return PrefixCache(self.prefix_cache_bytes, self.prefix_block_tokens, retention=retention)

    tls: TlsFiles | None = None  # TLS on the TCP connections between the nodes (None: plain TCP)
    db: Path | None = None  # the profile store (HATA's hash weights); None: $SMARTGEN_DB or the default

    def selector_params(self) -> dict:
        return {"budget": self.budget} if selector_kind(self.selector).sparse else {}


def _load(settings: NodeSettings, model: PreTrainedModel | None = None):
    """The model (loaded unless given: a colocated node shares one), its KV layout, and a selector of its own."""
    if model is None:
        model = load_model(settings.model, DTYPES[settings.dtype], settings.device)
    layout = kv_layout(model, num_blocks=settings.blocks)
    params = settings.selector_params()
    if selector_kind(settings.selector).needs_training:
        params["weights"] = _hash_weights(settings.db, model)
    selector = make_selector(settings.selector, model_info(model), **params)
    return model, layout, selector


def _recompute_cost(model: PreTrainedModel, block_tokens: int) -> ComputeCost:
    """What a prefill node's miss costs: the block's tokens prefilled again (only the ranking matters here)."""
    info = model_info(model)
    width = info.num_q_heads * info.head_dim
    return ComputeCost.for_model(model.num_parameters(), info.num_layers, width, block_tokens)


def _hash_weights(db: Path | None, model) -> dict:
    """The model's newest HATA hash weights from the profile store; a ValueError says how to make them."""
    from smartgen.selectors.hata import weights_from_bytes
    from smartgen.store import ProfileStore, StoreError

    how = "run `smartgen profile --selector hata` for this model first"
    path = Path(db) if db is not None else default_db_path()
    if not path.exists():
        raise ValueError(f"the hata selector needs hash weights and there is no profile database at {path}: {how}")
    try:
        with ProfileStore(db, create=False) as store:
            record = store.hash_weights(model_fingerprint(model))
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    if record is None:
        raise ValueError(f"no HATA hash weights for this model in {path}: {how}")
    log.info("HATA hash weights #%s from %s", record.id, path)
    return weights_from_bytes(record.weights)


def _profile_lookup(db: Path | None, model, settings: NodeSettings, layout):
    """A length -> ProfileMatch function over the store, or None (with the reason logged) when none exists."""
    from smartgen.store import NoProfileError, ProfileStore, StoreError

    path = Path(db) if db is not None else default_db_path()
    if not path.exists():
        log.info("no profile database at %s yet: using the fallback strategy", path)
        return None, f"no profile database at {path} (`smartgen profile` makes one)"
    fingerprint = model_fingerprint(model)
    try:
        store = ProfileStore(db, create=False)
        store.best(fingerprint, settings.selector, settings.blocks, 1)
        count = len(store.list(fingerprint=fingerprint, selector=settings.selector))
    except NoProfileError as exc:
        log.warning("%s; using the fallback strategy", exc)
        return None, "none for this model"
    except (StoreError, OSError) as exc:
        log.warning("profile store unusable (%s); using the fallback strategy", exc)
        return None, f"store unusable: {exc}"

    store.close()

    def lookup(length: int) -> ProfileMatch:
        # the engine plans on its serve threads; a SQLite connection belongs to one thread, so open per lookup
        with ProfileStore(db, create=False) as per_thread:
            match = per_thread.best(fingerprint, settings.selector, settings.blocks, length)
        profile = match.profile
        transfer = (
            transfer_seconds(profile.kv_bytes_per_token, settings.link_gbps)
            if settings.link_gbps
            else profile.transfer_seconds_per_token
        )
        return ProfileMatch(profile.importance, profile.prefill_seconds_per_token, transfer, profile.id, match.nearest)

    return lookup, f"{count} profile(s) for this model and selector"


def build_prefill_node(
    settings: NodeSettings,
    host: str,
    port: int,
    db: Path | None,
    fallback_strategy: str,
    model_name: str,
    limits: PrefillLimits | None = None,
    model: PreTrainedModel | None = None,
    listen: bool = True,
) -> tuple[PrefillNode, str]:
    """`model`: an already loaded one to share; `listen=False`: no TCP listener (a colocated node attaches its
    decode half itself)."""
    model, layout, selector = _load(settings, model)
    lookup, profile_note = _profile_lookup(db, model, settings, layout)
    planner = NodePlanner(layout, lookup, fallback_strategy, settings.link_gbps)
    node = PrefillNode(
        model,
        selector,
        layout,
        planner,
        host=host,
        port=port,
        secret=settings.secret,
        model_name=model_name,
        link_gbps=settings.link_gbps,
        delay_s=settings.delay_ms / 1e3,
        lane=settings.lane,
        rdma=settings.rdma,
        prefix_cache=settings.prefix_cache(_recompute_cost(model, settings.prefix_block_tokens)),
        limits=replace(limits or PrefillLimits(), lease_s=settings.lease_s),
        tls=settings.tls,
        listen=listen,
    )
    return node, profile_note


def build_decode_node(
    settings: NodeSettings,
    prefill: list[tuple[str, int]],
    scheme: str,
    speculative_ratio: float,
    model_name: str,
    max_batch: int,
    max_tokens: int,
    max_waiting: int,
    emulation: Emulation | None = None,
    limits: DecodeLimits | None = None,
    model: PreTrainedModel | None = None,
    connect: Connect | None = None,
    ingress_gbps: float | None = None,
) -> DecodeNode:
    """`model`: an already loaded one to share; `connect`: how to reach the prefill nodes (None: `settings.lane`);
    `ingress_gbps`: one paced link that all prefill nodes' bytes into this node cross (`serve --ingress-gbps`)."""
    from transformers import AutoTokenizer

    model, layout, selector = _load(settings, model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(settings.model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer from {settings.model}: {exc}") from exc
    # budgeted schemes ask for the "profile" strategy; a prefill node without a profile falls back to its own
    policy = check_servable(get_policy(scheme, speculative_ratio=speculative_ratio), head_dim=layout.head_dim)
    return DecodeNode(
        model,
        tokenizer,
        selector,
        layout,
        policy,
        prefill,
        secret=settings.secret,
        model_name=model_name,
        max_batch=max_batch,
        max_tokens=max_tokens,
        link_gbps=settings.link_gbps,
        delay_s=settings.delay_ms / 1e3,
        max_waiting=max_waiting,
        lane=settings.lane,
        rdma=settings.rdma,
        emulation=emulation,
        limits=replace(limits or DecodeLimits(), lease_s=settings.lease_s),
        prefix_cache=settings.prefix_cache(LinkCost(settings.link_gbps or 25.0)),  # unpaced: any rate ranks the same
        tls=settings.tls,
        connect=connect,
        ingress_gbps=ingress_gbps,
    )
