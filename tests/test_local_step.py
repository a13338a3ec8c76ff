"""The pilot's all-local step at a batch size: how many tokens its requests ask for, which gaps count, and how the
figure reaches the summaries and the regime line."""

from __future__ import annotations

import pytest

from smartgen.apps.bench.local_step import MAX_TOKENS, WINDOW_TOKENS, batch_step, pilot_tokens
from smartgen.apps.bench.results import Regime
from smartgen.apps.bench.stats import local_tbt


def test_the_first_request_still_decodes_when_the_last_one_starts() -> None:
    # 3 prefills of 2 s behind the first, 0.1 s steps: 60 steps at batch-1 speed, half as much again, and a window
    assert pilot_tokens(4, prefill_s=2.0, step_s=0.1) == 90 + WINDOW_TOKENS
    assert pilot_tokens(2, prefill_s=0.01, step_s=0.1) == 1 + WINDOW_TOKENS
    assert pilot_tokens(8, prefill_s=60.0, step_s=0.01) == MAX_TOKENS  # never unbounded


@pytest.mark.parametrize(("batch", "prefill", "step"), [(1, 1.0, 0.1), (2, 0.0, 0.1), (2, 1.0, -0.1)])
def test_pilot_tokens_refuses_what_has_no_batch_step(batch: int, prefill: float, step: float) -> None:
    with pytest.raises(ValueError):
        pilot_tokens(batch, prefill, step)


def test_only_gaps_while_every_request_decodes_count() -> None:
    # request A: sent at 0, tokens every 0.1 s alone, then every 0.3 s once B decodes too, then 0.1 s again
    a_times = [1.0, 1.1, 1.2, 1.3, 1.6, 1.9, 2.2, 2.5, 2.6, 2.7]
    # request B: sent at 0.5, its first token at 1.3 (absolute), second at 1.6, then with A, then alone
    b_abs = [1.3, 1.6, 1.9, 2.2, 2.5, 2.6, 2.7, 2.8]
    streams = [(0.0, a_times), (0.5, [t - 0.5 for t in b_abs])]
    # the window opens at B's second token (1.6) and closes at A's last (2.7): each request's three shared steps of
    # 0.3 s count, and its two 0.1 s gaps before 2.7, not B's last one after it (6 of 0.3 s, 4 of 0.1 s)
    assert batch_step(streams) == pytest.approx(0.3)


def test_no_figure_without_an_overlap() -> None:
    alone = [(0.0, [1.0, 1.1, 1.2, 1.3]), (5.0, [1.0, 1.1, 1.2, 1.3])]  # B starts after A has left
    assert batch_step(alone) is None
    assert batch_step([(0.0, [1.0, 1.1, 1.2, 1.3])]) is None  # one request is no batch
    assert batch_step([(0.0, [1.0, 1.1]), (0.0, [1.0, 1.1, 1.2])]) is None  # too few tokens to open a window


def _regime(batch_steps: dict[int, dict[int, float]]) -> Regime:
    return Regime(0.02, 4.7, 1024, {1024: 0.5}, {1024: 0.05}, 2.0, 0.15, 3072, 6, batch_step_s=batch_steps)


def test_the_local_tbt_adds_the_emulated_compute_to_the_pilots_step() -> None:
    regime = _regime({1024: {4: 0.08}})
    emulated = 6 * 2.0 / 1e3  # 6 layers of 2 ms
    assert local_tbt(regime, 1024, 1) == pytest.approx(0.05 + emulated)
    assert local_tbt(regime, 1024, 4) == pytest.approx(0.08 + emulated)
    assert local_tbt(regime, 1024, 2) is None  # not measured
    assert local_tbt(regime, 2048, 1) is None


def test_the_regime_line_names_the_batch_step() -> None:
    from smartgen.apps.bench.tables import _batch_step_words

    regime = _regime({1024: {4: 0.08}})
    assert _batch_step_words(regime, 1024, 4) == ", 4 requests decoding together 80 ms a step (1.60x one)"
    assert _batch_step_words(regime, 1024, 1) == ""
    assert _batch_step_words(regime, 1024, 2) == ""
