"""Typed engine messages: one dataclass per kind, each packed into and unpacked from the lanes' ordered `Message`.

The lanes carry a kind, a request id, a small JSON-able `meta` and named tensors; what those
mean is decided here, once, for both sides. `unpack` checks every field and raises
`MessageError` (a ValueError) naming what is wrong, so a malformed message is refused where
it arrives instead of failing somewhere later with a KeyError.

    link.control.send(Open(rid, slot, length, "smartgen", "profile", 0.1, ids).pack())
    match unpack(message):
        case Fetch(request_id, layer, fetch_id, positions): ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from smartgen.lanes.base import Message, MessageKind

__all__ = [
    "MessageError",
    "EngineMessage",
    "Open",
    "Metadata",
    "FirstToken",
    "Fetch",
    "FetchReply",
    "Attend",
    "AttendReply",
    "Idle",
    "Forecast",
    "SecondToken",
    "Release",
    "Abort",
    "Error",
    "unpack",
    "pack_metadata",
    "unpack_metadata",
]


class MessageError(ValueError):
    """A message whose fields are missing or of the wrong kind."""


def _field(meta: dict[str, Any], name: str, kind: type, what: str) -> Any:
    if name not in meta:
        raise MessageError(f"{what}: missing {name!r}")
    value = meta[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise MessageError(f"{what}: {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _tensor(payload: dict[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    if name not in payload:
        raise MessageError(f"{what}: missing tensor {name!r}")
    return payload[name]


def pack_metadata(metadata: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-layer selector metadata as flat message payload: {"<layer>/<name>": tensor}."""
    return {
        f"{layer}/{name}": tensor.contiguous() for layer, entry in enumerate(metadata) for name, tensor in entry.items()
    }


