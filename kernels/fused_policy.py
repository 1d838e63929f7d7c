"""A round start for every PB-LRU policy of an arena in one Triton launch.

:meth:`ulacache.pblru.PBLRU.advance` is about 70 small tensor ops (two whole-row moves over
five count tables, plus the epoch bookkeeping), issued once per selection group per decode
step: 61 groups made a round start ~4,300 launches, far more than the fused access itself
(4 per group). :func:`advance` does the same for all policies of a
:class:`~ulacache.pblru.PBLRUArena` in ONE launch, one program per policy (each program owns
its policy's rows and round scalars, so nothing is shared between programs and no atomics are
needed). The reference is :meth:`PBLRUArena.advance` (the torch path, same signature): the
tests hold every table and scalar equal after each round.

What one program does (rows of the bucket tables; see :class:`~ulacache.pblru.PBLRU`)::

    newest = 2 + epoch % n_b                  # the newest epoch's ring row
    row[newest] += row[current]; row[current] = 0          (all five tables, whole rows)
    go = entered >= bucket_fill
    epoch += go; entered *= 1 - go
    ring = 2 + epoch % n_b                    # the ring row a new epoch reuses
    if go: row[cold] += row[ring]; row[ring] = 0
    round += 1

The four rows are distinct (``n_b >= 2``), so each column is read and written once per move,
and whole rows are moved, scratch column included, exactly as the torch path moves them.
"""

from __future__ import annotations

import torch

from . import fused_access
from .fused_access import triton

__all__ = ["advance", "LAUNCHES_PER_ADVANCE"]

LAUNCHES_PER_ADVANCE = 1
_BLOCK = 1024  # columns per iteration of a row move

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _move_row(table, src, dst, move, width: tl.constexpr, BLOCK: tl.constexpr):
        """``table[dst] += table[src]; table[src] = 0`` over ``width`` columns where ``move``
        (rows hold disjoint bit sets, so adding is OR; counts add)."""
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = (cols < width) & move
            moved = tl.load(table + src * width + cols, mask=m, other=0)
            kept = tl.load(table + dst * width + cols, mask=m, other=0)
            tl.store(table + dst * width + cols, kept + moved, mask=m)
            tl.store(table + src * width + cols, tl.zeros_like(moved), mask=m)

    @triton.jit
    def _move_rows(bits, counts, supc, hypc, rowc, src, dst, move, WB: tl.constexpr,
                   WS: tl.constexpr, WH: tl.constexpr, BLOCK: tl.constexpr):
        """One bucket-row move in all five tables of one policy (PBLRU._move_row)."""
        _move_row(bits, src, dst, move, WB, BLOCK)
        _move_row(counts, src, dst, move, WB, BLOCK)
        _move_row(supc, src, dst, move, WS, BLOCK)
        _move_row(hypc, src, dst, move, WH, BLOCK)
        _move_row(rowc, src, dst, move, 2, BLOCK)

    @triton.jit
    def _advance_kernel(bits, counts, supc, hypc, rowc, scalars, bucket_fill,
                        WB: tl.constexpr, WS: tl.constexpr, WH: tl.constexpr,
                        NB: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        rows = NB + 3
        sc = scalars + p * 3
        round_t = tl.load(sc)
        epoch_t = tl.load(sc + 1)
        entered = tl.load(sc + 2)
        newest = 2 + epoch_t % NB
        go = entered >= bucket_fill
        epoch_n = epoch_t + go.to(tl.int64)
        ring = 2 + epoch_n % NB
        # the current bucket joins the newest epoch; on a new epoch its reused row turns cold
        _move_rows(bits + p * rows * WB, counts + p * rows * WB, supc + p * rows * WS,
                   hypc + p * rows * WH, rowc + p * rows * 2, NB + 2, newest, newest >= 0,
                   WB, WS, WH, BLOCK)
        _move_rows(bits + p * rows * WB, counts + p * rows * WB, supc + p * rows * WS,
                   hypc + p * rows * WH, rowc + p * rows * 2, ring, 1, go, WB, WS, WH, BLOCK)
        tl.store(sc + 1, epoch_n)
        tl.store(sc + 2, tl.where(go, 0, entered))
        tl.store(sc, round_t + 1)


def advance(arena) -> None:
    """Start a round in every policy of ``arena`` (:class:`~ulacache.pblru.PBLRUArena`): one
    launch, no host sync, graph-capturable; same result as ``arena.advance()``.

    The arena's tables are contiguous ``[n, n_b + 3, width]`` stacks and every policy shares
    ``bucket_fill`` and ``n_b`` (one geometry), which is what lets one grid cover them all.
    """
    bits, counts, supc, hypc, rowc, scalars = arena.tables
    first = arena.policies[0]
    if any(p.bucket_fill != first.bucket_fill for p in arena.policies):
        raise ValueError("an arena's policies must share bucket_fill for the fused advance")
    # the row widths are compile-time: one geometry per arena
    fused_access.launch(_advance_kernel, (len(arena),), bits, counts, supc, hypc, rowc,
                         scalars, first.bucket_fill, WB=bits.shape[-1], WS=supc.shape[-1],
                         WH=hypc.shape[-1], NB=first.n_buckets, BLOCK=_BLOCK)


def available(device: torch.device) -> bool:
    """Whether the fused advance can run on ``device`` here."""
    return fused_access.available() and (device.type == "cuda" or fused_access.INTERPRETED)
