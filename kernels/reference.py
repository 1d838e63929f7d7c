"""Pure-torch references of the data-movement kernels.

Every kernel in this package has a reference here with the same signature; the core calls
these names through :mod:`ulacache.kernels.dispatch`, which swaps in the GPU kernel when one
is available for the tensors' device.

Conventions shared by all of them:

- Pools are ``uint8 [L, R + 1, row_bytes]`` tensors: ``L`` layers of one selection group,
  ``R`` real rows and one *scratch row* at index ``R``. Masked entries (index ``-1``) are
  redirected to the scratch row, so a fixed-shape, branch-free torch version exists that
  never reads or writes out of bounds and needs no host synchronisation (CUDA-graph safe).
  GPU kernels simply skip masked entries.
- Index vectors are ``int64 [n]``; entries are ``-1`` (skip) or a valid row. Among the valid
  entries, destination rows are distinct (the planner guarantees it).
- On CPU tensors the references compact the valid entries first (cheap there and not a
  device synchronisation); on CUDA they run the fixed-shape masked form.
"""

from __future__ import annotations

import torch

__all__ = ["gather_rows", "swap_rows", "translate_rows", "masked_index"]


def masked_index(idx: torch.Tensor, scratch: int) -> torch.Tensor:
    """``idx`` with every negative entry replaced by ``scratch`` (int64, same shape)."""
    return torch.where(idx >= 0, idx, torch.full_like(idx, scratch))


COMPACT_ON_CPU = True
"""Compact valid pairs on CPU tensors (cheap there, and no device to synchronise). Tests turn it
off to run the fixed-shape form, the one CUDA uses, on CPU."""


def _valid_pairs(a: torch.Tensor, b: torch.Tensor, a_scratch: int,
                 b_scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs with both indices ``>= 0``: compacted on CPU; on other devices every pair is
    kept (fixed shape, no sync) and the masked ones are redirected to the scratch rows."""
    keep = (a >= 0) & (b >= 0)
    if a.device.type == "cpu" and COMPACT_ON_CPU:
        nz = keep.nonzero().squeeze(1)
        return a.index_select(0, nz), b.index_select(0, nz)
    return torch.where(keep, a, a_scratch), torch.where(keep, b, b_scratch)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Asynchronous only towards CUDA (stream-ordered with the consumer). A non-blocking copy to
    # the CPU would return before the data lands, and the CPU-side index_copy_ that follows is
    # not stream-ordered: it would read garbage.
    return t.to(device, non_blocking=device.type == "cuda")


def gather_rows(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst[:, dst_idx[i]] = src[:, src_idx[i]]`` for every ``i`` with both indices ``>= 0``.

    Parameters
    ----------
    src : ``uint8 [L, S + 1, row_bytes]`` source pool (any device the kernel can read).
    src_idx : ``int64 [n]`` source rows, ``-1`` = skip.
    dst : ``uint8 [L, D + 1, row_bytes]`` destination pool.
    dst_idx : ``int64 [n]`` destination rows, ``-1`` = skip; distinct among valid entries.
    """
    s, d = _valid_pairs(src_idx, dst_idx, src.shape[1] - 1, dst.shape[1] - 1)
    rows = src.index_select(1, s.to(src.device))
    dst.index_copy_(1, d.to(dst.device), _to(rows, dst.device))


def swap_rows(
    gpu: torch.Tensor, gpu_idx: torch.Tensor, cpu: torch.Tensor, cpu_idx: torch.Tensor
) -> None:
    """Exchange rows between two pools: ``gpu[:, g] <-> cpu[:, c]`` for each valid pair.

    This is the promotion swap: the promoted row moves CPU -> GPU slot ``g`` while the victim
    that held ``g`` moves into the CPU slot ``c`` the promoted row vacates. Both reads happen
    before either write. ``gpu_idx`` and ``cpu_idx`` are ``int64 [n]``, distinct among valid
    entries; a pair with either side ``-1`` is skipped.
    """
    g, c = _valid_pairs(gpu_idx, cpu_idx, gpu.shape[1] - 1, cpu.shape[1] - 1)
    g_dev, c_dev = g.to(gpu.device), c.to(cpu.device)
    promoted = _to(cpu.index_select(1, c_dev), gpu.device)
    victims = _to(gpu.index_select(1, g_dev), cpu.device)
    gpu.index_copy_(1, g_dev, promoted)
    cpu.index_copy_(1, c_dev, victims)


def translate_rows(
    mapping: torch.Tensor, addrs: torch.Tensor, out: torch.Tensor, row_base: int = 0
) -> torch.Tensor:
    """Logical -> physical rows with ``-1`` padding preserved.

    ``out[...] = mapping[addrs[...]] + row_base`` where ``addrs >= 0``, else ``-1``.

    Parameters
    ----------
    mapping : ``int64 [n + 1]`` (or int32); the last entry is a scratch entry.
    addrs : ``int [bs, k]`` (any int dtype), ``-1`` padding; valid entries ``< n``.
    out : ``int32 [bs, k]`` preallocated output (graph-stable); returned.
    row_base : added to every valid row (e.g. SGLang's first-page padding sink).
    """
    a = addrs.to(torch.int64)
    rows = mapping.index_select(0, masked_index(a, mapping.shape[0] - 1).reshape(-1))
    rows = rows.reshape(a.shape) + row_base
    out.copy_(torch.where(a >= 0, rows, torch.full_like(rows, -1)))
    return out
