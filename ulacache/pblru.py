"""Replacement policies over the GPU slots of one selection group.

Two policies sit behind one small interface (:class:`ReplacementPolicy`), registered by name in
:data:`POLICIES` (the config's legal ``policy`` values come from it):

- ``"pblru"`` :class:`PBLRU`, the paper's Parallel Bucketed LRU: recency buckets as bitmaps,
  one bit per GPU slot. A touch is O(k); choosing victims is O(n_b G / 1008) word operations
  (prefix sums over per-word popcounts), never a scan or sort of slots.
- ``"lru"`` :class:`ExactLRU`, the paper's baseline: a timestamp per slot and a pool-wide scan
  (``topk`` over all slots) to find victims.

Both are pure tensor code on the pool's device: no Python loop over slots and no host
synchronisation in any method but ``check_integrity``, fixed output shapes, so the per-step
path can be captured in a CUDA graph. ``advance`` runs once per scheduling round.

Victim order, both policies: free slots first, then least recently used. Slots touched in the
current round (rows this step reads or wrote) are never victims.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch

from .errors import ShapeError
from .pools import resolve_device

__all__ = ["ReplacementPolicy", "PBLRU", "PBLRUArena", "ExactLRU", "POLICIES", "make_policy",
           "DEFAULT_BUCKETS"]

WORD_BITS = 63  # bits per int64 word: bit 63 unused, so +/- 2**b scatter-adds never overflow
SUPER = 16  # words per superblock (second level of the count hierarchy)
HYPER = 64  # superblocks per hyper block (third level: the fused kernels' victim search)
DEFAULT_BUCKETS = 32
"""PB-LRU's recent buckets ``n_b`` wherever none is given (config, sizing, tools). Each
bucket is one bitmap row per group (8 B + a 4 B word count per 63 slots): ``n_b + 3`` rows."""
COLD_ROUND_AGE = 2
"""A prefetched slot's round stamp is this far behind the current round: older than the
shadow reclaim's recent rounds (``ulacache.group.RECLAIM_RECENT_ROUNDS``), never pinned."""
ROUND_MODULUS = 2**16
"""PB-LRU keeps each slot's last round modulo this (``int16``): the round is read only as an
age for the shadow reclaim's order (:meth:`ReplacementPolicy.round_age`), where an age that
wrapped is a heuristic's misjudgement, never a broken invariant."""


