"""The decode side of the transfer engine: KV pool, masks, and the parallel local/remote fetch.

A request on the decode node:
1. `open()`: a pool slot is taken (its masks say remote, padding 0), the push lane accepts
   writes for it, a prefill node is chosen (least loaded) and OPEN is sent.
2. Prefilling: proactive blocks land and their mask entries turn 1; `wait_first_token()`
   returns FIRST_TOKEN. Under full transfer `wait_all_local()` blocks until every block landed.
   `stall()` says whether nothing has arrived for it (nor for the requests ahead of it on its link) for a bound.
3. Decoding, per step and layer: `begin_layer()` sends the idle notice (speculative
   policies); `assemble()` splits the selector's index by the mask, gathers local entries
   while the remote ones are fetched, lands fetched tokens in the pool (mask 1, so they are
   never fetched twice) and returns the selected KV (a drop_remote policy, proactive-only,
   fetches nothing: remote entries count as padding); `append()` adds the new token's K/V.
4. Fully local: `end_step()` sends RELEASE once every block is local.
5. `finish()` / `abort()`: the lane stops accepting writes for the request, its slot is
   freed, and RELEASE / ABORT goes to the prefill node if it was not sent yet.
A prefill node lost (its link closed: dead, silent past its lease, or misbehaving): the link
leaves the list at once, so no new request picks it; requests that still needed it fail with
the reason (or, with `recompute`, they are opened again on another prefill node, telling it which
tokens are already local: a request that was decoding waits outside the batch, parked, until the new
node has prefilled, then fetches what it lacks); requests already fully local go on. Inside a decode
step a failed request is only marked, never raised, so the step completes for the rest of the batch
(see DecodeDriver).

Split by concern, as vLLM's KV connector splits a scheduler side from a worker side:
- decide.py: pure per-step decisions from the policy flags (read once): notices, hints, prefetch, the
  assembly of a selection (which entries are fetched, dropped, gathered early);
- move.py: the data path (`DecodePath`): pool, fetches posted and landed, the selected KV gathered;
- control.py: `DecodeControl`, links, leases and failures (a lost prefill node, stalled and parked requests);
- progress.py: what of a request's KV has arrived and when (the first-token bound fails a request on no progress);
- engine.py: `DecodeEngine`, the request's life listed above, on top of the other two;
- request.py: a request's state, and the errors it fails with.
"""

from smartgen.engine.decode.decide import CHAINED_NOTICE_LAYERS
from smartgen.engine.decode.engine import DecodeEngine
from smartgen.engine.decode.progress import Stall
from smartgen.engine.decode.request import Assembled, LinkLost, RequestFailed

__all__ = ["DecodeEngine", "Assembled", "RequestFailed", "LinkLost", "Stall", "CHAINED_NOTICE_LAYERS"]
