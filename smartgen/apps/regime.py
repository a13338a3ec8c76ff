"""The regime a run is measured in, defined once for `smartgen bench`, `demo` and `simulate`: the link, and the decode side.

The link: a given rate, or the rate at which a full transfer of the reference prompt(s) takes the stall ratio
(the paper's 4.7 at 25-32 Gbit/s, 7.1 at 15) times their prefill; `link_for` returns it with the stall ratio the
rate really gives. The decode side: the decode-side ratio is the bytes the link moves during one all-local decode step over the bytes a step
selects past the layers sent whole (the paper's testbed: about 0.15). A machine whose decode step is faster
than the paper's GPU's, against a link paced to the paper's stall ratio, has a lower ratio; sleeping
`emulate_layer_ms` in every decode layer (`serve --emulate-layer-ms`) brings it up; or, with a floor, every decode
layer takes at least `emulate_floor_ms` of compute (`serve --emulate-layer-floor-ms`: a batch's step then costs what
one request's does, as on a GPU; runtime/emulation.py). `smartgen bench` and `smartgen demo` both set it here.
"""

from __future__ import annotations

from typing import NamedTuple

from smartgen.lanes.rate import bytes_per_second, gbps_for

__all__ = [
    "Link",
    "link_for",
    "step_selected_bytes",
    "DecodeSide",
    "decode_side",
    "emulate_flags",
    "emulation_words",
]


class Link(NamedTuple):
    link_gbps: float
    stall_ratio: float  # a full transfer of the reference KV over this link / its prefill


def link_for(kv_bytes: float, prefill_s: float, *, stall_ratio: float | None = None, gbps: float | None = None) -> Link:
    """The link for `kv_bytes` of reference KV that prefill in `prefill_s`: `gbps` as given, or the rate at which
    they take `stall_ratio` x `prefill_s` to cross; with the stall ratio that rate gives. One of the two is needed."""
    if (stall_ratio is None) == (gbps is None):
        raise ValueError("a link is set by its rate or by its stall ratio, one of the two")
    if not prefill_s > 0:
        raise ValueError("deriving a link from a stall ratio needs a positive prefill time")
    rate_gbps = gbps if gbps is not None else gbps_for(kv_bytes, stall_ratio * prefill_s)  # type: ignore[operator]
    return Link(rate_gbps, kv_bytes / bytes_per_second(rate_gbps) / prefill_s)


def step_selected_bytes(budget: float, tokens: float, token_bytes: float, num_layers: int) -> float:
    """What one decode step could need over the link: its selection (`budget` of `tokens` tokens of `token_bytes`
    over every layer) in the layers past the two sent whole."""
    return budget * tokens * token_bytes * max(num_layers - 2, 1) / num_layers


class DecodeSide(NamedTuple):
    emulate_layer_ms: float  # sleep added to every decode layer of every step; 0: the machine's own speed
    decode_ratio: float  # link bytes in one all-local step, emulation included / selected bytes of a step
    emulate_floor_ms: float = 0.0  # or: every decode layer topped up to this much compute (a step's target / layers)


def decode_side(
    target_ratio: float | None,
    selected_bytes: float,
    link_bytes_per_s: float,
    step_s: float,
    num_layers: int,
    *,
    floor: bool = False,
) -> DecodeSide:
    """The emulation that brings an all-local step of `step_s` (as served, over `num_layers` layers) to
    `target_ratio` on a link of `link_bytes_per_s`, and the ratio it gives: a sleep added to every layer, or with
    `floor` every layer topped up to the target step's share. None, or a target the step already exceeds, emulates
    nothing (emulation only ever slows a step down): the ratio is then the native one."""
    emulate_ms = 0.0
    if target_ratio is not None:
        target_step = target_ratio * selected_bytes / link_bytes_per_s
        emulate_ms = max(0.0, (target_step - step_s) / num_layers) * 1e3
    ratio = link_bytes_per_s * (step_s + emulate_ms * num_layers / 1e3) / selected_bytes
    if floor and emulate_ms:
        return DecodeSide(0.0, ratio, emulate_ms + step_s / num_layers * 1e3)
    return DecodeSide(emulate_ms, ratio)


def emulate_flags(emulate_layer_ms: float, emulate_floor_ms: float = 0.0) -> tuple[str, ...]:
    """The `serve` flags for that emulation (ClusterSpec.decode_extra, and prefill_extra for the prefill node's own
    decode steps); none when it is 0."""
    if emulate_floor_ms:
        return ("--emulate-layer-floor-ms", f"{emulate_floor_ms:.4f}")
    return ("--emulate-layer-ms", f"{emulate_layer_ms:.4f}") if emulate_layer_ms else ()


def emulation_words(emulate_layer_ms: float, emulate_floor_ms: float = 0.0) -> str:
    """The emulation in a regime line: " + 3.20 ms/layer emulated", ", each layer at least 5.10 ms (floor)", or
    nothing."""
    if emulate_floor_ms:
        return f", each layer at least {emulate_floor_ms:.2f} ms (floor)"
    return f" + {emulate_layer_ms:.2f} ms/layer emulated" if emulate_layer_ms else ""