def unpack_metadata(payload: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """The inverse of `pack_metadata`, for a model of `num_layers` layers."""
    metadata: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    for key, tensor in payload.items():
        layer, _, name = key.partition("/")
        if not layer.isdigit() or int(layer) >= num_layers:
            raise MessageError(f"selector metadata for layer {layer!r} of a {num_layers}-layer model")
        metadata[int(layer)][name] = tensor
    return metadata


@dataclass(frozen=True, slots=True)
class Open:
    """Decode -> prefill: a new request, its pool slot and how its KV should move."""

    KIND: ClassVar[MessageKind] = MessageKind.OPEN
    request_id: str
    slot: int
    length: int
    scheme: str  # a policy name (smartgen, full, ...)
    strategy: str  # the proactive-set strategy
    speculative_ratio: float
    prompt_ids: torch.Tensor | None = None  # [n] int64, when the prefill node runs a model
    # Opened again after its prefill node was lost (--on-prefill-failure recompute):
    held: torch.Tensor | None = None  # [L, n] bool: tokens already local on the decode node, never pushed again
    resumed: bool = False  # the decode node already has the first token and metadata: send neither again
    # leading prompt tokens the decode node's prefix cache already put in the slot: never pushed (a count, not
    # a mask, so a cache hit costs OPEN nothing)
    held_prefix: int = 0
    # [L, n] int32: how often the request's own decode steps select each token (a recorded run of the same
    # prompt): the "optimal" proactive set, which only a replay can know
    oracle_counts: torch.Tensor | None = None
    # output tokens past the second the prefill node may decode ahead of the decode node (Policy.head_start): 0 for
    # none (a request that samples, or a policy without it)
    head_tokens: int = 0

    def pack(self) -> Message:
        meta: dict[str, Any] = {
            "slot": self.slot,
            "length": self.length,
            "scheme": self.scheme,
            "strategy": self.strategy,
            "speculative_ratio": self.speculative_ratio,
            "held_prefix": self.held_prefix,
        }
        if self.resumed:
            meta["resumed"] = True
        if self.head_tokens:
            meta["head_tokens"] = self.head_tokens
        payload = {} if self.prompt_ids is None else {"input_ids": self.prompt_ids.to(torch.int64).cpu()}
        if self.held is not None:
            payload["held"] = self.held.to(torch.uint8).cpu().contiguous()
        if self.oracle_counts is not None:
            payload["oracle_counts"] = self.oracle_counts.to(torch.int32).cpu().contiguous()
        return Message(self.KIND, self.request_id, meta, payload)

    @classmethod
    def unpack(cls, message: Message) -> Open:
        meta, what = message.meta, "OPEN"
        return cls(
            message.request_id,
            _field(meta, "slot", int, what),
            _field(meta, "length", int, what),
            _field(meta, "scheme", str, what),
            _field(meta, "strategy", str, what),
            _field(meta, "speculative_ratio", float, what),
            message.payload.get("input_ids"),
            _held(message.payload.get("held"), meta.get("length")),
            _field(meta, "resumed", bool, what) if "resumed" in meta else False,
            _field(meta, "held_prefix", int, what) if "held_prefix" in meta else 0,
            _oracle_counts(message.payload.get("oracle_counts"), meta.get("length")),
            _head_tokens(meta),
        )


def _head_tokens(meta: dict[str, Any]) -> int:
    count = _field(meta, "head_tokens", int, "OPEN") if "head_tokens" in meta else 0
    if count < 0:
        raise MessageError(f"OPEN: head_tokens must be >= 0, got {count}")
    return count


def _held(held: torch.Tensor | None, length: object) -> torch.Tensor | None:
    """OPEN's `held` as [L, n] bool; a tensor of another shape or kind is refused (the layer count is the
    prefill engine's to check)."""
    if held is None:
        return None
    if held.dtype != torch.uint8 or held.dim() != 2 or held.shape[1] != length:
        raise MessageError(f"OPEN: 'held' must be uint8 [layers, {length}], got {held.dtype} {list(held.shape)}")
    return held.bool()


def _oracle_counts(counts: torch.Tensor | None, length: object) -> torch.Tensor | None:
    """OPEN's `oracle_counts` as [L, n] int32 of counts >= 0; anything else is refused (the layer count is the
    prefill engine's to check)."""
    if counts is None:
        return None
    if counts.dtype != torch.int32 or counts.dim() != 2 or counts.shape[1] != length:
        raise MessageError(
            f"OPEN: 'oracle_counts' must be int32 [layers, {length}], got {counts.dtype} {list(counts.shape)}"
        )
    if counts.numel() and int(counts.min()) < 0:
        raise MessageError("OPEN: 'oracle_counts' must not be negative")
    return counts


@dataclass(frozen=True, slots=True)
class Metadata:
    """Prefill -> decode: one layer's selector metadata, sent as soon as the layer is prefilled."""

    KIND: ClassVar[MessageKind] = MessageKind.METADATA
    request_id: str
    layer: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def pack(self) -> Message:
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        return Message(self.KIND, self.request_id, {"layer": self.layer}, tensors)

    @classmethod
    def unpack(cls, message: Message) -> Metadata:
        return cls(message.request_id, _field(message.meta, "layer", int, "METADATA"), dict(message.payload))


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill -> decode: the first output token, with any metadata not sent per layer."""

    KIND: ClassVar[MessageKind] = MessageKind.FIRST_TOKEN
    request_id: str
    token: int
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)  # pack_metadata's flat form
    cached: int = 0  # prompt tokens the prefill node's prefix cache supplied (not computed)
    forecast: bool = False  # a FORECAST of the first decode step follows (the decode node waits for it)

    def pack(self) -> Message:
        meta: dict[str, Any] = {"token": self.token, "cached": self.cached}
        if self.forecast:
            meta["forecast"] = True
        return Message(self.KIND, self.request_id, meta, dict(self.metadata))

    @classmethod
    def unpack(cls, message: Message) -> FirstToken:
        meta, what = message.meta, "FIRST_TOKEN"
        cached = _field(meta, "cached", int, what) if "cached" in meta else 0
        forecast = _field(meta, "forecast", bool, what) if "forecast" in meta else False
        return cls(message.request_id, _field(meta, "token", int, what), dict(message.payload), cached, forecast)


@dataclass(frozen=True, slots=True)
class Fetch:
    """Decode -> prefill: the K/V of these token positions of one layer, now (an urgent message); with `heads`,
    only the KV heads it marks of each token."""

    KIND: ClassVar[MessageKind] = MessageKind.FETCH
    request_id: str
    layer: int
    fetch_id: int
    positions: torch.Tensor  # [p] int64
    heads: torch.Tensor | None = None  # [p, H] bool: the heads wanted of each token (None: all)
    # a forecast's fetch: its reply goes after the replies to running requests' fetches (`Message.priority`)
    low: bool = False

    def pack(self) -> Message:
        meta: dict[str, Any] = {"layer": self.layer, "fetch_id": self.fetch_id}
        if self.low:
            meta["low"] = True
        payload = {"positions": self.positions}
        if self.heads is not None:
            payload["heads"] = self.heads.to(torch.uint8).contiguous()
        return Message(self.KIND, self.request_id, meta, payload)

    @classmethod
    def unpack(cls, message: Message) -> Fetch:
        meta, what = message.meta, "FETCH"
        positions = _tensor(message.payload, "positions", what)
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise MessageError(f"{what}: positions must be a 1-D int64 tensor")
        heads = message.payload.get("heads")
        if heads is not None:
            if heads.dtype not in (torch.uint8, torch.bool) or heads.dim() != 2 or heads.shape[0] != positions.numel():
                raise MessageError(f"{what}: heads must be a [{positions.numel()}, H] uint8 tensor")
            heads = heads.bool()
        layer, fetch_id = _field(meta, "layer", int, what), _field(meta, "fetch_id", int, what)
        low = _field(meta, "low", bool, what) if "low" in meta else False
        return cls(message.request_id, layer, fetch_id, positions, heads, low)


@dataclass(frozen=True, slots=True)
class FetchReply:
    """Prefill -> decode: the fetched K and V for the fetch with this id: [p, H, d] each, or [E, d] for the E
    entries a FETCH with `heads` marked (token-major). A reply the lane landed in place (the RDMA lane, into the
    rows the FETCH's landing named) has no K and V here, and `landed` says how many bytes it put there."""

    KIND: ClassVar[MessageKind] = MessageKind.FETCH_REPLY
    request_id: str
    fetch_id: int
    k: torch.Tensor | None
    v: torch.Tensor | None
    landed: int = 0

    @property
    def num_bytes(self) -> int:
        if self.k is None or self.v is None:
            return self.landed
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def pack(self) -> Message:
        if self.k is None or self.v is None:
            raise MessageError("FETCH_REPLY: a reply to send needs K and V")
        return Message(self.KIND, self.request_id, {"fetch_id": self.fetch_id}, {"k": self.k, "v": self.v})

    @classmethod
    def unpack(cls, message: Message) -> FetchReply:
        what = "FETCH_REPLY"
        fetch_id = _field(message.meta, "fetch_id", int, what)
        if "landed" in message.meta:
            return cls(message.request_id, fetch_id, None, None, _field(message.meta, "landed", int, what))
        return cls(
            message.request_id, fetch_id, _tensor(message.payload, "k", what), _tensor(message.payload, "v", what)
        )


@dataclass(frozen=True, slots=True)
class Attend:
    """Decode -> prefill: attend to these (token, KV head) entries of one layer with the step's query and send the
    partial result (an urgent message): the decode node merges it with its own attention over what is local, so
    the entries never cross the link (`Policy.attend_remote`). `positions` and `heads` name the entries as a
    FETCH's do; query [Hq, d] fp32, post-RoPE; `scale` and `softcap` as the model's attention applies them."""

    KIND: ClassVar[MessageKind] = MessageKind.ATTEND
    request_id: str
    layer: int
    fetch_id: int
    positions: torch.Tensor  # [p] int64
    heads: torch.Tensor  # [p, H] bool
    query: torch.Tensor  # [Hq, d] float32
    scale: float
    softcap: float | None = None

    def pack(self) -> Message:
        meta: dict[str, Any] = {"layer": self.layer, "fetch_id": self.fetch_id, "scale": self.scale}
        if self.softcap is not None:
            meta["softcap"] = self.softcap
        payload = {
            "positions": self.positions,
            "heads": self.heads.to(torch.uint8).contiguous(),
            "query": self.query.float().contiguous(),
        }
        return Message(self.KIND, self.request_id, meta, payload)

    @classmethod
    def unpack(cls, message: Message) -> Attend:
        meta, what = message.meta, "ATTEND"
        fetch = Fetch.unpack(message)  # the entries, checked as a FETCH's
        if fetch.heads is None:
            raise MessageError(f"{what}: heads are required")
        query = _tensor(message.payload, "query", what)
        if query.dtype != torch.float32 or query.dim() != 2:
            raise MessageError(f"{what}: query must be a [Hq, d] float32 tensor")
        scale = _field(meta, "scale", float, what)
        softcap = _field(meta, "softcap", float, what) if "softcap" in meta else None
        return cls(
            message.request_id,
            fetch.layer,
            fetch.fetch_id,
            fetch.positions,
            fetch.heads,
            query,
            scale,
            softcap,
        )


@dataclass(frozen=True, slots=True)
class AttendReply:
    """Prefill -> decode: the attention an ATTEND asked for, over its entries only: output [Hq, d] and [Hq, 2] the
    softmax's max and sum, fp32 (`engine.attention.partial_attention`)."""

    KIND: ClassVar[MessageKind] = MessageKind.ATTEND_REPLY
    request_id: str
    fetch_id: int
    out: torch.Tensor
    stats: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.out.numel() * self.out.element_size() + self.stats.numel() * self.stats.element_size()

    def pack(self) -> Message:
        return Message(self.KIND, self.request_id, {"fetch_id": self.fetch_id}, {"out": self.out, "stats": self.stats})

    @classmethod
    def unpack(cls, message: Message) -> AttendReply:
        what = "ATTEND_REPLY"
        out, stats = _tensor(message.payload, "out", what), _tensor(message.payload, "stats", what)
        if out.dim() != 2 or tuple(stats.shape) != (out.shape[0], 2):
            raise MessageError(f"{what}: out must be [Hq, d] and stats [Hq, 2]")
        return cls(message.request_id, _field(message.meta, "fetch_id", int, what), out, stats)


@dataclass(frozen=True, slots=True)
class Idle:
    """Decode -> prefill: the link is idle while this layer computes (a chance to push speculatively); `hints`
    names the remote entries the selector ranked just past its budget in the layers since the last notice, to
    push before the speculative order (flat ids (layer * prompt length + token) * KV heads + head)."""

    KIND: ClassVar[MessageKind] = MessageKind.IDLE
    request_id: str
    layer: int
    hints: torch.Tensor | None = None  # [p] int64

    def pack(self) -> Message:
        payload = {} if self.hints is None else {"hints": self.hints.to(torch.int64).contiguous()}
        return Message(self.KIND, self.request_id, {"layer": self.layer}, payload)

    @classmethod
    def unpack(cls, message: Message) -> Idle:
        hints = message.payload.get("hints")
        if hints is not None and (hints.dtype != torch.int64 or hints.dim() != 1):
            raise MessageError("IDLE: hints must be a 1-D int64 tensor")
        return cls(message.request_id, _field(message.meta, "layer", int, "IDLE"), hints)


@dataclass(frozen=True, slots=True)
class SecondToken:
    """The forecast step's output: the request's second token, and the K/V [L, H, d] of the token it ran on (the
    first), every layer, which the decode node adds to its pool in place of running that step itself."""

    token: int
    keys: torch.Tensor  # [L, H, d]
    values: torch.Tensor  # [L, H, d]


@dataclass(frozen=True, slots=True)
class Forecast:
    """Prefill -> decode: the first decode step's post-RoPE query of each sparse layer ([Hq, d] each), from a step
    the prefill node ran on its whole KV after FIRST_TOKEN. The decode node selects with them and fetches what the
    step will pick before the request joins a running batch; empty when the prefill node could not compute it.
    With `second` (Policy.second_token) it also carries that step's token and the first token's K/V."""

    KIND: ClassVar[MessageKind] = MessageKind.FORECAST
    request_id: str
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    second: SecondToken | None = None
    # 1: the first decode step's; 2: the step after it, on the second token (a FORECAST that brought `second`
    # promises this one: the decode node's own first step, whose picks a joining request fetches before it joins;
    # after a head start it ends the prefill node's tokens, empty); 3: a head-start token (Policy.head_start), in
    # `second`: the next output token and the K/V of the token its step ran on
    step: int = 1

    def pack(self) -> Message:
        payload = {str(layer): q.contiguous() for layer, q in self.queries.items()}
        meta: dict[str, Any] = {} if self.step == 1 else {"step": self.step}
        if self.second is not None:
            meta["token"] = self.second.token
            payload["k"], payload["v"] = self.second.keys.contiguous(), self.second.values.contiguous()
        return Message(self.KIND, self.request_id, meta, payload)

    @classmethod
    def unpack(cls, message: Message) -> Forecast:
        queries: dict[int, torch.Tensor] = {}
        payload = dict(message.payload)
        keys, values = payload.pop("k", None), payload.pop("v", None)
        for key, query in payload.items():
            if not key.isdigit() or query.dim() != 2 or not query.is_floating_point():
                raise MessageError(f"FORECAST: {key!r} must be a layer holding a [heads, head_dim] float query")
            queries[int(key)] = query
        second = None
        if "token" in message.meta or keys is not None or values is not None:
            token = _field(message.meta, "token", int, "FORECAST")
            if (
                keys is None
                or values is None
                or keys.dim() != 3
                or keys.shape != values.shape
                or not keys.is_floating_point()
                or keys.dtype != values.dtype
            ):
                raise MessageError("FORECAST: a second token needs k and v, both [layers, heads, head_dim] float")
            if token < 0:
                raise MessageError(f"FORECAST: token must be >= 0, got {token}")
            second = SecondToken(token, keys, values)
        step = _field(message.meta, "step", int, "FORECAST") if "step" in message.meta else 1
        if step not in (1, 2, 3) or (second is not None and step == 2) or (second is None and step == 3):
            raise MessageError(f"FORECAST: step must be 1, 2 without a token or 3 with one, got {step}")
        return cls(message.request_id, queries, second, step)


@dataclass(frozen=True, slots=True)
class _Reasoned:
    request_id: str
    reason: str = ""

    def pack(self) -> Message:
        return Message(self.KIND, self.request_id, {"reason": self.reason} if self.reason else {})  # type: ignore[attr-defined]

    @classmethod
    def unpack(cls, message: Message) -> Any:
        return cls(message.request_id, _reason(message))


def _reason(message: Message) -> str:
    reason = message.meta.get("reason", "")
    return reason if isinstance(reason, str) else str(reason)


@dataclass(frozen=True, slots=True)
class Release(_Reasoned):
    """Decode -> prefill: the request is done with the prefill node's copy of its KV."""

    KIND: ClassVar[MessageKind] = MessageKind.RELEASE


@dataclass(frozen=True, slots=True)
class Abort(_Reasoned):
    """Either way: the request failed or was cancelled; free it."""

    KIND: ClassVar[MessageKind] = MessageKind.ABORT


@dataclass(frozen=True, slots=True)
class Error(_Reasoned):
    """Prefill -> decode: the prefill node could not serve the request (the reason says why)."""

    KIND: ClassVar[MessageKind] = MessageKind.ERROR
    overloaded: bool = False  # refused for lack of room (store or queue full): the client may try again later

    def pack(self) -> Message:
        message = _Reasoned.pack(self)
        if self.overloaded:
            message.meta["overloaded"] = True
        return message

    @classmethod
    def unpack(cls, message: Message) -> Error:
        return cls(message.request_id, _reason(message), message.meta.get("overloaded") is True)


EngineMessage = (
    Open | Metadata | FirstToken | Fetch | FetchReply | Attend | AttendReply | Idle | Forecast | Release | Abort | Error
)
_BY_KIND: dict[MessageKind, Any] = {
    cls.KIND: cls
    for cls in (
        Open,
        Metadata,
        FirstToken,
        Fetch,
        FetchReply,
        Attend,
        AttendReply,
        Idle,
        Forecast,
        Release,
        Abort,
        Error,
    )
}


def unpack(message: Message) -> EngineMessage:
    """The typed message a lane delivered; a MessageError for a kind the engine does not speak or bad fields."""
    cls = _BY_KIND.get(message.kind)
    if cls is None:
        raise MessageError(f"the engine does not handle {message.kind.name} messages")
    return cls.unpack(message)
