"""Prefill and decode nodes of the tiny Llama in this process, over real TCP on loopback (shared by the node tests)."""

from __future__ import annotations

from typing import Any

from conftest import wait_until
from tiny_models import IdTokenizer, tiny_config

from smartgen.engine.policy import get_policy
from smartgen.roles.decode_node import DecodeNode
from smartgen.roles.planner import NodePlanner
from smartgen.roles.prefill_node import PrefillNode
from smartgen.runtime.models import kv_layout, model_from_config, model_info
from smartgen.selectors import make_selector

Parts = tuple[Any, Any, Any]  # (model, layout, model_info)


def tiny_parts(num_blocks: int = 16, config: Any = None) -> Parts:
    """The tiny Llama's (or `config`'s) model, layout and model info."""
    model = model_from_config(config if config is not None else tiny_config("llama"))
    return model, kv_layout(model, num_blocks=num_blocks), model_info(model)


def prefill_node(parts: Parts, *, start: bool = True, **options: Any) -> PrefillNode:
    """A prefill node on a free port (secret "s"), started unless told; `options` go to PrefillNode (limits=...).

    Its prefill time per token is fixed, not measured: proactive-only's answers follow K_r, which must not
    follow this shared machine's load between two runs a test compares."""
    model, layout, info = parts
    node = PrefillNode(
        model,
        make_selector("quest", info, budget=0.3, page_size=4),
        layout,
        NodePlanner(layout, None, "streaming", link_gbps=0.5, prefill_seconds_per_token=2e-4),
        port=0,
        secret="s",
        **options,
    )
    if start:
        node.start()
    return node


def decode_node(parts: Parts, prefills: list[PrefillNode], scheme: str = "partial", **options: Any) -> DecodeNode:
    """A started decode node (4 slots of 256 tokens) on `prefills`, linked to every one of them (a test that spreads
    requests over them must not race a slow link set-up: a one-sided lane's engine takes seconds on a loaded machine);
    `options` go to DecodeNode (limits=...)."""
    model, layout, info = parts
    node = DecodeNode(
        model,
        IdTokenizer(),
        make_selector("quest", info, budget=0.3, page_size=4),
        layout,
        get_policy(scheme),
        [p.address for p in prefills],
        secret="s",
        **{"max_batch": 4, "max_tokens": 256, **options},
    )
    node.start()
    wait_until(lambda: len(node.engine.links) == len(prefills), 60, "the decode node to link to every prefill node")
    return node
