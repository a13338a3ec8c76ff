"""The decode side of a regime: emulated compute per decode layer that sets the decode-side ratio.

The decode-side ratio is the bytes the link moves during one all-local decode step over the bytes a step
selects past the layers sent whole (the paper's testbed: about 0.15). A machine whose decode step is faster
than the paper's GPU's, against a link paced to the paper's stall ratio, has a lower ratio; sleeping
`emulate_layer_ms` in every decode layer (`serve --emulate-layer-ms`) brings it up. `smartgen bench` and
`smartgen demo` both set it here.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DecodeSide", "decode_side", "emulate_flags"]


class DecodeSide(NamedTuple):
    emulate_layer_ms: float  # sleep added to every decode layer of every step; 0: the machine's own speed
    decode_ratio: float  # link bytes in one all-local step, emulation included / selected bytes of a step


def decode_side(
    target_ratio: float | None, selected_bytes: float, link_bytes_per_s: float, step_s: float, num_layers: int
) -> DecodeSide:
    """The emulation that brings an all-local step of `step_s` (as served, over `num_layers` layers) to
    `target_ratio` on a link of `link_bytes_per_s`, and the ratio it gives. None, or a target the step already
    exceeds, emulates nothing (emulation only ever slows a step down): the ratio is then the native one."""
    emulate_ms = 0.0
    if target_ratio is not None:
        target_step = target_ratio * selected_bytes / link_bytes_per_s
        emulate_ms = max(0.0, (target_step - step_s) / num_layers) * 1e3
    return DecodeSide(emulate_ms, link_bytes_per_s * (step_s + emulate_ms * num_layers / 1e3) / selected_bytes)


def emulate_flags(emulate_layer_ms: float) -> tuple[str, ...]:
    """The decode node's `serve` flags for that emulation (ClusterSpec.decode_extra); none when it is 0."""
    return ("--emulate-layer-ms", f"{emulate_layer_ms:.4f}") if emulate_layer_ms else ()
