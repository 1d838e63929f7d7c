"""The TP buffer's map from a global address to the buffer slot holding its copy, sized by the
buffer (not by the address space): a two-choice bucketed hash table over the slots.

A rank's buffer holds at most ``B`` copies (``B`` = a decode step's selections), but the
addresses range over every token of the group (``N``, the whole system's history). An array
over ``N`` per group cost every rank ``4 N`` bytes per group (2.5 KB per unique token on
8xH200 GLM-5, more than the latent); this table costs ``64 ceil(B / 4) + 4`` bytes per group.

Layout (``table int32 [n_buckets * WAYS + 1]``): bucket ``k`` is entries ``[WAYS k, WAYS (k +
1))`` (64 bytes: one cache line), and the last entry is scratch (the torch path's masked writes
land there, so no step op has a data-dependent shape; it stays ``EMPTY``). An entry is ``EMPTY``
(-1) or a buffer slot ``s``, whose address is the buffer's ``holder[s]`` (the key is not stored
twice). An address ``a`` may sit in either of its two buckets (:func:`buckets`: two
multiplicative hashes, reduced by multiply-shift, so ``n_buckets`` need not be a power of two).
A lookup reads both buckets (two lines) and compares the holders of their live entries; an
insert takes the first empty entry among the first ``SPILL`` ways of its first bucket, then of
its second, then the rest of each (:data:`SPILL`); an erase empties the entry. No tombstones, no
probing chains, no rebuild.

Why it does not overflow: ``n_buckets = ceil(B / LOAD)`` keeps the mean load at most
``LOAD`` = 4 of ``WAYS`` = 16 entries, and the threshold choice keeps the fullest bucket near
``SPILL``: a 131,136-slot buffer filled in one batch, then turned over by a tenth 40 times,
peaked at 10 of 16 (``tests/test_bufmap.py`` measures it; choosing the less full bucket
instead peaked at 13: a batch decides on stale counts). Should both buckets be full, the insert
fails, the caller leaves that copy unmade (counted as ``buffer_overflow``, served as padding)
and no state changes for it.

The fused path (``kernels/fused_tp.py``) reads and writes the same table with the same
hashes; where lanes race for an entry it resolves them by compare-and-swap, the torch path by
lane order, so the two may place a copy in different entries of its bucket pair: the map
(address to slot) is what is equal, and what tests compare (:meth:`BufferMap.dense`).
"""

from __future__ import annotations

import torch

from .pools import allocate

__all__ = ["BufferMap", "WAYS", "LOAD", "EMPTY", "buckets", "map_bytes"]

WAYS = 16
"""Entries per bucket (``int32``: 64 bytes)."""
LOAD = 4
"""Mean entries per bucket when the buffer is full (``n_buckets = ceil(B / LOAD)``)."""
SPILL = 8
"""An insert tries the first ``SPILL`` ways of its first bucket, then of its second, then the
rest of each: a threshold two-choice rule, which needs no count of a bucket's entries (a batch
of inserts racing on stale counts all pick the same bucket; the rule is immune to that)."""
EMPTY = -1
HASH1, HASH2 = 2654435761, 2246822507
"""Odd 32-bit multipliers (Knuth's golden ratio, MurmurHash3's fmix constant): with addresses
``< 2**31`` the products stay below ``2**63``."""
MASK32 = 0xFFFFFFFF
PIECE = 1 << 14
"""The torch path works on at most this many addresses at a time: its ``[n, 2 WAYS]``
temporaries stay a few MB for a prefill's 10^5-10^6 addresses (``ulacache rehearse`` measures
the transient peak)."""


