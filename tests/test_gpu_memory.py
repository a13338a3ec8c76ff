"""How the RDMA lane registers GPU memory (GPUDirect RDMA), and one-sided lanes refusing device memory they cannot
register. No GPU, CUDA driver or RDMA device here: routes are decided from a fake sysfs tree, the verbs and the
driver are fakes that record their calls, and the refused region is a tensor on PyTorch's `meta` device."""

import os
import types
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from hypothesis import given
from hypothesis import strategies as st
from test_onesided_slots import MemcpyTransport

from smartgen.lanes.onesided import one_sided_factory
from smartgen.lanes.rdma import gpu_memory
from smartgen.lanes.rdma import lane as rdma_lane
from smartgen.lanes.rdma.gpu_memory import (
    DMA_BUF,
    PEER_MEMORY,
    DeviceMR,
    GpuDirect,
    page_span,
    register_device_memory,
    routes_from,
)
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.transport import DeviceMemoryUnsupported, TransportError
from smartgen.sysinfo import collect_info


def _sysfs(tmp_path: Path, *modules: str) -> Path:
    for name in modules:
        (tmp_path / "module" / name).mkdir(parents=True)
    (tmp_path / "module" / "mlx5_ib").mkdir(parents=True, exist_ok=True)  # an unrelated module changes nothing
    return tmp_path


@pytest.mark.parametrize("module", ["nvidia_peermem", "nv_peer_mem"])
def test_a_loaded_peer_memory_module_is_a_route(tmp_path, module):
    status = routes_from(_sysfs(tmp_path, module), None, "the GPU driver exports no dma-bufs")
    assert status.routes == (PEER_MEMORY,)
    assert status.reason == f"peer-memory ({module} loaded) (not dma-buf: the GPU driver exports no dma-bufs)"


def test_no_module_and_no_dmabuf_is_no_route_with_both_reasons(tmp_path):
    status = routes_from(_sysfs(tmp_path), None, "the GPU driver exports no dma-bufs")
    assert status.routes == ()
    assert "no nvidia_peermem or nv_peer_mem kernel module loaded" in status.reason
    assert "dma-buf: the GPU driver exports no dma-bufs" in status.reason and status.reason.startswith("none")


def test_both_routes_put_peer_memory_first(tmp_path):
    assert routes_from(_sysfs(tmp_path, "nvidia_peermem"), None, None).routes == (PEER_MEMORY, DMA_BUF)
    assert routes_from(_sysfs(tmp_path / "other"), None, None) == GpuDirect(
        (DMA_BUF,), "dma-buf (not peer-memory: no nvidia_peermem or nv_peer_mem kernel module loaded)"
    )


def test_a_gpu_that_cannot_take_gpudirect_writes_has_no_route_whatever_is_loaded(tmp_path):
    status = routes_from(_sysfs(tmp_path, "nvidia_peermem"), "no CUDA driver (libcuda.so.1 not found)", None)
    assert status == GpuDirect((), "none (no CUDA driver (libcuda.so.1 not found))")


@given(st.integers(0, 2**48), st.integers(1, 2**30), st.sampled_from([4096, 65536]))
def test_the_page_span_is_the_fewest_whole_pages_covering_the_range(addr, length, page):
    span = page_span(addr, length, page)
    assert span.start % page == 0 and span.length % page == 0
    assert span.start <= addr and addr + length <= span.start + span.length
    assert span.start + page > addr and span.start + span.length - page < addr + length
    assert span.offset == addr - span.start


class _FakeVerbs:
    """pyverbs.mr's MR and DmaBufMR as far as registration goes: they record their arguments."""

    def __init__(self, failing: str = "") -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.failing = failing

    def _mr(self, kind: str, *args, **kwargs):
        self.calls.append((kind, args, kwargs))
        if kind == self.failing:
            raise RuntimeError(f"{kind} refused")
        return types.SimpleNamespace(lkey=11, rkey=22, close=lambda: None)

    def MR(self, *args, **kwargs):
        return self._mr("MR", *args, **kwargs)

    def DmaBufMR(self, *args, **kwargs):
        return self._mr("DmaBufMR", *args, **kwargs)


@pytest.fixture
def routes(monkeypatch):
    """Sets the routes this host has; a DMA-BUF export hands out a real descriptor (checked closed afterwards)."""
    exported: list[tuple[int, object]] = []

    def export(span):
        read_end, write_end = os.pipe()
        os.close(write_end)
        exported.append((read_end, span))
        return read_end

    monkeypatch.setattr(gpu_memory, "_dmabuf_fd", export)

    def use(*names: str) -> list:
        monkeypatch.setattr(gpu_memory, "gpudirect_status", lambda index=0: GpuDirect(names, "fake"))
        return exported

    return use


def test_peer_memory_registers_the_pointer_itself(routes):
    routes(PEER_MEMORY, DMA_BUF)
    verbs = _FakeVerbs()
    mr = register_device_memory("pd", verbs, 0x7F0000001234, 1000, 7)
    assert verbs.calls == [("MR", ("pd", 1000, 7), {"address": 0x7F0000001234})]
    assert (mr.route, mr.lkey, mr.rkey) == (PEER_MEMORY, 11, 22)
    assert mr.address(0x7F0000001234 + 40) == 0x7F0000001234 + 40


