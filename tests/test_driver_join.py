"""A request joins a running decode batch only once its layers 0-1 are local: its first step would wait for them,
and every request in the batch with it (measured at batch 4: 0.6-1.9 s stalls of the running requests)."""

import types

import torch

from smartgen.engine.decode import Stall
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.policy import get_policy
from smartgen.runtime.driver import DecodeDriver, DriverRequest
from smartgen.runtime.sampling import Sampler


class _Engine:
    """What collect_first_tokens asks of a DecodeEngine: every first token is in; layers 0-1 are local for the
    requests in `dense_local`; the requests in `stalls` got nothing for the bound (tests/test_progress_bound.py
    drives the bound itself)."""

    def __init__(self) -> None:
        self.dense_local: set[str] = set()
        self.stalls: dict[str, Stall] = {}  # nothing arrived for these for the bound
        self._metrics: dict[str, RequestMetrics] = {}
        # the first step's forecast: none promised unless a test says so
        self.pending: set[str] = set()  # promised, not come
        self.forecasts: dict[str, dict] = {}  # come, not taken
        self.landed: set[str] = set()
        self.pending_fetches: dict[str, bool] = {}
        self.seconds: dict[str, int] = {}  # second tokens a FORECAST brought, not taken
        self.pending_next: set[str] = set()  # the next step's forecast (after a second token): promised, not come
        self.forecasts_next: dict[str, dict] = {}
        self.heads: dict[str, list[int]] = {}  # head-start tokens come, not taken
        self.heading: set[str] = set()  # a head start still under way (its end not come)

    def take_head_token(self, request_id: str) -> int | None:
        tokens = self.heads.get(request_id)
        if not tokens:
            return None
        self.metrics(request_id).record_token(2.0)
        return tokens.pop(0)

    def head_pending(self, request_id: str) -> bool:
        return request_id in self.heading

    def take_second_token(self, request_id: str) -> int | None:
        token = self.seconds.pop(request_id, None)
        if token is not None:
            self.metrics(request_id).record_token(1.0)
            self.metrics(request_id).prefill_tokens = 2
        return token

    def first_token_ready(self, request_id: str) -> bool:
        return True

    def wait_first_token(self, request_id: str, timeout: float | None = None) -> int:
        self.metrics(request_id).record_token(0.0)
        return 7

    def metrics(self, request_id: str) -> RequestMetrics:
        return self._metrics.setdefault(request_id, RequestMetrics(request_id, 4))

    def dense_layers_local(self, request_id: str) -> bool:
        return request_id in self.dense_local

    def is_all_local(self, request_id: str) -> bool:
        return False

    def request_metadata(self, request_id: str) -> list:
        return []

    def stall(self, request_id: str, bound: float) -> Stall | None:
        return self.stalls.get(request_id)

    def forecast_pending(self, request_id: str, *, after_second: bool = False) -> bool:
        return request_id in (self.pending_next if after_second else self.pending)

    def take_forecast(self, request_id: str, *, after_second: bool = False) -> dict | None:
        mine, other = (self.forecasts_next, self.forecasts) if after_second else (self.forecasts, self.forecasts_next)
        other.pop(request_id, None)
        return mine.pop(request_id, None)

    def forecast_landed(self, request_id: str) -> bool:
        return request_id in self.landed or not self.pending_fetches.get(request_id)


def _request(request_id: str, scheme: str = "smartgen") -> DriverRequest:
    return DriverRequest(request_id, torch.arange(4), get_policy(scheme), max_tokens=8)


def _driver(engine: _Engine) -> DecodeDriver:
    return DecodeDriver(types.SimpleNamespace(engine=engine))  # type: ignore[arg-type]


def test_the_first_request_joins_at_once_and_a_later_one_when_its_dense_layers_are_local():
    engine = _Engine()
    driver = _driver(engine)
    driver.prefilling = [_request("a")]
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a"]  # an empty batch: no one to hold up
    driver.prefilling = [_request("b")]
    events = driver.collect_first_tokens()
    assert [e.request_id for e in events] == ["b"]  # its first token is streamed (TTFT) while it waits
    assert [r.request_id for r in driver.running] == ["a"] and [r.request_id for r in driver.prefilling] == ["b"]
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a"]  # still waiting; its first token is not sent again
    engine.dense_local.add("b")
    assert driver.collect_first_tokens() == []
    assert [r.request_id for r in driver.running] == ["a", "b"] and not driver.prefilling
    assert "joined" in engine.metrics("b").milestones  # the bench's timeline says when it joined


