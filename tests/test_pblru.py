"""PB-LRU and exact LRU against plain-Python reference models (sets and timestamps)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache.errors import ShapeError
from ulacache.pblru import PBLRU, POLICIES, ExactLRU, make_policy


class RefBuckets:
    """PB-LRU with turnover-paced epochs, spelled out with Python sets.

    ``current`` holds this round's touches; at a round's end it joins the newest epoch, and a
    new epoch starts (the oldest recent epoch retiring to cold) once ``fill`` slots turned over
    (assigned, or touched out of cold or free) since the last one.
    """

    def __init__(self, n: int, nb: int, fill: int):
        self.n, self.nb, self.fill = n, nb, fill
        self.free = set(range(n))
        self.cold: set[int] = set()
        self.epochs = [set() for _ in range(nb)]  # oldest .. newest
        self.current: set[int] = set()
        self.entered = 0

    def _remove(self, s: int) -> str:
        for name, b in [("free", self.free), ("cold", self.cold), ("cur", self.current)]:
            if s in b:
                b.discard(s)
                return name
        for b in self.epochs:
            if s in b:
                b.discard(s)
                return "recent"
        raise AssertionError(s)

    def touch(self, slots, assigned: bool = False):
        for s in slots:
            was = self._remove(s)
            self.current.add(s)
            if was != "cur" and (assigned or was in ("cold", "free")):
                self.entered += 1

    def release(self, slots):
        for s in slots:
            self._remove(s)
            self.free.add(s)

    def advance(self):
        self.epochs[-1] |= self.current
        self.current = set()
        if self.entered >= self.fill:
            self.entered = 0
            self.cold |= self.epochs.pop(0)
            self.epochs.append(set())

    def victims(self, n):
        order = sorted(self.free) + sorted(self.cold)
        for b in self.epochs:
            order += sorted(b)
        return (order + [-1] * n)[:n]


class RefLRU:
    def __init__(self, n):
        self.stamp = [-1] * n
        self.round = 0

    def touch(self, slots, assigned: bool = False):
        for s in slots:
            self.stamp[s] = self.round

    def release(self, slots):
        for s in slots:
            self.stamp[s] = -1

    def advance(self):
        self.round += 1

    def victims(self, n):
        order = sorted((st_, s) for s, st_ in enumerate(self.stamp) if st_ != self.round)
        return ([s for _, s in order] + [-1] * n)[:n]


ops = st.lists(
    st.tuples(st.sampled_from(["touch", "assign", "release", "advance", "victims"]),
              st.lists(st.integers(0, 199), max_size=40, unique=True)),
    min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(ops=ops, n=st.sampled_from([1, 63, 64, 126, 200]), nb=st.sampled_from([2, 3, 8]),
       fill=st.sampled_from([None, 0, 1, 5]))
def test_pblru_matches_bucket_model(ops, n, nb, fill):
    pol = PBLRU(n, nb, bucket_fill=fill)
    ref = RefBuckets(n, nb, pol.bucket_fill)
    for op, slots in ops:
        slots = [s for s in slots if s < n]
        t = torch.tensor(slots + [-1, -1], dtype=torch.int64)  # padding is ignored
        if op in ("touch", "assign"):
            (pol.assign if op == "assign" else pol.touch)(t)
            ref.touch(slots, assigned=op == "assign")
        elif op == "release":
            used = [s for s in slots if s not in ref.free]
            pol.release(torch.tensor(used, dtype=torch.int64))
            ref.release(used)
        elif op == "advance":
            pol.advance()
            ref.advance()
        k = len(slots) + 5
        assert pol.victims(k).tolist() == ref.victims(k)
        assert int(pol.eligible()) == len([v for v in ref.victims(n + 1) if v >= 0])
        assert int(pol.used_count()) == n - len(ref.free)
        pol.check_integrity()


@settings(max_examples=40, deadline=None)
@given(ops=ops, n=st.sampled_from([1, 50, 200]))
def test_exact_lru_matches_model(ops, n):
    pol, ref = ExactLRU(n), RefLRU(n)
    for op, slots in ops:
        slots = [s for s in slots if s < n]
        t = torch.tensor(slots, dtype=torch.int64)
        if op in ("touch", "assign"):
            getattr(pol, op)(t)
            ref.touch(slots)
        elif op == "release":
            pol.release(t)
            ref.release(slots)
        elif op == "advance":
            pol.advance()
            ref.advance()
        k = len(slots) + 3
        assert pol.victims(k).tolist() == ref.victims(k)
        pol.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_current_round_never_victim(name):
    pol = make_policy(name, 100, 4)
    pol.touch(torch.arange(100))
    assert pol.victims(10).tolist() == [-1] * 10  # everything was touched this round
    assert int(pol.eligible()) == 0
    pol.advance()
    pol.touch(torch.arange(0, 100, 2))
    v = pol.victims(60)
    assert set(v[:50].tolist()) == set(range(1, 100, 2)) and (v[50:] == -1).all()
    assert pol.pinned(torch.tensor([0, 1, -1])).tolist() == [True, False, False]


def test_epochs_follow_turnover_not_rounds():
    """With one epoch per round (bucket_fill=0) a slot not touched for n_b rounds turns cold
    and loses its order; paced by turnover, quiet rounds (only re-touches of hot slots) do not
    age the recent buckets."""
    hot = torch.tensor([0, 1])
    for fill, expect_cold in ((0, True), (None, False)):
        pol = PBLRU(16, n_buckets=2, bucket_fill=fill)
        pol.assign(torch.arange(2, 6))  # 4 rows turn over: half of bucket_fill (16 / 2)
        pol.advance()
        for _ in range(5):  # quiet rounds
            pol.touch(hot)
            pol.advance()
        cold = bool((pol.bucket_of(torch.arange(2, 6)) == 1).all())
        assert cold == expect_cold
    pol = PBLRU(16, n_buckets=2)  # fill 8: the 8th assignment starts a new epoch
    pol.assign(torch.arange(7))
    pol.advance()
    assert int(pol.epoch_t) == 0
    pol.assign(torch.tensor([7]))
    pol.advance()
    assert int(pol.epoch_t) == 1


def test_cold_before_recent_and_oldest_first():
    pol = PBLRU(10, n_buckets=3, bucket_fill=0)  # one epoch per round: the paper's rotation
    pol.touch(torch.tensor([0, 1]))  # round 0
    pol.advance()
    pol.touch(torch.tensor([2, 3]))  # round 1
    pol.advance()
    pol.touch(torch.tensor([4]))  # round 2
    pol.advance()  # the round-0 epoch retires to cold
    pol.touch(torch.tensor([5]))
    assert pol.victims(10).tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 4, -1]
    cold, current = 1, pol.current_row
    rows = pol.bucket_of(torch.tensor([0, 2, 5, 9])).tolist()
    assert rows[0] == cold and rows[2] == current and rows[3] == 0 and rows[1] >= 2


def test_touch_is_idempotent_within_round():
    pol = PBLRU(130, 4)
    for _ in range(3):
        pol.touch(torch.tensor([5, 64, 129]))
    pol.check_integrity()
    assert int(pol.eligible()) == 127


def test_bad_slot_tensor_rejected():
    with pytest.raises(ShapeError):
        PBLRU(8).touch(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ShapeError):
        make_policy("fifo", 8)


def test_out_of_range_slots_are_ignored():
    pol = PBLRU(8, 2)
    pol.touch(torch.tensor([3, 8, 100, -5]))
    pol.check_integrity()
    assert int(pol.used_count()) == 1


@pytest.mark.parametrize("fill", [0, None])
def test_large_random_against_model(fill):
    rng = random.Random(0)
    n = 5000
    pol = PBLRU(n, 8, bucket_fill=fill)
    ref = RefBuckets(n, 8, pol.bucket_fill)
    for _ in range(30):
        slots = rng.sample(range(n), 300)
        pol.assign(torch.tensor(slots[:100]))
        ref.touch(slots[:100], assigned=True)
        pol.touch(torch.tensor(slots[100:]))
        ref.touch(slots[100:])
        if rng.random() < 0.3:
            rel = [s for s in rng.sample(range(n), 50) if s not in ref.free]
            pol.release(torch.tensor(rel, dtype=torch.int64))
            ref.release(rel)
        pol.advance()
        ref.advance()
        assert pol.victims(2000).tolist() == ref.victims(2000)
    pol.check_integrity()


@settings(max_examples=40, deadline=None)
@given(ops=ops, nb=st.sampled_from([2, 8]), fill=st.sampled_from([0, 1, 5]))
def test_pblru_is_the_same_across_the_stamps_wrap(ops, nb, fill):
    """PB-LRU's per-slot stamps are ``int16`` (a ring row, a round modulo 2**16): a policy whose
    round counter starts just below 2**16 (and whose epoch counter starts far along the ring)
    behaves exactly as one started at 0 as both cross the wrap: the same bucket of every slot,
    victims, pins, and shadow-reclaim ages, and both stay consistent."""
    n = 200
    base, late = PBLRU(n, nb, bucket_fill=fill), PBLRU(n, nb, bucket_fill=fill)
    late.round_t.fill_(2**16 - 2)
    late.epoch_t.fill_(7 * nb - 1)
    ref = RefBuckets(n, nb, base.bucket_fill)
    slots_all = torch.arange(n)
    for op, slots in ops * 2:
        slots = [s for s in slots if s < n]
        t = torch.tensor(slots + [-1], dtype=torch.int64)
        for pol in (base, late):
            if op in ("touch", "assign"):
                (pol.assign if op == "assign" else pol.touch)(t)
            elif op == "release":
                pol.release(torch.tensor([s for s in slots if s not in ref.free],
                                         dtype=torch.int64))
            elif op == "advance":
                pol.advance()
        if op in ("touch", "assign"):
            ref.touch(slots, assigned=op == "assign")
        elif op == "release":
            ref.release([s for s in slots if s not in ref.free])
        elif op == "advance":
            ref.advance()
        for pol in (base, late, ref):  # every op ends its round: the wrap is always crossed
            pol.advance()
        assert late.victims(n + 1).tolist() == base.victims(n + 1).tolist() == ref.victims(n + 1)
        assert torch.equal(late.pinned(slots_all), base.pinned(slots_all))
        used = base.used_mask()
        assert torch.equal(late.used_mask(), used)
        assert torch.equal(late.round_age()[used], base.round_age()[used])
        # ring rows differ by the epoch offset; free, cold and current are the same rows
        b, lt = base.bucket_of(slots_all), late.bucket_of(slots_all)
        assert torch.equal(b <= 1, lt <= 1) and torch.equal(b[b <= 1], lt[lt <= 1])
        late.check_integrity()
    assert int(late.round_t) >= 2**16
