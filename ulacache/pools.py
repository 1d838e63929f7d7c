"""Row storage of one selection group: a GPU pool and a CPU pool, plus the CPU free stack.

Region table of a pool tensor ``uint8 [L, R + 1, row_bytes]``::

    rows [0, R)   real slots, owned by at most one logical address each
    row  R        scratch row: masked (-1) entries of fixed-shape copies read/write it

The GPU pool lives on the group's device; the CPU pool in host memory (pinned, exact size,
when the device is CUDA). Free GPU slots are tracked by the replacement policy (its free
bitmap comes first in victim order); free CPU slots by a stack that lives beside the CPU pool,
in host memory, and is addressed from the device (zero-copy, :func:`device_view`), so spills
and promotions pop and push without host synchronisation and the device holds nothing per
CPU slot (4 B per CPU slot per group: at ``cpu_ratio`` 64 that alone was a third of the
tables' device bytes). Only its height, ``cpu_top``, is device memory.
"""

from __future__ import annotations

import logging
import os

import torch

from ulacache.kernels.pinned import device_view

from .errors import CapacityExhausted, ShapeError

logger = logging.getLogger(__name__)


def resolve_device(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``: tensors report an indexed device, and the core compares
    devices to reject misplaced inputs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def free_bytes(device: torch.device) -> int | None:
    """Memory that an allocation on ``device`` can still take (``None``: unknown, or unbounded:
    the ``meta`` device of ``ulacache rehearse`` allocates nothing)."""
    if device.type == "meta":
        return None
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts reclaimable page cache, unlike the free-page count
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str,
             fill: int | None = 0, pinned: bool = False) -> torch.Tensor:
    """A tensor for core state, refused with :class:`CapacityExhausted` naming ``what`` (and
    its size) when the memory is not there, instead of a raw ``MemoryError`` or an OOM kill
    half-way through building a cache."""
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    host = pinned or device.type == "cpu"
    avail = free_bytes(torch.device("cpu") if host else device)
    if avail is not None and nbytes > avail:
        raise CapacityExhausted(f"{what} needs {nbytes / 2**30:.2f} GiB ({tuple(shape)} "
                                f"{dtype}) but only {avail / 2**30:.2f} GiB of "
                                f"{'host' if host else str(device)} memory is available; "
                                "lower gpu_slots / cpu_slots / the layer count")
    try:
        if pinned:
            from ulacache.kernels.pinned import pinned_empty

            t = pinned_empty(shape, dtype)
            if fill is not None:
                t.fill_(fill)
            return t
        if fill is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.full(shape, fill, dtype=dtype, device=device)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise CapacityExhausted(f"{what} ({nbytes / 2**30:.2f} GiB, {tuple(shape)} {dtype}) "
                                f"could not be allocated on {device}: {e}") from None


class TierPools:
    """GPU and CPU row pools of one selection group and the CPU free stack.

    Attributes
    ----------
    gpu : ``uint8 [L, gpu_slots + 1, row_bytes]`` on ``device``.
    cpu : ``uint8 [L, cpu_slots + 1, row_bytes]`` in host memory.
    cpu_free : ``int32 [cpu_slots + 1]`` addressed on ``device`` (4 B per CPU slot), stored
        in host memory (``cpu_free_host``; on a CPU or meta device the same tensor);
        ``cpu_free[:cpu_top]`` are the free CPU slots (entry ``cpu_slots`` is scratch for
        masked pushes). An entry moves per spilled, promoted or released row, so the bus
        reads and writes of zero-copy access ride beside the row copies that cross the bus
        anyway.
    cpu_top : 0-dim ``int64`` on ``device`` (atomics stay in device memory).

    ``L`` may be 0: a residency-only group (simulations of the policy) moves no bytes.
    """

    def __init__(self, n_layers: int, gpu_slots: int, cpu_slots: int, row_bytes: int,
                 device: torch.device | str = "cpu", gpu_storage: torch.Tensor | None = None):
        self.device = resolve_device(device)
        self.n_layers, self.row_bytes = n_layers, row_bytes
        self.gpu_slots, self.cpu_slots = gpu_slots, cpu_slots
        if cpu_slots >= 2**31 - 1:  # the free stack holds int32 slot numbers
            raise ShapeError(f"cpu_slots {cpu_slots} per group must be < 2**31 - 1")
        shape = (n_layers, gpu_slots + 1, row_bytes)
        if gpu_storage is not None:
            # An engine-owned buffer (SGLang's kv_buffer rows): rows must be contiguous bytes.
            if (gpu_storage.dtype != torch.uint8 or tuple(gpu_storage.shape) != shape
                    or gpu_storage.stride(2) != 1 or gpu_storage.device != self.device):
                raise ShapeError(f"gpu_storage must be uint8 {shape} on {self.device} with "
                                 f"contiguous rows, got {gpu_storage.dtype} "
                                 f"{tuple(gpu_storage.shape)} stride {gpu_storage.stride()} on "
                                 f"{gpu_storage.device}")
            self.gpu = gpu_storage
        else:
            self.gpu = allocate(shape, torch.uint8, self.device, "the GPU pool")
        # Exact-size pinned host memory when the kernels read it from a CUDA device.
        self.cpu = allocate((n_layers, cpu_slots + 1, row_bytes), torch.uint8, self.device,
                            "the CPU pool", pinned=self.device.type == "cuda",
                            fill=None if self.device.type == "cuda" else 0)
        # Pops take from the top; reversed so that a fresh pool hands out slots 0, 1, 2, ...
        self.cpu_free_host = allocate((cpu_slots + 1,), torch.int32, self.device,
                                      "the CPU free stack", pinned=self.device.type == "cuda")
        if self.cpu_free_host.device.type != "meta":
            self.cpu_free_host[:cpu_slots] = torch.arange(cpu_slots - 1, -1, -1)
            self.cpu_free_host[cpu_slots] = cpu_slots
        self.cpu_free = device_view(self.cpu_free_host, self.device)
        self.cpu_top = torch.tensor(cpu_slots, dtype=torch.int64, device=self.device)
        logger.debug("pools: %d layers x (%d GPU + %d CPU) rows of %d B", n_layers, gpu_slots,
                     cpu_slots, row_bytes)

    def push_cpu(self, slots: torch.Tensor) -> None:
        """Push the valid (``>= 0``, distinct, currently used) CPU slots back. Graph-safe."""
        put = slots >= 0
        rank = torch.cumsum(put, 0) - 1
        pos = torch.where(put, self.cpu_top + rank, self.cpu_slots)
        self.cpu_free.index_put_((pos,), torch.where(put, slots, self.cpu_slots).to(torch.int32))
        self.cpu_top.add_(put.sum())

    def cpu_free_set(self) -> torch.Tensor:
        """The free CPU slots (host-side, for integrity checks)."""
        return self.cpu_free[: int(self.cpu_top)].to(torch.int64)
