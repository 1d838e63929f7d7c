"""Row formats of the latent KV pools and model geometry constants.

A *row* is one token's latent KV for one layer, stored as raw bytes (``uint8 [row_bytes]``)
so that every pool, kernel and copy is format-agnostic:

==========  =========  ==============================================================
layout      row bytes  contents
==========  =========  ==============================================================
``fp8``     656        512 x float8_e4m3 NoPE | 4 x float32 scales (one per 128) |
                       64 x bf16 RoPE  (FlashMLA "FP8 with scale")
``bf16``    1152       576 x bf16 (512 NoPE + 64 RoPE)
``tiny``    any        test rows; default 16 bytes
==========  =========  ==============================================================

Indexer keys (132 B per token per layer: 128 fp8 + one fp32 scale) are not tiered and do not
live in these pools.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

FP8_ROW_BYTES = 512 + 4 * 4 + 64 * 2  # 656
BF16_ROW_BYTES = 576 * 2  # 1152
INDEX_K_ROW_BYTES = 128 + 4  # 132, never tiered


@dataclass(frozen=True)
class RowLayout:
    """A named row format. ``row_bytes`` is a multiple of 16 for the fp8/bf16 layouts, so GPU
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
            return RowLayout("tiny", 16 if row_bytes is None else int(row_bytes))
        raise ConfigError(f"unknown row layout {name!r}; legal: 'fp8' (656 B), 'bf16' (1152 B), "
                          "'tiny' (row_bytes, default 16)")