def _stalled(engine: _Engine, request_id: str) -> None:
    """Nothing arrived for the request for the bound; aborting it is a no-op on the fake engine."""
    engine.stalls[request_id] = Stall(idle_s=130.0, num_landed=2, num_entries=8, last_s=1.0, num_ahead=0, behind=False)
    engine.abort = lambda request_id, reason: None  # type: ignore[attr-defined]
    engine.has_request = lambda request_id: True  # type: ignore[attr-defined]


def test_a_waiting_request_is_aborted_once_its_kv_stalls():
    engine = _Engine()
    driver = _driver(engine)
    driver.prefilling = [_request("a")]
    driver.collect_first_tokens()
    driver.prefilling = [_request("b")]
    driver.collect_first_tokens()
    _stalled(engine, "b")
    (finished,) = driver.collect_first_tokens()
    assert finished.reason == "timeout" and (finished.error or "").startswith("its KV stalled: nothing arrived for it")


class _Runner:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.fetched: list[tuple[str, list[int], int]] = []

    def fetch_forecast(self, request_id: str, queries: dict, metadata: list, length: int) -> int:
        self.fetched.append((request_id, sorted(queries), length))
        self.engine.pending_fetches[request_id] = True  # in flight until a test lands them
        return 1


def _forecast_driver() -> tuple[_Engine, _Runner, DecodeDriver]:
    engine = _Engine()
    runner = _Runner(engine)
    return engine, runner, DecodeDriver(runner)  # type: ignore[arg-type]


def test_a_lone_request_does_not_wait_for_a_forecast_that_brings_no_second_token():
    engine, runner, driver = _forecast_driver()
    engine.pending.add("a")
    driver.prefilling = [_request("a", "smartgen-no-second-token")]
    events = driver.collect_first_tokens()
    assert [e.request_id for e in events] == ["a"]
    assert [r.request_id for r in driver.running] == ["a"] and not runner.fetched  # its own step asks as it goes


def test_a_promised_forecast_is_waited_for_while_others_run_then_fetched():
    engine, runner, driver = _forecast_driver()
    driver.prefilling = [_request("a")]
    driver.collect_first_tokens()
    engine.dense_local.add("b")
    engine.pending.add("b")
    driver.prefilling = [_request("b")]
    events = driver.collect_first_tokens()
    assert [e.request_id for e in events] == ["b"] and [r.request_id for r in driver.running] == ["a"]
    engine.pending.clear()
    engine.forecasts["b"] = {2: torch.zeros(2, 4), 3: torch.zeros(2, 4)}
    driver.collect_first_tokens()
    assert runner.fetched == [("b", [2, 3], 4)]  # its picks asked for, with its prompt length
    assert [r.request_id for r in driver.running] == ["a"]  # in flight: it waits outside the batch


def test_a_joining_request_waits_outside_the_batch_until_its_forecast_picks_are_local():
    engine, runner, driver = _forecast_driver()
    driver.prefilling = [_request("a")]
    driver.collect_first_tokens()  # no forecast promised: joins as before
    engine.dense_local.add("b")
    engine.forecasts["b"] = {2: torch.zeros(2, 4)}
    driver.prefilling = [_request("b")]
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a"] and runner.fetched == [("b", [2], 4)]
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a"] and len(runner.fetched) == 1  # asked once
    engine.landed.add("b")
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a", "b"]


def test_a_lone_request_waits_for_the_forecast_that_brings_its_second_token_then_starts_at_once():
    engine, runner, driver = _forecast_driver()
    engine.pending.add("a")
    driver.prefilling = [_request("a")]
    events = driver.collect_first_tokens()
    assert [(e.request_id, e.index) for e in events] == [("a", 0)] and not driver.running
    engine.pending.clear()
    engine.forecasts["a"], engine.seconds["a"] = {2: torch.zeros(2, 4)}, 9
    engine.pending_fetches["a"] = True  # its picks are still on their way: alone, it does not wait for them
    events = driver.collect_first_tokens()
    assert [(e.request_id, e.index, e.token) for e in events] == [("a", 1, 9)]
    assert runner.fetched == [("a", [2], 4)] and [r.request_id for r in driver.running] == ["a"]
    assert driver.running[0].tokens == [7, 9] and driver.batch.last_tokens.tolist() == [9]
    assert driver.batch.positions.tolist() == [4 + 1]  # its first step decodes the third token


