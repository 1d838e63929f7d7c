"""One selection group's sparse access (and placement) in four Triton launches.

The torch path (:meth:`ulacache.group.SelectionGroup.access` with ``access_path="torch"``) is
the reference: the fused path must leave every table, counter, policy word and pool byte exactly
as it does. Decisions are fixed by that order: misses take victims by their first occurrence,
from the PB-LRU state after this step's hits were touched; so there are three grid-wide
synchronisation points and four kernels (docs/fused-access.md):

====  =====================================================================================
K1    resolve ``phys = loc[addr]``; the entries to keep (access: live; place: unmapped)
      claim their address: ``atomic_min(claim[addr], position)``; invalid entries counted;
      TP (``stripe``): global ``t`` is this rank's ``t // P`` if ``t % P == rank``
K2    first occurrence (the first resets the claim); access: touch the hits (bit moves to
      the current bucket, stamps, turnover); per-block counts of misses (place: of fresh
      addresses); counters
K3    rank of each miss (prefix of the block counts + in-block cumsum), its victim (the
      r-th slot in victim order, descending row -> hyper -> superblock -> word -> bit
      counts), the row moves for every layer of the group, then the mapping, owners and
      CPU free stack (data before mapping within each program); 16 entries at a time, so
      the search tiles stay in registers, and sub-blocks without misses skip it
K4    assign the victims (bit moves, stamps, turnover), the CPU stack pointer, and (access)
      translate every entry to its GPU row (``-1`` kept)
====  =====================================================================================

Why K3 needs no second rank: victim order puts free slots first, so a miss's victim is free
exactly when its rank is below the free count, and the free-stack position of a push (access)
or pop (place) is that rank (offset by the free count for pops). Nobody in K3 reads what K3
writes: victims are distinct, their owners are not selected this step, and the stack pointer
moves in K4.

On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before Triton is imported when no CUDA device is present), which is how CI checks them against
the torch path. Launches are counted (:func:`launch_count`) so tests can hold the path to four.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

# CPU tensors run only under Triton's interpreter, which must be chosen before Triton is first
# imported (its own library functions are decorated then); tests set it in conftest.py.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # the optional dependency decides whether the fused path exists
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - exercised where the [cuda] extra is absent
    triton = None
    tl = None

INTERPRETED = triton is not None and isinstance(tl.standard.sum, InterpretedFunction)
"""Whether the kernels run under Triton's interpreter (fixed when Triton was imported)."""

__all__ = ["available", "FusedAccess", "launch", "launches_recorded", "launch_count",
           "in_launch", "translate", "equivalence_state", "LAUNCHES_PER_CALL"]

LAUNCHES_PER_CALL = 4  # an access, and a placement (its K1's program 0 reclaims shadows)
_launches = 0
_launching = False
_interpreter_lock = threading.Lock()  # the interpreter's grid state is process-global


def available() -> bool:
    """Whether Triton imported (the fused path can run at all)."""
    return triton is not None


def launch_count() -> int:
    """Fused-kernel launches issued so far in this process (tests diff it around a call)."""
    return _launches


def in_launch() -> bool:
    """True while a fused kernel is being launched (the interpreter's own tensor work then
    belongs to the launch: tests count device ops outside launches)."""
    return _launching


_recorder = None


@contextlib.contextmanager
def launches_recorded(record):
    """While on (process-wide), every fused launch calls ``record(kernel, grid, *args,
    **meta)`` instead of running: for tools that record launches without a device
    (:mod:`ulacache.kernels.fused_compile`, ``ulacache rehearse`` on the meta device)."""
    global _recorder
    saved, _recorder = _recorder, record
    try:
        yield
    finally:
        _recorder = saved


def launch(kernel, grid, *args, **meta) -> None:
    """Launch one fused kernel (every fused module launches through here: counted, serialised
    under the interpreter, recordable)."""
    global _launches, _launching
    if _recorder is not None:
        _recorder(kernel, grid, *args, **meta)
        return
    if not INTERPRETED:
        _launches += 1
        kernel[grid](*args, **meta)
        return
    # Simulated TP ranks are threads: one interpreted launch at a time (a launch never waits
    # on another rank, so serialising launches cannot deadlock a collective).
    with _interpreter_lock:
        _launches += 1
        _launching = True
        try:
            kernel[grid](*args, **meta)
        finally:
            _launching = False
_interpreter_lock = threading.Lock()  # the interpreter's grid state is process-global


COUNTER_COLUMNS = {"accesses": 0, "gpu_hits": 1, "promotions": 2, "writebacks": 3,
                   "placed": 4, "spills": 5, "released_gpu": 6, "released_cpu": 7,
                   "access_overflow": 8, "place_overflow": 9, "invalid": 10, "remaps": 11,
                   "shadowed": 12, "reclaims": 13, "shadows_released": 14, "rewrites": 15,
                   "prefetches": 16}
"""Columns of ``ulacache.group.COUNTERS`` the kernels add to (a test holds them equal)."""

