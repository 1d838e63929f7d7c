"""The names the core calls: the CUDA kernel when it applies, else the pure-torch reference.

A kernel applies when a compile backend is available (:func:`cuda_rows.kernels_available`),
one pool is a CUDA tensor and the other is on the same device or in page-locked host memory,
rows are a multiple of 16 bytes with 16-byte aligned pointers and strides, and the two pools do
not share storage. Anything else runs the reference (logged once per reason), which has the
same signature and semantics. Bad shapes and dtypes raise :class:`ulacache.errors.ShapeError`
either way.

Index vectors on another device than the kernel's are moved there (an extra copy, not graph
capturable); pass them on the GPU on hot paths.

On the ``meta`` device (``ulacache rehearse``: shapes without data) a row operation takes the
kernel's path without a kernel: the index conversions a launch makes are made (they are what
it allocates) and no bytes move.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from . import cuda_rows
from . import peer_reference as _peer_ref
from . import reference as _ref
from .peer_reference import pool_ptr_table

log = logging.getLogger(__name__)

__all__ = [
    "gather_rows",
    "swap_rows",
    "translate_rows",
    "gather_rows_peers",
    "pool_ptr_table",
    "sort_by_source",
    "uses_kernel",
]

_noted: set[str] = set()


def _on_meta(dst: torch.Tensor, *idx: torch.Tensor) -> bool:
    """Whether ``dst`` is on the meta device; then ``idx`` are converted as the kernel path
    converts them (see the module docstring) and the caller moves nothing."""
    if dst.device.type != "meta":
        return False
    for i in idx:
        _on(i, dst.device)
    return True


def _note(reason: str) -> None:
    if reason not in _noted:
        _noted.add(reason)
        log.info("row kernels: using the torch reference (%s)", reason)


def _pool_fits(t: torch.Tensor) -> str | None:
    if t.dtype != torch.uint8 or t.dim() != 3:
        return None  # let the launcher raise the ShapeError
    if t.shape[2] % cuda_rows.ALIGN or t.stride(2) != 1:
        return "row_bytes not a multiple of 16 or rows not contiguous"
    if t.stride(0) % cuda_rows.ALIGN or t.stride(1) % cuda_rows.ALIGN or t.data_ptr() % 16:
        return "pool pointer or strides not 16-byte aligned"
    if not cuda_rows.is_device_readable(t):
        return "host pool not page-locked"
    return None


def uses_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a row operation between pools ``a`` and ``b`` runs the CUDA kernel."""
    if not (a.is_cuda or b.is_cuda):
        return False
    if not cuda_rows.kernels_available():
        _note("no kernel backend")
        return False
    if a.is_cuda and b.is_cuda and a.device != b.device:
        _note("pools on two CUDA devices")
        return False
    for t in (a, b):
        why = _pool_fits(t)
        if why:
            _note(why)
            return False
    if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
        _note("source and destination share storage")
        return False
    return True


