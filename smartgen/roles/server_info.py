"""What a router asks a decode node about itself (`/server_info`, `/model_info`, `/get_load`), in SGLang's names.

SGLang's router (`python -m sglang_router.launch_router --worker-urls ...`) registers a worker by
probing `/health`, then reading `/server_info` (falling back to `/get_server_info`) for the model's
name (`served_model_name`, else `model_path`) and `/model_info` for `model_type` and
`architectures`; without them it lists the model as "unknown". Its power-of-two policy polls
`/get_load`. To the router a SmartGen decode node is a regular worker: it takes whole requests,
and its prefill nodes stay behind it, so `disaggregation_mode` is "null" as on a plain SGLang server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import smartgen

if TYPE_CHECKING:
    from smartgen.roles.decode_node import DecodeNode
    from smartgen.roles.service import DecodeService

__all__ = ["NodeInfo", "describe_node", "describe_service", "load_report"]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A decode node's fixed facts: its model, what one request may be, how many it runs at once."""

    served_model_name: str  # the OpenAI `model` id (/v1/models)
    model_path: str
    tokenizer_path: str
    role: str = "decode"  # "decode", or "both" for `serve --role both`
    model_type: str | None = None  # the Hugging Face config's model_type ("llama", "qwen2", ...)
    architectures: tuple[str, ...] = ()
    vocab_size: int | None = None
    context_length: int | None = None  # the model's max_position_embeddings (None: the model sets none)
    slot_tokens: int | None = None  # prompt + output one KV pool slot holds
    max_running_requests: int | None = None  # KV pool slots
    max_queued_requests: int | None = None  # `--max-waiting`
    scheme: str | None = None  # the node's default transfer scheme

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("a node's served model name must not be empty")

    @property
    def max_req_len(self) -> int | None:
        """The most prompt + max_tokens one request may ask for (the smaller of the context and a pool slot)."""
        limits = [n for n in (self.context_length, self.slot_tokens) if n]
        return min(limits) if limits else None

    def server_info(self) -> dict[str, Any]:
        """`GET /server_info`: SGLang's server arguments a router reads, and SmartGen's own under "smartgen"."""
        max_req_len = self.max_req_len
        slots, slot_tokens = self.max_running_requests, self.slot_tokens
        return {
            # no "model" and no "model_id": the router reads one as an alias of the other and refuses both at once
            "served_model_name": self.served_model_name,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "disaggregation_mode": "null",
            "context_length": self.context_length,
            "max_req_len": max_req_len,
            "max_req_input_len": max_req_len - 1 if max_req_len else None,  # a prompt leaves room for one token
            "max_running_requests": slots,
            "max_queued_requests": self.max_queued_requests,
            "max_total_tokens": slots * slot_tokens if slots and slot_tokens else None,
            "version": smartgen.__version__,
            "smartgen": {"role": self.role, "scheme": self.scheme, "slot_tokens": slot_tokens},
        }

    def model_info(self) -> dict[str, Any]:
        """`GET /model_info`, as an SGLang server answers it."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "model_type": self.model_type,
            "architectures": list(self.architectures),
            "vocab_size": self.vocab_size,
            "max_context_length": self.context_length,
            "max_req_input_len": self.max_req_len - 1 if self.max_req_len else None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }


def describe_node(node: DecodeNode, role: str = "decode") -> NodeInfo:
    """The facts of a built decode node (`role`: "both" for `serve --role both`)."""
    scheduler = node.scheduler
    config = node.runner.model.config
    model_path = str(getattr(config, "name_or_path", "") or scheduler.model_name)
    return NodeInfo(
        served_model_name=scheduler.model_name,
        model_path=model_path,
        tokenizer_path=str(getattr(scheduler.tokenizer, "name_or_path", "") or model_path),
        role=role,
        model_type=getattr(config, "model_type", None),
        architectures=tuple(getattr(config, "architectures", None) or ()),
        vocab_size=scheduler.limits.vocab_size,
        context_length=scheduler.limits.context,
        slot_tokens=scheduler.limits.slot_tokens,
        max_running_requests=node.engine.pool.num_slots,
        max_queued_requests=scheduler.max_waiting,
        scheme=scheduler.default_policy.label,
    )


def describe_service(service: DecodeService) -> NodeInfo:
    """What any DecodeService can say of itself (its model's name; the tokenizer's path where it has one)."""
    path = str(getattr(service.tokenizer, "name_or_path", "") or service.model_name)
    return NodeInfo(service.model_name, path, path)


def load_report(health: dict[str, Any]) -> list[dict[str, Any]]:
    """`GET /get_load` from a `/health` report, as an SGLang server answers it: one entry per data-parallel rank (here
    one), with the requests holding or waiting for a pool slot and the tokens of those holding one."""
    running = int(health.get("running", 0)) + int(health.get("prefilling", 0)) + int(health.get("parked", 0))
    waiting = int(health.get("waiting", 0))
    tokens = int(health.get("active_tokens", 0))
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}]
