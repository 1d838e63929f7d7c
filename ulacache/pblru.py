"""Replacement policies over the GPU slots of one selection group.

Two policies sit behind one small interface (:class:`ReplacementPolicy`):

- :class:`PBLRU`, the paper's Parallel Bucketed LRU: ``n_b`` recent bucket bitmaps plus a cold
  bucket (and a free bitmap), one bit per GPU slot. A touch is O(k); choosing victims is
  O(G / 63) word operations (prefix sums over per-word popcounts), never a scan of slots.
- :class:`ExactLRU`, the paper's baseline: a timestamp per slot and a pool-wide scan
  (``topk`` over all slots) to find victims.

Both are pure tensor code on the pool's device: no Python loop over slots, no host
synchronisation in ``touch``/``victims``, fixed output shapes, so the per-step path can be
captured in a CUDA graph. ``advance`` runs once per scheduling round, outside the graph.

Victim order, both policies: free slots first, then least recently used. Slots touched in the
current round (the *current bucket*: rows this step reads or wrote) are never victims.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .errors import ShapeError
from .pools import resolve_device

__all__ = ["ReplacementPolicy", "PBLRU", "ExactLRU", "make_policy"]

_WORD_BITS = 63  # bits per int64 word: bit 63 unused, so +/- 2**b scatter-adds never overflow
_SUPER = 16  # words per superblock (second level of the count hierarchy)
_FREE_STAMP = -(2**62)


def _byte_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``POPCOUNT[256]`` and ``SELECT[256, 8]`` (position of the r-th set bit of a byte)."""
    popcount = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.int32)
    select = torch.zeros(256, 8, dtype=torch.int64)
    for v in range(256):
        ones = [b for b in range(8) if v >> b & 1]
        select[v, : len(ones)] = torch.tensor(ones, dtype=torch.int64)
    return popcount.to(device), select.to(device)


