"""The bench's fetch column: the link time of one decode step's fetches for the whole batch."""

import pytest

from smartgen.apps.bench.fetch_link import batch_seen, fetch_link_per_step


def _request(sent: float, first: float, end: float, tokens: int = 11, error: str | None = None) -> dict:
    return {"sent": sent, "ttft": first, "e2e": end, "completion_tokens": tokens, "error": error}


def test_a_request_alone_sees_a_batch_of_one() -> None:
    assert batch_seen([_request(0.0, 1.0, 3.0)]) == 1.0


def test_requests_decoding_together_see_each_other_and_apart_do_not() -> None:
    together = [_request(0.0, 1.0, 3.0), _request(0.0, 1.0, 3.0)]
    assert batch_seen(together) == 2.0
    apart = [_request(0.0, 1.0, 2.0), _request(0.0, 2.0, 3.0)]  # the second starts as the first ends
    assert batch_seen(apart) == 1.0
    # the second overlaps the first half of the first's decoding: 1.5 for the first, 2 for the second
    assert batch_seen([_request(0.0, 0.0, 2.0), _request(0.0, 0.0, 1.0)]) == pytest.approx((1.5 + 2.0) / 2)


def test_failed_and_unfinished_requests_are_left_out() -> None:
    failed = _request(0.0, 1.0, 3.0, error="lost")
    assert batch_seen([_request(0.0, 1.0, 3.0), failed]) == 1.0
    assert batch_seen([failed]) is None
    assert batch_seen([{"sent": 0.0, "ttft": None, "e2e": None, "completion_tokens": 0}]) is None


def test_fetch_link_time_is_fetched_bytes_per_step_of_the_whole_batch_over_the_rate() -> None:
    # two requests of 11 tokens decoding together: 10 steps each, 2 MB fetched in all, 1 MB/s
    pair = [_request(0.0, 1.0, 3.0), _request(0.0, 1.0, 3.0)]
    # 2 MB / 20 request-steps = 0.1 MB per request and step; a step carries both: 0.2 MB = 0.2 s
    assert fetch_link_per_step(pair, 2e6, 1e6) == pytest.approx(0.2)
    # the same bytes by two requests one after the other: each step carries one request's 0.1 MB
    apart = [_request(0.0, 1.0, 2.0), _request(0.0, 2.0, 3.0)]
    assert fetch_link_per_step(apart, 2e6, 1e6) == pytest.approx(0.1)
    assert fetch_link_per_step(pair, 0.0, 1e6) == 0.0


def test_no_steps_or_no_rate_gives_no_figure() -> None:
    assert fetch_link_per_step([_request(0.0, 1.0, 3.0, tokens=1)], 1e6, 1e6) is None
    assert fetch_link_per_step([_request(0.0, 1.0, 3.0)], 1e6, 0.0) is None
    assert fetch_link_per_step([], 1e6, 1e6) is None
