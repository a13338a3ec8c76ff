"""The emulated decode device (runtime/emulation.py): a sleep added to each layer, or each layer topped up to a floor."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.runtime import emulation as emulation_module
from smartgen.runtime.emulation import Emulation


class FakeClock:
    """The step thread's CPU clock and the wall clock: compute advances both, a sleep only the wall."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.sleeps: list[float] = []

    def compute(self, seconds: float) -> None:
        self.cpu += seconds
        self.wall += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.wall += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(emulation_module.time, "thread_time", lambda: fake.cpu)
    monkeypatch.setattr(emulation_module.time, "monotonic", lambda: fake.wall)
    monkeypatch.setattr(emulation_module.time, "sleep", fake.sleep)
    return fake


def _step(emulation: Emulation, clock: FakeClock, layer_cpu: list[float]) -> float:
    """One step of layers costing `layer_cpu` each; its wall time."""
    started = clock.wall
    step = emulation.step()
    for cpu in layer_cpu:
        clock.compute(cpu)
        step.layer()
    return clock.wall - started


def test_an_added_emulation_sleeps_the_same_in_every_layer_whatever_the_compute(clock: FakeClock) -> None:
    emulation = Emulation(added_s=0.005)
    assert _step(emulation, clock, [0.002, 0.004, 0.001]) == pytest.approx(0.007 + 3 * 0.005)
    assert clock.sleeps == [0.005] * 3 and emulation.slept_s == pytest.approx(0.015)


def test_a_floor_tops_the_steps_compute_up_and_a_layer_over_it_takes_from_the_next(clock: FakeClock) -> None:
    emulation = Emulation(floor_s=0.005)
    # layer 1: 2 ms of CPU, 3 slept; layer 2: 7 ms, over its floor, none; layer 3: 1 ms, 2 slept (15 - 10 - 3)
    assert _step(emulation, clock, [0.002, 0.007, 0.001]) == pytest.approx(0.015)
    assert clock.sleeps == pytest.approx([0.003, 0.002]) and emulation.slept_s == pytest.approx(0.005)


def test_under_a_floor_a_batchs_step_costs_what_one_requests_does(clock: FakeClock) -> None:
    """A batch of three whose layers cost three times the CPU: the same step while it fits under the floor, and its
    CPU alone once it does not."""
    emulation = Emulation(floor_s=0.005)
    alone = _step(emulation, clock, [0.0015] * 4)
    batch = _step(emulation, clock, [0.0045] * 4)
    assert alone == pytest.approx(batch) == pytest.approx(0.020)
    assert _step(emulation, clock, [0.006] * 4) == pytest.approx(0.024)  # over the floor: this CPU's own time
    added = Emulation(added_s=0.005 - 0.0015)  # the same step alone, added: the batch pays its CPU on top
    assert _step(added, clock, [0.0015] * 4) == pytest.approx(alone)
    assert _step(added, clock, [0.0045] * 4) == pytest.approx(alone + 4 * 0.003)


def test_each_step_starts_its_own_account(clock: FakeClock) -> None:
    emulation = Emulation(floor_s=0.005)
    _step(emulation, clock, [0.020])  # one slow step does not make the next one short
    assert _step(emulation, clock, [0.001, 0.001]) == pytest.approx(0.010)


def test_an_emulation_is_off_by_default_and_refuses_nonsense() -> None:
    assert not Emulation() and Emulation(added_s=0.001) and Emulation(floor_s=0.001)
    with pytest.raises(ValueError, match="not both"):
        Emulation(added_s=0.001, floor_s=0.002)
    with pytest.raises(ValueError, match=">= 0"):
        Emulation(floor_s=-1)


def test_serve_takes_one_emulation_not_both() -> None:
    args = ["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure"]
    result = CliRunner().invoke(
        app, [*args, "--emulate-layer-ms", "2", "--emulate-layer-floor-ms", "5"], env={"COLUMNS": "200"}
    )
    assert result.exit_code != 0 and "give one of the two" in result.stderr
    assert "Traceback" not in result.output + result.stderr
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--emulate-layer-floor-ms" in help_text and "--emulate-layer-ms" in help_text
