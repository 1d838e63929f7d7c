"""TP mode's gates as one more fused stage: buffer hit / own / peer in four Triton launches.

A TP rank's step over one group (:meth:`ulacache.tp.TPAddressSpace.plan`) with the fused
path is: the rank's own access in four launches over the *global* addresses (the kernels of
:mod:`ulacache.kernels.fused_access` with ``stripe``: this rank's addresses only), one
all-gather of the owners' slot tables, then these four launches, which make the same decisions
as the torch gates in ``tp.py`` (tests hold every table, plan entry, counter and byte equal):

====  =====================================================================================
G1    every in-range address finds its entry in the call's claim hash (inserted by the
      first lane to reach it) and claims it with its position (``atomic_min``)
G2    first occurrence (the first resets the hash entry); peers' rows already buffered are
      touched (pinned this round); the rest whose owner served them want a buffer slot;
      per-block counts of wants; counters (selected, own rows, buffer hits, peer missing)
G3    rank of each want, its buffer slot (the buffer's PB-LRU victim order, same search as
      K3), the evicted copy unmapped, the new copy mapped; the plan (owner rank, owner's
      slot, buffer row) every layer's ``load`` copies; counters (fetches, overflow,
      evictions)
G4    the claimed slots assigned (turnover); the rows attention reads: own rows in place,
      peers' rows at their buffer row, ``-1`` elsewhere
====  =====================================================================================
"""

from __future__ import annotations

import torch

from ulacache import bufmap
from ulacache.group import NO_CLAIM as FREE_CLAIM

from . import fused_access as fa

HASH_EMPTY = -1
"""A free claim-hash key (addresses are >= 0)."""

__all__ = ["FusedGates", "TP_COUNTER_COLUMNS"]

TP_COUNTER_COLUMNS = {"selected": 0, "own_rows": 1, "buffer_hits": 2, "peer_fetches": 3,
                      "peer_missing": 4, "buffer_overflow": 5, "buffer_evictions": 7}
"""Columns of ``ulacache.tp.TP_COUNTERS`` the gates add to (a test holds them equal)."""

