"""Page-locked host tensors of the exact requested size.

``torch.empty(..., pin_memory=True)`` goes through the CUDA caching host allocator, which
rounds every block up to a power of two: a 2.6 GB pool would lock 4 GiB. Here the memory is an
anonymous ``mmap`` of exactly ``nbytes`` (the kernel rounds the mapping to whole pages, never
more), registered with ``cudaHostRegister`` (default flags: mapped and portable under UVA, so
the host pointer is also the device pointer the kernels dereference) and wrapped as a tensor
with ``torch.frombuffer``. The registration is undone when the last tensor viewing the memory
is freed, before the mapping is unmapped.

On a machine without CUDA the same mmap-backed tensor is returned unregistered, with a logged
note; everything works there except zero-copy kernels, which need CUDA anyway.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import weakref

import torch

log = logging.getLogger(__name__)

__all__ = ["pinned_empty", "is_registered", "registered_bytes", "device_view"]

_lock = threading.Lock()
_regions: dict[int, int] = {}  # start address -> nbytes, registered and alive
_noted_cpu_only = False


def _cuda_register(ptr: int, nbytes: int) -> None:
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister({ptr:#x}, {nbytes}) failed: {err}")


def _cuda_unregister(ptr: int) -> None:
    rt = torch.cuda.cudart()
    err = rt.cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister(%#x) failed: %s", ptr, err)


# Indirection points for tests (monkeypatched on CPU-only machines).
_register = _cuda_register
_unregister = _cuda_unregister


def _release(ptr: int, registered: bool) -> None:
    with _lock:
        _regions.pop(ptr, None)
    if registered:
        _unregister(ptr)
    log.debug("released pinned region %#x", ptr)


def pinned_empty(shape: tuple[int, ...] | list[int] | torch.Size,
                 dtype: torch.dtype = torch.uint8, *, register: bool | None = None
                 ) -> torch.Tensor:
    """An uninitialised (zero-filled) CPU tensor of ``shape``/``dtype`` in page-locked memory.

    Exactly ``prod(shape) * itemsize`` bytes are locked (``untyped_storage().nbytes()`` equals
    that). ``register=None`` registers when CUDA is available; ``False`` never does (plain
    mmap-backed tensor); ``True`` requires it. The tensor is contiguous and page-aligned.
    """
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if register is None:
        register = torch.cuda.is_available()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mm)
    t = torch.frombuffer(view, dtype=torch.uint8)  # holds a buffer export of `view`
    ptr = t.data_ptr()
    if register:
        _register(ptr, nbytes)
    else:
        global _noted_cpu_only
        if not _noted_cpu_only:
            log.info("pinned_empty: CUDA unavailable or register=False; returning plain "
                     "(unregistered) mmap-backed host tensors")
            _noted_cpu_only = True
    with _lock:
        if register:
            _regions[ptr] = nbytes
    # `view` lives as long as any tensor/storage built on it; when it dies, unregister while the
    # mapping (held by the memoryview's managed buffer) is still mapped.
    weakref.finalize(view, _release, ptr, bool(register))
    del view, mm
    return t.view(dtype).view(shape)


def is_registered(t: torch.Tensor) -> bool:
    """True when ``t``'s data lies inside a live region registered by :func:`pinned_empty`."""
    if t.device.type != "cpu":
        return False
    p = t.data_ptr()
    with _lock:
        for start, size in _regions.items():
            if start <= p < start + size:
                return True
    return False


def registered_bytes() -> int:
    """Total bytes currently registered by :func:`pinned_empty` (all live regions)."""
    with _lock:
        return sum(_regions.values())


_TYPESTR = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8",
            torch.float32: "<f4"}


class _HostArray:
    """A registered host tensor presented as CUDA memory (``__cuda_array_interface__`` v3):
    under UVA its host pointer is also a device pointer. Holds the host tensor, so the memory
    outlives every device view built from it."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False), "version": 3,
            "strides": tuple(s * host.element_size() for s in host.stride())}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` as a tensor on ``device`` without a copy. CUDA: ``host`` must come from
    :func:`pinned_empty` (registered: kernels and torch ops on the view read and write host
    memory over the bus, zero-copy); the view keeps ``host`` alive. Any other device:
    ``host`` itself, which must already be there (CPU, or ``meta`` for ``ulacache
    rehearse``)."""
    if device.type != "cuda":
        if host.device != device:
            raise ValueError(f"device_view: a {host.device} tensor cannot stand for {device}")
        return host
    if not is_registered(host):
        raise ValueError("device_view needs a registered host tensor (pinned_empty)")
    view = torch.as_tensor(_HostArray(host), device=device)
    if view.data_ptr() != host.data_ptr():  # a copy would silently split the two
        raise RuntimeError("device_view: torch copied the host array instead of aliasing it")
    return view
