"""TP local buffer: one rank's copies of peers' rows for one selection group (design §2).

The buffer is a set of ``B`` extra rows at the end of the tensor attention reads, so that one
tensor per layer holds ``[own pool rows | scratch | buffer rows]`` and attention reads own rows
in place (no local copy) and peers' rows from the buffer::

    rows [0, G)              own GPU pool (the owner's slots, see :mod:`ulacache.group`)
    row  G                   scratch (masked copies)
    rows [G + 1, G + 1 + B)  buffer slot b at row G + 1 + b

This class keeps only the buffer's metadata; the bytes live in that tensor.

- ``map``: the buffer slot of a *global* address (:class:`ulacache.bufmap.BufferMap`, a hash
  table sized by ``B``, not by the address space).
- ``holder int64 [B + 1]``: the address each slot holds, ``-1`` when free (last: scratch).
- a replacement policy over the ``B`` slots (PB-LRU by default): slots read or filled this
  round are in its current bucket, so they are never victims before the round ends (design
  invariant 5: a slot is not reused before the attention that reads it has finished; the next
  round starts after this rank's attention, in stream order).

A copy is only ever a copy: the owner keeps the row, so evicting or dropping a buffer entry
loses nothing. Rows are immutable once written (a token's latent never changes) until their
address is released, and :meth:`drop` removes released addresses on every rank, so a hit can
never return another token's bytes.
"""

from __future__ import annotations

import torch

from .bufmap import BufferMap
from .pblru import DEFAULT_BUCKETS, ReplacementPolicy, make_policy


