"""CUDA row-movement kernels (NVRTC-compiled) and their short, checked launchers.

The kernel source is ``rows.cu`` beside this module (``kernels/rows.cu``, package data of
``ulacache.kernels``), read as text into :data:`CUDA_SOURCE` at import and specialised by
:func:`module_source`.

The kernels move whole rows between pools laid out as ``uint8 [L, R + 1, row_bytes]`` (see
:mod:`ulacache.kernels.reference`). A row pointer is plain UVA, so one gather kernel serves
every direction: pinned host -> GPU (zero-copy over PCIe), GPU -> GPU, GPU -> pinned host (the
spill of new rows) and, through a table of base pointers, peer GPU pools opened by CUDA IPC.

Kernels (all skip ``-1`` entries, take no host-side count and do no host synchronisation, so
every launcher is CUDA-graph capturable):

``ula_gather`` / ``ula_gather_peer``
    One warp per ``ROWS`` (row, layer) pairs; pair ``p = layer * n + i``, so a list sorted by
    source row walks every layer's source region in address order. Lane ``j`` owns the 16-byte
    chunks ``j, j + 32, ...`` of each row. All ``ROWS * VPL`` loads of a warp are issued before
    any store (more bytes in flight per warp, which is what PCIe latency needs).
``ula_swap``
    The promotion swap ``gpu[:, g] <-> cpu[:, c]``: both sides are read before either write.
``ula_translate_a{32,64}_m{32,64}``
    ``out = mapping[addrs] + row_base`` where ``addrs >= 0`` else ``-1`` (int32 out).

Two compile backends, tried in order: CuPy ``RawModule`` and torch's NVRTC wrapper
(``torch.cuda._compile_kernel``, launched here through ``cuLaunchKernel`` with typed
arguments). ``ULACACHE_KERNEL_BACKEND=cupy|torch|none`` forces one (``none`` disables kernels).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Sequence
from importlib import resources

import torch

from ulacache.errors import ShapeError

log = logging.getLogger(__name__)

__all__ = [
    "CUDA_SOURCE",
    "backend_name",
    "kernels_available",
    "gather",
    "gather_peers",
    "swap",
    "translate",
    "choose_rows_per_warp",
    "vectors_per_lane",
    "is_device_readable",
]

WARP = 32
THREADS = 256  # threads per block (8 warps)
ALIGN = 16  # bytes per vector load

# ---------------------------------------------------------------------------------------------
# CUDA source: kernels/rows.cu, read as text at import (shipped as package data). ROWS (rows per
# warp), VPL (16-byte vectors per lane per row, held in registers) and ULA_NC (gather load
# flavour) are compile-time constants set by a ``#define`` prefix (:func:`module_source`); one
# module per (ROWS, VPL, ULA_NC). Only builtins usable by NVRTC (no #include); the text also
# compiles as host C++ with a small shim, which the CPU tests use to run the kernels serially.
# ---------------------------------------------------------------------------------------------
CUDA_SOURCE: str = (resources.files(__package__) / "rows.cu").read_text(encoding="utf-8")

KERNEL_NAMES = (
    "ula_gather",
    "ula_gather_peer",
    "ula_swap",
    "ula_translate_a32_m32",
    "ula_translate_a32_m64",
    "ula_translate_a64_m32",
    "ula_translate_a64_m64",
)

ROWS_CHOICES = (1, 2, 4, 8)
MAX_VPL = 4  # rows up to 32 * 4 * 16 = 2048 bytes keep every chunk in registers


GATHER_NC_DEFAULT = os.environ.get("ULACACHE_GATHER_NC", "0") == "1"


def module_source(rows: int, vpl: int, nc: bool = False) -> str:
    """The CUDA source specialised for ``rows`` rows per warp, ``vpl`` vectors per lane and
    the gather's load flavour (``nc``: ``__ldg`` non-coherent loads)."""
    return (f"#define ROWS {int(rows)}\n#define VPL {int(vpl)}\n#define ULA_NC {int(nc)}\n"
            + CUDA_SOURCE)


# ---------------------------------------------------------------------------------------------
# Compile backends
# ---------------------------------------------------------------------------------------------
# Argument kinds of the launchers: "p" pointer, "q" int64, "i" int32.
_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32}


