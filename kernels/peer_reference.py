"""Pure-torch reference of the peer gather (rows from several pools in one call).

``gather_rows_peers(srcs, src_rank, src_idx, dst, dst_idx)`` copies, for every ``i`` with
``src_rank[i]``, ``src_idx[i]`` and ``dst_idx[i]`` all ``>= 0``::

    dst[:, dst_idx[i]] = pool(src_rank[i])[:, src_idx[i]]

The reference loops over the (at most 8) source pools, never over rows, and delegates to
:func:`ulacache.kernels.reference.gather_rows`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ulacache.errors import ShapeError

from .reference import gather_rows

__all__ = ["gather_rows_peers", "pool_ptr_table", "MAX_PEERS"]

MAX_PEERS = 8


def pool_ptr_table(pools: Sequence[torch.Tensor], device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """``int64 [P]`` table of the pools' base addresses (build once, outside graph capture).

    All pools must be contiguous ``uint8 [L, S + 1, row_bytes]`` of one shape.
    """
    if not 1 <= len(pools) <= MAX_PEERS:
        raise ShapeError(f"expected 1..{MAX_PEERS} pools, got {len(pools)}")
    shape = pools[0].shape
    for r, p in enumerate(pools):
        if p.dtype != torch.uint8 or p.dim() != 3 or not p.is_contiguous():
            raise ShapeError(f"pool {r}: expected contiguous uint8 [L, S + 1, row_bytes], got "
                             f"{p.dtype} {list(p.shape)} stride {p.stride()}")
        if p.shape != shape:
            raise ShapeError(f"pool {r}: shape {list(p.shape)} != pool 0's {list(shape)}")
    dev = pools[0].device if device is None else torch.device(device)
    return torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=dev)


def _wrap_host_pointer(ptr: int, layers: int, rows: int, row_bytes: int) -> torch.Tensor:
    nbytes = layers * rows * row_bytes
    buf = (ctypes.c_ubyte * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(layers, rows, row_bytes)


def _pools_from_table(table: torch.Tensor, dst: torch.Tensor, src_rows: int | None
                      ) -> list[torch.Tensor]:
    if table.device.type != "cpu" or dst.device.type != "cpu":
        raise ShapeError("a pointer table can be read by the reference only for CPU pools; on "
                         "CUDA without a kernel backend pass the pool tensors instead")
    if table.dtype != torch.int64 or table.dim() != 1:
        raise ShapeError(f"srcs_ptr_table: expected int64 [P], got {table.dtype} "
                         f"{list(table.shape)}")
    rows = dst.shape[1] if src_rows is None else int(src_rows)
    return [_wrap_host_pointer(int(p), dst.shape[0], rows, dst.shape[2]) for p in table.tolist()]


def gather_rows_peers(
    srcs_ptr_table: torch.Tensor | Sequence[torch.Tensor],
    src_rank: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    src_rows: int | None = None,
) -> None:
    """Reference peer gather.

    Parameters
    ----------
    srcs_ptr_table : a sequence of ``P <= 8`` pools ``uint8 [L, S + 1, row_bytes]``, or an
        ``int64 [P]`` table of their base addresses (CPU pools only here; the CUDA kernel takes
        device tables). Pools addressed through a table are contiguous with ``src_rows`` rows
        (default ``dst.shape[1]``).
    src_rank : ``int32 [n]`` pool of each row, ``-1`` = skip (any integer type here; the CUDA
        kernel takes ``int32``).
    src_idx : ``int32 [n]`` source rows, ``-1`` = skip.
    dst : ``uint8 [L, D + 1, row_bytes]``.
    dst_idx : ``int32 [n]`` destination rows, ``-1`` = skip; distinct among valid entries.
    """
    if isinstance(srcs_ptr_table, torch.Tensor):
        pools = _pools_from_table(srcs_ptr_table, dst, src_rows)
    else:
        pools = list(srcs_ptr_table)
    if len(pools) > MAX_PEERS:
        raise ShapeError(f"at most {MAX_PEERS} source pools, got {len(pools)}")
    if src_rank.shape != src_idx.shape or dst_idx.shape != src_idx.shape:
        raise ShapeError(f"src_rank {list(src_rank.shape)}, src_idx {list(src_idx.shape)} and "
                         f"dst_idx {list(dst_idx.shape)} must have one shape")
    rank = src_rank.to(src_idx.device)
    src_idx, dst_idx = src_idx.to(torch.int64), dst_idx.to(torch.int64)
    minus_one = torch.full_like(src_idx, -1)
    for r, pool in enumerate(pools):
        sel = torch.where(rank == r, src_idx, minus_one)
        gather_rows(pool, sel, dst, dst_idx)
