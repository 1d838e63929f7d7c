"""Packing of MLA latent KV rows into the byte layouts the attention kernels read.

Two layouts exist (sizes from :mod:`ulacache.layout`, the one place they are defined):

- **bf16**: the ``kv_lora_rank + rope_dim`` latent (576 dims for the real models) stored as bf16,
  i.e. 1152 bytes per row. ``pack_bf16``/``unpack_bf16`` are pure reinterpretations.
- **fp8** (FlashMLA "FP8 with scale", 656 bytes per row for the real models)::

      [0, rank)                          float8_e4m3fn NoPE values, value = fp8 * scale[block]
      [rank, rank + 4 * rank // block)   float32 scales, one per ``block`` NoPE values
      [.., + 2 * rope_dim)               bf16 RoPE values (never quantised)

  The scale of a block is ``amax / 448`` (448 is the largest finite e4m3fn value), and 1.0 for an
  all-zero block so that unpacking never divides by zero.

Every function works on any leading shape ``[...]``: rows are the last dimension.
"""

from __future__ import annotations

import torch

from ulacache.errors import ShapeError
from ulacache.layout import SCALE_BYTES, bf16_row_bytes, fp8_row_bytes

__all__ = [
    "FP8_MAX",
    "bf16_row_bytes",
    "fp8_row_bytes",
    "row_bytes",
    "pack_bf16",
    "unpack_bf16",
    "pack_fp8",
    "unpack_fp8",
    "pack_rows",
    "unpack_rows",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
_SCALE_BYTES = SCALE_BYTES  # one float32 per block


def row_bytes(layout: str, kv_lora_rank: int = 512, rope_dim: int = 64, block: int = 128) -> int:
    """Bytes of one latent row in ``layout`` (``"bf16"`` or ``"fp8"``); the formulas live in
    :mod:`ulacache.layout`."""
    if layout == "bf16":
        return bf16_row_bytes(kv_lora_rank, rope_dim)
    if layout == "fp8":
        return fp8_row_bytes(kv_lora_rank, rope_dim, block)
    raise ShapeError(f"unknown row layout {layout!r}; legal: 'bf16', 'fp8'")


def _check_block(kv_lora_rank: int, block: int) -> None:
    if block <= 0 or kv_lora_rank % block != 0:
        raise ShapeError(
            f"fp8 layout needs kv_lora_rank ({kv_lora_rank}) to be a multiple of the scale "
            f"block ({block})"
        )


def _check_rows(rows: torch.Tensor, expected: int) -> None:
    if rows.dtype != torch.uint8 or rows.dim() == 0 or rows.shape[-1] != expected:
        raise ShapeError(
            f"expected uint8 rows [..., {expected}], got {rows.dtype} {tuple(rows.shape)}"
        )


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's last dimension as raw bytes (``uint8 [..., n * itemsize]``)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A slice of a row is not aligned for wider dtypes in general: copy it to a fresh tensor first.
    return b.contiguous().view(dtype)


def pack_bf16(latent: torch.Tensor) -> torch.Tensor:
    """Pack latent vectors as bf16 rows.

    Parameters
    ----------
    latent : float tensor ``[..., D]`` (``D = kv_lora_rank + rope_dim``), any float dtype.

    Returns
    -------
    uint8 ``[..., 2 * D]``: the bf16 bytes, little-endian, in dimension order.
    """
    if not latent.is_floating_point() or latent.dim() == 0:
        raise ShapeError(f"expected a float tensor [..., D], got {latent.dtype} {latent.shape}")
    return _as_bytes(latent.to(torch.bfloat16))


def unpack_bf16(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bf16`: uint8 ``[..., 2 * D]`` -> bf16 ``[..., D]`` (exact)."""
    if rows.dtype != torch.uint8 or rows.dim() == 0 or rows.shape[-1] % 2 != 0:
        raise ShapeError(f"expected uint8 rows [..., 2 * D], got {rows.dtype} {rows.shape}")
    return _from_bytes(rows, torch.bfloat16)


def pack_fp8(latent: torch.Tensor, rope_dim: int = 64, block: int = 128) -> torch.Tensor:
    """Pack latent vectors in the FlashMLA FP8-with-scale layout.

    Parameters
    ----------
    latent : float tensor ``[..., rank + rope_dim]``; the first ``rank`` dims are NoPE.
    rope_dim : number of trailing RoPE dims, stored as bf16.
    block : NoPE values per float32 scale (128 in FlashMLA; smaller for tiny test geometries).

    Returns
    -------
    uint8 ``[..., rank + 4 * rank // block + 2 * rope_dim]``.
    """
    if not latent.is_floating_point() or latent.dim() == 0:
        raise ShapeError(f"expected a float tensor [..., D], got {latent.dtype} {latent.shape}")
    rank = latent.shape[-1] - rope_dim
    if rank <= 0:
        raise ShapeError(f"latent dim {latent.shape[-1]} leaves no NoPE part for rope {rope_dim}")
    _check_block(rank, block)
    lead = latent.shape[:-1]
    nope = latent[..., :rank].float().reshape(*lead, rank // block, block)
    amax = nope.abs().amax(dim=-1, keepdim=True)
    # An all-zero block would give scale 0 and 0/0 on quantisation; any positive scale is exact
    # for zeros, so use 1.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # amax / scale can round to slightly above 448; clamp so the cast never overflows to NaN.
    q = (nope / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    parts = (
        _as_bytes(q.reshape(*lead, rank)),
        _as_bytes(scale.reshape(*lead, rank // block)),
        _as_bytes(latent[..., rank:].to(torch.bfloat16)),
    )
    return torch.cat(parts, dim=-1)


def unpack_fp8(
    rows: torch.Tensor,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    block: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`pack_fp8` up to quantisation error.

    Parameters
    ----------
    rows : uint8 ``[..., fp8_row_bytes(kv_lora_rank, rope_dim, block)]``.
    kv_lora_rank, rope_dim, block : the geometry the rows were packed with.
    dtype : output dtype (float32 by default; bf16 is lossy for the NoPE part).

    Returns
    -------
    ``dtype [..., kv_lora_rank + rope_dim]``: NoPE dequantised as ``fp8 * scale``; RoPE exact.
    """
    _check_rows(rows, fp8_row_bytes(kv_lora_rank, rope_dim, block))
    lead = rows.shape[:-1]
    n_blocks = kv_lora_rank // block
    s0 = kv_lora_rank
    s1 = s0 + _SCALE_BYTES * n_blocks
    q = _from_bytes(rows[..., :s0], torch.float8_e4m3fn).float()
    scale = _from_bytes(rows[..., s0:s1], torch.float32)
    nope = (q.reshape(*lead, n_blocks, block) * scale.unsqueeze(-1)).reshape(*lead, kv_lora_rank)
    rope = _from_bytes(rows[..., s1:], torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1).to(dtype)


def pack_rows(
    latent: torch.Tensor, layout: str, rope_dim: int = 64, block: int = 128
) -> torch.Tensor:
    """Pack ``latent [..., D]`` in ``layout`` (``"bf16"`` or ``"fp8"``) -> uint8 rows."""
    if layout == "bf16":
        return pack_bf16(latent)
    if layout == "fp8":
        return pack_fp8(latent, rope_dim=rope_dim, block=block)
    raise ShapeError(f"unknown row layout {layout!r}; legal: 'bf16', 'fp8'")


def unpack_rows(
    rows: torch.Tensor,
    layout: str,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    block: int = 128,
) -> torch.Tensor:
    """Unpack uint8 rows of ``layout`` -> float32 ``[..., kv_lora_rank + rope_dim]``."""
    if layout == "bf16":
        _check_rows(rows, bf16_row_bytes(kv_lora_rank, rope_dim))
        return unpack_bf16(rows).float()
    if layout == "fp8":
        return unpack_fp8(rows, kv_lora_rank, rope_dim, block)
    raise ShapeError(f"unknown row layout {layout!r}; legal: 'bf16', 'fp8'")
