"""Row formats of the latent KV pools: the one place row sizes are defined.

A *row* is one token's latent KV for one layer, stored as raw bytes (``uint8 [row_bytes]``)
so that every pool, kernel and copy is format-agnostic:

==========  =========  ==============================================================
layout      row bytes  contents (``kv_lora_rank`` 512, ``rope_dim`` 64, scale block 128)
==========  =========  ==============================================================
``fp8``     656        512 x float8_e4m3 NoPE | 4 x float32 scales (one per 128) |
                       64 x bf16 RoPE  (FlashMLA "FP8 with scale")
``bf16``    1152       576 x bf16 (512 NoPE + 64 RoPE)
``tiny``    any        test rows; default 16 bytes
==========  =========  ==============================================================

The formulas take the model geometry, so the reference model (small ranks) and the SGLang
pool (whatever ``kv_cache_dim`` it was built with) derive sizes from the same code.
Indexer keys (132 B per token per layer: 128 fp8 + one fp32 scale) are not tiered and do not
live in these pools.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, ShapeError

SCALE_BYTES = 4  # one float32 scale per block of NoPE values (fp8 layout)


def bf16_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one bf16 latent row (1152 for rank 512 + rope 64)."""
    return 2 * (kv_lora_rank + rope_dim)


def fp8_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64, block: int = 128) -> int:
    """Bytes of one FP8-with-scale latent row (656 for rank 512 + rope 64, block 128)."""
    if block <= 0 or kv_lora_rank % block:
        raise ShapeError(f"fp8 layout needs kv_lora_rank ({kv_lora_rank}) to be a multiple of "
                          f"the scale block ({block})")
    return kv_lora_rank + SCALE_BYTES * (kv_lora_rank // block) + 2 * rope_dim


FP8_ROW_BYTES = fp8_row_bytes()  # 656
BF16_ROW_BYTES = bf16_row_bytes()  # 1152
TINY_ROW_BYTES = 16


@dataclass(frozen=True)
class RowLayout:
    """A named row format. ``row_bytes`` of the fp8/bf16 layouts is a multiple of 16, so GPU
    kernels can move rows with 16-byte vector accesses."""

    name: str
    row_bytes: int

    def __post_init__(self) -> None:
        if self.row_bytes <= 0:
            raise ConfigError(f"row_bytes must be positive, got {self.row_bytes}")

    @staticmethod
    def named(name: str, row_bytes: int | None = None) -> RowLayout:
        """``fp8`` (656 B), ``bf16`` (1152 B) or ``tiny`` (``row_bytes``, default 16)."""
        if name == "fp8":
            return RowLayout("fp8", FP8_ROW_BYTES)
        if name == "bf16":
            return RowLayout("bf16", BF16_ROW_BYTES)
        if name == "tiny":
            return RowLayout("tiny", TINY_ROW_BYTES if row_bytes is None else row_bytes)
        raise ConfigError(f"unknown row layout {name!r}; legal: 'fp8' ({FP8_ROW_BYTES} B), "
                          f"'bf16' ({BF16_ROW_BYTES} B), 'tiny' (row_bytes, default "
                          f"{TINY_ROW_BYTES})")

    @staticmethod
    def of_size(row_bytes: int) -> RowLayout:
        """The layout whose rows are ``row_bytes`` long (``tiny`` when no model layout is)."""
        for name in ("fp8", "bf16"):
            if RowLayout.named(name).row_bytes == row_bytes:
                return RowLayout.named(name)
        return RowLayout("tiny", row_bytes)


@dataclass(frozen=True)
class PoolRows:
    """The rows of one layer of an engine's KV tensor (SGLang's ``kv_buffer[layer]``) as
    ulacache's pools lay them out, in DP and TP mode alike; the pool, the coordinator and the
    sizing hook all read them from here::

        [0, page)                          the engine's padding sink page (its dummy writes, and
                                           the reads of the sink page's addresses)
        [page, page + G)                   GPU slot s at row page + s (``row_base``)
        page + G                           the core's scratch row
        [page + G + 1, page + G + 1 + B)   buffer slot b (TP mode): a copy of a peer's row
        [page + G + 1 + B, total)          padding to whole pages (FlashMLA reads 64-row pages)

    ``G`` = ``gpu_slots`` (DP: the pool; TP: this rank's own rows), ``B`` = ``buffer_slots``
    (0 in DP mode). The core sees rows ``[row_base, row_base + core_rows)`` and numbers them
    from 0.
    """

    page: int
    gpu_slots: int
    buffer_slots: int = 0

    def __post_init__(self) -> None:
        if self.page < 1 or self.gpu_slots < 1 or self.buffer_slots < 0:
            raise ConfigError(f"PoolRows needs page >= 1, gpu_slots >= 1, buffer_slots >= 0; "
                              f"got {self.page}, {self.gpu_slots}, {self.buffer_slots}")

    @property
    def row_base(self) -> int:
        """Row of GPU slot 0: the core's row ids plus this are ``kv_buffer`` rows."""
        return self.page

    @property
    def core_rows(self) -> int:
        """Rows the core owns: GPU slots, the scratch row, buffer slots."""
        return self.gpu_slots + 1 + self.buffer_slots

    @property
    def total(self) -> int:
        """Rows per layer the pool allocates: sink page + core rows, rounded up to pages."""
        return -(-(self.page + self.core_rows) // self.page) * self.page

    @staticmethod
    def most_beside_slots(page: int, buffer_slots: int = 0) -> int:
        """The most ``total - gpu_slots`` can be, whatever ``gpu_slots`` turns out to be (the
        sizing hook runs before SGLang picks it): ``buffer_slots + 2 x page``."""
        return buffer_slots + 2 * page