if triton is not None:
    _c = {name: tl.constexpr(col) for name, col in COUNTER_COLUMNS.items()}
    C_ACCESSES, C_HITS, C_PROMOTIONS = _c["accesses"], _c["gpu_hits"], _c["promotions"]
    C_WRITEBACKS, C_PLACED, C_SPILLS = _c["writebacks"], _c["placed"], _c["spills"]
    C_ACCESS_OVERFLOW, C_PLACE_OVERFLOW = _c["access_overflow"], _c["place_overflow"]
    C_INVALID = _c["invalid"]
    C_REMAPS, C_SHADOWED, C_REWRITES = _c["remaps"], _c["shadowed"], _c["rewrites"]
    C_RECLAIMS, C_PREFETCHES = _c["reclaims"], _c["prefetches"]
    # status bits of each entry (int32 scratch between the launches); BACK: a placement's
    # victim remapped to its shadow, whose popped CPU slot goes back to the stack in K4
    KEEP, FIRST, WANT, MOVED, INVALID, BACK = (tl.constexpr(1 << b) for b in range(6))
    WAS_ON_CPU = tl.constexpr(-2)  # ulacache.group.WAS_ON_CPU; BORN is -1
    RECENT = tl.constexpr(2)  # ulacache.group.RECLAIM_RECENT_ROUNDS
    INVALID_ROW = tl.constexpr(-2)  # ulacache.tp.INVALID_ROW: a TP owner's "not stored"
    NO_CLAIM = tl.constexpr(2**31 - 1)  # ulacache.group.NO_CLAIM: claim tables are int32
    COLD_AGE = tl.constexpr(2)  # ulacache.pblru.COLD_ROUND_AGE
    ROUND_MOD = tl.constexpr(2**16)  # ulacache.pblru.ROUND_MODULUS: round_of is int16

    @triton.jit
    def bucket_row_of(bits, ring_of, slot, mask, W1, NB: tl.constexpr):
        """PBLRU._row_of of distinct ``slot`` where ``mask``: free 0 | current NB + 2 | cold 1
        by the rows' bits, else the ring row 2 + ``ring_of``. Other lanes may move other bits
        of the same words meanwhile (atomics, no carries): a slot's own bit only its lane
        moves, so the plain loads read it right."""
        word = slot // 63
        bit = tl.full(slot.shape, 1, tl.int64) << (slot - word * 63)
        free = (tl.load(bits + word, mask=mask, other=0) & bit) != 0
        cold = (tl.load(bits + W1 + word, mask=mask, other=0) & bit) != 0
        cur = (tl.load(bits + (NB + 2) * W1 + word, mask=mask, other=0) & bit) != 0
        row = 2 + tl.load(ring_of + slot, mask=mask, other=0).to(tl.int64)
        row = tl.where(cold, 1, row)
        row = tl.where(cur, NB + 2, row)
        return tl.where(free, 0, row)

    @triton.jit
    def move_slots(bits, counts, supc, hypc, rowc, slot, src, dst, mask, W1, S1, H1,
                    HY: tl.constexpr):
        """Move ``slot`` from bucket row ``src`` to ``dst`` where ``mask`` (PBLRU._move_bits):
        +/- 2**bit on the words (no carries: the old bit is set, the new one clear) and +/- 1
        on every count level, all atomic (other programs move bits of the same words)."""
        slot = tl.where(mask, slot, 0)
        src = src + tl.zeros_like(slot)  # rows may be scalars: one pointer per lane
        dst = dst + tl.zeros_like(slot)
        word = slot // 63
        value = tl.full(slot.shape, 1, tl.int64) << (slot - word * 63)
        sup = word // 16
        hyp = sup // HY
        one = tl.full(slot.shape, 1, tl.int32)
        tl.atomic_add(bits + src * W1 + word, -value, mask=mask, sem="relaxed")
        tl.atomic_add(bits + dst * W1 + word, value, mask=mask, sem="relaxed")
        tl.atomic_add(counts + src * W1 + word, -one, mask=mask, sem="relaxed")
        tl.atomic_add(counts + dst * W1 + word, one, mask=mask, sem="relaxed")
        tl.atomic_add(supc + src * S1 + sup, -one, mask=mask, sem="relaxed")
        tl.atomic_add(supc + dst * S1 + sup, one, mask=mask, sem="relaxed")
        tl.atomic_add(hypc + src * H1 + hyp, -one, mask=mask, sem="relaxed")
        tl.atomic_add(hypc + dst * H1 + hyp, one, mask=mask, sem="relaxed")
        tl.atomic_add(rowc + src * 2, -one, mask=mask, sem="relaxed")
        tl.atomic_add(rowc + dst * 2, one, mask=mask, sem="relaxed")

    @triton.jit
    def touch_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
               entered, slot, mask, W1, S1, H1, NB: tl.constexpr, HY: tl.constexpr,
               ASSIGNED: tl.constexpr):
        """PBLRU.touch / assign of distinct ``slot`` where ``mask``."""
        slot = tl.where(mask, slot, 0)
        round_t = tl.load(round_ptr)
        epoch_t = tl.load(epoch_ptr)
        old = bucket_row_of(bits, ring_of, slot, mask, W1, NB)
        move = mask & (old != NB + 2)
        move_slots(bits, counts, supc, hypc, rowc, slot, old, NB + 2, move, W1, S1, H1, HY)
        if ASSIGNED:
            turned = move
        else:
            turned = move & (old <= 1)
        tl.atomic_add(entered, tl.sum(turned.to(tl.int64)), sem="relaxed")
        # truncating casts: the round modulo 2**16, the ring row (< NB <= 2**15) exactly
        tl.store(round_of + slot, (tl.zeros_like(slot) + round_t).to(tl.int16), mask=move)
        tl.store(ring_of + slot, (tl.zeros_like(slot) + epoch_t % NB).to(tl.int16), mask=move)

    @triton.jit
    def admit_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
                    slot, mask, W1, S1, H1, NB: tl.constexpr, HY: tl.constexpr):
        """PBLRU.admit of distinct ``slot`` where ``mask``: into the cold row (1), stamped a
        round ``COLD_AGE`` behind; pinned slots stay."""
        slot = tl.where(mask, slot, 0)
        round_t = tl.load(round_ptr)
        old = bucket_row_of(bits, ring_of, slot, mask, W1, NB)
        move = mask & (old != 1) & (old != NB + 2)
        move_slots(bits, counts, supc, hypc, rowc, slot, old, 1, move, W1, S1, H1, HY)
        tl.store(round_of + slot, (tl.zeros_like(slot) + round_t - COLD_AGE).to(tl.int16),
                 mask=move)

    @triton.jit
    def claim_in_range(addrs, claim, n, N, BLOCK: tl.constexpr):
        """Every in-range entry claims its address: ``atomic_min(claim[addr], position)`` (the
        first launch of a TP rank's gates and of a release)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        inrange = live & (a >= 0) & (a < N)
        tl.atomic_min(claim + tl.where(inrange, a, N), i.to(tl.int32), mask=inrange,
                      sem="relaxed")

    @triton.jit
    def _k1_claim(addrs, local, loc, claim, phys_out, status, counters, n, N, NG, RANK,
                  shadow, cpu_free, cpu_top, cursor, rowc, round_of, round_t, G,
                  PLACE: tl.constexpr, SHADOWS: tl.constexpr, TPP: tl.constexpr,
                  BLOCK: tl.constexpr, PREFETCH: tl.constexpr = False,
                  VERDICT: tl.constexpr = True):
        if PLACE and SHADOWS:
            # program 0 first gives back shadows until the free stack holds what this placement
            # may pop (its entries beyond the free GPU slots, PB-LRU's free row count):
            # nothing else reads the stack or the shadows before K3
            if tl.program_id(0) == 0:
                reclaim_shadows(shadow, cpu_free, cpu_top, cursor, counters,
                                round_of, round_t, n - tl.load(rowc), G, 1024)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        raw = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        if TPP > 1:
            # TP rank RANK of TPP: global address t is local position t // TPP on rank
            # t % TPP; peers' addresses are not this access's (the gates serve them)
            striped = (raw >= 0) & (raw < NG)
            mine = striped & (raw % TPP == RANK)
            a = tl.where(mine, raw // TPP, -1)
            peers = striped & ~mine
        else:
            a = raw
            peers = i < 0  # none (a false tensor of the right shape)
        inrange = live & (a >= 0) & (a < N)
        safe = tl.where(inrange, a, N)
        phys = tl.load(loc + safe, mask=live, other=-1).to(tl.int64)  # int32 mapping
        if PLACE:
            keep = inrange & (phys < 0)
            st = keep.to(tl.int32)
        elif PREFETCH:  # a hint: what is not live is skipped, not counted
            keep = inrange & (phys >= 0)
            st = keep.to(tl.int32)
        else:
            keep = inrange & (phys >= 0)
            bad = live & (raw != -1) & ~keep & ~peers
            tl.atomic_add(counters + C_INVALID, tl.sum(bad.to(tl.int64)), sem="relaxed")
            st = keep.to(tl.int32)
            if TPP > 1 and VERDICT:  # K4 writes the owner's "not stored" verdict for the
                st = st | tl.where(bad, INVALID, 0)  # buffered TP mode's peers' table
        tl.atomic_min(claim + safe, i.to(tl.int32), mask=keep, sem="relaxed")
        tl.store(local + i, a, mask=live)
        tl.store(phys_out + i, phys, mask=live)
        tl.store(status + i, st, mask=live)

    @triton.jit
    def _k2_first_touch(local, claim, phys_in, status, block_want, block_took, block_back,
                        victim_out, counters,
                        bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                        epoch_ptr, entered, n, N, G, W1, S1, H1,
                        PLACE: tl.constexpr, NB: tl.constexpr, HY: tl.constexpr,
                        BLOCK: tl.constexpr, PREFETCH: tl.constexpr = False):
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        st = tl.load(status + i, mask=live, other=0)
        keep = (st & KEEP) != 0
        a = tl.load(local + i, mask=live, other=-1)
        safe = tl.where(keep, a, N)
        first = keep & (tl.load(claim + safe, mask=keep, other=-1) == i)
        # Only the first occurrence resets its claim; a duplicate reading either value is not
        # first (neither equals its own position).
        tl.store(claim + safe, tl.full(safe.shape, NO_CLAIM, tl.int32), mask=first)
        if PLACE:
            want = first
            bad = live & (a != -1) & ~first
            tl.atomic_add(counters + C_INVALID, tl.sum(bad.to(tl.int64)), sem="relaxed")
        elif PREFETCH:  # resident predictions are left as they are (not touched)
            want = first & (tl.load(phys_in + i, mask=live, other=-1) >= G)
        else:
            phys = tl.load(phys_in + i, mask=live, other=-1)
            hit = first & (phys < G)
            want = first & (phys >= G)
            touch_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
                   entered, phys, hit, W1, S1, H1, NB, HY, False)
            tl.atomic_add(counters + C_ACCESSES, tl.sum(first.to(tl.int64)), sem="relaxed")
            tl.atomic_add(counters + C_HITS, tl.sum(hit.to(tl.int64)), sem="relaxed")
        st = st | tl.where(first, FIRST, 0) | tl.where(want, WANT, 0)
        tl.store(status + i, st, mask=live)
        tl.store(block_want + pid, tl.sum(want.to(tl.int32)))
        tl.store(block_took + pid, 0)  # K3 counts into these
        tl.store(block_back + pid, 0)
        tl.store(victim_out + i, tl.full(a.shape, -1, tl.int64), mask=live)  # K3: wants only

    @triton.jit
    def _victim_row(j, epoch_t, NB: tl.constexpr):
        """Bucket row at position ``j`` of the victim order: free, cold, recent oldest first."""
        return tl.where(j == 0, 0, tl.where(j == 1, 1, 2 + (epoch_t + j - 1) % NB))

    @triton.jit
    def _select(vals, r):
        """Per lane of ``vals [BLOCK, M]`` (counts in order): the index holding rank ``r`` and
        the rank within it."""
        ends = tl.cumsum(vals, 1)
        before = ends <= r[:, None]
        return tl.sum(before.to(tl.int32), 1), r - tl.sum(tl.where(before, vals, 0), 1)

    @triton.jit
    def victim_order(rowc, epoch_ptr, NB: tl.constexpr, RP: tl.constexpr):
        """(epoch, row totals in victim order ``[RP]``, their sum, free slots)."""
        epoch_t = tl.load(epoch_ptr)
        j = tl.arange(0, RP)
        tot = tl.load(rowc + _victim_row(j, epoch_t, NB) * 2, mask=j < NB + 2, other=0)
        return epoch_t, tot, tl.sum(tot), tl.load(rowc)

    @triton.jit
    def find_victims(rank, want, tot, total, epoch_t, bits, counts, supc, hypc, W1, S1, H1, NS, NH,
                 NB: tl.constexpr, RP: tl.constexpr, HP: tl.constexpr, HY: tl.constexpr,
                 HYP2: tl.constexpr, SUB: tl.constexpr):
        """PBLRU.victims(n)[rank] where ``want`` (``int64 [SUB]``, -1 elsewhere or past the
        eligible slots): descend row totals -> hyper blocks -> superblocks -> words -> bits."""
        sel = want & (rank < total)
        jj, r = _select(tl.zeros([SUB, RP], tl.int32) + tot[None, :], rank)
        row = tl.where(sel, _victim_row(jj, epoch_t, NB), 0)
        h = tl.arange(0, HP)
        hb, r = _select(tl.load(hypc + row[:, None] * H1 + h[None, :],
                                mask=sel[:, None] & (h[None, :] < NH), other=0), r)
        k = tl.arange(0, HYP2)[None, :]
        s = hb[:, None] * HY + k
        sb, r = _select(tl.load(supc + row[:, None] * S1 + s,
                                mask=sel[:, None] & (k < HY) & (s < NS), other=0), r)
        sb = hb * HY + sb
        w = sb[:, None] * 16 + tl.arange(0, 16)[None, :]
        wb, r = _select(tl.load(counts + row[:, None] * W1 + w, mask=sel[:, None], other=0),
                        r)
        word = sb * 16 + wb
        val = tl.load(bits + row * W1 + word, mask=sel, other=0)
        ones = (val[:, None] >> tl.arange(0, 64)[None, :].to(tl.int64)) & 1
        bit, _ = _select(ones, r.to(tl.int64))
        return tl.where(sel, word.to(tl.int64) * 63 + bit, -1)

    @triton.jit
    def _k3_victims_move(local, phys_in, status, block_want, block_took, block_back, top_saved,
                         victim_out, counters,
                         bits, counts, supc, hypc, rowc, epoch_ptr,
                         loc, gpu_owner, shadow, cpu_free, cpu_top,
                         gpu_pool, cpu_pool, g_sl, g_sr, c_sl, c_sr,
                         n, G, C, W1, S1, H1, NS, NH, n_blocks,
                         PLACE: tl.constexpr, SHADOWS: tl.constexpr,
                         NB: tl.constexpr, RP: tl.constexpr,
                         L: tl.constexpr, RW: tl.constexpr, HP: tl.constexpr,
                         HY: tl.constexpr, HYP2: tl.constexpr,
                         BP: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                         BLOCK: tl.constexpr, budget=None, PREFETCH: tl.constexpr = False,
                         moves=None, MSTRIDE=0, DEFER: tl.constexpr = False):
        # DEFER (an access, ``SelectionGroup.access_deferred``): the caller passes L = 1, so
        # only the anchor layer's bytes move here; every entry's move goes to ``moves``
        # (int32 [3, MSTRIDE]: victim GPU slot, source CPU slot, write-back CPU slot, -1 none)
        pid = tl.program_id(0)
        b = tl.arange(0, BP)
        run = tl.sum(tl.load(block_want + b, mask=b < pid, other=0))  # wants before this entry
        epoch_t, tot, total, n_free = victim_order(rowc, epoch_ptr, NB, RP)
        top = tl.load(cpu_top)
        if PREFETCH:
            limit = tl.load(budget)  # the first ``limit`` misses only (K4 charges them)
        if PLACE or SHADOWS:
            tl.store(top_saved, top, mask=pid == 0)  # K4 rebuilds the stack from it
        # SUB entries at a time: the search tiles are [SUB, <= 128] (no register spills)
        for c in range(0, BLOCK, SUB):
            i = pid * BLOCK + c + tl.arange(0, SUB)
            live = i < n
            st = tl.load(status + i, mask=live, other=0)
            want = (st & WANT) != 0
            rank = run + tl.cumsum(want.to(tl.int32), 0) - 1
            run += tl.sum(want.to(tl.int32))
            if PREFETCH:
                want = want & (rank < limit)
            if DEFER:  # no move unless one is recorded below
                none = tl.full([SUB], -1, tl.int32)
                tl.store(moves + i, none, mask=live)
                tl.store(moves + MSTRIDE + i, none, mask=live)
                tl.store(moves + 2 * MSTRIDE + i, none, mask=live)
            if tl.sum(want.to(tl.int32)) > 0:  # sub-blocks of hits only: nothing to do
                victim = find_victims(rank, want, tot, total, epoch_t, bits, counts, supc, hypc, W1,
                                  S1, H1, NS, NH, NB, RP, HP, HY, HYP2, SUB)
                ok = victim >= 0
                vs = tl.where(ok, victim, G)
                owner = tl.load(gpu_owner + vs, mask=ok, other=-1).to(tl.int64)  # int32
                occupied = ok & (owner >= 0)
                had = tl.load(shadow + vs, mask=occupied, other=-1).to(tl.int64)
                remap = occupied & (had >= 0)  # evicted onto its shadow: nothing copied out
                copy_out = occupied & ~remap  # a write-back (place: a spill)
                a = tl.load(local + i, mask=live, other=-1)
                if PLACE or SHADOWS:
                    # every occupied victim takes the next free-stack position (pop order =
                    # rank order); a remapped one hands it back in K4
                    pos = top - 1 - (rank - n_free)
                    took = occupied & (pos >= 0)
                    popped = tl.load(cpu_free + tl.where(took, pos, 0), mask=took,
                                     other=C).to(tl.int64)  # int32 stack
                    back = took & remap
                    # this block's stack positions taken and handed back (zeroed by K2;
                    # atomics rather than loop-carried sums keep K3 in registers)
                    tl.atomic_add(block_took + pid, tl.sum(took.to(tl.int32)), sem="relaxed")
                    tl.atomic_add(block_back + pid, tl.sum(back.to(tl.int32)), sem="relaxed")
                if PLACE:
                    copy_out = copy_out & took  # no free CPU slot: the row is not placed
                    cslot = tl.where(copy_out, popped, C)
                    dst = cslot
                    ok = ok & (~occupied | remap | copy_out)
                    victim = tl.where(ok, victim, -1)
                    moved = copy_out
                else:
                    cslot = tl.where(ok, tl.load(phys_in + i, mask=ok, other=G) - G, C)
                    if SHADOWS:
                        into_free = copy_out & took  # the victim goes to a free CPU slot ...
                        swap = copy_out & ~took  # ... else to the one its promoted row vacates
                        keep = ok & ~swap  # the vacated slot stays the promoted row's shadow
                        dst = tl.where(into_free, popped, cslot)
                    else:
                        into_free = ok & (i < 0)
                        swap = copy_out
                        keep = into_free
                        dst = cslot
                    moved = ok & ~occupied & ~keep  # the vacated CPU slot goes back (push)
                # -- data first: every layer of the group
                for layer in range(L):
                    for c0 in range(0, RW, CHUNK):
                        cc = c0 + tl.arange(0, CHUNK)[None, :]
                        cm = cc < RW
                        gp = gpu_pool + layer * g_sl + vs[:, None] * g_sr + cc
                        dp = cpu_pool + layer * c_sl + dst[:, None] * c_sr + cc
                        if PLACE:
                            tl.store(dp, tl.load(gp, mask=copy_out[:, None] & cm),
                                     mask=copy_out[:, None] & cm)
                        else:  # write-back and promotion, or a single copy
                            cp = cpu_pool + layer * c_sl + cslot[:, None] * c_sr + cc
                            out_row = tl.load(gp, mask=copy_out[:, None] & cm)
                            in_row = tl.load(cp, mask=ok[:, None] & cm)
                            tl.store(gp, in_row, mask=ok[:, None] & cm)
                            tl.store(dp, out_row, mask=copy_out[:, None] & cm)
                if DEFER:  # the other layers' bytes of the same moves: replayed later
                    tl.store(moves + i, tl.where(ok, vs, -1).to(tl.int32), mask=live)
                    tl.store(moves + MSTRIDE + i, tl.where(ok, cslot, -1).to(tl.int32),
                             mask=live)
                    tl.store(moves + 2 * MSTRIDE + i, tl.where(copy_out, dst, -1).to(tl.int32),
                             mask=live)
                # -- then the mapping
                evicted = copy_out | remap
                tl.store(loc + tl.where(evicted, owner, 0),
                         tl.where(copy_out, G + dst, G + had).to(tl.int32), mask=evicted)
                tl.atomic_add(counters + C_REMAPS, tl.sum(remap.to(tl.int64)), sem="relaxed")
                tl.atomic_add(counters + C_REWRITES,
                              tl.sum((copy_out & (had == WAS_ON_CPU)).to(tl.int64)),
                              sem="relaxed")
                if PLACE:
                    tl.store(shadow + vs, tl.full(vs.shape, -1, tl.int32), mask=ok)
                    tl.atomic_add(counters + C_PLACED, tl.sum(ok.to(tl.int64)), sem="relaxed")
                    tl.atomic_add(counters + C_SPILLS, tl.sum(copy_out.to(tl.int64)),
                                  sem="relaxed")
                    tl.atomic_add(counters + C_PLACE_OVERFLOW,
                                  tl.sum((want & ~ok).to(tl.int64)), sem="relaxed")
                else:
                    tl.store(shadow + vs, tl.where(keep, cslot, WAS_ON_CPU).to(tl.int32),
                             mask=ok)
                    tl.store(cpu_free + top + rank, cslot, mask=moved)
                    if PREFETCH:
                        tl.atomic_add(counters + C_PREFETCHES, tl.sum(ok.to(tl.int64)),
                                      sem="relaxed")
                    else:
                        tl.atomic_add(counters + C_PROMOTIONS, tl.sum(ok.to(tl.int64)),
                                      sem="relaxed")
                        tl.atomic_add(counters + C_ACCESS_OVERFLOW,
                                      tl.sum((want & ~ok).to(tl.int64)), sem="relaxed")
                    tl.atomic_add(counters + C_WRITEBACKS, tl.sum(copy_out.to(tl.int64)),
                                  sem="relaxed")
                    tl.atomic_add(counters + C_SHADOWED, tl.sum(keep.to(tl.int64)),
                                  sem="relaxed")
                tl.store(loc + tl.where(ok, a, 0), victim.to(tl.int32), mask=ok)
                tl.store(gpu_owner + vs, a.to(tl.int32), mask=ok)
                tl.store(victim_out + i, victim, mask=want)
                if PLACE or SHADOWS:
                    # K4 hands these slots back (phys_in was read above: cslot)
                    tl.store(phys_in + i, popped, mask=back)
                    tl.store(status + i, st | tl.where(moved, MOVED, 0) | tl.where(back, BACK, 0),
                             mask=moved | back)
                else:
                    tl.store(status + i, st | MOVED, mask=moved)

    @triton.jit
    def _k4_assign_translate(local, status, victim_in, out, loc, cpu_top, cpu_free, popped_in,
                             block_took, block_back, top_saved,
                             bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                             epoch_ptr, entered, n, N, G, W1, S1, H1, row_base, n_blocks,
                             PLACE: tl.constexpr, SHADOWS: tl.constexpr, NB: tl.constexpr,
                             HY: tl.constexpr, BP: tl.constexpr, BLOCK: tl.constexpr,
                             budget=None, PREFETCH: tl.constexpr = False):
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        victim = tl.load(victim_in + i, mask=live, other=-1)
        if PREFETCH:
            admit_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                        epoch_ptr, victim, victim >= 0, W1, S1, H1, NB, HY)
            tl.atomic_add(budget, -tl.sum((victim >= 0).to(tl.int64)), sem="relaxed")
        else:
            touch_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                        epoch_ptr, entered, victim, victim >= 0, W1, S1, H1, NB, HY, True)
        st = tl.load(status + i, mask=live, other=0)
        if PLACE or SHADOWS:
            # K3 took stack positions [top - took, top) in victim order; the slots of remapped
            # victims go back to the bottom of that range, in entry order (no atomics: every
            # program computes the same totals, program 0 moves the pointer)
            b = tl.arange(0, BP)
            took = tl.sum(tl.load(block_took + b, mask=b < n_blocks, other=0)).to(tl.int64)
            back_all = tl.sum(tl.load(block_back + b, mask=b < n_blocks, other=0)).to(tl.int64)
            before = tl.sum(tl.load(block_back + b, mask=b < pid, other=0)).to(tl.int64)
            base = tl.load(top_saved) - took
            back = (st & BACK) != 0
            dest = base + before + tl.cumsum(back.to(tl.int64), 0) - 1
            tl.store(cpu_free + dest, tl.load(popped_in + i, mask=back, other=0), mask=back)
            tl.store(cpu_top, base + back_all, mask=pid == 0)
        else:  # access without shadows: promotions into free GPU slots pushed their CPU slot
            tl.atomic_add(cpu_top, tl.sum(((st & MOVED) != 0).to(tl.int64)), sem="relaxed")
        if not PLACE and not PREFETCH:
            keep = (st & KEEP) != 0
            a = tl.load(local + i, mask=keep, other=N)
            rows = tl.load(loc + tl.where(keep, a, N), mask=keep, other=-1).to(tl.int64)
            rows = tl.where(keep & (rows >= 0) & (rows < G), rows + row_base, -1)
            rows = tl.where((st & INVALID) != 0, INVALID_ROW, rows)  # TP stripes only
            tl.store(out + i, rows.to(tl.int32), mask=live)

    @triton.jit
    def _reclaim(shadow, cpu_free, cpu_top, cursor, counters, round_of, round_t,
                 need, G, BLOCK: tl.constexpr):
        """One program: :func:`reclaim_shadows` alone (a placement runs it inside K1)."""
        reclaim_shadows(shadow, cpu_free, cpu_top, cursor, counters, round_of,
                        round_t, need, G, BLOCK)

    @triton.jit
    def reclaim_shadows(shadow, cpu_free, cpu_top, cursor, counters, round_of,
                        round_t, need, G, BLOCK: tl.constexpr):
        """Shadows back to the CPU free stack until it holds ``need`` slots: those of rows
        touched in the last ``RECENT`` rounds first, then the others, each pass scanning GPU
        slots from ``cursor`` (wrapping) only until enough were found; the cursor moves past
        the last one the second pass took (``SelectionGroup.reclaim``).

        The second pass reads only older slots' shadows, which the first pass never writes:
        no store of one pass is read back by another thread of this program."""
        top = tl.load(cpu_top)
        short = tl.maximum(need - top, 0)
        start = tl.load(cursor)
        now = tl.load(round_t)
        taken = tl.sum(tl.zeros([BLOCK], tl.int64))
        last = taken - 1
        for second in tl.static_range(2):
            j0 = taken * 0
            while (taken < short) & (j0 < G):
                j = j0 + tl.arange(0, BLOCK).to(tl.int64)
                inr = j < G
                slot = (start + j) % G
                # PBLRU.round_age: the int16 stamp's age modulo 2**16
                stamp = tl.load(round_of + slot, mask=inr, other=0).to(tl.int64)
                age = (now - stamp) & (ROUND_MOD - 1)
                older = age >= RECENT
                want = (inr & older) if second == 1 else (inr & ~older)
                had = tl.load(shadow + slot, mask=want, other=-1).to(tl.int64)
                live = want & (had >= 0)
                rank = taken + tl.cumsum(live.to(tl.int64), 0)  # 1-based, in pass order
                take = live & (rank <= short)
                tl.store(cpu_free + top + rank - 1, had, mask=take)
                tl.store(shadow + slot, tl.full(slot.shape, WAS_ON_CPU, tl.int32), mask=take)
                taken += tl.sum(take.to(tl.int64))
                if second == 1:
                    last = tl.maximum(last, tl.max(tl.where(take, j, -1)))
                j0 += BLOCK
        tl.store(cpu_top, top + taken)
        tl.store(cursor, tl.where(last >= 0, (start + last + 1) % G, start))
        tl.atomic_add(counters + C_RECLAIMS, taken, sem="relaxed")

    @triton.jit
    def _translate(addrs, loc, out, n, N, G, row_base, BLOCK: tl.constexpr):
        """``out = loc[addr] + row_base`` where GPU-resident, else -1 (no side effect)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        ok = live & (a >= 0) & (a < N)
        rows = tl.load(loc + tl.where(ok, a, N), mask=ok, other=-1).to(tl.int64)
        rows = tl.where(ok & (rows >= 0) & (rows < G), rows + row_base, -1)
        tl.store(out + i, rows.to(tl.int32), mask=live)