def test_a_joining_request_streams_its_second_token_then_fetches_its_own_first_steps_picks_before_it_joins():
    engine, runner, driver = _forecast_driver()
    driver.prefilling = [_request("a", "partial")]
    driver.collect_first_tokens()
    engine.forecasts["b"], engine.seconds["b"] = {2: torch.zeros(2, 4)}, 9
    engine.pending_next.add("b")
    engine.pending_fetches["b"] = True
    driver.prefilling = [_request("b")]  # its layers 0-1 are not local yet
    events = driver.collect_first_tokens()
    assert [(e.request_id, e.index) for e in events] == [("b", 0), ("b", 1)]
    assert [r.request_id for r in driver.running] == ["a"]
    engine.dense_local.add("b")
    driver.collect_first_tokens()
    assert not runner.fetched  # the first step's picks are not its own first step's: it waits for the next's
    engine.pending_next.clear()
    engine.forecasts_next["b"] = {3: torch.zeros(2, 4)}
    driver.collect_first_tokens()
    assert runner.fetched == [("b", [3], 4)] and [r.request_id for r in driver.running] == ["a"]
    engine.landed.add("b")
    assert driver.collect_first_tokens() == []  # the second token left once
    assert [r.request_id for r in driver.running] == ["a", "b"] and driver.running[1].tokens == [7, 9]


def test_a_request_that_samples_decodes_its_second_token_itself():
    engine, runner, driver = _forecast_driver()
    engine.pending.add("a")
    request = _request("a")
    request.sampler = Sampler(temperature=0.8)
    driver.prefilling = [request]
    driver.collect_first_tokens()
    assert [r.request_id for r in driver.running] == ["a"] and request.tokens == [7]  # alone: no wait
    assert not runner.fetched


def test_a_head_start_streams_its_tokens_as_they_come_and_the_request_joins_once_they_end():
    """Policy.head_start: tokens the prefill node decoded ahead leave as they come; the request stays out of the
    batch while more may come (its step would decode a token the prefill node is decoding), then joins without
    fetching a forecast's picks (its KV has left)."""
    engine, runner, driver = _forecast_driver()
    engine.seconds["a"], engine.heads["a"], engine.heading = 9, [11, 12], {"a"}
    driver.prefilling = [_request("a")]
    events = driver.collect_first_tokens()
    assert [(e.request_id, e.index) for e in events] == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert not driver.running and driver.prefilling[0].tokens == [7, 9, 11, 12]
    engine.heads["a"] = [13]
    assert [e.index for e in driver.collect_first_tokens()] == [4] and not driver.running
    engine.heading.clear()  # the step-2 FORECAST ended the head start
    engine.forecasts["a"] = {2: torch.zeros(2, 4)}
    assert driver.collect_first_tokens() == []
    assert [r.request_id for r in driver.running] == ["a"] and not runner.fetched


def test_a_head_start_that_reaches_max_tokens_finishes_the_request_without_a_step():
    engine, _, driver = _forecast_driver()
    finished: list[str] = []
    engine.finish = lambda rid: finished.append(rid) or engine.metrics(rid)  # type: ignore[attr-defined]
    engine.seconds["a"], engine.heads["a"], engine.heading = 9, list(range(20, 26)), {"a"}
    driver.prefilling = [_request("a")]  # max_tokens 8: the first, the second and six from the head start
    events = driver.collect_first_tokens()
    assert [e.index for e in events if hasattr(e, "index")] == list(range(8))
    assert finished == ["a"] and not driver.prefilling and not driver.running


def test_a_head_start_that_stalls_fails_its_request_on_the_progress_bound():
    engine, _, driver = _forecast_driver()
    engine.seconds["a"], engine.heading = 9, {"a"}
    driver.prefilling = [_request("a")]
    driver.collect_first_tokens()
    _stalled(engine, "a")
    (finished,) = driver.collect_first_tokens()
    assert finished.reason == "timeout" and (finished.error or "").startswith("its head start stalled")