def first_of_each(addrs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (``bool [n]``) restricted to the first occurrence of each address of ``addrs``
    (``int64 [n]``) among the kept entries, by a stable sort of the call's own entries: O(n log
    n), fixed shapes, no sync, and no table over the address space (a TP rank's buffers see
    every global address; a claim table over them would cost 4 B per global token)."""
    n = addrs.numel()
    if n == 0:
        return keep.clone()
    key = torch.where(keep, addrs, -1)  # the entries not kept share one key: masked below
    order = torch.sort(key, stable=True).indices
    ranked = key[order]
    head = torch.ones(n, dtype=torch.bool, device=addrs.device)
    head[1:] = ranked[1:] != ranked[:-1]  # stable: the lowest position of each key leads
    first = torch.empty_like(head).scatter_(0, order, head)
    return first & keep


def member_of(values: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """``bool`` per entry of ``values``: it occurs in ``among`` (non-empty ``int64``), by a
    sort of ``among`` and a binary search: fixed shapes, no sync."""
    ranked = torch.sort(among).values
    at = torch.searchsorted(ranked, values).clamp_(max=ranked.numel() - 1)
    return ranked[at] == values


class LocalBuffer:
    """Metadata of ``n_slots`` buffer rows over global addresses ``[0, n_logical)``."""

    def __init__(self, n_logical: int, n_slots: int, device: torch.device,
                 policy: str | ReplacementPolicy = "pblru", n_buckets: int = DEFAULT_BUCKETS):
        self.n_logical, self.n_slots, self.device = n_logical, n_slots, device
        self.map = BufferMap(n_slots, device)
        self.holder = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=device)
        self.policy = policy if isinstance(policy, ReplacementPolicy) else \
            make_policy(policy, n_slots, n_buckets, device)

    def lookup(self, safe: torch.Tensor) -> torch.Tensor:
        """Buffer slot of each address (``safe``: in range or the scratch index ``n_logical``);
        ``int64``, ``-1`` where not buffered."""
        return self.map.find(safe, self.holder)[0]

    def first(self, safe: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` restricted to the first occurrence of each address."""
        return first_of_each(safe, keep)

    def touch(self, slots: torch.Tensor) -> None:
        """Mark buffer hits as read this round (pins them; ``-1`` skipped)."""
        self.policy.touch(slots)

    def claim(self, addrs: torch.Tensor, want: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot for each wanted address (distinct, not buffered): (``int64 [n]`` slots,
        ``-1`` where not wanted or no slot is free or evictable this round, i.e. overflow to be
        counted; 0-dim number of copies evicted for them).

        Victims come in policy order (free, then least recent; never this round's slots); an
        evicted copy's address is unmapped first. The caller fills the rows (bytes) after this
        returns; nobody reads them before that (the round's plan is not published yet).
        """
        rank = torch.cumsum(want, 0) - 1
        cand = self.policy.victims(addrs.numel())
        slot = torch.where(want, cand[rank.clamp(min=0)], -1)
        # the new copy is mapped first: if its buckets are full (never seen; counted by the
        # caller as overflow) nothing changes, the victim keeps its copy
        ok, pos = self.map.insert(addrs, slot, slot >= 0)
        slot = torch.where(ok, slot, -1)
        B = self.n_slots
        old = self.holder[torch.where(ok, slot, B)]
        evict = ok & (old >= 0)
        self.map.erase(slot, old, evict, pos)
        self.holder.index_put_((torch.where(ok, slot, B),), torch.where(ok, addrs, -1))
        self.policy.assign(slot)
        return slot, evict.sum()

    def drop(self, safe: torch.Tensor) -> torch.Tensor:
        """Forget the copies of these addresses (released on their owner); ``int64`` number
        of copies dropped (0-dim). Duplicates and unbuffered addresses are harmless.

        A release longer than the buffer (a finished request's pages, a flush of the whole
        space) walks the buffer's ``B`` slots instead of looking every address up: each holder
        is searched among the sorted addresses, O((n + B) log n) (the choice depends on shapes
        only: no sync)."""
        if safe.numel() > self.n_slots:
            return self._drop_by_slot(safe)
        slot, pos = self.map.find(safe, self.holder)
        held = slot >= 0
        first = self.first(safe, held)
        B = self.n_slots
        self.map.erase_at(pos, first)
        self.holder.index_put_((torch.where(first, slot, B),), torch.full_like(slot, -1))
        self.policy.release(torch.where(first, slot, -1))
        return first.sum()

    def _drop_by_slot(self, safe: torch.Tensor) -> torch.Tensor:
        B = self.n_slots
        held = self.holder[:B]
        gone = (held >= 0) & member_of(held, safe)
        slots = torch.arange(B, device=self.device)
        self.map.erase(slots, held, gone, torch.full_like(slots, -1))
        self.holder.index_put_((torch.where(gone, slots, B),), torch.full_like(slots, -1))
        self.policy.release(torch.where(gone, slots, -1))
        return gone.sum()

    def advance(self) -> None:
        self.policy.advance()

    def eligible(self) -> torch.Tensor:
        """Slots free or evictable this round (0-dim ``int64``)."""
        return self.policy.eligible()

    def buffered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(addresses, slots) of every copy held (host-side: tests and integrity checks)."""
        held = self.holder[: self.n_slots]
        slots = torch.nonzero(held >= 0).reshape(-1)
        return held[slots], slots

    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """Map and holders agree, the policy's used set is the held set, scratch untouched;
        ``live`` (``bool [n_logical]``): every copy's address is live."""
        B = self.n_slots
        assert int(self.holder[B]) == -1, "buffer scratch holder written"
        addrs, slots = self.buffered()
        assert bool((addrs < self.n_logical).all()), "buffer holds an out-of-range address"
        assert addrs.unique().numel() == addrs.numel(), "address buffered twice"
        assert torch.equal(self.lookup(addrs), slots), "buffer map disagrees with holders"
        self.map.check_integrity(self.holder)
        assert torch.equal(self.policy.used_mask(), self.holder[:B] >= 0), \
            "buffer policy's used set != held slots"
        self.policy.check_integrity()
        if live is not None:
            assert bool(live.to(self.device)[addrs].all()), "buffer holds a released address"