def test_dmabuf_exports_whole_pages_and_addresses_the_mr_from_its_offset(routes):
    exported = routes(DMA_BUF)
    verbs = _FakeVerbs()
    addr = 0x7F0000003000 + 100
    mr = register_device_memory("pd", verbs, addr, 5000, 7)
    [(fd, span)] = exported
    assert span == page_span(addr, 5000) and span.offset == 100
    assert verbs.calls == [("DmaBufMR", ("pd", 5000, 7), {"dmabuf": fd, "offset": 100})]
    with pytest.raises(OSError):  # our descriptor is closed: the MR holds the dma-buf
        os.fstat(fd)
    # pyverbs registers with iova = offset: the range's first byte is `offset` to a work request
    assert mr.route == DMA_BUF and mr.address(addr) == 100 and mr.address(addr + 64) == 164


def test_a_route_that_fails_gives_way_to_the_next_and_all_failing_say_why(routes):
    routes(PEER_MEMORY, DMA_BUF)
    assert register_device_memory("pd", _FakeVerbs(failing="MR"), 4096, 64, 7).route == DMA_BUF
    routes(PEER_MEMORY)
    with pytest.raises(TransportError, match="peer-memory: MR refused"):
        register_device_memory("pd", _FakeVerbs(failing="MR"), 4096, 64, 7)
    routes()
    with pytest.raises(TransportError, match="no GPUDirect RDMA route: fake"):
        register_device_memory("pd", _FakeVerbs(), 4096, 64, 7)


class _FakeDriver:
    """libcuda as far as the checks go: every call succeeds; device attributes by number (116 GPUDirect RDMA
    supported, 118 its write ordering, 124 dma-buf supported)."""

    def __init__(self, **attributes: int) -> None:
        self.attributes = {116: 1, 118: 100, 124: 1} | {int(k[1:]): v for k, v in attributes.items()}
        self.cuMemGetHandleForAddressRange = object()

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, device, index):
        return 0

    def cuDeviceGetAttribute(self, value, attribute, device):
        value._obj.value = self.attributes[attribute]  # value is ctypes.byref(c_int)
        return 0


@pytest.mark.parametrize(
    "attributes, device_says, dmabuf_says",
    [
        ({}, None, None),
        ({"a124": 0}, None, "exports no dma-bufs"),
        ({"a116": 0}, "does not support GPUDirect RDMA", None),
        ({"a118": 0}, "does not order GPUDirect RDMA writes", None),  # A100-class: needs a flush we do not do
    ],
)
def test_the_driver_checks_say_what_stops_each_route(monkeypatch, attributes, device_says, dmabuf_says):
    monkeypatch.setattr(gpu_memory, "_driver", lambda: _FakeDriver(**attributes))
    problem = gpu_memory.device_problem()
    if device_says is not None:
        assert problem is not None and device_says in problem
        return
    assert problem is None
    said = gpu_memory.dmabuf_problem()
    if dmabuf_says is None:  # the venv may lack Debian's pyverbs
        assert said in (None, "pyverbs is not installed")
    else:
        assert said is not None and dmabuf_says in said


def test_no_cuda_driver_is_no_route(monkeypatch):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(gpu_memory, "_driver", missing)
    assert gpu_memory.device_problem() == "no CUDA driver (libcuda.so.1 not found)"


def test_the_rdma_transport_registers_device_memory_only_with_a_route(monkeypatch):
    monkeypatch.setattr(rdma_lane, "gpudirect_status", lambda index=0: GpuDirect((DMA_BUF,), "fake"))
    assert rdma_lane.RdmaTransport.registers_device_memory(torch.device("cuda", 1))
    assert not rdma_lane.RdmaTransport.registers_device_memory(torch.device("cpu"))
    monkeypatch.setattr(rdma_lane, "gpudirect_status", lambda index=0: GpuDirect((), "fake"))
    assert not rdma_lane.RdmaTransport.registers_device_memory(torch.device("cuda", 1))


def test_the_rdma_transport_advertises_a_dmabuf_regions_own_addresses():
    transport = object.__new__(rdma_lane.RdmaTransport)  # no verbs endpoint needed for this
    tensor = torch.zeros(16, dtype=torch.uint8)
    assert transport.region_address(object(), tensor) == tensor.data_ptr()
    mr = DeviceMR(types.SimpleNamespace(), DMA_BUF, tensor.data_ptr(), 300)
    assert transport.region_address(mr, tensor) == 300


class _DeviceTransport(MemcpyTransport):
    """A transport that takes device memory and addresses its registrations from 4096."""

    @classmethod
    def registers_device_memory(cls, device: torch.device) -> bool:
        return True

    def region_address(self, handle, tensor) -> int:
        return 4096 + tensor.data_ptr()


@pytest.mark.parametrize("transport", [MemcpyTransport, _DeviceTransport])
def test_a_one_sided_lane_registers_device_memory_only_where_its_transport_can(transport):
    writer, owner = loopback_tcp_link(lane_factory=one_sided_factory(lambda sock, timeouts: transport()))
    try:
        region = torch.empty(64, dtype=torch.uint8, device="meta")  # not host memory, and no GPU needed
        if transport is MemcpyTransport:
            with pytest.raises(DeviceMemoryUnsupported, match="cannot register meta memory here .*stage the pool"):
                owner.push.register_region("k", region)
            return
        owner.push.register_region("k", region)
        # the writer addresses the region as the owner's transport says (an RDMA DMA-BUF MR: from its offset)
        addr, length, _ = wait_until(lambda: writer.push._peer_regions.get("k"), 10, "the REGION frame")
        assert (addr, length) == (4096 + region.data_ptr(), 64)
    finally:
        writer.close()
        owner.close()


def test_info_reports_the_gpudirect_routes(monkeypatch):
    monkeypatch.setattr(gpu_memory, "gpudirect_status", lambda index=0: GpuDirect((PEER_MEMORY,), "peer ok"))
    assert collect_info()["gpudirect"] == {"routes": [PEER_MEMORY], "status": "peer ok"}