if fa.triton is not None:
    import triton
    import triton.language as tl

    from .fused_access import (
        C_INVALID,
        INVALID_ROW,
        NO_CLAIM,
        find_victims,
        touch_slots,
        victim_order,
    )

    _t = {name: tl.constexpr(col) for name, col in TP_COUNTER_COLUMNS.items()}
    T_SELECTED, T_OWN, T_HITS, T_FETCHES = (_t["selected"], _t["own_rows"], _t["buffer_hits"],
                                            _t["peer_fetches"])
    T_MISSING, T_OVERFLOW, T_EVICTIONS = (_t["peer_missing"], _t["buffer_overflow"],
                                          _t["buffer_evictions"])
    WANT = tl.constexpr(1)
    EMPTY, NEVER = tl.constexpr(HASH_EMPTY), tl.constexpr(-2)  # claim hash: free; no entry
    HASH_MULT = tl.constexpr(2654435761)  # Knuth's multiplicative hash (addresses < 2**31)
    WAYS, SPILL = tl.constexpr(bufmap.WAYS), tl.constexpr(bufmap.SPILL)
    HASH1, HASH2 = tl.constexpr(bufmap.HASH1), tl.constexpr(bufmap.HASH2)

    @triton.jit
    def _buckets(a, NBK):
        """The two buckets of each address (``ulacache.bufmap.buckets``)."""
        a = a & 0x7FFFFFFF
        h1 = (a * HASH1) & 0xFFFFFFFF
        h2 = (a * HASH2) & 0xFFFFFFFF
        return (h1 * NBK) >> 32, (h2 * NBK) >> 32

    @triton.jit
    def map_find(table, holder, a, live, NBK):
        """Buffer slot of each address (``int64``, ``-1``: not mapped): both buckets' live
        entries, compared by their holders."""
        b1, b2 = _buckets(a, NBK)
        w = tl.arange(0, WAYS)
        e1 = tl.load(table + b1[:, None] * WAYS + w[None, :], mask=live[:, None], other=-1)
        e2 = tl.load(table + b2[:, None] * WAYS + w[None, :], mask=live[:, None], other=-1)
        k1 = tl.load(holder + tl.where(e1 >= 0, e1, 0), mask=e1 >= 0, other=-1)
        k2 = tl.load(holder + tl.where(e2 >= 0, e2, 0), mask=e2 >= 0, other=-1)
        m1 = tl.max(tl.where((e1 >= 0) & (k1 == a[:, None]), e1, -1), axis=1)
        m2 = tl.max(tl.where((e2 >= 0) & (k2 == a[:, None]), e2, -1), axis=1)
        return tl.maximum(m1, m2).to(tl.int64)

    @triton.jit
    def map_insert(table, a, s, want, NBK):
        """Map ``a -> s`` where ``want``: the first empty entry in the order of
        ``ulacache.bufmap.BufferMap.insert`` (the first ``SPILL`` ways of the first bucket,
        then of the second, then the rest of each), taken by compare-and-swap (racing lanes:
        one wins, the rest try the next entry). Returns (inserted, position ``int64``, ``-1``
        where not)."""
        b1, b2 = _buckets(a, NBK)
        pending = want
        pos = tl.full(a.shape, -1, tl.int64)
        j = 0
        while (j < 2 * WAYS) & (tl.max(pending.to(tl.int32), axis=0) > 0):
            one = (j < SPILL) | ((j >= 2 * SPILL) & (j < WAYS + SPILL))
            way = tl.where(j < SPILL, j, tl.where(j < WAYS + SPILL, j - SPILL, j - WAYS))
            p = tl.where(one, b1, b2) * WAYS + way
            # settled lanes compare-and-swap an entry with -2, which no entry holds: a no-op
            # (atomic_cas has no mask)
            target = tl.where(pending, p, tl.where(pos >= 0, pos, b1 * WAYS))  # settled: own
            old = tl.atomic_cas(table + target, tl.where(pending, -1, -2).to(tl.int32),
                                s.to(tl.int32), sem="relaxed")
            won = pending & (old == -1)
            pos = tl.where(won, p, pos)
            pending = pending & ~won
            j += 1
        return want & ~pending, pos

    @triton.jit
    def map_erase(table, a, s, mask, keep, NBK):
        """Unmap slot ``s`` (whose address was ``a``) where ``mask``; the entry at ``keep``
        (the slot's new address, inserted first) stays."""
        b1, b2 = _buckets(a, NBK)
        w = tl.arange(0, WAYS)
        for bk in tl.static_range(2):
            p = tl.where(bk == 0, b1, b2)[:, None] * WAYS + w[None, :]
            e = tl.load(table + p, mask=mask[:, None], other=-1)
            hit = mask[:, None] & (e == s[:, None]) & (p != keep[:, None])
            tl.store(table + p, tl.full(p.shape, -1, tl.int32), mask=hit)

    @triton.jit
    def _g1_claim_hashed(addrs, keys, vals, hslot, n, N, H, BLOCK: tl.constexpr):
        """Every in-range entry finds its address's entry in the open-addressing hash
        ``keys int32 [H]`` (linear probing from a multiplicative hash; the first lane to reach
        an empty entry inserts it with ``atomic_cas``; entries are never removed during the
        launch, so lanes with equal addresses stop at the same entry), claims it with its
        position (``atomic_min`` into ``vals``) and leaves the entry's index in ``hslot``.
        ``H >= 2 n``: the probe always ends."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        inrange = live & (a >= 0) & (a < N)
        key = tl.where(inrange, a, 0).to(tl.int32)
        slot = tl.where(inrange, (a * HASH_MULT) % H, 0)
        pending = inrange
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            # lanes no longer probing compare against a key no entry holds: no write
            prev = tl.atomic_cas(keys + slot, tl.where(pending, EMPTY, NEVER).to(tl.int32), key,
                                 sem="relaxed")
            pending = pending & (prev != EMPTY) & (prev != key)
            slot = tl.where(pending, (slot + 1) % H, slot)
        tl.atomic_min(vals + slot, i.to(tl.int32), mask=inrange, sem="relaxed")
        tl.store(hslot + i, slot.to(tl.int32), mask=live)

    @triton.jit
    def _g2_first_hits(addrs, hslot, keys, vals, table, bmap, holder, status, block_want,
                       victim_out,
                       counters, dp_counters,
                       bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
                       entered, n, N, P, RANK, W1, S1, H1, NBK,
                       NB: tl.constexpr, HY: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        inrange = live & (a >= 0) & (a < N)
        hs = tl.load(hslot + i, mask=inrange, other=0)
        first = inrange & (tl.load(vals + hs, mask=inrange, other=-1) == i)
        # the first resets the entry (the others compare their own positions: never equal)
        tl.store(vals + hs, tl.full(hs.shape, NO_CLAIM, tl.int32), mask=first)
        tl.store(keys + hs, tl.full(hs.shape, EMPTY, tl.int32), mask=first)
        owner = tl.where(inrange, a % P, 0)
        mine = inrange & (owner == RANK)
        theirs = inrange & ~mine
        bslot = map_find(bmap, holder, a, theirs, NBK)
        hit = theirs & (bslot >= 0)
        touch_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
               entered, bslot, first & hit, W1, S1, H1, NB, HY, False)
        oslot = tl.load(table + owner * n + i, mask=theirs, other=-1)
        want = first & theirs & ~hit & (oslot >= 0)
        tl.store(status + i, tl.where(want, WANT, 0), mask=live)
        tl.store(block_want + pid, tl.sum(want.to(tl.int32)))
        # default; G3 writes its wants' entries only
        tl.store(victim_out + i, tl.full(a.shape, -1, tl.int64), mask=live)
        tl.atomic_add(counters + T_SELECTED, tl.sum(first.to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + T_OWN, tl.sum((first & mine).to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + T_HITS, tl.sum((first & hit).to(tl.int64)), sem="relaxed")
        tl.atomic_add(counters + T_MISSING,
                      tl.sum((first & theirs & ~hit & (oslot == -1)).to(tl.int64)),
                      sem="relaxed")
        # an address its owner does not store is invalid on every rank (every entry, as the
        # owner's own K1 counts it)
        tl.atomic_add(dp_counters + C_INVALID,
                      tl.sum((theirs & (oslot == INVALID_ROW)).to(tl.int64)), sem="relaxed")

    @triton.jit
    def _g3_claim_slots(addrs, status, block_want, victim_out, counters,
                        bits, counts, supc, hypc, rowc, epoch_ptr, bmap, holder,
                        n, B, W1, S1, H1, NS, NH, NBK,
                        NB: tl.constexpr, RP: tl.constexpr, HP: tl.constexpr, HY: tl.constexpr,
                        HYP2: tl.constexpr, BP: tl.constexpr, SUB: tl.constexpr,
                        BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        b = tl.arange(0, BP)
        run = tl.sum(tl.load(block_want + b, mask=b < pid, other=0))
        epoch_t, tot, total, n_free = victim_order(rowc, epoch_ptr, NB, RP)
        for c in range(0, BLOCK, SUB):
            i = pid * BLOCK + c + tl.arange(0, SUB)
            live = i < n
            want = (tl.load(status + i, mask=live, other=0) & WANT) != 0
            rank = run + tl.cumsum(want.to(tl.int32), 0) - 1
            run += tl.sum(want.to(tl.int32))
            if tl.sum(want.to(tl.int32)) > 0:
                victim = find_victims(rank, want, tot, total, epoch_t, bits, counts, supc, hypc, W1,
                                  S1, H1, NS, NH, NB, RP, HP, HY, HYP2, SUB)
                a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
                # the new copy is mapped first: if its buckets are full (never seen) nothing
                # changes, the victim keeps its copy and the want overflows
                ok, pos = map_insert(bmap, a, victim, victim >= 0, NBK)
                victim = tl.where(ok, victim, -1)
                vs = tl.where(ok, victim, B)
                old = tl.load(holder + vs, mask=ok, other=-1)
                evict = ok & (old >= 0)
                map_erase(bmap, old, victim, evict, pos, NBK)
                tl.store(holder + vs, a, mask=ok)
                tl.store(victim_out + i, victim, mask=want)  # G4 lists the copy in the plan
                tl.atomic_add(counters + T_FETCHES, tl.sum(ok.to(tl.int64)), sem="relaxed")
                tl.atomic_add(counters + T_OVERFLOW, tl.sum((want & ~ok).to(tl.int64)),
                              sem="relaxed")
                tl.atomic_add(counters + T_EVICTIONS, tl.sum(evict.to(tl.int64)), sem="relaxed")

    @triton.jit
    def _g4_assign_rows(addrs, own, victim_in, out, bmap, holder, table, src_rank, src_slot,
                        dst_row, bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr,
                        epoch_ptr, entered, n, N, G, P, RANK, W1, S1, H1, row_base, NBK,
                        NB: tl.constexpr, HY: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        victim = tl.load(victim_in + i, mask=live, other=-1)
        touch_slots(bits, counts, supc, hypc, rowc, round_of, ring_of, round_ptr, epoch_ptr,
               entered, victim, victim >= 0, W1, S1, H1, NB, HY, True)
        a = tl.load(addrs + i, mask=live, other=-1).to(tl.int64)
        # the plan (int32, every live entry): a claimed slot is a copy to fetch from its owner
        # (written here, not in G3, whose victim search is at the register limit)
        fetch = live & (victim >= 0)
        owner = tl.where(fetch, a % P, 0)
        oslot = tl.load(table + owner * n + i, mask=fetch, other=-1)
        tl.store(src_rank + i, tl.where(fetch, owner, -1).to(tl.int32), mask=live)
        tl.store(src_slot + i, tl.where(fetch, oslot, -1), mask=live)
        tl.store(dst_row + i, tl.where(fetch, G + 1 + victim, -1).to(tl.int32), mask=live)
        inrange = live & (a >= 0) & (a < N)
        mine = inrange & (a % P == RANK)
        theirs = inrange & ~mine
        mine_row = tl.load(own + i, mask=mine, other=-1).to(tl.int64)
        mine_row = tl.where(mine_row >= 0, mine_row, -1)  # the owner's verdicts read as padding
        bslot = map_find(bmap, holder, a, theirs, NBK)
        row = tl.where(mine, mine_row, tl.where(theirs & (bslot >= 0), G + 1 + bslot, -1))
        row = tl.where(row >= 0, row + row_base, -1)  # rows of the engine's tensor
        tl.store(out + i, row.to(tl.int32), mask=live)


GATE_DTYPES = (torch.int32, torch.int64, torch.int32)
"""Per-entry scratch of one gates call: status and victim (G2 -> G3 -> G4) and the entry's
claim-hash index (G1 -> G2), read by no later call; shared by every group of the rank
(:meth:`FusedGates.new_scratch`)."""
PLAN_DTYPE = torch.int32
"""The plan's entries (src_rank, src_slot, dst_row), per group: every layer of the group reads
them (:meth:`ulacache.tp.TPAddressSpace.load`) after later groups' gates have run."""


