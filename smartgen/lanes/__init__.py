"""Lanes: the transports that carry KV bytes and control messages between prefill and decode nodes.

Backends are looked up by name in `smartgen.lanes.backends` (the registry a `--lane NAME` option
uses) and imported lazily, so a missing optional dependency (pyverbs, mooncake, nixl) only fails
when that backend is asked for.
"""

from smartgen.lanes.base import Completion, Lane, LaneCounters, Message, MessageKind, WriteOp, coalesce
from smartgen.lanes.pacer import Pacer

__all__ = ["Completion", "Lane", "LaneCounters", "Message", "MessageKind", "WriteOp", "coalesce", "Pacer"]