if triton is not None:

    @triton.jit
    def _replay_moves(moves, gpu_pool, cpu_pool, g_sr, c_sr, n, MSTRIDE, RW: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One layer's bytes of a deferred access's moves (``FusedAccess.replay``): per entry
        with a victim, the victim's row out to its write-back CPU slot (if any) and the
        promoted row in from its CPU slot, both read before either write (K3's order)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        vs = tl.load(moves + i, mask=live, other=-1).to(tl.int64)
        cs = tl.load(moves + MSTRIDE + i, mask=live, other=-1).to(tl.int64)
        ds = tl.load(moves + 2 * MSTRIDE + i, mask=live, other=-1).to(tl.int64)
        ok = vs >= 0
        out = ok & (ds >= 0)
        vs, cs, ds = tl.where(ok, vs, 0), tl.where(ok, cs, 0), tl.where(out, ds, 0)
        for c0 in range(0, RW, CHUNK):
            cc = c0 + tl.arange(0, CHUNK)[None, :]
            cm = cc < RW
            gp = gpu_pool + vs[:, None] * g_sr + cc
            out_row = tl.load(gp, mask=out[:, None] & cm)
            in_row = tl.load(cpu_pool + cs[:, None] * c_sr + cc, mask=ok[:, None] & cm)
            tl.store(gp, in_row, mask=ok[:, None] & cm)
            tl.store(cpu_pool + ds[:, None] * c_sr + cc, out_row, mask=out[:, None] & cm)


def pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def row_tile(n_buckets: int) -> int:
    """Lanes of the victim search's tile over PB-LRU's ``n_b + 2`` ordered rows: a power of two,
    at least 128. Why the floor: at 64 lanes (32 buckets) ptxas gives G3 an 8-byte stack frame
    on sm_90 (``kernels/fused_compile.py`` refuses any); the masked lanes cost a few adds."""
    return max(128, pow2(n_buckets + 2))


def _word_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` (``uint8 [L, R, row_bytes]``) as the widest integer words its row size,
    strides and address allow (fewer, wider loads in the copy loops); a view, no copy."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if pool.shape[2] % size == 0 and pool.stride(0) % size == 0 and \
                pool.stride(1) % size == 0 and pool.data_ptr() % size == 0 and \
                pool.stride(2) == 1:
            return pool.view(dtype)
    return pool


SCRATCH_DTYPES = (torch.int64, torch.int64, torch.int32, torch.int64)
"""Per-entry scratch of one access / place call (local address, phys, status, victim); the
release uses the first tensor (its CPU slots)."""


class Scratch:
    """Per-call scratch: one tensor per entry of each dtype given, plus per-block ``int32``
    counts, allocated once for ``capacity`` entries and never replaced: a CUDA graph that
    captured views of it stays valid whatever is called later (a prefill larger than any
    decode step included). Calls of more than ``capacity`` entries are the caller's to split
    (:class:`ulacache.group.SelectionGroup` and :class:`ulacache.tp.TPAddressSpace` run them
    in chunks); one here raises :class:`~ulacache.errors.ShapeError`."""

    def __init__(self, device: torch.device, dtypes: tuple[torch.dtype, ...] | list,
                 block: int, capacity: int):
        self.device, self.dtypes, self.block = device, tuple(dtypes), block
        self.cap = -(-max(1, int(capacity)) // block) * block
        self.tensors: tuple[torch.Tensor, ...] = (
            *(torch.empty(self.cap, dtype=d, device=device) for d in self.dtypes),
            torch.empty(3 * (self.cap // block), dtype=torch.int32, device=device))

    def get(self, n: int) -> tuple[torch.Tensor, ...]:
        if n > self.cap:
            from ulacache.errors import ShapeError

            raise ShapeError(f"a fused call of {n} entries exceeds its scratch ({self.cap} "
                             "entries, config call_capacity): split it into chunks")
        *per_entry, blocks = self.tensors
        return (*(t[:n] for t in per_entry), blocks)


class FusedAccess:
    """The fused kernels bound to one selection group's tensors
    (:class:`ulacache.state.GroupTables`, PB-LRU policy).

    Calls take the group's already-checked inputs, at most ``scratch.cap`` entries; every call
    is four launches and no other device op (the scratch is allocated once).
    """

    BLOCK = 128
    # Entries per victim search in K3 / G3. Compiled: 16 (the [SUB, 128] search tiles stay in
    # registers, no spills on sm_90 / sm_100). Interpreted (CI on CPU): 64, because Triton's
    # interpreter pays per op, not per element, and the decisions do not depend on SUB; a
    # block still splits into two sub-blocks, so the carry between them is exercised (a test
    # also runs the compiled value through the interpreter).
    SUB = 64 if INTERPRETED else 16
    CHUNK = 64  # words of a row copied per inner step
    # K3's register ceiling, given explicitly: without one, ptxas picks its own and under
    # Triton 3.6 (ptxas 12.8, sm_90) chose 128 for the placement variant and spilled 8 B. Its
    # allocation is not monotone in the ceiling: 168 spills under Triton 3.8, 200 and 224
    # under 3.6; 232, 240 and 255 spill nowhere in either (docs/fused-access.md). 255, the
    # hardware's limit, only switches the occupancy heuristic off; K3's time is its serial
    # victim search and row copies. ``python -m ulacache.kernels.fused_compile`` checks every
    # variant; interpreted launches drop the option.
    K3_MAXNREG = 255

    def __init__(self, tables, scratch: Scratch | None = None) -> None:
        if triton is None:
            raise RuntimeError("the fused access path needs Triton (pip install triton)")
        self.g = tables
        p = tables.policy
        self.nb = p.n_buckets
        self.w1, self.s1, self.h1 = p.n_words + 16, p.n_super + 1, p.n_hyper + 1
        self.rp = row_tile(p.n_buckets)
        self.hp = pow2(p.n_hyper)
        # shared by the groups of an address space (they run one at a time on one stream)
        self.shared_scratch = scratch if scratch is not None else \
            Scratch(tables.device, SCRATCH_DTYPES, self.BLOCK, tables.max_call)
        if self.shared_scratch.dtypes != SCRATCH_DTYPES or \
                self.shared_scratch.block != self.BLOCK:
            raise ValueError("a fused access scratch needs SCRATCH_DTYPES per BLOCK entries")
        self.top_saved = torch.zeros((), dtype=torch.int64, device=tables.device)  # K3 -> K4
        self.gpu_words = _word_view(tables.gpu)
        self.cpu_words = _word_view(tables.cpu)
        if self.gpu_words.dtype != self.cpu_words.dtype:  # one element type per copy loop
            self.gpu_words, self.cpu_words = tables.gpu, tables.cpu

    def scratch(self, n: int) -> tuple[torch.Tensor, ...]:
        """(local address int64 [n], phys int64 [n], status int32 [n], victim int64 [n],
        per-block counts int32 [3 x cap / BLOCK]: wants, stack positions taken, handed back)."""
        return self.shared_scratch.get(n)

    def _policy_args(self):
        p = self.g.policy
        return (p.bits, p.counts, p.super_counts, p.hyper_counts, p.row_counts)

    def run(self, addrs: torch.Tensor, place: bool, out: torch.Tensor | None = None,
            victim_out: torch.Tensor | None = None, row_base: int = 0,
            stripe: tuple[int, int, int] | None = None, verdicts: bool = True,
            prefetch_budget: torch.Tensor | None = None,
            moves: torch.Tensor | None = None) -> None:
        """K1..K4 over the flat contiguous ``addrs`` (``int32|int64``). Access writes the GPU
        rows to ``out`` (``int32``, ``addrs.numel()`` elements); place writes the slots to
        ``victim_out`` (``int64``). ``stripe = (P, rank, n_global)`` (access only): ``addrs``
        are TP-global; this rank's (``t % P == rank``) are accessed at ``t // P``, the rest
        read as padding without being counted invalid (:mod:`ulacache.tp` serves them).
        ``prefetch_budget`` (0-dim ``int64``): a prefetch instead of an access
        (``SelectionGroup.prefetch``): resident predictions untouched, the first ``budget``
        misses promoted and admitted cold, the budget decremented, nothing translated.
        ``moves`` (``int32 [3, >= n]``, access only): a deferred access, the anchor layer's
        bytes moved and every entry's move recorded for :meth:`replay`."""
        g, p = self.g, self.g.policy
        n = addrs.numel()
        if n == 0:
            return
        P, rank, n_global = stripe if stripe is not None else (1, 0, g.n_logical)
        local, phys, status, victim, blocks = self.scratch(n)
        nblk = self.shared_scratch.cap // self.BLOCK
        block_want, block_took, block_back = blocks[:nblk], blocks[nblk:2 * nblk], \
            blocks[2 * nblk:]
        if victim_out is not None:
            victim = victim_out
        grid = (-(-n // self.BLOCK),)
        N, G, C = g.n_logical, g.gpu_slots, g.cpu_slots
        pol = self._policy_args()
        stamps = (p.round_of, p.ring_of, p.round_t, p.epoch_t, p.entered)
        mode = dict(PLACE=place, BLOCK=self.BLOCK)
        if prefetch_budget is not None:  # the variant exists only where it is used
            mode["PREFETCH"] = True
            budget = dict(budget=prefetch_budget)
        else:
            budget = {}
        if moves is not None:  # the variant exists only where it is used
            budget.update(moves=moves, MSTRIDE=moves.stride(0), DEFER=True)
        launch(_k1_claim, grid, addrs, local, g.loc, g.claim, phys, status, g.counters, n, N,
                n_global, rank, g.shadow, g.cpu_free, g.cpu_top, g.reclaim_cursor,
                p.row_counts, p.round_of, p.round_t, G, SHADOWS=g.shadows and place, TPP=P,
                VERDICT=verdicts, **mode)  # (one access variant)
        launch(_k2_first_touch, grid, local, g.claim, phys, status, block_want, block_took,
                block_back, victim,
                g.counters,
                *pol, *stamps, n, N, G, self.w1, self.s1, self.h1, NB=self.nb, HY=p.hyper,
                **mode)
        gw, cw = self.gpu_words, self.cpu_words
        launch(_k3_victims_move, grid, local, phys, status, block_want, block_took, block_back,
                self.top_saved, victim, g.counters,
                *pol, p.epoch_t, g.loc, g.gpu_owner, g.shadow, g.cpu_free,
                g.cpu_top, gw, cw, gw.stride(0), gw.stride(1),
                cw.stride(0), cw.stride(1), n, G, C, self.w1, self.s1, self.h1, p.n_super,
                p.n_hyper, grid[0], NB=self.nb, RP=self.rp,
                L=1 if moves is not None else gw.shape[0], RW=gw.shape[2],
                HP=self.hp, HY=p.hyper, HYP2=pow2(p.hyper), BP=pow2(grid[0]),
                CHUNK=self.CHUNK, SUB=self.SUB, SHADOWS=g.shadows, maxnreg=self.K3_MAXNREG,
                **budget, **mode)
        budget = {k: v for k, v in budget.items() if k not in ("moves", "MSTRIDE", "DEFER")}
        launch(_k4_assign_translate, grid, local, status, victim,
                out if out is not None else status, g.loc, g.cpu_top, g.cpu_free, phys,
                block_took, block_back, self.top_saved, *pol, *stamps,
                n, N, G, self.w1, self.s1, self.h1, row_base, grid[0], NB=self.nb, HY=p.hyper,
                BP=pow2(grid[0]), SHADOWS=g.shadows, **budget, **mode)

    # Entries per program of a replay: a [REPLAY_BLOCK, CHUNK] tile of words per copy step
    REPLAY_BLOCK = 64 if INTERPRETED else 32

    def replay(self, moves: torch.Tensor, n: int, li: int) -> None:
        """Layer ``li``'s bytes of the first ``n`` moves a deferred :meth:`run` recorded in
        ``moves`` (``int32 [3, >= n]``): one launch."""
        gw, cw = self.gpu_words[li], self.cpu_words[li]
        launch(_replay_moves, (-(-n // self.REPLAY_BLOCK),), moves, gw, cw, gw.stride(0),
               cw.stride(0), n, moves.stride(0), RW=gw.shape[1], CHUNK=self.CHUNK,
               BLOCK=self.REPLAY_BLOCK)


    def reclaim(self, need: int) -> None:
        """Shadows back to the free stack until it holds ``need`` slots: one launch of one
        program (``ulacache.group.SelectionGroup.reclaim``; a placement does it in its K1)."""
        g = self.g
        p = g.policy
        launch(_reclaim, (1,), g.shadow, g.cpu_free, g.cpu_top, g.reclaim_cursor,
               g.counters, p.round_of, p.round_t, need, g.gpu_slots, BLOCK=1024)

    def translate(self, addrs: torch.Tensor, out: torch.Tensor, row_base: int = 0
                  ) -> torch.Tensor:
        """The group's GPU rows of ``addrs`` (one launch, no side effect; see :func:`translate`)."""
        return translate(self.g.loc, addrs, out, self.g.n_logical, self.g.gpu_slots, row_base)


def translate(loc: torch.Tensor, addrs: torch.Tensor, out: torch.Tensor, n_logical: int,
              gpu_slots: int, row_base: int = 0) -> torch.Tensor:
    """One launch: ``out = loc[addrs] + row_base`` where the row is GPU-resident, else ``-1``
    (``addrs`` flat contiguous ``int32|int64``, ``out`` ``int32`` of as many elements)."""
    n = addrs.numel()
    if n:
        launch(_translate, (-(-n // FusedAccess.BLOCK),), addrs, loc, out, n, n_logical,
                gpu_slots, row_base, BLOCK=FusedAccess.BLOCK)
    return out


def equivalence_state(group, pools: bool = True) -> dict[str, torch.Tensor]:
    """Every piece of a group's state the fused and torch paths must leave equal (tests and
    bench/access_bench.py compare two groups with it): mapping, owners, CPU free stack,
    counters, claim table, shadow table, every PB-LRU level, stamps and (``pools``) the rows.
    Scratch entries are left out: the torch path's masked writes land there and nothing reads them.
    ``group``: a :class:`ulacache.state.GroupTables` or anything with ``tables``. Host-side
    (reads the stack pointer)."""
    g = getattr(group, "tables", group)
    p, G, C = g.policy, g.gpu_slots, g.cpu_slots
    top = int(g.cpu_top)
    out = {
        "loc": g.loc, "gpu_owner": g.gpu_owner,
        "shadow": g.shadow[:G], "reclaim_cursor": g.reclaim_cursor,
        "cpu_top": g.cpu_top, "cpu_free": g.cpu_free[:top],
        "cpu_free_scratch": g.cpu_free[C:], "counters": g.counters, "claim": g.claim,
        "bits": p.bits[:, : p.n_words], "counts": p.counts[:, : p.n_words],
        "super_counts": p.super_counts[:, : p.n_super],
        "hyper_counts": p.hyper_counts[:, : p.n_hyper], "row_counts": p.row_counts[:, 0],
        "round_of": p.round_of[:G], "ring_of": p.ring_of[:G], "round_t": p.round_t,
        "epoch_t": p.epoch_t, "entered": p.entered,
    }
    if pools:
        out.update(gpu_pool=g.gpu[:, :G], cpu_pool=g.cpu[:, :C])
    return out
