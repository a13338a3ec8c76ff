"""How the RDMA lane registers CUDA memory: peer memory (nvidia_peermem) or a DMA-BUF, whichever this host offers.

Peer memory: with NVIDIA's `nvidia_peermem` (or the older `nv_peer_mem`) kernel module loaded,
`ibv_reg_mr` on a device pointer pins GPU pages like host ones. DMA-BUF: the CUDA driver
exports the range as a dma-buf file descriptor (`cuMemGetHandleForAddressRange`, whole host
pages) and `ibv_reg_dmabuf_mr` registers that; it needs NVIDIA's open kernel modules, rdma-core
v34+ and a NIC driver that takes dma-bufs. Either way the GPU must support GPUDirect RDMA and
order the NIC's writes for its own kernels: the decoder learns that data landed from a mask in
host memory and never flushes (`cuFlushGPUDirectRDMAWrites`) before reading it. What decides
is pure (`routes_from`, `page_span`); the driver and verbs calls are thin.

Addresses: a peer-memory MR is addressed by the pointers themselves. pyverbs' `DmaBufMR`
registers with iova = its offset into the dma-buf, so work requests address a DMA-BUF MR from
there: `DeviceMR.address(ptr)` gives the address a WRITE's remote_addr or an SGE must carry.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path
from typing import Any, NamedTuple

from smartgen.lanes.transport import TransportError

__all__ = [
    "PEER_MEMORY",
    "DMA_BUF",
    "GpuDirect",
    "PageSpan",
    "DeviceMR",
    "peer_module",
    "routes_from",
    "page_span",
    "device_problem",
    "dmabuf_problem",
    "gpudirect_status",
    "register_device_memory",
]

PEER_MEMORY = "peer-memory"
DMA_BUF = "dma-buf"
# NVIDIA's module (in the driver package since R470), then Mellanox's older out-of-tree one
PEER_MODULES = ("nvidia_peermem", "nv_peer_mem")

_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116
_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118
_CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER = 100  # the GPU's own kernels see the NIC's writes in order
_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_CU_POINTER_ATTRIBUTE_CONTEXT = 1
_CUDA_ERROR_NO_DEVICE = 100


class GpuDirect(NamedTuple):
    """The routes by which the RDMA lane can register GPU memory here, preferred first, and why, in one line."""

    routes: tuple[str, ...]
    reason: str


class PageSpan(NamedTuple):
    """The whole host pages covering a byte range: what the driver exports as a dma-buf."""

    start: int  # the first page's address
    length: int  # bytes of whole pages
    offset: int  # where the range starts inside them


def peer_module(sys_root: Path) -> str | None:
    """The loaded peer-memory kernel module (a loaded module has /sys/module/NAME), or None."""
    return next((name for name in PEER_MODULES if (sys_root / "module" / name).is_dir()), None)


def routes_from(sys_root: Path, device_why_not: str | None, dmabuf_why_not: str | None) -> GpuDirect:
    """The routes given sysfs at `sys_root`, what stops the GPU from taking GPUDirect RDMA writes at all and what
    stops DMA-BUF (None: nothing does). Peer memory comes first where both work: an administrator loaded it on
    purpose, and its MRs are addressed by plain pointers."""
    if device_why_not is not None:
        return GpuDirect((), f"none ({device_why_not})")
    module = peer_module(sys_root)
    peer_why_not = None if module else f"no {' or '.join(PEER_MODULES)} kernel module loaded"
    found = {PEER_MEMORY: peer_why_not, DMA_BUF: dmabuf_why_not}
    routes = tuple(route for route, why_not in found.items() if why_not is None)
    missing = "; ".join(f"{route}: {why_not}" for route, why_not in found.items() if why_not is not None)
    if not routes:
        return GpuDirect((), f"none ({missing})")
    said = [f"peer-memory ({module} loaded)" if route == PEER_MEMORY else route for route in routes]
    return GpuDirect(routes, ", ".join(said) + (f" (not {missing})" if missing else ""))


def page_span(addr: int, length: int, page: int = mmap.PAGESIZE) -> PageSpan:
    """The host pages covering [addr, addr + length): the driver exports only page-aligned ranges."""
    start = addr - addr % page
    stop = -(-(addr + length) // page) * page
    return PageSpan(start, stop - start, addr - start)


class DeviceMR:
    """A verbs MR over GPU memory (`lkey`, `rkey`, `close` like pyverbs' MR) and how work requests address it."""

    __slots__ = ("mr", "route", "addr", "base")

    def __init__(self, mr: Any, route: str, addr: int, base: int) -> None:
        self.mr = mr
        self.route = route
        self.addr = addr  # the pointer registered
        self.base = base  # what work requests call that pointer: itself (peer memory) or its dma-buf offset

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        return self.mr.rkey

    def address(self, ptr: int) -> int:
        """The address a WRITE's remote_addr or an SGE gives `ptr` (inside the registered range)."""
        return self.base + (ptr - self.addr)

    def close(self) -> None:
        self.mr.close()


# -- thin calls: the CUDA driver (ctypes) and pyverbs -------------------------------------
@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise TransportError(f"{call} failed: CUresult {rc}")


def _attribute(device_index: int, attribute: int) -> int:
    """A device attribute of CUDA device `device_index`; TransportError when the driver cannot say."""
    cuda, device, value = _driver(), ctypes.c_int(), ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(device), device_index), f"cuDeviceGet({device_index})")
    _check(cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), f"cuDeviceGetAttribute({attribute})")
    return value.value


