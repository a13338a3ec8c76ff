"""The prefill side of the transfer engine: request KV store, proactive and speculative pushes, fetch serving.

A request on a prefill node:
1. OPEN arrives from a decode node: the request's KV store is allocated, its transfer plan
   made (policy + profile + link timings), and it is queued for `next_request()`.
2. Prefill runs layer by layer; `prefill_layer()` stores each layer's K/V and at once
   pushes that layer's planned blocks (data, then mask) on the push lane, and
   `send_metadata()` sends the layer's selector metadata on the control lane.
3. `finish_prefill()` sends FIRST_TOKEN on the control lane (not behind bulk pushes).
4. FETCH requests are answered with the K/V of the asked tokens; each IDLE notice pushes the
   next speculative slice, in importance order, unless the previous slice is still in flight.
5. RELEASE or ABORT frees the store; so does the decode node's link closing (dead, or silent past its lease).

Split by concern, as vLLM's KV connector splits a scheduler side from a worker side:
- decide.py: pure decisions from the policy flags (read once): which blocks a prefilled layer pushes, the next
  speculative slice (hinted entries first, sized to the link's idle window), how pushes bridge sent gaps;
- move.py: the data path (`PrefillPath`): the request's store, pushes posted, fetches served;
- gate.py: one link's schedule across requests: speculation waits while pushes (proactive sets first) fill the
  link's room ahead, and requests speculate in turn;
- control.py: `PrefillEngine`, links, leases and failures, and the request's life listed above;
- request.py: a request's state, and the errors an OPEN or a message meets.
"""

from smartgen.engine.prefill.control import DEFAULT_FLUSH_TIMEOUT_S, PrefillEngine
from smartgen.engine.prefill.decide import CHAIN_WINDOW_S, MAX_HINT_NOTICES, RUN_COST_S, query_blocks
from smartgen.engine.prefill.request import OpenedRequest, Overloaded, RequestGone

__all__ = [
    "PrefillEngine",
    "OpenedRequest",
    "RequestGone",
    "Overloaded",
    "DEFAULT_FLUSH_TIMEOUT_S",
    "RUN_COST_S",
    "MAX_HINT_NOTICES",
    "CHAIN_WINDOW_S",
    "query_blocks",
]
