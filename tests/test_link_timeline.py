"""The link's timeline: bytes a paced link carried, second by second, by what the lanes said they were."""

from __future__ import annotations

import pytest

from smartgen.lanes import Pacer
from smartgen.lanes.link_timeline import OTHER_TAG, LinkTimeline, between, merged


def test_bookings_count_in_the_bin_they_end_in_by_tag():
    timeline = LinkTimeline(bin_s=1.0, keep_bins=3)
    timeline.add(10.2, 100, "proactive")
    timeline.add(10.9, 50, "on_demand")
    timeline.add(12.5, 7, "")
    timeline.add(11.1, 30, "proactive")  # a late booking of a bin skipped while idle
    timeline.add(10.5, 1, "proactive")  # and one of an earlier bin, still kept
    assert timeline.snapshot() == {
        "bin_s": 1.0,
        "bins": [
            [10.0, {"proactive": 101, "on_demand": 50}],
            [11.0, {"proactive": 30}],
            [12.0, {OTHER_TAG: 7}],
        ],
    }
    timeline.add(13.0, 5, "speculative")  # the oldest bin goes: three kept
    timeline.add(10.0, 9, "proactive")  # older than what is kept: dropped
    assert [start for start, _ in timeline.snapshot()["bins"]] == [11.0, 12.0, 13.0]
    with pytest.raises(ValueError):
        LinkTimeline(bin_s=0)


def test_a_rounds_seconds_are_cut_out_of_several_links_and_summed():
    a = {"bin_s": 1.0, "bins": [[9.0, {"proactive": 5}], [10.0, {"proactive": 100}], [12.0, {"on_demand": 3}]]}
    b = {"bin_s": 1.0, "bins": [[10.0, {"proactive": 1, "speculative": 2}], [14.0, {"speculative": 8}]]}
    # from the bin holding 10.4 to the one holding 12.9: three bins, the idle one zero
    assert between([a, b], 10.4, 12.9) == {"proactive": [101, 0, 0], "speculative": [2, 0, 0], "on_demand": [0, 0, 3]}
    assert between([a, {}], 20.0, 21.0) == {} and between([], 0.0, 1.0) == {}
    with pytest.raises(ValueError, match="bin widths"):
        between([a, {"bin_s": 0.5, "bins": [[10.0, {"x": 1}]]}], 10.0, 11.0)


def test_several_links_merge_into_one_timeline_bin_by_bin():
    a = {"bin_s": 1.0, "bins": [[9.0, {"proactive": 5}], [10.0, {"proactive": 100}]]}
    b = {"bin_s": 1.0, "bins": [[10.0, {"proactive": 1, "speculative": 2}], [14.0, {"speculative": 8}]]}
    assert merged([a, b, {}]) == {
        "bin_s": 1.0,
        "bins": [[9.0, {"proactive": 5}], [10.0, {"proactive": 101, "speculative": 2}], [14.0, {"speculative": 8}]],
    }
    assert merged([]) == {"bin_s": 1.0, "bins": []}
    with pytest.raises(ValueError, match="bin widths"):
        merged([a, {"bin_s": 0.5, "bins": [[10.0, {"x": 1}]]}])


def test_a_paced_link_books_its_timeline_and_an_unpaced_one_does_not():
    pacer = Pacer(gbps=8.0)  # 1 GB/s
    done = pacer.reserve(10**6, "proactive")
    pacer.arrival(10**6, "on_demand")
    (start, counts), *_ = pacer.timeline.snapshot()["bins"]
    assert start <= done and counts == {"proactive": 10**6, "on_demand": 10**6}
    unpaced = Pacer(None)
    unpaced.reserve(10**6, "proactive")
    assert unpaced.timeline.snapshot()["bins"] == []
