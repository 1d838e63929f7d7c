"""Latent-row packing: bf16 is an exact reinterpretation, fp8 is FlashMLA's FP8-with-scale."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache.errors import ShapeError
from ulacache.oracle.rowpack import (
    FP8_MAX,
    bf16_row_bytes,
    fp8_row_bytes,
    pack_bf16,
    pack_fp8,
    pack_rows,
    row_bytes,
    unpack_bf16,
    unpack_fp8,
    unpack_rows,
)


def _bf16_valued(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).float()


def test_row_sizes_match_the_real_formats() -> None:
    assert bf16_row_bytes() == 1152
    assert fp8_row_bytes() == 656
    assert row_bytes("fp8") == 656 and row_bytes("bf16") == 1152
    assert fp8_row_bytes(64, 16, 32) == 64 + 8 + 32
    with pytest.raises(ShapeError):
        row_bytes("int4")
    with pytest.raises(ShapeError):
        fp8_row_bytes(64, 16, 128)  # rank not a multiple of the block


@pytest.mark.parametrize("shape", [(576,), (3, 576), (2, 3, 80)])
def test_bf16_round_trip_is_exact(shape: tuple[int, ...]) -> None:
    x = _bf16_valued(*shape)
    rows = pack_bf16(x)
    assert rows.dtype == torch.uint8 and rows.shape == (*shape[:-1], 2 * shape[-1])
    back = unpack_bf16(rows)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.float(), x)
    assert torch.equal(unpack_rows(rows, "bf16", shape[-1] - 16, 16), x)


def test_bf16_byte_layout_is_little_endian_in_dimension_order() -> None:
    x = _bf16_valued(576)
    rows = pack_bf16(x)
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    lo, hi = rows[0::2].to(torch.int32), rows[1::2].to(torch.int32)
    assert torch.equal(lo | (hi << 8), bits)


def test_fp8_byte_layout_offsets() -> None:
    x = _bf16_valued(2, 576, seed=1)
    rows = pack_fp8(x)
    assert rows.shape == (2, 656)
    nope = x[:, :512].reshape(2, 4, 128)
    scale = nope.abs().amax(-1) / FP8_MAX
    # [512, 528): four float32 scales, one per 128 NoPE values
    assert torch.equal(rows[:, 512:528].contiguous().view(torch.float32), scale)
    # [0, 512): e4m3 values of nope / scale
    q = (nope / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(rows[:, :512], q.reshape(2, 512).view(torch.uint8))
    # [528, 656): the RoPE part as bf16 bytes, untouched
    assert torch.equal(rows[:, 528:], pack_bf16(x[:, 512:]))


def _check_fp8_bound(x: torch.Tensor, rank: int, rope: int, block: int) -> None:
    rows = pack_fp8(x, rope_dim=rope, block=block)
    assert rows.shape[-1] == fp8_row_bytes(rank, rope, block)
    y = unpack_fp8(rows, rank, rope, block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # RoPE exact (x is bf16-valued)
    assert torch.equal(y[..., rank:], x[..., rank:])
    # NoPE: e4m3 has 3 mantissa bits (relative error <= 2^-4) and a subnormal step of 2^-9
    # in units of the block scale.
    lead = x.shape[:-1]
    nope = x[..., :rank].reshape(*lead, rank // block, block)
    scale = nope.abs().amax(-1, keepdim=True) / FP8_MAX
    err = (y[..., :rank].reshape_as(nope) - nope).abs()
    bound = nope.abs() * 2.0**-4 + scale * 2.0**-9 + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())


def test_fp8_round_trip_error_bound_real_geometry() -> None:
    _check_fp8_bound(_bf16_valued(8, 576, seed=2), 512, 64, 128)


def test_fp8_zero_block_and_mixed_magnitudes() -> None:
    x = _bf16_valued(3, 96, seed=3)
    x[0, :32] = 0.0  # an all-zero block: scale 1, zeros back
    x[1, 32:64] *= 1e4
    x[2, :32] *= 1e-6
    rows = pack_fp8(x, rope_dim=32, block=32)
    assert rows[0, 64:68].contiguous().view(torch.float32).item() == 1.0
    y = unpack_fp8(rows, 64, 32, 32)
    assert torch.equal(y[0, :32], torch.zeros(32))
    _check_fp8_bound(x, 64, 32, 32)


@settings(max_examples=30, deadline=None)
@given(
    n_blocks=st.integers(1, 4),
    block=st.sampled_from([16, 32, 128]),
    rope=st.sampled_from([2, 16, 64]),
    log_scale=st.floats(-8, 8),
    seed=st.integers(0, 2**16),
)
def test_fp8_round_trip_property(n_blocks: int, block: int, rope: int, log_scale: float,
                                 seed: int) -> None:
    rank = n_blocks * block
    x = _bf16_valued(2, rank + rope, seed=seed, scale=10.0**log_scale)
    _check_fp8_bound(x, rank, rope, block)


def test_pack_rows_dispatch_and_errors() -> None:
    x = _bf16_valued(4, 80)
    assert torch.equal(pack_rows(x, "bf16"), pack_bf16(x))
    assert torch.equal(pack_rows(x, "fp8", rope_dim=16, block=32), pack_fp8(x, 16, 32))
    y = unpack_rows(pack_rows(x, "fp8", 16, 32), "fp8", 64, 16, 32)
    assert y.shape == x.shape
    with pytest.raises(ShapeError):
        pack_rows(x, "fp4")
    with pytest.raises(ShapeError):
        pack_fp8(x, rope_dim=16, block=128)  # rank 64 is not a multiple of 128
    with pytest.raises(ShapeError):
        unpack_fp8(torch.zeros(4, 100, dtype=torch.uint8), 64, 16, 32)  # 104 bytes expected
    with pytest.raises(ShapeError):
        unpack_bf16(torch.zeros(3, dtype=torch.int32))
