"""A selection group's release in three Triton launches.

:meth:`ulacache.group.SelectionGroup.release` on the torch path is about 200 small ops per
group (dedup, mapping and owner updates, PB-LRU bit moves to the free row, CPU free-stack
pushes, counters), issued for every group each time finished requests are freed. The fused
path does the same with identical results (the tests compare every table) in three launches,
split where a grid-wide order is needed:

====  =====================================================================================
R1    every in-range entry claims its address: ``atomic_min(claim[addr], position)``
      (``fused_access.claim_in_range``, shared with the TP gates' G1)
R2    first occurrence (the first resets the claim); invalid entries counted; dropped rows
      unmapped (mapping, owners, a GPU row's shadow); GPU slots released in the policy (bit
      to the free row, stamps freed); per-block counts of CPU slots to push; the stack
      pointer snapshot
R3    rank of each CPU push (prefix of the block counts + in-block cumsum): ``cpu_free[top +
      rank] = slot``, then the pointer moves by the block's count (positions come from the
      snapshot, so no program reads a moved pointer)
====  =====================================================================================
"""

from __future__ import annotations

import torch

from . import fused_access
from .fused_access import COUNTER_COLUMNS, FusedAccess, Scratch, pow2, triton

__all__ = ["FusedRelease", "LAUNCHES_PER_RELEASE"]

LAUNCHES_PER_RELEASE = 3

if triton is not None:
    import triton.language as tl

    from .fused_access import NO_CLAIM, bucket_row_of, claim_in_range, move_slots

    C_INVALID = tl.constexpr(COUNTER_COLUMNS["invalid"])
    C_RELEASED_GPU = tl.constexpr(COUNTER_COLUMNS["released_gpu"])
    C_RELEASED_CPU = tl.constexpr(COUNTER_COLUMNS["released_cpu"])
    C_SHADOWS_RELEASED = tl.constexpr(COUNTER_COLUMNS["shadows_released"])

    @triton.jit
    def _r2_drop(addrs, claim, loc, gpu_owner, shadow, cslot_out, block_push, cpu_top,
                 top0, counters, bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                 epoch_ptr, n, N, G, C, W1, S1, H1, NB: tl.constexpr, HY: tl.constexpr,
                 BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        inrange = live & (a >= 0) & (a < N)
        safe = tl.where(inrange, a, N)
        first = inrange & (tl.load(claim + safe, mask=inrange, other=-1) == i)
        tl.store(claim + safe, tl.full(safe.shape, NO_CLAIM, tl.int32), mask=first)
        bad = (live & (a != -1) & ~inrange) | (inrange & ~first)
        phys = tl.load(loc + safe, mask=first, other=-1).to(tl.int64)  # int32 mapping
        drop = first & (phys >= 0)
        on_gpu = drop & (phys < G)
        on_cpu = drop & (phys >= G)
        tl.store(loc + safe, tl.full(safe.shape, -1, tl.int32), mask=drop)
        tl.store(gpu_owner + tl.where(on_gpu, phys, G), tl.full(safe.shape, -1, tl.int32),
                 mask=on_gpu)
        # a GPU row's shadow is freed with it
        had = tl.load(shadow + tl.where(on_gpu, phys, G), mask=on_gpu, other=-1).to(tl.int64)
        shadowed = on_gpu & (had >= 0)
        cslot = tl.where(on_cpu, phys - G, tl.where(shadowed, had, -1))
        push = cslot >= 0
        tl.store(shadow + tl.where(on_gpu, phys, G), tl.full(safe.shape, -1, tl.int32),
                 mask=on_gpu)
        # PBLRU.release: a used slot's bit moves to the free row (a free slot's stamps are
        # never read)
        slot = tl.where(on_gpu, phys, 0)
        old = bucket_row_of(bits, ring_of, slot, on_gpu, W1, NB)
        move = on_gpu & (old != 0)
        move_slots(bits, counts, supc, hypc, rowc, slot, old, 0, move, W1, S1, H1, HY)
        tl.store(cslot_out + i, cslot, mask=live)
        tl.store(block_push + pid, tl.sum(push.to(tl.int32)))
        if pid == 0:  # R3 places pushes from this snapshot while it moves the pointer
            tl.store(top0, tl.load(cpu_top))
        tl.atomic_add(counters + C_INVALID, tl.sum(bad.to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + C_RELEASED_GPU, tl.sum(on_gpu.to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + C_RELEASED_CPU, tl.sum(on_cpu.to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + C_SHADOWS_RELEASED, tl.sum(shadowed.to(tl.int64)),
                      sem="relaxed")

    @triton.jit
    def _r3_push(cslot_in, block_push, cpu_free, cpu_top, top0, n, n_blocks,
                 BP: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        b = tl.arange(0, BP)
        before = tl.sum(tl.load(block_push + b, mask=(b < pid) & (b < n_blocks), other=0))
        cslot = tl.load(cslot_in + i, mask=live, other=-1)
        put = live & (cslot >= 0)
        rank = before + tl.cumsum(put.to(tl.int32), 0) - 1
        tl.store(cpu_free + tl.load(top0) + rank, cslot, mask=put)
        tl.atomic_add(cpu_top, tl.sum(put.to(tl.int64)), sem="relaxed")


class FusedRelease:
    """The fused release bound to one selection group's tensors
    (:class:`ulacache.state.GroupTables`, PB-LRU policy).

    Calls take the group's already-checked ``addrs`` (flat, contiguous ``int32|int64``);
    every call is three launches and no other device op (scratch allocated once).
    """

    BLOCK = FusedAccess.BLOCK

    def __init__(self, tables, scratch: Scratch | None = None) -> None:
        if triton is None:
            raise RuntimeError("the fused release needs Triton (pip install triton)")
        self.g = tables
        p = tables.policy
        self.w1, self.s1, self.h1 = p.n_words + 16, p.n_super + 1, p.n_hyper + 1
        # ``scratch``: the group's access scratch (its first per-entry tensor holds the CPU
        # slots), shared; else one of its own
        self.shared_scratch = scratch if scratch is not None else \
            Scratch(tables.device, [torch.int64], self.BLOCK, tables.max_call)
        self._top0 = torch.zeros((), dtype=torch.int64, device=tables.device)

    def run(self, addrs: torch.Tensor) -> None:
        g, p = self.g, self.g.policy
        n = addrs.numel()
        if n == 0:
            return
        cslot, *_, block_push = self.shared_scratch.get(n)
        grid = (-(-n // self.BLOCK),)
        N, G, C = g.n_logical, g.gpu_slots, g.cpu_slots
        launch = fused_access.launch  # looked up per call: fused_compile records launches
        launch(claim_in_range, grid, addrs, g.claim, n, N, BLOCK=self.BLOCK)
        launch(_r2_drop, grid, addrs, g.claim, g.loc, g.gpu_owner, g.shadow, cslot,
               block_push, g.cpu_top, self._top0, g.counters, p.bits, p.counts,
               p.super_counts, p.hyper_counts, p.row_counts, p.round_of, p.ring_of,
               p.round_t, p.epoch_t, n, N, G, C, self.w1, self.s1, self.h1,
               NB=p.n_buckets, HY=p.hyper, BLOCK=self.BLOCK)
        launch(_r3_push, grid, cslot, block_push, g.cpu_free, g.cpu_top,
               self._top0, n, grid[0], BP=pow2(grid[0]), BLOCK=self.BLOCK)