def device_problem(device_index: int = 0) -> str | None:
    """What stops this CUDA device from taking GPUDirect RDMA writes the decoder can read as they land, or None."""
    try:
        rc = _driver().cuInit(0)
    except OSError:
        return "no CUDA driver (libcuda.so.1 not found)"
    if rc:
        return "no CUDA device" if rc == _CUDA_ERROR_NO_DEVICE else f"cuInit failed (CUresult {rc})"
    try:
        if not _attribute(device_index, _CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED):
            return f"CUDA device {device_index} does not support GPUDirect RDMA"
        ordering = _attribute(device_index, _CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING)
    except TransportError as exc:
        return f"CUDA device {device_index}: {exc}"
    if ordering < _CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER:
        # the decoder would have to flush (cuFlushGPUDirectRDMAWrites) after reading a mask, before the data
        return f"CUDA device {device_index} does not order GPUDirect RDMA writes for its own kernels (no flush built)"
    return None


def dmabuf_problem(device_index: int = 0) -> str | None:
    """What stops the DMA-BUF route on a device that takes GPUDirect RDMA (the driver, then pyverbs), or None."""
    if not hasattr(_driver(), "cuMemGetHandleForAddressRange"):
        return "the CUDA driver predates 11.7 (no cuMemGetHandleForAddressRange)"
    try:
        if not _attribute(device_index, _CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED):
            return "the GPU driver exports no dma-bufs (it takes NVIDIA's open kernel modules and Linux 5.12+)"
    except TransportError as exc:
        return str(exc)
    try:
        import pyverbs.mr as mr_module
    except ImportError:
        return "pyverbs is not installed"
    if not hasattr(mr_module, "DmaBufMR"):
        return "this pyverbs has no DmaBufMR (it came with rdma-core v34)"
    return None


@functools.cache
def gpudirect_status(device_index: int = 0) -> GpuDirect:
    """The GPUDirect RDMA routes for this CUDA device on this host (asked once per process: modules and drivers do
    not change under a running node)."""
    problem = device_problem(device_index)
    return routes_from(Path("/sys"), problem, None if problem else dmabuf_problem(device_index))


def _dmabuf_fd(span: PageSpan) -> int:
    """A dma-buf file descriptor for the pages of `span`, exported by the driver in the memory's own context."""
    cuda = _driver()
    context, popped = ctypes.c_void_p(), ctypes.c_void_p()
    rc = cuda.cuPointerGetAttribute(ctypes.byref(context), _CU_POINTER_ATTRIBUTE_CONTEXT, ctypes.c_uint64(span.start))
    _check(rc, "cuPointerGetAttribute")
    _check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")  # this thread may have no current context
    try:
        fd = ctypes.c_int(-1)
        rc = cuda.cuMemGetHandleForAddressRange(
            ctypes.byref(fd),
            ctypes.c_uint64(span.start),
            ctypes.c_size_t(span.length),
            _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            ctypes.c_ulonglong(0),
        )
        _check(rc, "cuMemGetHandleForAddressRange")
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))
    return fd.value


def _register(route: str, pd: Any, mr_module: Any, addr: int, length: int, access: int) -> DeviceMR:
    if route == PEER_MEMORY:
        return DeviceMR(mr_module.MR(pd, length, access, address=addr), route, addr, addr)
    span = page_span(addr, length)
    fd = _dmabuf_fd(span)
    try:
        # pyverbs (rdma-core 34 to now): DmaBufMR(pd, length, access, dmabuf=fd, offset) registers with iova = offset
        mr = mr_module.DmaBufMR(pd, length, access, dmabuf=fd, offset=span.offset)
    finally:
        os.close(fd)  # the MR holds the dma-buf itself
    return DeviceMR(mr, route, addr, span.offset)


def register_device_memory(
    pd: Any, mr_module: Any, addr: int, length: int, access: int, device_index: int = 0
) -> DeviceMR:
    """Registers [addr, addr + length) of CUDA memory with the verbs (`mr_module`: pyverbs.mr) by the first route
    that works here; TransportError says why none did."""
    status = gpudirect_status(device_index)
    if not status.routes:
        raise TransportError(f"cannot register GPU memory for RDMA: no GPUDirect RDMA route: {status.reason}")
    failures = []
    for route in status.routes:
        try:
            return _register(route, pd, mr_module, addr, length, access)
        except Exception as exc:  # pyverbs raises its own classes; the next route may still work
            failures.append(f"{route}: {exc}")
    raise TransportError(f"cannot register GPU memory for RDMA: {'; '.join(failures)}")
