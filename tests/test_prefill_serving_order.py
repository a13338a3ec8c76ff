"""A prefill node serves what arrived together fetches first, then one idle notice per request (hints merged)."""

from __future__ import annotations

import torch

from smartgen.engine import messages as msg
from smartgen.engine.layout import KVLayout
from smartgen.engine.planning import Planner
from smartgen.engine.prefill import PrefillEngine
from smartgen.lanes.base import Message, MessageKind


class _Control:
    def __init__(self, messages):
        self.queue = list(messages)
        self.sent = []

    def recv(self, timeout=None):
        return self.queue.pop(0) if self.queue else None

    def send(self, message, tag=None):
        self.sent.append(message)


class _Link:
    def __init__(self, messages):
        self.control = _Control(messages)
        self.alive = True

    def close(self):
        self.alive = False


def _serve(messages):
    engine = PrefillEngine(KVLayout(4, 2, 8, num_blocks=16), Planner(4, 16))
    handled = []
    engine._handle = lambda link, geometry, message: handled.append(message)  # type: ignore[method-assign]
    link = _Link(messages)
    original_recv = link.control.recv

    def recv(timeout=None):
        message = original_recv(timeout)
        if message is None and timeout:  # the batch is drained and the blocking wait finds nothing: the peer left
            link.alive = False
        return message

    link.control.recv = recv
    engine._drop_link = lambda link: None  # type: ignore[method-assign]
    engine._serve(link, None)  # type: ignore[arg-type]
    return handled, link.control.sent


def test_fetches_go_before_idle_notices_that_arrived_with_them_and_the_notices_merge():
    fetch = msg.Fetch("a", 2, 7, torch.tensor([1, 2]))
    handled, _ = _serve(
        [
            msg.Idle("a", 2, torch.tensor([5, 9])).pack(),
            msg.Idle("b", 2).pack(),
            msg.Idle("a", 3, torch.tensor([9, 11])).pack(),
            fetch.pack(),
            msg.Release("b").pack(),
        ]
    )
    kinds = [type(m).__name__ for m in handled]
    assert kinds == ["Fetch", "Release", "Idle", "Idle"]  # every other message in order, then the notices
    assert handled[0].fetch_id == 7
    idle = {m.request_id: m for m in handled[2:]}
    assert idle["a"].layer == 3 and idle["a"].hints.tolist() == [
        9,
        11,
        5,
    ]  # the last layer; every hint once, newest first
    assert idle["b"].hints is None


def test_a_bad_notice_is_refused_with_its_reason_and_the_rest_are_served():
    bad = Message(MessageKind.IDLE, "a", {"layer": 2}, {"hints": torch.tensor([1.5])})  # float hints: refused
    handled, sent = _serve([bad, msg.Fetch("c", 2, 1, torch.tensor([0])).pack()])
    assert [type(m).__name__ for m in handled] == ["Fetch"]
    errors = [msg.unpack(m) for m in sent]
    assert len(errors) == 1 and errors[0].request_id == "a" and "hints" in errors[0].reason