def _on(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    if idx.device != device or idx.dtype != torch.int64 or not idx.is_contiguous():
        idx = idx.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    return idx


def _dev(a: torch.Tensor, b: torch.Tensor) -> torch.device:
    return b.device if b.is_cuda else a.device


def gather_rows(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst[:, dst_idx[i]] = src[:, src_idx[i]]`` for each ``i`` with both ``>= 0``.

    ``src``/``dst``: ``uint8 [L, *, row_bytes]``; ``src_idx``/``dst_idx``: ``int64 [n]``.
    Covers host -> GPU (zero-copy), GPU -> GPU and GPU -> host (spill of new rows).
    """
    if _on_meta(dst, src_idx, dst_idx):
        return
    if uses_kernel(src, dst):
        dev = _dev(src, dst)
        cuda_rows.gather(src, _on(src_idx, dev), dst, _on(dst_idx, dev))
    else:
        _ref.gather_rows(src, src_idx, dst, dst_idx)


def swap_rows(
    gpu: torch.Tensor, gpu_idx: torch.Tensor, cpu: torch.Tensor, cpu_idx: torch.Tensor
) -> None:
    """Promotion swap ``gpu[:, g] <-> cpu[:, c]`` for each valid pair (both read first)."""
    if _on_meta(gpu, gpu_idx, cpu_idx):
        return
    if gpu.is_cuda and uses_kernel(cpu, gpu):
        dev = gpu.device
        cuda_rows.swap(gpu, _on(gpu_idx, dev), cpu, _on(cpu_idx, dev))
    else:
        _ref.swap_rows(gpu, gpu_idx, cpu, cpu_idx)


def translate_rows(
    mapping: torch.Tensor, addrs: torch.Tensor, out: torch.Tensor, row_base: int = 0
) -> torch.Tensor:
    """``out = mapping[addrs] + row_base`` where ``addrs >= 0`` else ``-1``; returns ``out``.

    ``mapping``: ``int32|int64 [n + 1]``; ``addrs``: int ``[bs, k]``; ``out``: ``int32 [bs, k]``.
    """
    if (out.is_cuda and mapping.is_cuda and addrs.is_cuda and cuda_rows.kernels_available()
            and mapping.dtype in (torch.int32, torch.int64)
            and addrs.dtype in (torch.int32, torch.int64)
            and mapping.is_contiguous() and addrs.is_contiguous() and out.is_contiguous()
            and len({mapping.device, addrs.device, out.device}) == 1):
        return cuda_rows.translate(mapping, addrs, out, row_base)
    return _ref.translate_rows(mapping, addrs, out, row_base)


def gather_rows_peers(
    srcs_ptr_table: torch.Tensor | Sequence[torch.Tensor],
    src_rank: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    src_rows: int | None = None,
) -> None:
    """Rows from up to 8 pools (own, CUDA-IPC peers, pinned host) into ``dst`` in one launch.

    ``srcs_ptr_table``: ``int64 [P]`` base addresses (see :func:`pool_ptr_table`; device
    table for the kernel) or a sequence of the pool tensors. ``src_rank``/``src_idx``/
    ``dst_idx``: ``int32 [n]`` (the TP plan's type; the CUDA kernel takes no other), ``-1``
    skips. See :mod:`ulacache.kernels.peer_reference`.
    """
    if _on_meta(dst, src_rank, src_idx, dst_idx):
        return
    if dst.is_cuda and cuda_rows.kernels_available() and _pool_fits(dst) is None:
        dev = dst.device
        if isinstance(srcs_ptr_table, torch.Tensor):
            table = _on(srcs_ptr_table, dev)
            rows = src_rows
        else:
            pools = list(srcs_ptr_table)
            if any(_pool_fits(p) or not p.is_contiguous() for p in pools) or any(
                    p.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
                    for p in pools):
                _peer_ref.gather_rows_peers(pools, src_rank, src_idx, dst, dst_idx)
                return
            table = pool_ptr_table(pools, dev)
            rows = pools[0].shape[1]
        cuda_rows.gather_peers(table, _on(src_rank, dev), _on(src_idx, dev), dst,
                               _on(dst_idx, dev), src_rows=rows)
        return
    _peer_ref.gather_rows_peers(srcs_ptr_table, src_rank, src_idx, dst, dst_idx,
                                src_rows=src_rows)


def sort_by_source(src_idx: torch.Tensor, dst_idx: torch.Tensor,
                   src_rank: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """Reorder the pairs by source address (rank first, then row), keeping each pairing.

    Host gathers over a large pinned pool run ~1.6x faster at 131K rows on sorted lists
    (docs/kernels.md, "Design figures"). Returns ``(src_idx, dst_idx)`` or
    ``(src_rank, src_idx, dst_idx)``; ``-1`` entries sort first and are still skipped.
    Device-side, no synchronisation.
    """
    key = src_idx
    if src_rank is not None:
        key = src_rank.to(torch.int64) * (1 << 40) + src_idx
    order = torch.sort(key, stable=True).indices
    out = [src_idx.index_select(0, order), dst_idx.index_select(0, order)]
    if src_rank is not None:
        out.insert(0, src_rank.index_select(0, order))
    return tuple(out)
