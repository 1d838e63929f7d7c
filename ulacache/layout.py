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
