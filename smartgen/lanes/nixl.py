"""NIXL as a one-sided transport: one agent per endpoint (UCX backend), host memory, WRITE transfers.

The endpoints swap agent metadata in LANE_INFO; every REGION frame carries the owner's fresh
metadata too, since NIXL learns a peer's registrations from it. Writes are one
`initialize_xfer("WRITE")` per run, polled to DONE. UCX picks its transports from the
environment: `UCX_TLS=tcp,self` on a machine without RDMA, its defaults on a cluster.

Each agent's progress thread (it lands the peer's writes: UCX over TCP needs the target to
progress) waits for UCX events instead of polling without pause, and ends when the lane closes.
"""

from __future__ import annotations

import base64
import importlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from smartgen.lanes.extras import require
from smartgen.lanes.onesided import one_sided_factory
from smartgen.lanes.transport import Segment, Transport, TransportError

__all__ = ["NixlTransport", "nixl_lane", "PROGRESS_WAIT_US"]

log = logging.getLogger(__name__)
# The progress thread sleeps until UCX signals work, and progresses anyway after this long (NIXL's guard against a
# missed wake-up). nixl_agent fixes it at 0, a thread that never sleeps: a core per agent, one agent per lane endpoint.
PROGRESS_WAIT_US = 1000


class NixlTransport(Transport):
    """One NIXL agent per endpoint."""

    name = "nixl"

    @staticmethod
    def probe() -> Any:
        """The nixl._api module, or MissingExtra naming the extra."""
        return require("nixl._api", "nixl")

    def __init__(self, backend: str = "UCX", write_timeout_s: float = 30.0) -> None:
        api = self.probe()
        self.write_timeout_s = write_timeout_s  # a write list not DONE by then breaks the lane
        self.agent_name = f"smartgen-{uuid.uuid4().hex[:12]}"
        self._agent: Any = _agent(api, self.agent_name, backend)
        self._peer: str | None = None
        self._registrations: dict[int, Any] = {}

    @property
    def _live(self) -> Any:
        """The agent; TransportError once closed (a lane thread may still be finishing)."""
        if self._agent is None:
            raise TransportError("NIXL transport is closed")
        return self._agent

    def _metadata(self) -> str:
        return base64.b64encode(self._live.get_agent_metadata()).decode()

    def info(self) -> dict[str, Any]:
        return {"agent": self.agent_name, "metadata": self._metadata()}

    def connect(self, peer: dict[str, Any]) -> None:
        self._peer = self._live.add_remote_agent(base64.b64decode(peer["metadata"])).decode()

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        addr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        try:
            self._registrations[addr] = self._live.register_memory([(addr, size, 0, "")], "DRAM")
        except Exception as exc:  # nixl raises its own exception classes
            raise TransportError(f"NIXL register_memory failed: {exc}") from exc
        return addr, self._metadata()

    def peer_region(self, key: Any) -> Any:
        self._live.add_remote_agent(base64.b64decode(key))  # the peer's metadata now includes the region
        return None

    def deregister(self, handle: Any) -> None:
        registration = self._registrations.pop(handle, None)
        if registration is not None:
            self._live.deregister_memory(registration)

    def write(self, segments: Sequence[Segment]) -> None:
        agent = self._live
        if self._peer is None:
            raise TransportError("NIXL transport is not connected")
        try:
            local = agent.get_xfer_descs([(s.src_addr, s.length, 0) for s in segments], "DRAM")
            remote = agent.get_xfer_descs([(s.dst_addr, s.length, 0) for s in segments], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, self._peer)
        except Exception as exc:
            raise TransportError(f"NIXL could not set up a write of {len(segments)} segments: {exc}") from exc
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.write_timeout_s
            spins = 0
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                spins += 1
                if spins > 64:  # spin briefly for small writes, then stop burning a shared core
                    time.sleep(20e-6)
                if time.monotonic() > deadline:
                    raise TransportError(f"NIXL write to {self._peer} still running after {self.write_timeout_s:g} s")
            if state != "DONE":
                raise TransportError(f"NIXL write to {self._peer} ended in state {state}")
        finally:
            agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Drops the registrations and the peer, then the agent itself: its progress thread ends now, not when the
        garbage collector gets to it (a closed lane's agent kept polling until then)."""
        if self._agent is None:
            return
        for handle in list(self._registrations):
            self.deregister(handle)
        if self._peer is not None:
            try:
                self._agent.remove_remote_agent(self._peer)
            except Exception:  # the agent may already have dropped it
                pass
        self._agent = None  # a call still running holds its own reference: the agent goes when it returns


def _agent(api: Any, name: str, backend: str) -> Any:
    """A NIXL agent with `backend` whose progress thread waits PROGRESS_WAIT_US for events, safe to call from several
    threads (the lane writes from one while another reads the peer's metadata; NIXL's default sync mode locks
    nothing). nixl_agent takes no such wait, so the wrapper is built without backends, given a native agent
    configured with it, then the backend; with a wrapper unlike nixl 1.5's, a plain agent (it polls without pause)."""
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[], sync_mode=sync))
    try:
        bindings = importlib.import_module("nixl._bindings")
        config = bindings.nixlAgentConfig()
        config.useProgThread, config.useListenThread, config.captureTelemetry = True, False, False
        config.syncMode, config.pthrDelay = sync.value, PROGRESS_WAIT_US
        if not hasattr(agent, "agent"):
            raise AttributeError("nixl_agent keeps no native agent in .agent")
        agent.agent = bindings.nixlAgent(name, config)
    except (ImportError, AttributeError, TypeError) as exc:
        log.warning("NIXL agent without a waiting progress thread (%s): it polls without pause", exc)
        return api.nixl_agent(name, api.nixl_agent_config(backends=[backend], sync_mode=sync))
    agent.create_backend(backend)
    return agent


# a lane factory for TcpListener/tcp_connect: NIXL for the writes, the authenticated socket as the side channel
nixl_lane = one_sided_factory(lambda sock, timeouts: NixlTransport(write_timeout_s=timeouts.write_s))