@functools.lru_cache(maxsize=None)
def _byte_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``POPCOUNT[256]`` and ``SELECT[256, 8]`` (position of the r-th set bit of a byte), one
    read-only pair per device shared by every policy (a model has one policy per selection
    group and, in TP mode, per buffer: building them per policy cost ~0.1 s each)."""
    popcount = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.int32)
    select = torch.tensor([[b for b in range(8) if v >> b & 1] + [0] * (8 - bin(v).count("1"))
                           for v in range(256)], dtype=torch.int64)
    return popcount.to(device), select.to(device)


class ReplacementPolicy(ABC):
    """Recency over ``n_slots`` GPU slots. Slot ids are ``int64 [n]``; ``-1`` entries are
    ignored; the slots of one call are distinct.

    Graph-safe methods (tensor work on the device, no host sync):

    - ``touch(slots)``: the slots become used and most recent (this round: pinned).
    - ``assign(slots)``: as ``touch``, for slots that just received a new row (placement,
      promotion): turnover, which PB-LRU paces its buckets by.
    - ``admit(slots)``: the slots just received a *prefetched* row: used, but at the lowest
      recency (victims right after the free slots), not pinned, no turnover; a prefetch that
      guessed wrong is the first thing evicted, never a row more likely to be reused. Pinned
      slots are left as they are (a prefetch never takes one as its victim).
    - ``release(slots)``: the (used) slots become free.
    - ``victims(n)``: ``int64 [n]``, the first ``n`` slots in victim order, ``-1`` past the
      number of eligible slots. Pure: state is unchanged.
    - ``eligible()``: 0-dim ``int64``, how many slots ``victims`` can return.
    - ``pinned(slots)``: ``bool [n]``, slots touched this round (never victims).
    - ``used_count()``: 0-dim ``int64``, slots that are not free.
    - ``advance()``: start a new scheduling round.

    ``used_mask()`` and ``check_integrity()`` are host-side (tests, metrics).
    """

    n_slots: int
    device: torch.device
    round_t: torch.Tensor  # 0-dim int64 on the device: the current round

    @abstractmethod
    def touch(self, slots: torch.Tensor) -> None: ...

    def assign(self, slots: torch.Tensor) -> None:
        self.touch(slots)

    @abstractmethod
    def admit(self, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def release(self, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def victims(self, n: int) -> torch.Tensor: ...

    @abstractmethod
    def eligible(self) -> torch.Tensor: ...

    @abstractmethod
    def pinned(self, slots: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def advance(self) -> None: ...

    @abstractmethod
    def used_mask(self) -> torch.Tensor:
        """``bool [n_slots]``: slots that are not free."""

    @abstractmethod
    def round_age(self) -> torch.Tensor:
        """``int64 [n_slots]``: rounds since each slot was last touched (any value for free
        slots; PB-LRU's wraps at :data:`ROUND_MODULUS`). Read by the shadow reclaim, which
        gives back the shadows of the most recently touched rows first."""

    def used_count(self) -> torch.Tensor:
        return self.used_mask().sum(dtype=torch.int64)

    @abstractmethod
    def check_integrity(self) -> None: ...

    def _slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid mask, slots with invalid entries redirected to the scratch index n_slots)."""
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise ShapeError(f"slots must be int64 [n], got {slots.dtype} {tuple(slots.shape)}")
        valid = (slots >= 0) & (slots < self.n_slots)
        return valid, torch.where(valid, slots, self.n_slots)


class PBLRU(ReplacementPolicy):
    """Parallel Bucketed LRU (UlaCache §5.1) with turnover-paced buckets.

    Buckets, one bitmap row each (bit ``s % 63`` of word ``s // 63`` is slot ``s``; every slot
    is in exactly one row)::

        row 0            free slots
        row 1            cold: older than every recent bucket (unordered)
        rows 2 .. n_b+1  recent buckets, one per *epoch* (ring: epoch e is row 2 + e % n_b)
        row n_b + 2      the current bucket: slots touched this round (never victims)

    Victim order: free, cold, recent buckets oldest -> newest; the current bucket is excluded.

    Epochs follow the pool's turnover, not the round count: at a round boundary the current
    bucket joins the newest epoch, and a new epoch starts only once ``bucket_fill`` slots
    (default ``ceil(G / n_b)``) have turned over since the last one: received a new row
    (``assign``: placement, promotion) or been touched out of the cold or free row. Re-touching
    the hot set does not count. The n_b recent buckets then span about one pool's worth of
    turnover whatever the batch or selection size, so rows rarely fall into the unordered cold
    bucket while exact LRU would still order them (with one epoch per round, a single request
    with a slow pool turnover missed up to 3x as often as exact LRU). ``bucket_fill=0``
    restores one epoch per round. The decision is made on the device: rounds stay sync-free.

    State (``W = ceil(G / 63)`` words, rounded up to whole superblocks of 16 words):

    - ``bits int64 [n_b + 3, W + 16]``, ``counts int32`` (popcount per word),
      ``super_counts int32 [n_b + 3, W / 16 + 1]`` (sums per superblock),
      ``hyper_counts int32 [n_b + 3, ceil(W / (16 hyper)) + 1]`` (sums per ``hyper`` = 64
      superblocks) and
      ``row_counts int32 [n_b + 3, 2]`` (column 0: members of the row), kept in step; the last
      entry of each row is scratch (masked updates land there). The two upper levels let one
      fused kernel find the r-th victim with five scans of at most 67 values
      (:mod:`ulacache.kernels.fused_access`); the torch path keeps them without reading them.
    - ``ring_of int16 [G + 1]``: the ring row of each slot's last touch, ``epoch % n_b``, and
      ``round_of int16 [G + 1]``: its round modulo :data:`ROUND_MODULUS` (4 B per slot). The
      paper's slot -> bucket table in a rotation-free form: the bitmaps of the free, cold and
      current rows say whether a slot is in one of them (three bit tests), otherwise its row
      is ``2 + ring_of``. Advancing therefore rewrites no per-slot ids (O(W), not O(G)), and no
      stamp is compared across rounds or epochs, so nothing wraps into a wrong row however
      long a slot stays untouched (absolute ``int64`` stamps cost 16 B per slot per group).
    - ``round_t``, ``epoch_t``, ``entered``: 0-dim ``int64`` on the device.

    Why bitmaps with a two-level count hierarchy: the i-th victim is found by a prefix sum over
    superblock counts in victim order, then a 16-word prefix inside its superblock and a select
    within one word: O(n_b G / 1008) + O(16 n) fixed-shape tensor work, so many buckets (a fine
    recency resolution) stay cheap, where exact LRU must scan all G timestamps.
    """

    def __init__(self, n_slots: int, n_buckets: int = DEFAULT_BUCKETS,
                 device: torch.device | str = "cpu",
                 bucket_fill: int | None = None, hyper: int = HYPER,
                 arena: tuple[PBLRUArena, int] | None = None):
        if n_slots < 1 or n_buckets < 2:
            raise ShapeError("PBLRU needs n_slots >= 1 and n_buckets >= 2")
        self.n_slots, self.n_buckets = int(n_slots), int(n_buckets)
        self.bucket_fill = -(-self.n_slots // self.n_buckets) if bucket_fill is None \
            else int(bucket_fill)
        self.device = resolve_device(device)
        self.n_super = -(-self.n_slots // (WORD_BITS * SUPER))
        self.n_words = self.n_super * SUPER  # padded to whole superblocks
        self.hyper = int(hyper)  # superblocks per hyper block (small in tests: deep searches)
        if self.hyper < 1:
            raise ShapeError("PBLRU needs hyper >= 1")
        self.n_hyper = -(-self.n_super // self.hyper)
        self.current_row = self.n_buckets + 2
        i64 = dict(dtype=torch.int64, device=self.device)
        if self.n_buckets > 2**15:  # ring_of is int16
            raise ShapeError(f"PBLRU needs n_buckets <= {2**15}, got {self.n_buckets}")
        tables = _bucket_tables(1, self.n_buckets, self.n_words, self.n_super, self.n_hyper,
                                self.device) if arena is None else arena[0].tables
        i = 0 if arena is None else arena[1]
        # one policy's slice of each stacked table (an arena's, or its own of one)
        self.bits, self.counts, self.super_counts, self.hyper_counts, self.row_counts, scalars \
            = (t[i] for t in tables)
        self.ring_of = torch.zeros((self.n_slots + 1,), dtype=torch.int16, device=self.device)
        self.round_of = torch.zeros((self.n_slots + 1,), dtype=torch.int16, device=self.device)
        # 0-dim views: in-place updates only, so an arena's stacked copy stays the state
        self.round_t, self.epoch_t, self.entered = scalars[0], scalars[1], scalars[2]
        self.arena = None if arena is None else arena[0]  # whose stacked tables these are
        self._popcount, self._select = _byte_tables(self.device)
        self._ring = torch.arange(1, self.n_buckets + 1, device=self.device)
        self._head = torch.tensor([0, 1], **i64)
        self._rows = torch.arange(self.n_buckets + 3, device=self.device)  # bucket row ids
        self._flag_rows = self._rows[[0, 1, self.current_row]]  # free, cold, current
        all_slots = torch.arange(self.n_slots, device=self.device)
        self._move_bits(all_slots, None, torch.zeros_like(all_slots),
                        torch.ones_like(all_slots, dtype=torch.bool))  # everything starts free

    # -- bit plumbing -------------------------------------------------------------------
    def _move_bits(self, slots: torch.Tensor, src_rows: torch.Tensor | None,
                   dst_rows: torch.Tensor, mask: torch.Tensor) -> None:
        """Move ``slots`` from bucket ``src_rows`` to ``dst_rows`` where ``mask``: clear the old
        bit and set the new one (+/- 2**bit scatter-adds: no carries, as the old bit is set and
        the new one clear), keeping word and superblock counts in step. Masked entries land in
        the scratch word / superblock. One scatter per table."""
        word = torch.div(slots, WORD_BITS, rounding_mode="floor")
        value = torch.bitwise_left_shift(torch.ones_like(word), slots - word * WORD_BITS)
        sup = torch.div(word, SUPER, rounding_mode="floor")
        hyp = torch.where(mask, torch.div(sup, self.hyper, rounding_mode="floor"), self.n_hyper)
        sup = torch.where(mask, sup, self.n_super)
        word = torch.where(mask, word, self.n_words)
        col = torch.where(mask, 0, 1)
        ones = torch.ones_like(word, dtype=torch.int32)
        w1, s1, h1 = self.n_words + SUPER, self.n_super + 1, self.n_hyper + 1
        index = [(dst_rows * w1 + word, dst_rows * s1 + sup, dst_rows * h1 + hyp,
                  dst_rows * 2 + col)]
        if src_rows is not None:
            index.insert(0, (src_rows * w1 + word, src_rows * s1 + sup, src_rows * h1 + hyp,
                             src_rows * 2 + col))
            value, ones = torch.cat([-value, value]), torch.cat([-ones, ones])
        flat, flat_sup, flat_hyp, flat_row = index[0] if len(index) == 1 else \
            (torch.cat(parts) for parts in zip(*index))
        self.bits.view(-1).scatter_add_(0, flat, value)
        for table, at in ((self.counts, flat), (self.super_counts, flat_sup),
                          (self.hyper_counts, flat_hyp), (self.row_counts, flat_row)):
            table.view(-1).scatter_add_(0, at, ones)

    def _in_rows(self, rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``bool [len(rows), n]``: whether slots ``s`` (in range, or the scratch index) are in
        each of ``rows`` (``int64``): one gather of their words."""
        word = torch.div(s, WORD_BITS, rounding_mode="floor")
        bit = torch.bitwise_left_shift(torch.ones_like(word), s - word * WORD_BITS)
        words = self.bits.view(-1)[rows.unsqueeze(1) * self.bits.shape[1] + word]
        return (words & bit) != 0

    def _in_row(self, row: int, s: torch.Tensor) -> torch.Tensor:
        """``bool [n]``: whether slots ``s`` are in ``row``."""
        return self._in_rows(self._rows[row: row + 1], s)[0]

    def _row_of(self, s: torch.Tensor) -> torch.Tensor:
        """Bucket row of slots ``s`` (see the class docstring): free, current, cold by their
        bits, else the ring row of their last touch."""
        free, cold, current = self._in_rows(self._flag_rows, s)
        row = torch.where(cold, 1, 2 + self.ring_of[s].to(torch.int64))
        row = torch.where(current, self.current_row, row)
        return torch.where(free, 0, row)

    def _move_row(self, dst: torch.Tensor, src: torch.Tensor, move: torch.Tensor) -> None:
        """If ``move`` (0-dim 0/1): every member of row ``src`` joins row ``dst`` (rows hold
        disjoint sets, so adding is OR). Rows are device scalars: no host sync."""
        for table in (self.bits, self.counts, self.super_counts, self.hyper_counts,
                      self.row_counts):
            moved = table.index_select(0, src.view(1)) * move.to(table.dtype)
            table.index_add_(0, dst.view(1), moved)
            table.index_add_(0, src.view(1), -moved)

    # -- interface ----------------------------------------------------------------------
    def touch(self, slots: torch.Tensor, assigned: bool = False) -> None:
        valid, s = self._slots(slots)
        old = self._row_of(s)
        move = valid & (old != self.current_row)
        self._move_bits(s, old, torch.full_like(s, self.current_row), move)
        # turnover: slots with a new row, and touches from outside recency (free or cold)
        self.entered.add_((move if assigned else move & (old <= 1)).sum())
        dst = torch.where(move, s, self.n_slots)
        # truncating casts: the round modulo 2**16, the ring row (< n_b <= 2**15) exactly
        self.round_of.index_put_((dst,), self.round_t.to(torch.int16).expand_as(s))
        self.ring_of.index_put_((dst,), torch.remainder(self.epoch_t, self.n_buckets)
                                .to(torch.int16).expand_as(s))

    def assign(self, slots: torch.Tensor) -> None:
        self.touch(slots, assigned=True)

    def admit(self, slots: torch.Tensor) -> None:
        """Into the cold bucket (row 1), stamped a round :data:`COLD_ROUND_AGE` behind (the
        shadow reclaim counts it as an older row, whose shadow is worth keeping)."""
        valid, s = self._slots(slots)
        old = self._row_of(s)
        move = valid & (old != 1) & (old != self.current_row)
        self._move_bits(s, old, torch.ones_like(s), move)
        dst = torch.where(move, s, self.n_slots)
        self.round_of.index_put_((dst,), (self.round_t - COLD_ROUND_AGE).to(torch.int16)
                                 .expand_as(s))

    def release(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        old = self._row_of(s)
        move = valid & (old != 0)
        self._move_bits(s, old, torch.zeros_like(s), move)  # stamps of free slots: unread

    def advance(self) -> None:
        """End the round: its bucket joins the newest epoch; a new epoch starts (retiring the
        ring row it reuses into cold) once ``bucket_fill`` slots entered recency."""
        one = torch.ones((), dtype=torch.int64, device=self.device)
        newest = 2 + torch.remainder(self.epoch_t, self.n_buckets)
        self._move_row(newest, one * self.current_row, one)
        go = (self.entered >= self.bucket_fill).to(torch.int64)
        self.epoch_t.add_(go)
        self.entered.mul_(1 - go)
        # the ring row the new epoch reuses held epoch e - n_b: its members turn cold
        self._move_row(one, 2 + torch.remainder(self.epoch_t, self.n_buckets), go)
        self.round_t.add_(1)

    def _victim_rows(self) -> torch.Tensor:
        """``int64 [n_b + 2]`` bucket rows in victim order: free, cold, recent oldest .. newest
        (the current bucket is not among them)."""
        recent = 2 + torch.remainder(self.epoch_t + self._ring, self.n_buckets)
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
        wc = self.counts.view(-1, SUPER).index_select(0, block)
        wends = torch.cumsum(wc, 1, dtype=torch.int32)
        r1 = r1.to(torch.int32)  # same dtype as wends: no promotion copies of [n, 16]
        # words whose running count is <= r1 come before the one holding rank r1
        which = torch.searchsorted(wends, r1.unsqueeze(1), right=True).squeeze(1)
        which = which.clamp(max=SUPER - 1)
        before = torch.where(which > 0, wends.gather(1, (which - 1).clamp(min=0).unsqueeze(1))
                             .squeeze(1), 0)
        word = sb_local * SUPER + which
        words = self.bits.view(-1).index_select(0, row * (self.n_words + SUPER) + word)
        bit = self._select_bit(words, r1 - before)
        slot = word * WORD_BITS + bit
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
        return self.row_counts.index_select(0, rows)[:, 0].sum(dtype=torch.int64)

    def pinned(self, slots: torch.Tensor) -> torch.Tensor:
        valid, s = self._slots(slots)
        return valid & self._in_row(self.current_row, s)

    def used_count(self) -> torch.Tensor:
        return self.n_slots - self.row_counts[0, 0].to(torch.int64)

    def used_mask(self) -> torch.Tensor:
        return ~self._in_row(0, torch.arange(self.n_slots, device=self.device))

    def round_age(self) -> torch.Tensor:
        return torch.remainder(self.round_t - self.round_of[: self.n_slots].to(torch.int64),
                               ROUND_MODULUS)

    def bucket_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Bucket row of each slot (0 free, 1 cold, 2 + i recent ring row i, n_b + 2 current);
        for tests and metrics."""
        return self._row_of(slots)

    def check_integrity(self) -> None:
        G, W, S, H = self.n_slots, self.n_words, self.n_super, self.n_hyper
        used = self.used_mask()
        slots = torch.arange(G, device=self.device)
        # every slot in exactly one row (the bitmaps are the truth; rows derive from them)
        members = self._in_rows(self._rows, slots).sum(0)
        assert bool((members == 1).all()), "a slot is in no bucket row, or in two"
        ring = self.ring_of[:G].to(torch.int64)
        assert bool(((ring >= 0) & (ring < self.n_buckets)).all()), "ring stamp out of range"
        current = self._in_row(self.current_row, slots)
        assert bool((self.round_of[:G][current] == self.round_t.to(torch.int16)).all()), \
            "a slot of the current row was not stamped this round"
        assert 0 <= int(self.entered), "negative entry count"
        expected = PBLRU.__new__(PBLRU)
        expected.__dict__.update(self.__dict__)
        for name in ("bits", "counts", "super_counts", "hyper_counts", "row_counts"):
            setattr(expected, name, torch.zeros_like(getattr(self, name)))
        expected._move_bits(slots, None, self.bucket_of(slots), torch.ones_like(used))
        assert torch.equal(expected.bits[:, :W], self.bits[:, :W]), \
            "bitmaps disagree with the ring stamps"
        assert torch.equal(expected.counts[:, :W], self.counts[:, :W]), "word counts != bits"
        assert torch.equal(expected.super_counts[:, :S], self.super_counts[:, :S]), \
            "superblock counts != word counts"
        assert torch.equal(expected.hyper_counts[:, :H], self.hyper_counts[:, :H]), \
            "hyper block counts != superblock counts"
        assert torch.equal(expected.row_counts[:, 0], self.row_counts[:, 0]), \
            "row totals != hyper block counts"


def _bucket_tables(n: int, n_buckets: int, n_words: int, n_super: int, n_hyper: int,
                   device: torch.device) -> tuple[torch.Tensor, ...]:
    """Zeroed state of ``n`` PB-LRU policies, stacked on dim 0 (see :class:`PBLRU`): bits,
    counts, super_counts, hyper_counts, row_counts, and ``int64 [n, 3]`` scalars (round_t,
    epoch_t, entered)."""
    rows = n_buckets + 3
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.zeros(n, rows, n_words + SUPER, dtype=torch.int64, device=device),
            torch.zeros(n, rows, n_words + SUPER, **i32),
            torch.zeros(n, rows, n_super + 1, **i32),
            torch.zeros(n, rows, n_hyper + 1, **i32),
            torch.zeros(n, rows, 2, **i32),
            torch.zeros(n, 3, dtype=torch.int64, device=device))


class PBLRUArena:
    """``n`` PB-LRU policies of one geometry whose bucket tables and round scalars are slices
    of stacked tensors (``tables``: each ``[n, ...]``, policy ``i`` owns index ``i``), so one
    launch can start a round for all of them (:func:`ulacache.kernels.fused_policy.advance`)
    where the torch path issues about 70 small ops per policy. An address space keeps one for
    its selection groups (a TP rank one more for its buffers): every group has the same pool,
    so the same geometry. The per-slot stamps stay per policy (a round start never reads them).
    """

    def __init__(self, n: int, n_slots: int, n_buckets: int = DEFAULT_BUCKETS,
                 device: torch.device | str = "cpu", bucket_fill: int | None = None,
                 hyper: int = HYPER):
        if n < 1:
            raise ShapeError("PBLRUArena needs at least one policy")
        n_super = -(-int(n_slots) // (WORD_BITS * SUPER))  # PBLRU's geometry rule
        self.device = resolve_device(device)
        self.tables = _bucket_tables(n, int(n_buckets), n_super * SUPER, n_super,
                                     -(-n_super // max(1, int(hyper))), self.device)
        self.policies = [PBLRU(n_slots, n_buckets, self.device, bucket_fill, hyper,
                               arena=(self, i)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.policies)

    def advance(self) -> None:
        """Start a round in every policy: the torch reference of the fused
        :func:`ulacache.kernels.fused_policy.advance` (same signature, same result)."""
        for p in self.policies:
            p.advance()


class ExactLRU(ReplacementPolicy):
    """Exact LRU (the paper's baseline): a last-touch round per slot; victims by a pool-wide
    scan (``topk`` of the smallest keys over all G slots). Ties break by slot id. Stamps:
    :data:`FREE_STAMP` free, :data:`COLD_STAMP` admitted by a prefetch (after the free slots,
    before every touched one), else the round of the last touch."""

    FREE_STAMP, COLD_STAMP = -2, -1

    def __init__(self, n_slots: int, device: torch.device | str = "cpu"):
        self.n_slots = int(n_slots)
        self.device = resolve_device(device)
        self.stamp = torch.full((self.n_slots + 1,), self.FREE_STAMP, dtype=torch.int64,
                                device=self.device)
        self.round_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self._ids = torch.arange(self.n_slots, device=self.device)

    def touch(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        self.stamp.index_put_((s,), torch.where(valid, self.round_t, self.stamp[s]))

    def admit(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        move = valid & (self.stamp[s] != self.round_t)
        self.stamp.index_put_((s,), torch.where(move, self.COLD_STAMP, self.stamp[s]))

    def release(self, slots: torch.Tensor) -> None:
        valid, s = self._slots(slots)
        self.stamp.index_put_((s,), torch.where(valid, self.FREE_STAMP, self.stamp[s]))

    def advance(self) -> None:
        self.round_t.add_(1)

    def victims(self, n: int) -> torch.Tensor:
        stamp = self.stamp[: self.n_slots]
        never = torch.iinfo(torch.int64).max
        key = torch.where(stamp == self.round_t, never, (stamp - self.FREE_STAMP) * self.n_slots
                          + self._ids)
        m = min(n, self.n_slots)
        vals, idx = torch.topk(key, m, largest=False, sorted=True)
        out = torch.where(vals != never, idx, -1)
        if m < n:
            out = torch.cat([out, torch.full((n - m,), -1, dtype=torch.int64, device=self.device)])
        return out

    def eligible(self) -> torch.Tensor:
        return (self.stamp[: self.n_slots] != self.round_t).sum(dtype=torch.int64)

    def pinned(self, slots: torch.Tensor) -> torch.Tensor:
        valid, s = self._slots(slots)
        return valid & (self.stamp[s] == self.round_t)

    def used_mask(self) -> torch.Tensor:
        return self.stamp[: self.n_slots] != self.FREE_STAMP

    def round_age(self) -> torch.Tensor:
        return self.round_t - self.stamp[: self.n_slots]

    def check_integrity(self) -> None:
        assert bool((self.stamp[: self.n_slots] <= self.round_t).all()), "stamp from the future"


POLICIES: dict[str, type[ReplacementPolicy]] = {"pblru": PBLRU, "lru": ExactLRU}
"""Policy names (config ``policy``) -> classes. The one registry of legal names."""


def make_policy(name: str, n_slots: int, n_buckets: int = DEFAULT_BUCKETS,
                device: torch.device | str = "cpu") -> ReplacementPolicy:
    """A policy by registered name (see :data:`POLICIES`)."""
    if name not in POLICIES:
        raise ShapeError(f"unknown policy {name!r}; legal: {sorted(POLICIES)}")
    if POLICIES[name] is PBLRU:
        return PBLRU(n_slots, n_buckets, device)
    return POLICIES[name](n_slots, device)