class _CupyBackend:
    name = "cupy"

    def __init__(self) -> None:
        import cupy  # noqa: F401  (ImportError = backend unavailable)
        import numpy

        self._cupy = cupy
        self._np = {"p": numpy.uint64, "q": numpy.int64, "i": numpy.int32}
        self._streams: dict[tuple[int, int], object] = {}

    def compile(self, source: str, names: Sequence[str], device: int) -> dict[str, object]:
        with self._cupy.cuda.Device(device):
            mod = self._cupy.RawModule(code=source)
            return {n: mod.get_function(n) for n in names}

    def launch(self, fn, device: int, grid: int, block: int, sig: str, args, stream: int):
        key = (device, stream)
        st = self._streams.get(key)
        if st is None:
            st = self._cupy.cuda.ExternalStream(stream, device)
            self._streams[key] = st
        typed = tuple(self._np[k](a) for k, a in zip(sig, args, strict=True))
        with self._cupy.cuda.Device(device), st:
            fn((grid,), (block,), typed)


class _TorchNvrtcBackend:
    name = "torch"

    def __init__(self) -> None:
        if not hasattr(torch.cuda, "_compile_kernel"):
            raise ImportError("torch.cuda._compile_kernel is missing in this torch")
        from torch.cuda._utils import _get_gpu_runtime_library

        self._lib = _get_gpu_runtime_library()

    def compile(self, source: str, names: Sequence[str], device: int) -> dict[str, object]:
        with torch.cuda.device(device):
            try:  # one NVRTC compile for the whole module (private torch helpers)
                from torch.cuda._utils import _cuda_load_module, _nvrtc_compile

                binary, _ = _nvrtc_compile(source, names[0])
                return dict(_cuda_load_module(binary, list(names)))
            except Exception as e:  # noqa: BLE001  (private API; fall back to the public one)
                log.info("torch NVRTC module compile failed (%s); compiling per kernel", e)
                return {n: torch.cuda._compile_kernel(source, n) for n in names}

    def launch(self, fn, device: int, grid: int, block: int, sig: str, args, stream: int):
        vals = [_CTYPES[k](a) for k, a in zip(sig, args, strict=True)]
        arr = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                              for v in vals])
        with torch.cuda.device(device):
            rc = self._lib.cuLaunchKernel(fn.func, grid, 1, 1, block, 1, 1, 0,
                                          ctypes.c_void_p(stream), arr, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {rc}")


_PROBE = 'extern "C" __global__ void ula_probe(int* p) { if (p) *p = 1; }'
_lock = threading.Lock()
_backend_state: dict[str, object] = {}


def _backend():
    """The compile backend, or ``None`` when no CUDA device or no backend is usable."""
    if "backend" in _backend_state:
        return _backend_state["backend"]
    with _lock:
        if "backend" in _backend_state:
            return _backend_state["backend"]
        chosen = None
        want = os.environ.get("ULACACHE_KERNEL_BACKEND", "").strip().lower()
        if want != "none" and torch.cuda.is_available():
            order = {"cupy": [_CupyBackend], "torch": [_TorchNvrtcBackend]}.get(
                want, [_CupyBackend, _TorchNvrtcBackend]
            )
            for cls in order:
                try:
                    cand = cls()
                    cand.compile(_PROBE, ["ula_probe"], torch.cuda.current_device())
                    chosen = cand
                    break
                except Exception as e:  # ImportError, or a broken CUDA install
                    log.info("kernel backend %s unavailable: %s", cls.name, e)
        if chosen is None:
            log.info("no CUDA kernel backend: the pure-torch references will be used")
        else:
            log.info("CUDA kernel backend: %s", chosen.name)
        _backend_state["backend"] = chosen
        return chosen


def reset_backend() -> None:
    """Forget the chosen backend and compiled modules (tests switch backends with this)."""
    with _lock:
        _backend_state.clear()
        _module.cache_clear()


def backend_name() -> str | None:
    """``"cupy"``, ``"torch"`` or ``None``."""
    b = _backend()
    return None if b is None else b.name


def kernels_available() -> bool:
    """True when CUDA is present and a compile backend imports."""
    return _backend() is not None


@functools.lru_cache(maxsize=64)
def _module(rows: int, vpl: int, device: int, nc: bool = False) -> dict[str, object]:
    b = _backend()
    if b is None:
        raise RuntimeError("no CUDA kernel backend (needs CUDA and CuPy or torch NVRTC)")
    log.debug("compiling row kernels ROWS=%d VPL=%d NC=%d for cuda:%d with %s", rows, vpl, nc,
              device, b.name)
    return b.compile(module_source(rows, vpl, nc), KERNEL_NAMES, device)


def _launch(name: str, rows: int, vpl: int, device: torch.device, n_threads: int, sig: str,
            args: Sequence[int], nc: bool = False) -> None:
    dev = device.index if device.index is not None else torch.cuda.current_device()
    fn = _module(rows, vpl, dev, nc)[name]
    grid = max(1, -(-n_threads // THREADS))
    stream = torch.cuda.current_stream(dev).cuda_stream
    _backend().launch(fn, dev, grid, THREADS, sig, args, stream)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def vectors_per_lane(row_bytes: int) -> int:
    """16-byte vectors each lane holds per row: ``ceil(row_bytes / 16 / 32)``, at most 4."""
    return max(1, min(MAX_VPL, -(-(row_bytes // ALIGN) // WARP)))


def choose_rows_per_warp(pairs: int, vpl: int, swap: bool = False) -> int:
    """Rows per warp for ``pairs`` (row, layer) pairs.

    Small launches keep one row per warp (more warps, latency-bound anyway); from 16K pairs up,
    8 rows per warp keeps the most bytes in flight (docs/kernels.md, "Design figures"). The
    register budget caps ``rows * vpl`` (halved for the swap, which buffers both sides).
    """
    if pairs >= 16384:
        r = 8
    elif pairs >= 8192:
        r = 4
    elif pairs >= 4096:
        r = 2
    else:
        r = 1
    budget = 12 if swap else 24
    while r > 1 and r * vpl > budget:
        r //= 2
    return r


def is_device_readable(t: torch.Tensor) -> bool:
    """CUDA tensors, and CPU tensors in page-locked (pinned or host-registered) memory."""
    if t.is_cuda:
        return True
    if t.device.type != "cpu":
        return False
    from .pinned import is_registered

    if is_registered(t):
        return True
    try:
        return bool(t.is_pinned())
    except Exception:  # no CUDA in this torch
        return False


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _check_pool(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 3:
        raise ShapeError(f"{name}: expected uint8 [L, R + 1, row_bytes], got {t.dtype} "
                         f"{list(t.shape)}")
    if t.shape[2] % ALIGN:
        raise ShapeError(f"{name}: row_bytes={t.shape[2]} is not a multiple of {ALIGN}")
    if t.stride(2) != 1:
        raise ShapeError(f"{name}: rows must be contiguous (stride(2)=1), got {t.stride()}")
    if t.stride(0) % ALIGN or t.stride(1) % ALIGN:
        raise ShapeError(f"{name}: layer/row strides {t.stride()[:2]} must be multiples of "
                         f"{ALIGN} bytes")
    if t.data_ptr() % ALIGN:
        raise ShapeError(f"{name}: data pointer {t.data_ptr():#x} is not {ALIGN}-byte aligned")
    if not is_device_readable(t):
        raise ShapeError(f"{name}: on {t.device} but neither CUDA nor page-locked host memory "
                         "(use ulacache.kernels.pinned.pinned_empty)")


def _check_idx(name: str, t: torch.Tensor, n: int | None, device: torch.device,
               dtype: torch.dtype = torch.int64) -> int:
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != 1:
        kind = str(dtype).removeprefix("torch.")
        raise ShapeError(f"{name}: expected {kind} [n], got {t.dtype} {list(t.shape)}")
    if not t.is_contiguous():
        raise ShapeError(f"{name}: must be contiguous, got stride {t.stride()}")
    if t.device != device:
        raise ShapeError(f"{name}: on {t.device}, the kernel runs on {device}")
    if n is not None and t.shape[0] != n:
        raise ShapeError(f"{name}: length {t.shape[0]} != {n}")
    return t.shape[0]


def _kernel_device(a: torch.Tensor, b: torch.Tensor) -> torch.device:
    if a.is_cuda and b.is_cuda and a.device != b.device:
        raise ShapeError(f"pools on two CUDA devices ({a.device}, {b.device}); use gather_peers")
    if b.is_cuda:
        return b.device
    if a.is_cuda:
        return a.device
    raise ShapeError("neither pool is a CUDA tensor: the kernels need one side on the GPU")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_pair_pools(sname: str, s: torch.Tensor, dname: str, d: torch.Tensor) -> None:
    _check_pool(sname, s)
    _check_pool(dname, d)
    if s.shape[0] != d.shape[0] or s.shape[2] != d.shape[2]:
        raise ShapeError(f"{sname} {list(s.shape)} and {dname} {list(d.shape)} differ in L or "
                         "row_bytes")
    if _same_storage(s, d):
        raise ShapeError(f"{sname} and {dname} share storage: the kernels need distinct pools")


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def gather(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
           *, rows_per_warp: int | None = None, nc: bool | None = None) -> None:
    """``dst[:, dst_idx[i]] = src[:, src_idx[i]]`` for all layers, one launch; ``-1`` skips.

    ``src``/``dst``: ``uint8 [L, *, row_bytes]``, row_bytes % 16 == 0, 16-byte aligned, one of
    them CUDA and the other CUDA (same device) or page-locked host memory. ``src_idx``/
    ``dst_idx``: ``int64 [n]`` contiguous on the kernel's device. Indices are trusted (no bounds
    check on the device). ``rows_per_warp`` (1/2/4/8) and ``nc`` (non-coherent loads) override
    the defaults (:func:`choose_rows_per_warp`, ``ULACACHE_GATHER_NC``).
    """
    _check_pair_pools("src", src, "dst", dst)
    dev = _kernel_device(src, dst)
    n = _check_idx("src_idx", src_idx, None, dev)
    _check_idx("dst_idx", dst_idx, n, dev)
    layers, row_bytes = dst.shape[0], dst.shape[2]
    pairs = n * layers
    if pairs == 0 or row_bytes == 0:
        return
    vpl = vectors_per_lane(row_bytes)
    rows = rows_per_warp or choose_rows_per_warp(pairs, vpl)
    if rows not in ROWS_CHOICES:
        raise ValueError(f"rows_per_warp must be one of {ROWS_CHOICES}, got {rows}")
    warps = -(-pairs // rows)
    _launch("ula_gather", rows, vpl, dev, warps * WARP, "pqqppqqpqqi",
            (src.data_ptr(), src.stride(0), src.stride(1), src_idx.data_ptr(),
             dst.data_ptr(), dst.stride(0), dst.stride(1), dst_idx.data_ptr(),
             n, pairs, row_bytes // ALIGN), GATHER_NC_DEFAULT if nc is None else bool(nc))


def gather_peers(src_table: torch.Tensor, src_rank: torch.Tensor, src_idx: torch.Tensor,
                 dst: torch.Tensor, dst_idx: torch.Tensor, *, src_rows: int | None = None,
                 rows_per_warp: int | None = None, nc: bool | None = None) -> None:
    """``dst[:, dst_idx[i]] = pool[src_rank[i]][:, src_idx[i]]`` in one launch.

    ``src_table``: ``int64 [P]`` base addresses (device-readable in this process: own pool,
    pools opened by CUDA IPC, pinned host pools) of contiguous ``uint8 [L, src_rows,
    row_bytes]`` pools, same L and row_bytes as ``dst``; ``src_rows`` defaults to
    ``dst.shape[1]``. ``src_rank``/``src_idx``/``dst_idx``: ``int32 [n]`` (a TP plan, kept per
    group: 4 B an entry); a ``-1`` in any skips. Pointers and ranks are trusted.
    """
    _check_pool("dst", dst)
    if not _on_gpu(dst):
        raise ShapeError("dst: the peer gather writes a CUDA pool")
    dev = dst.device
    n = _check_idx("src_idx", src_idx, None, dev, torch.int32)
    _check_idx("src_rank", src_rank, n, dev, torch.int32)
    _check_idx("dst_idx", dst_idx, n, dev, torch.int32)
    _check_idx("src_table", src_table, None, dev)
    layers, row_bytes = dst.shape[0], dst.shape[2]
    srows = dst.shape[1] if src_rows is None else int(src_rows)
    if srows <= 0:
        raise ShapeError(f"src_rows must be positive, got {srows}")
    pairs = n * layers
    if pairs == 0 or row_bytes == 0:
        return
    vpl = vectors_per_lane(row_bytes)
    rows = rows_per_warp or choose_rows_per_warp(pairs, vpl)
    if rows not in ROWS_CHOICES:
        raise ValueError(f"rows_per_warp must be one of {ROWS_CHOICES}, got {rows}")
    warps = -(-pairs // rows)
    _launch("ula_gather_peer", rows, vpl, dev, warps * WARP, "ppqqppqqpqqi",
            (src_table.data_ptr(), src_rank.data_ptr(), srows * row_bytes, row_bytes,
             src_idx.data_ptr(), dst.data_ptr(), dst.stride(0), dst.stride(1),
             dst_idx.data_ptr(), n, pairs, row_bytes // ALIGN),
            GATHER_NC_DEFAULT if nc is None else bool(nc))


def swap(gpu: torch.Tensor, gpu_idx: torch.Tensor, cpu: torch.Tensor, cpu_idx: torch.Tensor,
         *, rows_per_warp: int | None = None) -> None:
    """Promotion swap ``gpu[:, g] <-> cpu[:, c]`` over all layers in one launch.

    ``gpu``: CUDA ``uint8 [L, G + 1, row_bytes]``; ``cpu``: page-locked host (or a second CUDA
    pool on the same device) ``uint8 [L, C + 1, row_bytes]``; indices ``int64 [n]`` on the GPU,
    distinct among valid entries, ``-1`` skips the pair.
    """
    _check_pair_pools("gpu", gpu, "cpu", cpu)
    if not _on_gpu(gpu):
        raise ShapeError("gpu: expected a CUDA pool")
    dev = _kernel_device(cpu, gpu)
    n = _check_idx("gpu_idx", gpu_idx, None, dev)
    _check_idx("cpu_idx", cpu_idx, n, dev)
    layers, row_bytes = gpu.shape[0], gpu.shape[2]
    pairs = n * layers
    if pairs == 0 or row_bytes == 0:
        return
    vpl = vectors_per_lane(row_bytes)
    rows = rows_per_warp or choose_rows_per_warp(pairs, vpl, swap=True)
    if rows not in ROWS_CHOICES:
        raise ValueError(f"rows_per_warp must be one of {ROWS_CHOICES}, got {rows}")
    warps = -(-pairs // rows)
    _launch("ula_swap", rows, vpl, dev, warps * WARP, "pqqppqqpqqi",
            (gpu.data_ptr(), gpu.stride(0), gpu.stride(1), gpu_idx.data_ptr(),
             cpu.data_ptr(), cpu.stride(0), cpu.stride(1), cpu_idx.data_ptr(),
             n, pairs, row_bytes // ALIGN))


_INT_BITS = {torch.int32: 32, torch.int64: 64}


def translate(mapping: torch.Tensor, addrs: torch.Tensor, out: torch.Tensor,
              row_base: int = 0) -> torch.Tensor:
    """``out = mapping[addrs] + row_base`` where ``addrs >= 0``, else ``-1``; returns ``out``.

    ``mapping``: CUDA ``int32|int64 [m]`` contiguous; ``addrs``: CUDA ``int32|int64 [bs, k]``
    contiguous (any shape), valid entries ``< m``; ``out``: CUDA ``int32``, same shape,
    contiguous.
    """
    for nm, t in (("mapping", mapping), ("addrs", addrs), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{nm}: expected a torch.Tensor, got {type(t).__name__}")
        if not _on_gpu(t):
            raise ShapeError(f"{nm}: expected a CUDA tensor, got {t.device}")
        if not t.is_contiguous():
            raise ShapeError(f"{nm}: must be contiguous, got stride {t.stride()}")
    if mapping.dtype not in _INT_BITS or mapping.dim() != 1:
        raise ShapeError(f"mapping: expected int32|int64 [m], got {mapping.dtype} "
                         f"{list(mapping.shape)}")
    if addrs.dtype not in _INT_BITS:
        raise ShapeError(f"addrs: expected int32|int64, got {addrs.dtype}")
    if out.dtype != torch.int32 or out.shape != addrs.shape:
        raise ShapeError(f"out: expected int32 {list(addrs.shape)}, got {out.dtype} "
                         f"{list(out.shape)}")
    if len({mapping.device, addrs.device, out.device}) != 1:
        raise ShapeError("mapping, addrs and out must be on one device")
    count = addrs.numel()
    if count == 0:
        return out
    name = f"ula_translate_a{_INT_BITS[addrs.dtype]}_m{_INT_BITS[mapping.dtype]}"
    threads = min(count, THREADS * 1024)
    _launch(name, 1, 1, out.device, threads, "pppqq",
            (addrs.data_ptr(), mapping.data_ptr(), out.data_ptr(), count, int(row_base)))
    return out
