"""The RDMA lane: two RC queue pairs per endpoint, set up over the authenticated TCP side channel.

The side channel (the TCP lane's handshake: shared secret, model, layout) carries LANE_INFO with
each end's queue pairs (QPN, PSN, LID, GID, MTU) and bounce-buffer size, REGION frames with each
region's address and rkey, the accept/revoke round trips and heartbeats. Everything else moves
through verbs:

- pushes: one ordered WRITE list on the MAIN queue pair, doorbell batches, selective signalling;
  RC delivers it in order, so no fence is needed between data and mask (`ordered = True`);
- messages (OPEN, FIRST_TOKEN, FETCH, IDLE, ...): SENDs on MAIN into the peer's bounce buffers,
  cut to fit them (messaging.py), so they are ordered with the WRITEs posted before them;
- fetch replies land in place (replies.py): the FETCH carries the sizes of the decode side's
  scatter lists; the prefill side sends a header on MAIN, then the reply's bytes on the REPLY
  queue pair cut at those sizes; the decode side, on the header, posts RECVs whose scatter lists
  are the pool rows (or a discard buffer when nobody waits any more) and delivers the reply once
  every RECV has completed, with meta["landed"] and no payload.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from smartgen.lanes.base import Landing, Message, MessageKind
from smartgen.lanes.framing import bytes_view
from smartgen.lanes.onesided import OneSidedLane, one_sided_factory
from smartgen.lanes.rdma.endpoint import Endpoint, MemoryHandle
from smartgen.lanes.rdma.gpu_memory import DeviceMR, gpudirect_status
from smartgen.lanes.rdma.handshake import QpRole, endpoint_infos, endpoint_meta
from smartgen.lanes.rdma.messaging import FrameAssembler, fragments, frame_parts
from smartgen.lanes.rdma.plan import SendQueue, Sge, plan_writes
from smartgen.lanes.rdma.replies import check_chunk_sizes, landing_chunks
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.transport import Segment, SourceCache, Transport, TransportError

__all__ = ["RdmaTransport", "RdmaLane", "rdma_lane", "rdma_lane_for", "BOUNCE_BYTES", "BOUNCES"]

log = logging.getLogger(__name__)
BOUNCE_BYTES = 64 * 1024  # one posted RECV on MAIN: a message longer than this arrives in several
BOUNCES = 64  # RECVs kept posted on MAIN (the receive queue's depth caps it)
SCATTER_IDS = 1 << 32  # receive wr_ids from here on are scatter RECVs on REPLY; below, bounce buffers
HOT_S = 0.005  # after any traffic the receive thread polls without sleeping this long (a reply follows a FETCH)
MAX_PLANS = 4096  # reply plans a prefill-side lane keeps for FETCHes not answered yet


class RdmaTransport(Transport):
    """Verbs on one endpoint: WRITE lists and SENDs (posting thread), bounce and scatter RECVs (receive thread)."""

    name = "rdma"
    ordered = True

    def __init__(
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        write_timeout_s: float = 30.0,
        endpoint: Endpoint | None = None,
        bounce_bytes: int = BOUNCE_BYTES,
        bounces: int = BOUNCES,
    ) -> None:
        self.write_timeout_s = write_timeout_s  # work not completed by then breaks the lane
        self.endpoint: Endpoint = endpoint if endpoint is not None else _verbs_endpoint(device, port, gid_index)
        limits = self.endpoint.limits
        self._queues = {role: SendQueue(limits.max_send_wr) for role in QpRole}
        self._send_ids = itertools.count(1)
        self.bounce_bytes = bounce_bytes
        self.fragment_bytes = bounce_bytes  # the peer's bounce size, once connected
        self._bounce = torch.empty(min(bounces, limits.max_send_wr) * bounce_bytes, dtype=torch.uint8)
        self._bounce_mr = self.endpoint.register(self._bounce.data_ptr(), self._bounce.numel())
        self._staging: tuple[torch.Tensor, MemoryHandle] | None = None
        self._discard: tuple[torch.Tensor, MemoryHandle] | None = None
        self._scatter_ids = itertools.count(SCATTER_IDS)
        self._scatter_backlog: deque[tuple[int, list[Sge]]] = deque()  # scatter RECVs the queue has no room for yet
        self._scatter_posted = 0
        self._closed = False

    # -- set-up ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {**endpoint_meta(self.endpoint.qp_infos()), "bounce_bytes": self.bounce_bytes}

    def connect(self, peer: dict[str, Any]) -> None:
        bounce = peer.get("bounce_bytes")
        if not isinstance(bounce, int) or bounce < 256:
            raise TransportError(f"peer sent a bounce-buffer size of {bounce!r}")
        self.endpoint.connect(endpoint_infos(peer))
        self.fragment_bytes = bounce
        count = self._bounce.numel() // self.bounce_bytes
        self.endpoint.post_recvs(QpRole.MAIN, [(i, [self._bounce_sge(i)]) for i in range(count)])

    @classmethod
    def registers_device_memory(cls, device: torch.device) -> bool:
        return device.type == "cuda" and bool(gpudirect_status(device.index or 0).routes)

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        # CUDA memory: GPUDirect RDMA, the NIC reaches GPU memory itself (gpu_memory.py)
        device_index = (tensor.device.index or 0) if tensor.device.type == "cuda" else None
        mr = self.endpoint.register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_index)
        return mr, mr.rkey

    def region_address(self, handle: Any, tensor: torch.Tensor) -> int:
        return handle.address(tensor.data_ptr()) if isinstance(handle, DeviceMR) else tensor.data_ptr()

    def deregister(self, handle: Any) -> None:
        handle.close()

    # -- the posting thread: WRITEs and SENDs -----------------------------------------------
    def write(self, segments: Sequence[Segment]) -> None:
        keyed = [s._replace(src_key=s.src_key.lkey) for s in segments]
        first = next(self._send_ids)
        batches = plan_writes(keyed, self.endpoint.limits, first)
        count = sum(len(b) for b in batches)
        self._send_ids = itertools.count(first + count)
        deadline = time.monotonic() + self.write_timeout_s
        queue = self._queues[QpRole.MAIN]
        for batch in batches:
            while not queue.fits(batch):
                self._retire(deadline)
            self.endpoint.post_writes(batch)
            queue.posted(batch)
        self._drain(deadline)  # the list's last WRITE is signalled: this returns once all have landed

    def send(self, role: QpRole, parts: Sequence[memoryview], sizes: Sequence[int] | None = None) -> None:
        """SENDs the concatenation of `parts` on `role`, cut at `sizes` (one peer RECV each) or at the peer's
        bounce size; returns once every SEND has completed (the peer has the bytes)."""
        total = sum(p.nbytes for p in parts)
        cuts = list(sizes) if sizes is not None else fragments(total, self.fragment_bytes)
        if sum(cuts) != total:
            raise ValueError(f"SEND sizes add up to {sum(cuts)} bytes, not {total}")
        staging, mr = self._staging_for(total)
        view = bytes_view(staging)
        offset = 0
        for part in parts:
            view[offset : offset + part.nbytes] = part.cast("B")
            offset += part.nbytes
        deadline = time.monotonic() + self.write_timeout_s
        queue = self._queues[role]
        offset = 0
        for size in cuts:
            while queue.in_use >= queue.depth:
                self._retire(deadline)
            wr_id = next(self._send_ids)
            self.endpoint.post_send(role, [Sge(staging.data_ptr() + offset, size, mr.lkey)], wr_id)
            queue.posted_ids([wr_id])
            offset += size
        self._drain(deadline)

    def _staging_for(self, size: int) -> tuple[torch.Tensor, MemoryHandle]:
        """A registered send buffer of at least `size` bytes, grown (and registered again) when too small."""
        if self._staging is None or self._staging[0].numel() < size:
            if self._staging is not None:
                self._staging[1].close()
            buffer = torch.empty(max(size, 2 * self.bounce_bytes), dtype=torch.uint8)
            self._staging = (buffer, self.endpoint.register(buffer.data_ptr(), buffer.numel()))
        return self._staging

    def _drain(self, deadline: float) -> None:
        while any(q.in_use for q in self._queues.values()):
            self._retire(deadline)

    def _retire(self, deadline: float) -> None:
        for wr_id in self.endpoint.poll_send():
            for queue in self._queues.values():
                if queue.holds(wr_id):
                    queue.completed(wr_id)
                    break
        if time.monotonic() > deadline:
            raise TransportError(f"RDMA work not completed after {self.write_timeout_s:g} s")

    # -- the receive thread: bounce and scatter RECVs ----------------------------------------
    def _bounce_sge(self, index: int) -> Sge:
        return Sge(self._bounce.data_ptr() + index * self.bounce_bytes, self.bounce_bytes, self._bounce_mr.lkey)

    def take_bounce(self, index: int, length: int) -> bytes:
        """The bytes a completed bounce RECV holds; its buffer is posted again."""
        start = index * self.bounce_bytes
        data = bytes(bytes_view(self._bounce[start : start + length]))
        self.endpoint.post_recvs(QpRole.MAIN, [(index, [self._bounce_sge(index)])])
        return data

    def post_scatter(self, chunks: Sequence[Sequence[Sge]]) -> list[int]:
        """RECVs on REPLY, one per scatter list, in order; returns their wr_ids. Those past the receive queue's
        depth wait and are posted as earlier ones complete (`scatter_done`): the SENDs they are for wait too."""
        recvs = [(next(self._scatter_ids), list(chunk)) for chunk in chunks]
        self._scatter_backlog.extend(recvs)
        self._post_backlog()
        return [wr_id for wr_id, _ in recvs]

    def scatter_done(self) -> None:
        """A scatter RECV completed: its place in the receive queue takes the next one waiting."""
        self._scatter_posted -= 1
        self._post_backlog()

    def _post_backlog(self) -> None:
        room = self.endpoint.limits.max_send_wr - self._scatter_posted
        if room > 0 and self._scatter_backlog:
            batch = [self._scatter_backlog.popleft() for _ in range(min(room, len(self._scatter_backlog)))]
            self.endpoint.post_recvs(QpRole.REPLY, batch)
            self._scatter_posted += len(batch)

    def discard_chunks(self, sizes: Sequence[int]) -> list[list[Sge]]:
        """Scatter lists that drop a reply of these SEND sizes (a reply nobody waits for)."""
        largest = max(sizes)
        if self._discard is None or self._discard[0].numel() < largest:
            if self._discard is not None:
                self._discard[1].close()
            buffer = torch.empty(largest, dtype=torch.uint8)
            self._discard = (buffer, self.endpoint.register(buffer.data_ptr(), buffer.numel()))
        buffer, mr = self._discard
        return [[Sge(buffer.data_ptr(), size, mr.lkey)] for size in sizes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.endpoint.close()  # first: nothing lands in, or is read from, the buffers freed below
        for held in (self._staging, self._discard):
            if held is not None:
                held[1].close()
        self._bounce_mr.close()


def _verbs_endpoint(device: str | None, port: int | None, gid_index: int | None) -> Endpoint:
    from smartgen.lanes.rdma.verbs import VerbsEndpoint

    return VerbsEndpoint(device, port, gid_index)


@dataclass(slots=True)
class _Reply:
    """A fetch reply being received: its header, and the scatter RECVs not completed yet."""

    message: Message
    sizes: list[int]
    wanted: bool  # a fetch of ours waits for it (else it is dropped once its bytes are in)
    landed: bool  # into the asked rows; False: into the discard buffer
    waiting: dict[int, int] = field(default_factory=dict)  # wr_id -> size expected
    short: bool = False  # a RECV got fewer bytes than its size


class RdmaLane(OneSidedLane):
    """A one-sided lane whose messages and fetch replies also move through verbs (see the module docstring)."""

    transport: RdmaTransport
    lands_replies = True

    def __init__(self, sock: Any, transport: RdmaTransport, name: str, *args: Any, **kwargs: Any) -> None:
        # set before the base class starts the side channel's threads
        self._assembler = FrameAssembler()
        self._landings: dict[tuple[str, int], tuple[list[list[Sge]], list[int]]] = {}
        self._landing_open: set[str] = set()
        self._scattering: dict[str, int] = defaultdict(int)  # request -> replies landing in its rows now
        self._landing_lock = threading.Condition()
        self._landing_keys = SourceCache(transport)  # registrations of the regions replies land in
        self._plans: OrderedDict[tuple[str, int], list[int]] = OrderedDict()  # prefill side: FETCH -> sizes
        self._plans_lock = threading.Lock()
        self._replies: dict[int, _Reply] = {}  # scatter wr_id -> its reply
        self._ordered: deque[Message | _Reply] = deque()  # received, not yet delivered (a reply is landing)
        self._wake = threading.Event()
        self._verbs_closed = threading.Event()  # set once the queue pairs are gone: nothing can land any more
        super().__init__(sock, transport, name, *args, **kwargs)
        thread = threading.Thread(target=self._verbs_loop, name=f"{name}-verbs-rx", daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- sending ----------------------------------------------------------------------------
    def send(self, message: Message, *, tag: str = "control", landing: Landing | None = None) -> None:
        if landing is not None and message.kind == MessageKind.FETCH and not self._closed.is_set():
            limits = self.transport.endpoint.limits
            chunks, sizes = landing_chunks(landing.ranges, self._locate, limits.max_sge, limits.max_msg_bytes)
            if sizes:
                key = (message.request_id, int(message.meta["fetch_id"]))
                with self._landing_lock:
                    self._landings[key] = (chunks, sizes)
                    self._landing_open.add(landing.request_id)
                message = Message(
                    message.kind, message.request_id, {**message.meta, "reply_chunks": sizes}, message.payload
                )
        self._wake.set()  # a reply will follow: poll hot
        super().send(message, tag=tag)

    def _locate(self, region: torch.Tensor) -> tuple[int, int]:
        """Where a landing region starts as the NIC addresses it, and its lkey (registered on first use)."""
        handle = self._landing_keys.key_for(region)
        return self.transport.region_address(handle, region), handle.lkey

    def drop_landings(self, request_id: str) -> None:
        """Stops replies landing in this request's rows; waits for those landing now (past the confirm timeout it
        closes the lane: queue pairs that are gone land nothing)."""
        deadline = time.monotonic() + self.confirm_timeout_s
        with self._landing_lock:
            self._landing_open.discard(request_id)
            for key in [k for k in self._landings if k[0] == request_id]:
                del self._landings[key]
            while self._scattering.get(request_id, 0) and not self._verbs_closed.is_set():
                if time.monotonic() > deadline:
                    break
                self._landing_lock.wait(0.05)
            else:
                self._scattering.pop(request_id, None)
                return
        self.error = f"a fetch reply of {request_id!r} did not finish landing"
        self.close()
        self._verbs_closed.wait(self.confirm_timeout_s)

    def _post(self, item: object) -> None:
        if isinstance(item, Message) and not self._closed.is_set():
            self._send_message(item)
        else:
            super()._post(item)

    def _send_message(self, message: Message) -> None:
        sizes = None
        if message.kind == MessageKind.FETCH_REPLY:
            with self._plans_lock:
                sizes = self._plans.pop((message.request_id, int(message.meta.get("fetch_id", -1))), None)
        if sizes is None or sum(sizes) != message.payload_bytes:
            self.transport.send(QpRole.MAIN, frame_parts(message))  # whole, through the peer's bounce buffers
            return
        header = Message(message.kind, message.request_id, {**message.meta, "scatter": sizes})
        self.transport.send(QpRole.MAIN, frame_parts(header))
        parts = [bytes_view(t.detach().contiguous().cpu()) for t in message.payload.values()]
        self.transport.send(QpRole.REPLY, parts, sizes)

    # -- receiving --------------------------------------------------------------------------
    def _verbs_loop(self) -> None:
        idle_since = time.monotonic()
        try:
            while not self._closed.is_set():
                done = self.transport.endpoint.poll_recv(32)
                if done:
                    for wr_id, length in done:
                        self._on_recv(wr_id, length)
                    idle_since = time.monotonic()
                    continue
                if self._wake.is_set():
                    self._wake.clear()
                    idle_since = time.monotonic()
                idle = time.monotonic() - idle_since
                if idle < HOT_S:
                    time.sleep(0)
                else:  # idle: back off to at most 1 ms, woken at once when this end sends
                    self._wake.wait(min(0.001, idle / 10))
        except (TransportError, ConnectionError, ValueError, KeyError) as exc:
            self._on_broken(f"rdma: {exc}")
        except Exception as exc:  # a bug must close the lane with its reason, not kill a thread silently
            log.exception("%s: receive thread failed", self.name)
            self._on_broken(f"rdma: {type(exc).__name__}: {exc}")

    def _on_recv(self, wr_id: int, length: int) -> None:
        if wr_id < SCATTER_IDS:
            for message in self._assembler.feed(self.transport.take_bounce(wr_id, length)):
                self._on_message(message)
            return
        self.transport.scatter_done()
        reply = self._replies.pop(wr_id)
        if length != reply.waiting.pop(wr_id):
            reply.short = True
        if not reply.waiting:
            self._reply_done(reply)

    def _on_message(self, message: Message) -> None:
        if message.kind == MessageKind.FETCH and "reply_chunks" in message.meta:
            sizes = check_chunk_sizes(message.meta["reply_chunks"])
            with self._plans_lock:
                self._plans[(message.request_id, int(message.meta.get("fetch_id", -1)))] = sizes
                while len(self._plans) > MAX_PLANS:
                    self._plans.popitem(last=False)
        if message.kind == MessageKind.FETCH_REPLY and "scatter" in message.meta:
            self._start_reply(message, check_chunk_sizes(message.meta["scatter"]))
        elif self._ordered:
            self._ordered.append(message)  # behind a reply still landing: messages keep their order
        else:
            self._inbox.put(message)

    def _start_reply(self, message: Message, sizes: list[int]) -> None:
        """Posts the RECVs a reply's bytes land in: the rows asked for while its request still takes them."""
        key = (message.request_id, int(message.meta.get("fetch_id", -1)))
        with self._landing_lock:
            asked = self._landings.pop(key, None)
            landed = asked is not None and asked[1] == sizes and message.request_id in self._landing_open
            if landed:
                self._scattering[message.request_id] += 1
        chunks = asked[0] if landed and asked is not None else self.transport.discard_chunks(sizes)
        reply = _Reply(message, sizes, wanted=asked is not None, landed=landed)
        wr_ids = self.transport.post_scatter(chunks)
        reply.waiting = dict(zip(wr_ids, sizes))
        for wr_id in wr_ids:
            self._replies[wr_id] = reply
        self._ordered.append(reply)

    def _reply_done(self, reply: _Reply) -> None:
        if reply.landed:
            with self._landing_lock:
                self._scattering[reply.message.request_id] -= 1
                self._landing_lock.notify_all()
        message = reply.message
        meta = {k: v for k, v in message.meta.items() if k != "scatter"}
        if reply.landed and not reply.short:
            meta["landed"] = sum(reply.sizes)
        # a short or misplaced reply goes on without payload or "landed": the engine fails that fetch
        reply.message = Message(message.kind, message.request_id, meta)
        reply.waiting = {}
        while self._ordered:
            head = self._ordered[0]
            if isinstance(head, _Reply) and head.waiting:
                break
            self._ordered.popleft()
            if isinstance(head, Message):
                self._inbox.put(head)
            elif head.wanted:
                self._inbox.put(head.message)

    def _release_registrations(self) -> None:
        super()._release_registrations()
        self._landing_keys.clear()

    def close(self) -> None:
        first = not self._closed.is_set()
        super().close()  # returns at once when another thread is closing: only that one says the QPs are gone
        if first:
            self._verbs_closed.set()
            with self._landing_lock:
                self._landing_lock.notify_all()


def rdma_lane_for(
    options: RdmaOptions, endpoint: Callable[[], Endpoint] | None = None, **transport_options: Any
) -> Callable[..., OneSidedLane]:
    """A lane factory for TcpListener/tcp_connect on the asked device, port and GID index: verbs for WRITEs,
    messages and fetch replies, the authenticated socket as the side channel. `endpoint` makes the verbs endpoint
    instead (the tests' software endpoint)."""
    return one_sided_factory(
        lambda sock, timeouts: RdmaTransport(
            options.device,
            options.port,
            options.gid_index,
            write_timeout_s=timeouts.write_s,
            endpoint=endpoint() if endpoint is not None else None,
            **transport_options,
        ),
        lane_class=RdmaLane,
    )


rdma_lane = rdma_lane_for(RdmaOptions())  # everything chosen automatically