def n_buckets_for(n_slots: int) -> int:
    return max(1, -(-int(n_slots) // LOAD))


def map_bytes(n_slots: int) -> int:
    """Device bytes of the map of an ``n_slots``-row buffer (``int32 [n_buckets * WAYS + 1]``)."""
    return 4 * (WAYS * n_buckets_for(n_slots) + 1)


def buckets(addrs: torch.Tensor, n_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each address (``int64 [n]`` each; addresses in
    ``[0, 2**31)``; any other value gets some bucket, and is never found)."""
    a = addrs.to(torch.int64) & 0x7FFFFFFF
    h1 = (a * HASH1) & MASK32
    h2 = (a * HASH2) & MASK32
    return (h1 * n_buckets) >> 32, (h2 * n_buckets) >> 32


class BufferMap:
    """Address -> buffer slot for one :class:`ulacache.buffer.LocalBuffer` of ``n_slots`` rows.

    Every method takes the buffer's ``holder int64 [B + 1]`` (slot -> address, ``-1``: free)
    where it needs keys; the map never holds a slot whose holder is another address.
    """

    def __init__(self, n_slots: int, device: torch.device):
        self.n_slots, self.device = int(n_slots), device
        self.n_buckets = n_buckets_for(n_slots)
        self.scratch = self.n_buckets * WAYS
        self.table = allocate((self.scratch + 1,), torch.int32, device, "the buffer map",
                              fill=EMPTY)

    def _entries(self, bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions ``int64 [n, WAYS]``, entries ``int64 [n, WAYS]``) of each bucket."""
        pos = bucket.unsqueeze(1) * WAYS + torch.arange(WAYS, device=self.device)
        return pos, self.table[pos].to(torch.int64)

    def _pair_positions(self, a: torch.Tensor) -> torch.Tensor:
        """``int64 [n, 2 WAYS]``: the positions of both buckets of each address (first, then
        second: the order lookups read and inserts fill)."""
        ways = torch.arange(WAYS, device=self.device)
        return torch.cat([b.unsqueeze(1) * WAYS + ways for b in buckets(a, self.n_buckets)], 1)

    @staticmethod
    def _by_piece(fn, *lanes: torch.Tensor):
        """``fn`` over the lanes in pieces of at most :data:`PIECE` (in lane order), its
        tensor results concatenated: the ``[n, 2 WAYS]`` temporaries stay bounded."""
        n = lanes[0].numel()
        if n <= PIECE:
            return fn(*lanes)
        parts = [fn(*(t[i:i + PIECE] for t in lanes)) for i in range(0, n, PIECE)]
        return None if parts[0] is None else tuple(torch.cat(p) for p in zip(*parts))

    def find(self, addrs: torch.Tensor, holder: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) of each address, ``int64 [n]`` each, ``-1`` where not mapped."""
        return self._by_piece(lambda a: self._find(a, holder),
                              addrs.to(torch.int64).reshape(-1))

    def _find(self, a: torch.Tensor, holder: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self._pair_positions(a)
        e = self.table[pos].to(torch.int64)
        live = e >= 0
        match = live & (holder[torch.where(live, e, 0)] == a.unsqueeze(1))
        # an address is in at most one entry: max picks it (or -1)
        slot = torch.where(match, e, -1).amax(1) if a.numel() else a.new_empty(0)
        where = torch.where(match, pos, -1).amax(1) if a.numel() else a.new_empty(0)
        return slot, where

    def insert(self, addrs: torch.Tensor, slots: torch.Tensor, want: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map ``addrs[i] -> slots[i]`` where ``want`` (addresses distinct and not mapped).
        Returns (``bool [n]`` inserted, ``int64 [n]`` positions, ``-1`` elsewhere); a wanted
        address whose two buckets are full is not inserted (the caller counts it)."""
        return self._by_piece(self._insert, addrs.to(torch.int64).reshape(-1), slots, want)

    def _insert(self, a: torch.Tensor, slots: torch.Tensor, want: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        b1, b2 = buckets(a, self.n_buckets)
        done = torch.zeros_like(want)
        pos = torch.full_like(a, -1)
        for bucket, lo, hi in ((b1, 0, SPILL), (b2, 0, SPILL), (b1, SPILL, WAYS),
                               (b2, SPILL, WAYS)):
            got, p = self._fill(bucket, slots, want & ~done, lo, hi)
            done |= got
            pos = torch.where(got, p, pos)
        return done, pos

    def _fill(self, bucket: torch.Tensor, slots: torch.Tensor, pending: torch.Tensor,
              lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One round: the ``r``-th pending lane (lane order) of a bucket takes the ``r``-th
        empty entry among its ways ``[lo, hi)``, if there is one."""
        n = bucket.numel()
        if n == 0:
            return pending, bucket
        key = torch.where(pending, bucket, self.n_buckets)
        order = torch.argsort(key, stable=True)
        ranked = key[order]
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=self.device) - torch.searchsorted(ranked, ranked)
        pos, e = self._entries(bucket)
        ways = torch.arange(WAYS, device=self.device)
        empties = torch.cumsum((e == EMPTY) & (ways >= lo) & (ways < hi), 1)
        got = pending & (rank < empties[:, -1])
        way = (empties <= rank.unsqueeze(1)).sum(1).clamp(max=WAYS - 1)
        p = pos.gather(1, way.unsqueeze(1)).squeeze(1)
        self._put(torch.where(got, p, self.scratch), torch.where(got, slots, EMPTY))
        return got, torch.where(got, p, -1)

    def _put(self, pos: torch.Tensor, value: torch.Tensor | int) -> None:
        """``table[pos] = value`` (masked entries point at the scratch entry with ``EMPTY``)."""
        value = torch.as_tensor(value, device=self.device).to(torch.int32).expand(pos.shape)
        self.table.index_put_((pos.reshape(-1),), value.reshape(-1))

    def erase(self, slots: torch.Tensor, addrs: torch.Tensor, mask: torch.Tensor,
              keep: torch.Tensor) -> None:
        """Unmap slot ``slots[i]`` (which held ``addrs[i]``) where ``mask``; the entry at
        position ``keep[i]`` (the slot's new address, inserted first) is left alone."""
        self._by_piece(self._erase, slots, addrs.to(torch.int64).reshape(-1), mask, keep)

    def _erase(self, slots: torch.Tensor, a: torch.Tensor, mask: torch.Tensor,
               keep: torch.Tensor) -> None:
        pos = self._pair_positions(a)
        hit = (self.table[pos].to(torch.int64) == slots.to(torch.int64).unsqueeze(1)) \
            & (pos != keep.unsqueeze(1)) & mask.unsqueeze(1)
        self._put(torch.where(hit, pos, self.scratch), EMPTY)

    def erase_at(self, pos: torch.Tensor, mask: torch.Tensor) -> None:
        """Empty the entries at these positions where ``mask``."""
        self._put(torch.where(mask, pos, self.scratch), EMPTY)

    def dense(self, n_logical: int, holder: torch.Tensor) -> torch.Tensor:
        """``int64 [n_logical + 1]``: the slot of every address (``-1``: none); tests only."""
        return self.find(torch.arange(n_logical + 1, device=self.device), holder)[0]

    def check_integrity(self, holder: torch.Tensor) -> None:
        """Every live entry is a held slot, in one of its address's two buckets, listed
        once; every held slot has an entry."""
        B = self.n_slots
        assert int(self.table[self.scratch]) == EMPTY, "buffer map scratch entry written"
        e = self.table[: self.scratch].to(torch.int64)
        live = torch.nonzero(e >= 0).reshape(-1)
        slot = e[live]
        assert bool((slot < B).all()), "buffer map holds an out-of-range slot"
        assert slot.unique().numel() == slot.numel(), "buffer map lists a slot twice"
        addr = holder[slot]
        assert bool((addr >= 0).all()), "buffer map lists a free slot"
        b1, b2 = buckets(addr, self.n_buckets)
        home = live // WAYS
        assert bool(((home == b1) | (home == b2)).all()), "buffer map entry outside its buckets"
        assert slot.numel() == int((holder[:B] >= 0).sum()), "buffer map misses a held slot"
