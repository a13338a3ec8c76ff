"""A benchmark's emulated decode device: the sleep each decode layer adds, added to the step or topping it up to a floor.

Two ways to stand in for a slower decode device on a CPU (`serve --emulate-layer-ms`, `--emulate-layer-floor-ms`):
- added: every layer sleeps the same time after its own compute, so a step costs this CPU's compute plus the
  emulation. A batch of B costs what this CPU takes for B, which grows about linearly with B here;
- floor: every layer takes at least the floor, counted over the step so far on the step thread's own CPU clock
  (sleeps, link waits and time other threads take are not compute), and is topped up with sleep to it. A step of
  a batch then costs what one request's does while the CPU fits under the floor, as a GPU's decode step hardly
  grows with small batches (it reads the weights once for all of them). Link waits come on top in both.
"""

from __future__ import annotations

import time

__all__ = ["Emulation", "StepEmulation"]


class Emulation:
    """The emulated compute of one runner's decode layers; `step()` starts one step's account."""

    def __init__(self, added_s: float = 0.0, floor_s: float = 0.0) -> None:
        if added_s < 0 or floor_s < 0:
            raise ValueError(f"emulated layer time must be >= 0, got {added_s if added_s < 0 else floor_s}")
        if added_s and floor_s:
            raise ValueError("emulate a layer by an added time or by a floor, not both")
        self.added_s = added_s
        self.floor_s = floor_s
        self.slept_s = 0.0  # every step's sleeps so far (the step breakdown's emulated compute)

    def __bool__(self) -> bool:
        return bool(self.added_s or self.floor_s)

    def step(self) -> StepEmulation:
        """One step's account: call as the step starts, on the thread that runs it."""
        return StepEmulation(self)


class StepEmulation:
    """One step's emulated compute: `layer()` after each layer's own compute sleeps that layer's share."""

    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation
        self.cpu_started = time.thread_time()
        self.layers = 0
        self.slept_s = 0.0

    def layer(self) -> None:
        """Sleeps the layer's emulated compute: the added time, or what tops the step's CPU and sleeps so far up to
        the floor of the layers done (a layer over it takes from the ones after)."""
        emulation = self.emulation
        self.layers += 1
        if emulation.floor_s:
            due = self.layers * emulation.floor_s - (time.thread_time() - self.cpu_started) - self.slept_s
        else:
            due = emulation.added_s
        if due <= 0:
            return
        started = time.monotonic()
        time.sleep(due)
        slept = time.monotonic() - started
        self.slept_s += slept
        emulation.slept_s += slept