class GateScratch(fa.Scratch):
    """One gates call's scratch (:data:`GATE_DTYPES` per entry, per-block counts) and its claim
    hash ``int32 [2, 2 cap]``: row 0 the keys (addresses, :data:`HASH_EMPTY` when free), row 1
    the least position that claimed each (``NO_CLAIM`` when none). Twice the call's entries,
    so linear probing always ends; clean between calls (G2 resets every entry G1 filled).
    Sized by the call, not by the address space: a rank's buffers need no table over every
    global address."""

    def __init__(self, device: torch.device, block: int, capacity: int):
        super().__init__(device, GATE_DTYPES, block, capacity)
        self.claim_hash = torch.empty(2, 2 * self.cap, dtype=torch.int32, device=device)
        self.claim_hash[0].fill_(HASH_EMPTY)
        self.claim_hash[1].fill_(FREE_CLAIM)

    def is_clean(self) -> bool:
        """Every hash entry free (host read: tests and integrity checks)."""
        return bool((self.claim_hash[0] == HASH_EMPTY).all()) and \
            bool((self.claim_hash[1] == FREE_CLAIM).all())


class FusedGates:
    """The gates of one TP group's :class:`ulacache.buffer.LocalBuffer` (PB-LRU policy).

    ``shared``: the rank's one-call scratch (:meth:`new_scratch`; the groups' gates run one
    after another on the rank's stream); a fresh one when not given. The plan (three
    ``int32 [capacity]``) is the group's own."""

    BLOCK, SUB = fa.FusedAccess.BLOCK, fa.FusedAccess.SUB

    def __init__(self, buffer, gpu_slots: int, rank: int, size: int, capacity: int,
                 row_base: int = 0, shared: GateScratch | None = None) -> None:
        if fa.triton is None:
            raise RuntimeError("the fused TP gates need Triton (pip install triton)")
        self.b, self.G, self.rank, self.P = buffer, gpu_slots, rank, size
        self.row_base = int(row_base)  # added to every row G4 writes (the engine's offset)
        p = buffer.policy
        self.nb, self.hy = p.n_buckets, p.hyper
        self.w1, self.s1, self.h1 = p.n_words + 16, p.n_super + 1, p.n_hyper + 1
        # allocated once for ``capacity`` entries (config call_capacity)
        self._scratch = shared if shared is not None else \
            self.new_scratch(buffer.device, capacity)
        self._plan = torch.empty(3, self._scratch.cap, dtype=PLAN_DTYPE, device=buffer.device)

    @classmethod
    def new_scratch(cls, device: torch.device, capacity: int) -> GateScratch:
        """One gates call's scratch for ``capacity`` entries (shareable by a rank's groups)."""
        return GateScratch(device, cls.BLOCK, capacity)

    def claims_clean(self) -> bool:
        """The shared claim hash is clean (host read: between calls it always is)."""
        return self._scratch.is_clean()

    def scratch(self, n: int) -> tuple[torch.Tensor, ...]:
        """(status int32 [n], victim int64 [n], hash index int32 [n], plan: src_rank,
        src_slot, dst_row int32 [n], per-block wants int32); the plan views stay valid until
        this group's next call."""
        status, victim, hslot, block_want = self._scratch.get(n)
        return (status, victim, hslot, *self._plan[:, :n], block_want)

    def claim_first(self, addrs: torch.Tensor) -> None:
        """G1 (needs nothing from the peers: issue it before the all-gather)."""
        n = addrs.numel()
        if n:
            hslot = self._scratch.get(n)[2]
            keys, vals = self._scratch.claim_hash
            fa.launch(_g1_claim_hashed, (-(-n // self.BLOCK),), addrs, keys, vals, hslot, n,
                       self.b.n_logical, keys.numel(), BLOCK=self.BLOCK)

    def run(self, addrs: torch.Tensor, table: torch.Tensor, own: torch.Tensor,
            out: torch.Tensor, counters: torch.Tensor, dp_counters: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
        """G2..G4 (after :meth:`claim_first` and the all-gather). ``addrs``: flat global
        ``int32|int64 [n]``; ``table``: ``int32 [P, n]`` owners' rows (``-2``: the owner
        stores no such address); ``own``: this rank's ``int32 [n]``; ``out``: ``int32 [n]``;
        ``counters``: the group's TP counters, ``dp_counters``: its DP counters (``invalid``).
        Returns the plan (src_rank, src_slot, dst_row)."""
        b, p = self.b, self.b.policy
        n = addrs.numel()
        status, victim, hslot, *plan, block_want = self.scratch(n)
        if n == 0:
            return tuple(plan)
        grid = (-(-n // self.BLOCK),)
        pol = (p.bits, p.counts, p.super_counts, p.hyper_counts, p.row_counts)
        stamps = (p.round_of, p.ring_of, p.round_t, p.epoch_t, p.entered)
        N = b.n_logical
        bmap, nbk = b.map.table, b.map.n_buckets
        keys, vals = self._scratch.claim_hash
        fa.launch(_g2_first_hits, grid, addrs, hslot, keys, vals, table, bmap, b.holder, status,
                   block_want, victim, counters, dp_counters, *pol, *stamps, n, N,
                   self.P, self.rank, self.w1, self.s1, self.h1, nbk, NB=self.nb, HY=self.hy,
                   BLOCK=self.BLOCK)
        fa.launch(_g3_claim_slots, grid, addrs, status, block_want, victim, counters,
                   *pol, p.epoch_t, bmap, b.holder, n, b.n_slots, self.w1, self.s1, self.h1,
                   p.n_super, p.n_hyper, nbk, NB=self.nb, RP=fa.row_tile(self.nb),
                   HP=fa.pow2(p.n_hyper), HY=self.hy, HYP2=fa.pow2(self.hy),
                   BP=fa.pow2(grid[0]), SUB=self.SUB, BLOCK=self.BLOCK)
        fa.launch(_g4_assign_rows, grid, addrs, own, victim, out, bmap, b.holder, table, *plan,
                   *pol, *stamps, n, N, self.G, self.P, self.rank, self.w1, self.s1, self.h1,
                   self.row_base, nbk, NB=self.nb, HY=self.hy, BLOCK=self.BLOCK)
        return tuple(plan)