class ReplacementPolicy(ABC):
    """Recency over ``n_slots`` GPU slots. Slot ids are ``int64``; ``-1`` entries are ignored.

    Contract (all methods except ``advance`` and ``check_integrity`` are graph-safe):

    - ``touch(slots)``: the (distinct) slots become used and most recent (current round).
    - ``release(slots)``: the (distinct, used) slots become free.
    - ``victims(n)``: ``int64 [n]``, the first ``n`` slots in victim order, ``-1`` past the
      number of eligible slots. Pure: state is unchanged.
    - ``eligible()``: 0-dim ``int64``, how many slots ``victims`` can return.
    - ``in_current_round(slots)``: ``bool`` mask, slots touched this round (never victims).
    - ``advance()``: start a new scheduling round.
    """

    n_slots: int
    device: torch.device

    @abstractmethod
    def touch(self, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def release(self, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def victims(self, n: int) -> torch.Tensor: ...

    @abstractmethod
    def eligible(self) -> torch.Tensor: ...

    # Both policies keep ``stamp int64 [n_slots + 1]`` (last-touch round) and the round counter
    # twice: ``round_t`` on the device for the graph-safe path, ``_round`` on the host.
    stamp: torch.Tensor
    round_t: torch.Tensor
    _round: int

    def in_current_round(self, slots: torch.Tensor) -> torch.Tensor:
        valid, s = self._slots(slots)
        return valid & (self.stamp[s] == self.round_t)

    def advance(self) -> None:
        self._round += 1
        self.round_t.fill_(self._round)
        self._retire()

    def _retire(self) -> None:  # noqa: B027 - optional hook, a no-op for exact LRU
        """Policy-specific work when a round starts (after the counter moved)."""

    @abstractmethod
    def used_mask(self) -> torch.Tensor:
        """``bool [n_slots]``: slots that are not free."""

    @abstractmethod
    def check_integrity(self) -> None: ...

    def _slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid mask, slots with invalid entries redirected to the scratch index n_slots)."""
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise ShapeError(f"slots must be int64 [n], got {slots.dtype} {tuple(slots.shape)}")
        valid = slots >= 0
        return valid, torch.where(valid, slots, self.n_slots)


class PBLRU(ReplacementPolicy):
    """Parallel Bucketed LRU (UlaCache §5.1).

    State (``W = ceil(G / 63)`` words, rounded up to whole superblocks):

    - ``bits int64 [n_b + 2, W + 16]``: row 0 the free bitmap, row 1 the cold bucket, row
      ``2 + i`` recent bucket ``i``. Bit ``s % 63`` of word ``s // 63`` is slot ``s``. Every
      slot is in exactly one row.
    - ``counts int32 [n_b + 2, W + 16]``: popcount of each word, kept in step with ``bits``;
      ``super_counts int32 [n_b + 2, W / 16 + 1]``: their sums per superblock of 16 words.
      The last superblock of each row is scratch (masked updates land there).
    - ``stamp int64 [G + 1]``: the round of the slot's last touch, or a FREE sentinel. This is
      the paper's slot -> bucket id table in a rotation-free form: bucket(s) is FREE, COLD
      when ``round - stamp >= n_b``, else ``stamp % n_b``. Advancing a round therefore rewrites
      no per-slot ids: it ORs the bucket that becomes current into cold and clears it (O(W)).

    Why bitmaps with a two-level count hierarchy: the i-th victim is found by a prefix sum over
    superblock counts in victim order (free, cold, recent oldest -> newest, current excluded),
    then a 16-word prefix inside its superblock and a select within one word. That is
    O(n_b * G / 1008) + O(16 n) tensor work with fixed shapes, so many buckets (a fine recency
    resolution) stay cheap, where an exact LRU must scan (sort) all G timestamps.
    """

    def __init__(self, n_slots: int, n_buckets: int = 64, device: torch.device | str = "cpu"):
        if n_slots < 1 or n_buckets < 2:
            raise ValueError("PBLRU needs n_slots >= 1 and n_buckets >= 2")
        self.n_slots, self.n_buckets = int(n_slots), int(n_buckets)
        self.device = resolve_device(device)
        self.n_super = -(-self.n_slots // (_WORD_BITS * _SUPER))
        self.n_words = self.n_super * _SUPER  # padded to whole superblocks
        rows = self.n_buckets + 2
        # one extra (scratch) superblock per row absorbs masked updates; its first word is the
        # scratch word n_words
        self.bits = torch.zeros(rows, self.n_words + _SUPER, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(rows, self.n_words + _SUPER, dtype=torch.int32,
                                  device=self.device)
        self.super_counts = torch.zeros(rows, self.n_super + 1, dtype=torch.int32,
                                        device=self.device)
        self.stamp = torch.full((self.n_slots + 1,), _FREE_STAMP, dtype=torch.int64,
                                device=self.device)
        self.round_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self._round = 0
        self._popcount, self._select = _byte_tables(self.device)
        self._recent_age = torch.arange(1, self.n_buckets, device=self.device)
        self._head = torch.tensor([0, 1], dtype=torch.int64, device=self.device)
        all_slots = torch.arange(self.n_slots, device=self.device)
        self._set_bits(torch.zeros_like(all_slots), all_slots)  # everything starts free

    # -- bit plumbing -------------------------------------------------------------------
    def _set_bits(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``slots`` (all absent from every row) to bucket ``rows`` (initial fill)."""
        self._move_bits(slots, None, rows, torch.ones_like(slots, dtype=torch.bool))

    def _move_bits(self, slots: torch.Tensor, src_rows: torch.Tensor | None,
                   dst_rows: torch.Tensor, mask: torch.Tensor) -> None:
        """Move ``slots`` from bucket ``src_rows`` to ``dst_rows`` where ``mask``: clear the old
        bit and set the new one (+/- 2**bit scatter-adds: no carries, the caller guarantees the
        old bit is set and the new one clear), keeping word and superblock counts in step.
        Masked entries land in the scratch word / superblock. One scatter per table."""
        word = torch.div(slots, _WORD_BITS, rounding_mode="floor")
        value = torch.bitwise_left_shift(torch.ones_like(word), slots - word * _WORD_BITS)
        sup = torch.where(mask, torch.div(word, _SUPER, rounding_mode="floor"), self.n_super)
        word = torch.where(mask, word, self.n_words)
        ones = torch.ones_like(word, dtype=torch.int32)
        w1, s1 = self.n_words + _SUPER, self.n_super + 1
        flat, flat_sup = dst_rows * w1 + word, dst_rows * s1 + sup
        if src_rows is not None:
            flat = torch.cat([src_rows * w1 + word, flat])
            flat_sup = torch.cat([src_rows * s1 + sup, flat_sup])
            value, ones = torch.cat([-value, value]), torch.cat([-ones, ones])
        self.bits.view(-1).scatter_add_(0, flat, value)
        self.counts.view(-1).scatter_add_(0, flat, ones)
        self.super_counts.view(-1).scatter_add_(0, flat_sup, ones)

    def _row_of(self, stamp: torch.Tensor) -> torch.Tensor:
        """Bucket row (0 free, 1 cold, 2 + i recent) of slots with these stamps."""
        recent = 2 + torch.remainder(stamp, self.n_buckets)
        row = torch.where(self.round_t - stamp >= self.n_buckets, 1, recent)
        return torch.where(stamp == _FREE_STAMP, 0, row)

    def _current_row(self) -> torch.Tensor:
        return 2 + torch.remainder(self.round_t, self.n_buckets)

    # -- interface ----------------------------------------------------------------------
    def touch(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        stamp = self.stamp[s]
        move = valid & (stamp != self.round_t)  # in the current bucket iff touched this round
        self._move_bits(s, self._row_of(stamp), self._current_row().expand_as(s), move)
        self.stamp.index_put_((torch.where(move, s, self.n_slots),), self.round_t.expand_as(s))

    def release(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        old_row = self._row_of(self.stamp[s])
        move = valid & (old_row != 0)
        self._move_bits(s, old_row, torch.zeros_like(s), move)
        self.stamp.index_put_((torch.where(move, s, self.n_slots),),
                              torch.full_like(s, _FREE_STAMP))

    def _victim_rows(self) -> torch.Tensor:
        """``int64 [n_b + 1]`` bucket rows in victim order: free, cold, oldest .. newest recent
        (the current bucket is not among them)."""
        recent = 2 + torch.remainder(self.round_t + self._recent_age, self.n_buckets)
        return torch.cat([self._head, recent])

    def victims(self, n: int) -> torch.Tensor:
        rows = self._victim_rows()
        # Level 1: superblock counts in victim order; rank r falls in superblock sb_of_rank[r].
        counts = self.super_counts.index_select(0, rows)[:, : self.n_super].reshape(-1)
        ends = torch.cumsum(counts, 0, dtype=torch.int64)
        starts = ends - counts
        total = ends[-1]
        # Mark each non-empty superblock at its first rank; a running max fills the ranks in
        # between (superblock ids grow with rank).
        flat = torch.arange(counts.numel(), device=self.device)
        marks = torch.full((n + 1,), -1, dtype=torch.int64, device=self.device)
        keep = (counts > 0) & (starts < n)
        marks.scatter_reduce_(0, torch.where(keep, starts, n), flat, "amax")
        sb = torch.cummax(marks[:n], 0).values.clamp(min=0)
        ranks = torch.arange(n, device=self.device)
        r1 = ranks - starts[sb]
        row = rows[torch.div(sb, self.n_super, rounding_mode="floor")]
        sb_local = torch.remainder(sb, self.n_super)
        # Level 2: the word inside the superblock, then the bit inside the word.
        block = row * (self.n_super + 1) + sb_local  # one contiguous 16-word block per rank
        wc = self.counts.view(-1, _SUPER).index_select(0, block)
        wends = torch.cumsum(wc, 1, dtype=torch.int32)
        r1 = r1.to(torch.int32)  # same dtype as wends: no promotion copies of [n, 16]
        # words whose running count is <= r1 come before the one holding rank r1
        which = torch.searchsorted(wends, r1.unsqueeze(1), right=True).squeeze(1)
        which = which.clamp(max=_SUPER - 1)
        before = torch.where(which > 0, wends.gather(1, (which - 1).clamp(min=0).unsqueeze(1))
                             .squeeze(1), 0)
        word = sb_local * _SUPER + which
        words = self.bits.view(-1).index_select(0, row * (self.n_words + _SUPER) + word)
        bit = self._select_bit(words, r1 - before)
        slot = word * _WORD_BITS + bit
        return torch.where(ranks < total, slot, -1)

    def _select_bit(self, words: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Position of the ``r``-th (0-based) set bit of each word; ``[n]`` int64."""
        shifts = torch.arange(0, 64, 8, device=self.device)
        byte = torch.bitwise_and(torch.bitwise_right_shift(words.unsqueeze(1), shifts), 255)
        ends = torch.cumsum(self._popcount[byte], 1, dtype=torch.int32)
        r = r.to(torch.int32)
        which = torch.searchsorted(ends, r.unsqueeze(1), right=True).squeeze(1).clamp(max=7)
        before = torch.where(which > 0, ends.gather(1, (which - 1).clamp(min=0).unsqueeze(1))
                             .squeeze(1), 0)
        r_in_byte = (r - before).clamp(0, 7).to(torch.int64)
        byte_val = byte.gather(1, which.unsqueeze(1)).squeeze(1)
        return which * 8 + self._select[byte_val, r_in_byte]

    def eligible(self) -> torch.Tensor:
        rows = self._victim_rows()
        return self.super_counts.index_select(0, rows)[:, : self.n_super].sum(dtype=torch.int64)

    def _retire(self) -> None:
        row = 2 + self._round % self.n_buckets  # becomes current: its members retire to cold
        self.bits[1].add_(self.bits[row])  # disjoint sets: add == OR, no carries
        self.counts[1].add_(self.counts[row])
        self.super_counts[1].add_(self.super_counts[row])
        self.bits[row].zero_()
        self.counts[row].zero_()
        self.super_counts[row].zero_()

    def used_mask(self) -> torch.Tensor:
        return self.stamp[: self.n_slots] != _FREE_STAMP

    def bucket_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Bucket row of each slot (0 free, 1 cold, 2 + i recent bucket i); for tests/metrics."""
        return self._row_of(self.stamp[slots])

    def check_integrity(self) -> None:
        assert int(self.round_t) == self._round, "device round diverged from host round"
        expected = PBLRU.__new__(PBLRU)
        expected.__dict__.update(self.__dict__)
        expected.bits = torch.zeros_like(self.bits)
        expected.counts = torch.zeros_like(self.counts)
        expected.super_counts = torch.zeros_like(self.super_counts)
        slots = torch.arange(self.n_slots, device=self.device)
        expected._set_bits(self._row_of(self.stamp[: self.n_slots]), slots)
        W, S = self.n_words, self.n_super  # the scratch word / superblock absorb masked updates
        assert torch.equal(expected.bits[:, :W], self.bits[:, :W]), "bitmaps disagree with stamps"
        assert torch.equal(expected.counts[:, :W], self.counts[:, :W]), "word counts != bits"
        assert torch.equal(expected.super_counts[:, :S], self.super_counts[:, :S]), \
            "superblock counts != word counts"
        assert bool((self.stamp[: self.n_slots] <= self.round_t).all()), "stamp from the future"


class ExactLRU(ReplacementPolicy):
    """Exact LRU (the paper's baseline): a last-touch round per slot; victims by a pool-wide
    scan (``topk`` of the smallest keys over all G slots). Ties break by slot id."""

    def __init__(self, n_slots: int, device: torch.device | str = "cpu"):
        self.n_slots = int(n_slots)
        self.device = resolve_device(device)
        self.stamp = torch.full((self.n_slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.round_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self._round = 0
        self._ids = torch.arange(self.n_slots, device=self.device)

    def touch(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        self.stamp.index_put_((s,), torch.where(valid, self.round_t, self.stamp[s]))

    def release(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        self.stamp.index_put_((s,), torch.where(valid, -1, self.stamp[s]))

    def victims(self, n: int) -> torch.Tensor:
        stamp = self.stamp[: self.n_slots]
        never = torch.iinfo(torch.int64).max
        key = torch.where(stamp == self.round_t, never, (stamp + 1) * self.n_slots + self._ids)
        m = min(n, self.n_slots)
        vals, idx = torch.topk(key, m, largest=False, sorted=True)
        out = torch.where(vals != never, idx, -1)
        if m < n:
            out = torch.cat([out, torch.full((n - m,), -1, dtype=torch.int64, device=self.device)])
        return out

    def eligible(self) -> torch.Tensor:
        return (self.stamp[: self.n_slots] != self.round_t).sum(dtype=torch.int64)

    def used_mask(self) -> torch.Tensor:
        return self.stamp[: self.n_slots] >= 0

    def check_integrity(self) -> None:
        assert int(self.round_t) == self._round, "device round diverged from host round"
        assert bool((self.stamp[: self.n_slots] <= self.round_t).all()), "stamp from the future"


def make_policy(name: str, n_slots: int, n_buckets: int = 64,
                device: torch.device | str = "cpu") -> ReplacementPolicy:
    """``"pblru"`` or ``"lru"`` (exact LRU baseline)."""
    if name == "pblru":
        return PBLRU(n_slots, n_buckets, device)
    if name == "lru":
        return ExactLRU(n_slots, device)
    raise ValueError(f"unknown policy {name!r}; legal: 'pblru', 'lru'")
