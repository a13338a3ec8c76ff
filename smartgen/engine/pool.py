"""KV memory on both sides: the decode node's slotted KV pool and the prefill node's per-request store.

The decode pool is token-major, K and V each one tensor [L, S, N, H, d]: a run of tokens
of one layer of one slot is one contiguous byte range, so a block (or several adjacent
blocks) is a single one-sided write for K and one for V, and the whole tensor can be
registered as one memory region.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from smartgen.engine.kv_quant import (
    SERVING_QUANT,
    QuantUnsupported,
    packed_layer_bytes,
    quant_unsupported,
    unpack_layer,
)
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL, MaskTable
from smartgen.engine.staging import HostStaging

__all__ = ["PoolGeometry", "PoolFull", "DecodePool", "RequestKV", "PrefillStore", "StoreFull"]


class PoolFull(RuntimeError):
    """No free slot, or the request is longer than a slot."""


class StoreFull(RuntimeError):
    """The prefill store has no room for another request's KV under its byte cap (the reason says how much)."""


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Byte offsets into a decode pool's regions; shared with prefill nodes at the handshake.

    `quantized`: the pool has a staging region for `quant2` (a serving pool does: a request may ask for the scheme);
    it is empty where the scheme cannot group the head size (`quant_refusal` says why) or the pool was made
    without one."""

    layout: KVLayout
    num_slots: int
    max_tokens: int
    quantized: bool = True

    @property
    def quant_refusal(self) -> str | None:
        """Why this pool cannot take a `quant2` request, or None when it can."""
        if not self.quantized:
            return "this decode pool was made without a quantized staging region"
        return quant_unsupported(self.layout.head_dim)

    def kv_offset(self, layer: int, slot: int, token: int) -> int:
        """Byte offset of (layer, slot, token) in the K (or V) region."""
        return ((layer * self.num_slots + slot) * self.max_tokens + token) * self.layout.token_bytes

    def entry_ranges(self, layer: int, slot: int, entries: torch.Tensor) -> list[tuple[int, int]]:
        """Byte ranges (offset, length) in the K (or V) region of flat (token, head) entries token * H + head,
        sorted and unique: one range per run of consecutive entries, in order (where a fetch reply lands)."""
        if not entries.numel():
            return []
        entries = entries.to(torch.int64).cpu()
        breaks = torch.nonzero(entries[1:] - entries[:-1] != 1).flatten() + 1
        starts = torch.cat([entries[:1], entries[breaks]])
        counts = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int64), breaks, torch.tensor([entries.numel()])]))
        entry_bytes = self.layout.head_dim * self.layout.dtype.itemsize
        base = self.kv_offset(layer, slot, 0)
        return [
            (base + start * entry_bytes, count * entry_bytes) for start, count in zip(starts.tolist(), counts.tolist())
        ]

    def mask_offset(self, layer: int, slot: int, token: int) -> int:
        """Byte offset of (layer, slot, token)'s first head in the int8 mask region ([L, S, N, H]: a token's heads
        are adjacent, so a run of tokens is one run of mask bytes)."""
        return ((layer * self.num_slots + slot) * self.max_tokens + token) * self.layout.num_kv_heads

    @property
    def quant_layer_bytes(self) -> int:
        """Room for one layer of one slot in the quantized staging region: a full slot packed (`quant2`); 0 where the
        pool takes no `quant2` request (`quant_refusal`)."""
        layout = self.layout
        if self.quant_refusal is not None:
            return 0
        # not monotonic in the length: up to G - 1 keys past a whole group stay exact, so a slightly shorter prompt
        # can take more bytes; within each run of G lengths the last is the largest, and each run beats the one before
        first = max(1, self.max_tokens - SERVING_QUANT.group + 1)
        return max(
            packed_layer_bytes(n, layout.num_kv_heads, layout.head_dim, layout.dtype, SERVING_QUANT)
            for n in range(first, self.max_tokens + 1)
        )

    def quant_offset(self, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot)'s packed layer in the quantized staging region."""
        return (layer * self.num_slots + slot) * self.quant_layer_bytes

    def ready_offset(self, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot)'s flag in the quant_ready region: 1 once its packed layer is in."""
        return layer * self.num_slots + slot

    def slot_extents(self, slot: int, length: int) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges a prefill node may write for a request of `length` prompt tokens in `slot`:
        per layer, its prompt tokens in K, V and the mask, and its packed layer and flag in the quantized
        staging regions (what a lane checks every descriptor against)."""
        layers = range(self.layout.num_layers)
        kv = [(self.kv_offset(layer, slot, 0), self.kv_offset(layer, slot, length)) for layer in layers]
        mask = [(self.mask_offset(layer, slot, 0), self.mask_offset(layer, slot, length)) for layer in layers]
        packed = (
            0
            if self.quant_refusal is not None
            else packed_layer_bytes(
                length, self.layout.num_kv_heads, self.layout.head_dim, self.layout.dtype, SERVING_QUANT
            )
        )
        quant = [(self.quant_offset(layer, slot), self.quant_offset(layer, slot) + packed) for layer in layers]
        ready = [(self.ready_offset(layer, slot), self.ready_offset(layer, slot) + 1) for layer in layers]
        return {"k": kv, "v": kv, "mask": mask, "quant": quant, "quant_ready": ready}


class DecodePool:
    """The decode node's KV pool: K and V [L, S, N, H, d] plus the mask table [L, S, N].

    Host memory (pinned when CUDA is present) unless a device is given. One slot per request;
    prompt tokens arrive from prefill nodes, generated tokens are appended here. A quantized transfer
    (`quant2`) lands each layer packed in a staging region [L, S, packed bytes of a full slot] with a flag
    [L, S] written after it; `land_quantized` dequantizes flagged layers into K and V and marks them local.
    The staging region is about a fifth of K+V's size in fp32 (two fifths in fp16).

    `staged`: the lane cannot register the device's memory, so lanes write into host mirrors of K and V and a
    host landing mask instead (`byte_views`), and `sync_staged` copies what landed into K and V before the
    mask table says LOCAL (staging.py); the quantized staging regions are host memory then too.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        max_tokens: int,
        device: str | torch.device = "cpu",
        staged: bool = False,
        quantized: bool = True,
    ) -> None:
        if num_slots < 1 or max_tokens < 1:
            raise ValueError("a pool needs at least one slot of at least one token")
        self.layout = layout
        self.geometry = PoolGeometry(layout, num_slots, max_tokens, quantized)
        shape = (layout.num_layers, num_slots, max_tokens, layout.num_kv_heads, layout.head_dim)
        pin = torch.device(device).type == "cpu" and torch.cuda.is_available()
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device, pin_memory=pin)
        self.masks = MaskTable(layout.num_layers, num_slots, max_tokens, layout.num_kv_heads)
        self.staging = HostStaging(shape, layout.dtype) if staged else None
        # staged, the lanes' quantized layers land on the host like the rest (dequantized into K and V from there)
        quant_device = "cpu" if staged else device
        quant_pin = torch.device(quant_device).type == "cpu" and torch.cuda.is_available()
        staging = (layout.num_layers, num_slots, self.geometry.quant_layer_bytes)
        self.quant = torch.zeros(staging, dtype=torch.uint8, device=quant_device, pin_memory=quant_pin)
        self.quant_ready = torch.zeros(layout.num_layers, num_slots, dtype=torch.uint8, device=quant_device)
        self.lengths = [0] * num_slots  # tokens in use per slot (prompt + generated)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    @property
    def max_tokens(self) -> int:
        return self.geometry.max_tokens

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, prompt_length: int, max_new_tokens: int = 0, quantized: bool = False) -> int:
        """Takes a slot for a prompt of `prompt_length` tokens: its mask says remote, the rest padding.
        `quantized`: the request is a `quant2` one (QuantUnsupported, with the reason, where the pool cannot take it)."""
        if quantized and self.geometry.quant_refusal is not None:
            raise QuantUnsupported(f"scheme quant2 cannot run here: {self.geometry.quant_refusal}")
        needed = prompt_length + max_new_tokens
        if needed > self.max_tokens:
            raise PoolFull(f"request needs {needed} tokens, a pool slot holds {self.max_tokens}")
        with self._lock:
            if not self._free:
                raise PoolFull(f"all {self.num_slots} pool slots are in use")
            slot = self._free.pop()
        self.masks.open(slot, prompt_length)
        if self.staging is not None:
            self.staging.open(slot, prompt_length)
        self.quant_ready[:, slot] = 0
        self.lengths[slot] = prompt_length
        return slot

    def free(self, slot: int) -> None:
        """Returns a slot; its mask goes back to padding so nothing can read stale KV."""
        self.masks.close(slot)
        if self.staging is not None:
            self.staging.close(slot)
        self.lengths[slot] = 0
        with self._lock:
            if slot in self._free:
                raise ValueError(f"slot {slot} is already free")
            self._free.append(slot)

    def append(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Writes a generated token's K/V [H, d] of one layer at the slot's end; local at once.

        Returns its position. The slot's length advances when layer 0 appends, so call
        layers in order for each new token.
        """
        position = self.lengths[slot] if layer == 0 else self.lengths[slot] - 1
        if layer == 0:
            if position >= self.max_tokens:
                raise PoolFull(f"slot {slot} is full ({self.max_tokens} tokens)")
            self.lengths[slot] += 1
        self.k[layer, slot, position] = k
        self.v[layer, slot, position] = v
        self.masks.values[layer, slot, position] = LOCAL
        return position

    def append_batch(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """`append` for a batch: each slot's generated token's K/V ([B, H, d]) in one write per tensor (a write per
        request and layer was most of a batch's appends)."""
        if len(slots) == 1:  # one request: plain indexing is cheaper than building an index
            self.append(layer, slots[0], k[0], v[0])
            return
        if layer == 0:
            for slot in slots:  # every check first: a full slot leaves the others' lengths as they were
                if self.lengths[slot] >= self.max_tokens:
                    raise PoolFull(f"slot {slot} is full ({self.max_tokens} tokens)")
            for slot in slots:
                self.lengths[slot] += 1
        # (slot, token) as one flat row of [S·N, H, d]: index_copy_ is one pass, a two-tensor index a slow one
        flat = torch.tensor([slot * self.max_tokens + self.lengths[slot] - 1 for slot in slots], dtype=torch.int64)
        rows = self.k.shape[1] * self.k.shape[2]
        on_device = flat.to(self.k.device)
        self.k[layer].view(rows, *self.k.shape[3:]).index_copy_(0, on_device, k.to(self.k))
        self.v[layer].view(rows, *self.v.shape[3:]).index_copy_(0, on_device, v.to(self.v))
        self.masks.values[layer].view(rows, -1).index_fill_(0, flat, LOCAL)

    def drop_last(self, slot: int) -> None:
        """Forgets the slot's last appended token (a decode step taken back); its cells are simply rewritten."""
        if self.lengths[slot] <= 0:
            raise ValueError(f"slot {slot} holds no token to drop")
        self.lengths[slot] -= 1

    def write_tokens(self, layer: int, slot: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Lands fetched tokens ([T, H, d] each) in the pool, then marks them local (data before mask)."""
        self.k[layer, slot, positions] = k.to(self.k.device)
        self.v[layer, slot, positions] = v.to(self.v.device)
        self.masks.set_local_tokens(layer, slot, positions)

    def write_entries(self, layer: int, slot: int, entries: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Lands fetched (token, head) entries (flat ids token * H + head; K and V [E, d]), then marks them local."""
        head_dim = self.layout.head_dim
        self.k[layer, slot].view(-1, head_dim)[entries] = k.to(self.k.device)
        self.v[layer, slot].view(-1, head_dim)[entries] = v.to(self.v.device)
        self.masks.set_local_entries(layer, slot, entries)

    def entries_landed(self, layer: int, slot: int, entries: torch.Tensor) -> None:
        """Fetched (token, head) entries (flat ids token * H + head) that already sit in the registered K and V
        regions (a fetch reply the lane scattered there) become local; staged, they are copied in first."""
        if self.staging is None:
            self.masks.set_local_entries(layer, slot, entries)
        else:
            self.staging.land(layer, slot, entries, self.k, self.v, self.masks)

    def sync_staged(self, layer: int | None, slots: Sequence[int]) -> int:
        """Staged: moves what lanes landed for these slots (one layer; None: every layer) into K and V, then marks it
        in the mask table; returns the entries moved. Call before reading the table. Unstaged: nothing to do."""
        if self.staging is None:
            return 0
        return self.staging.sync(layer, slots, self.k, self.v, self.masks)

    def ready_layers(self, slot: int) -> list[int]:
        """The layers of the slot whose packed bytes are in (flag set), read once. Through a copy: a lane's thread
        sets flags meanwhile, and nonzero() over a tensor that changes between its count and its fill fails an
        internal assert (seen once in CI: "out_ptr == out_accessor[...]") or corrupts the heap."""
        return self.quant_ready[:, slot].clone().nonzero().flatten().tolist()

    def land_quantized(self, slot: int, length: int) -> int:
        """Dequantizes every layer of the slot whose packed bytes are in (flag set) into K and V, then marks
        its prompt tokens local and clears the flag; returns the layers landed."""
        layout = self.layout
        landed = 0
        for layer in self.ready_layers(slot):
            k, v = unpack_layer(  # on K's device: staged, the packed bytes landed on the host
                self.quant[layer, slot].to(self.k.device),
                length,
                layout.num_kv_heads,
                layout.head_dim,
                layout.dtype,
                SERVING_QUANT,
            )
            self.k[layer, slot, :length] = k
            self.v[layer, slot, :length] = v
            self.masks.values[layer, slot, :length] = LOCAL  # after the data, as a push does
            self.quant_ready[layer, slot] = 0
            landed += 1
        return landed

    def byte_views(self) -> dict[str, torch.Tensor]:
        """The regions a lane registers: flat uint8 views of K, V, the masks and the quantized staging (staged: the
        host mirrors of K and V and the landing mask)."""
        views = {
            "k": self.k.view(-1).view(torch.uint8),
            "v": self.v.view(-1).view(torch.uint8),
            "mask": self.masks.values.view(-1).view(torch.uint8),
            "quant": self.quant.view(-1),
            "quant_ready": self.quant_ready.view(-1),
        }
        if self.staging is not None:
            views.update(self.staging.byte_views())
        return views


@dataclass(slots=True)
class RequestKV:
    """One request's prompt KV on a prefill node: K and V [L, n, H, d], token-major like the pool."""

    request_id: str
    k: torch.Tensor
    v: torch.Tensor
    layers_ready: int = 0

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def byte_views(self) -> dict[str, torch.Tensor]:
        return {"k": self.k.view(-1).view(torch.uint8), "v": self.v.view(-1).view(torch.uint8)}

    def kv_offset(self, layer: int, token: int) -> int:
        return (layer * self.length + token) * self.k.shape[2] * self.k.shape[3] * self.k.element_size()


class PrefillStore:
    """The prefill node's per-request KV, kept until the decode node releases the request.

    `max_bytes` caps the K and V held at once: a request that would go over it is refused (StoreFull) before
    anything is allocated, so a slow or stuck decode node cannot make a prefill node run out of memory."""

    def __init__(self, layout: KVLayout, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"a prefill store cap must be positive, got {max_bytes}")
        self.layout = layout
        self.max_bytes = max_bytes
        self._requests: dict[str, RequestKV] = {}
        self._reserved = 0  # bytes of K and V of the requests held
        self._lock = threading.Lock()

    def open(self, request_id: str, length: int) -> RequestKV:
        shape = (self.layout.num_layers, length, self.layout.num_kv_heads, self.layout.head_dim)
        needed = self.layout.kv_bytes(length)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already open on this prefill node")
            if self.max_bytes is not None and self._reserved + needed > self.max_bytes:
                raise StoreFull(self._full_reason(needed))
            # under the lock: the check and the allocation are one step (torch.empty does not touch the memory)
            entry = RequestKV(
                request_id, torch.empty(shape, dtype=self.layout.dtype), torch.empty(shape, dtype=self.layout.dtype)
            )
            self._requests[request_id] = entry
            self._reserved += needed
        return entry

    def _full_reason(self, needed: int) -> str:
        cap = self.max_bytes or 0
        if needed > cap:
            return f"prefill store too small: this prompt's KV needs {needed} bytes, the store holds at most {cap}"
        return (
            f"prefill store full: {self._reserved} of {cap} bytes held by {len(self._requests)} request(s), "
            f"this prompt's KV needs {needed}; try again later"
        )

    def put_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> RequestKV:
        """Stores one layer's K/V ([n, H, d] each) as soon as that layer's prefill is done."""
        entry = self.get(request_id)
        if layer != entry.layers_ready:
            raise ValueError(f"layer {layer} of {request_id!r} arrived out of order (expected {entry.layers_ready})")
        entry.k[layer].copy_(k)
        entry.v[layer].copy_(v)
        entry.layers_ready += 1
        return entry

    def get(self, request_id: str) -> RequestKV:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            raise KeyError(f"no KV for request {request_id!r} on this prefill node")
        return entry

    def release(self, request_id: str) -> bool:
        """Frees a request's KV; returns whether it was held."""
        with self._lock:
            entry = self._requests.pop(request_id, None)
            if entry is not None:
                self._reserved -= entry.k.nbytes + entry.v.nbytes
            return entry is not None

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._requests

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(e.k.nbytes + e.v.nbytes for e in self._requests.values())
