"""A prefill link lost while a request is being opened on it: the link's listener and `open` both see the loss, and
exactly one of them opens the request again elsewhere (recompute): the other prefill node never gets it twice."""

import threading

import torch

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import POLICIES
from smartgen.lanes.base import MessageKind
from smartgen.lanes.link import inproc_link

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=16)


def _opens(end, request_id: str) -> int:
    """How many OPENs for `request_id` wait on a prefill end's control lane."""
    count = 0
    while (message := end.control.recv(timeout=0.05)) is not None:
        count += message.kind is MessageKind.OPEN and message.request_id == request_id
    return count


def test_a_request_opened_as_its_link_drops_is_opened_again_once():
    """The interleaving that failed a slow test under load: the listener takes the request as a victim of the lost
    link, and before it opens the request again, `open` sees the dead link and (before the fix) opened it too."""
    engine = DecodeEngine(LAYOUT, num_slots=3, max_tokens=32, recompute=True)
    lost_prefill, lost = inproc_link(name="lost")
    other_prefill, other = inproc_link(name="other")
    engine._links += [lost, other]  # open() picks the first of two idle links: `lost`; nothing listens on either

    listener_in_reopen, go_on = threading.Event(), threading.Event()
    listener: list[threading.Thread] = []
    reopen = engine._reopen

    def held_reopen(request) -> bool:  # the listener pauses between taking its victims and opening them again
        if threading.current_thread() in listener:
            listener_in_reopen.set()
            go_on.wait(10)
        return reopen(request)

    engine._reopen = held_reopen  # type: ignore[method-assign]
    send = lost.control.send

    def send_then_drop(message) -> None:  # the OPEN goes out as the link dies; its listener notices at once
        send(message)
        lost.close()
        listener.append(threading.Thread(target=engine._fail_link, args=(lost, "peer gone")))
        listener[0].start()
        listener_in_reopen.wait(10)

    lost.control.send = send_then_drop  # type: ignore[method-assign]
    try:
        request_id = engine.open(10, POLICIES["smartgen"])
        go_on.set()
        listener[0].join(10)
        assert not listener[0].is_alive()
        assert listener_in_reopen.is_set()  # the listener took it: `open` left it alone
        assert _opens(other_prefill, request_id) == 1
        assert engine._requests[request_id].link is other and not engine._requests[request_id].metrics.error
    finally:
        go_on.set()
        engine.close()
        lost_prefill.close()
        other_prefill.close()


def test_a_forecast_the_lost_node_promised_is_not_waited_for_after_the_request_is_opened_again():
    """A prefill node lost after FIRST_TOKEN (and after a FORECAST that brought the second token) but before the
    FORECASTs it promised: the request is prefilled again elsewhere, which forecasts nothing, so nothing may wait."""
    engine = DecodeEngine(LAYOUT, num_slots=3, max_tokens=32, recompute=True)
    lost_prefill, lost = inproc_link(name="lost")
    other_prefill, other = inproc_link(name="other")
    engine._links += [lost, other]
    try:
        request_id = engine.open(10, POLICIES["smartgen"])
        request = engine._requests[request_id]
        request.forecast_promised, request.forecast_next_promised = True, True
        request.first_token.set_result(5)
        assert engine.forecast_pending(request_id) and engine.forecast_pending(request_id, after_second=True)
        lost.close()
        engine._fail_link(lost, "peer gone")
        assert request.link is other and request.resuming and not request.metrics.error
        assert not engine.forecast_pending(request_id) and not engine.forecast_pending(request_id, after_second=True)
    finally:
        engine.close()
        lost_prefill.close()
        other_prefill.close()
