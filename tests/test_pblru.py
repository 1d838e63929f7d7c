"""PB-LRU and exact LRU against plain-Python reference models."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache.errors import ShapeError
from ulacache.pblru import PBLRU, ExactLRU, make_policy


class RefBuckets:
    """The paper's PB-LRU spelled out with Python sets."""

    def __init__(self, n: int, nb: int):
        self.n, self.nb, self.round = n, nb, 0
        self.free = set(range(n))
        self.cold: set[int] = set()
        self.recent = [set() for _ in range(nb)]

    def _remove(self, s: int) -> None:
        for b in [self.free, self.cold, *self.recent]:
            b.discard(s)

    def touch(self, slots):
        for s in slots:
            self._remove(s)
            self.recent[self.round % self.nb].add(s)

    def release(self, slots):
        for s in slots:
            self._remove(s)
            self.free.add(s)

    def advance(self):
        self.round += 1
        cur = self.round % self.nb
        self.cold |= self.recent[cur]
        self.recent[cur] = set()

    def victims(self, n):
        order = sorted(self.free) + sorted(self.cold)
        for age in range(1, self.nb):
            order += sorted(self.recent[(self.round + age) % self.nb])
        return (order + [-1] * n)[:n]


class RefLRU:
    def __init__(self, n):
        self.stamp = [-1] * n
        self.round = 0

    def touch(self, slots):
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
    st.tuples(st.sampled_from(["touch", "release", "advance", "victims"]),
              st.lists(st.integers(0, 199), max_size=40, unique=True)),
    min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=ops, n=st.sampled_from([1, 63, 64, 126, 200]), nb=st.sampled_from([2, 3, 8]))
def test_pblru_matches_bucket_model(ops, n, nb):
    pol, ref = PBLRU(n, nb), RefBuckets(n, nb)
    for op, slots in ops:
        slots = [s for s in slots if s < n]
        t = torch.tensor(slots + [-1, -1], dtype=torch.int64)  # padding is ignored
        if op == "touch":
            pol.touch(t)
            ref.touch(slots)
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
        pol.check_integrity()


@settings(max_examples=40, deadline=None)
@given(ops=ops, n=st.sampled_from([1, 50, 200]))
def test_exact_lru_matches_model(ops, n):
    pol, ref = ExactLRU(n), RefLRU(n)
    for op, slots in ops:
        slots = [s for s in slots if s < n]
        t = torch.tensor(slots, dtype=torch.int64)
        if op == "touch":
            pol.touch(t)
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


@pytest.mark.parametrize("name", ["pblru", "lru"])
def test_current_round_never_victim(name):
    pol = make_policy(name, 100, 4)
    pol.touch(torch.arange(100))
    assert pol.victims(10).tolist() == [-1] * 10  # everything was touched this round
    assert int(pol.eligible()) == 0
    pol.advance()
    pol.touch(torch.arange(0, 100, 2))
    v = pol.victims(60)
    assert set(v[:50].tolist()) == set(range(1, 100, 2)) and (v[50:] == -1).all()
    assert pol.in_current_round(torch.tensor([0, 1, -1])).tolist() == [True, False, False]


def test_cold_before_recent_and_oldest_first():
    pol = PBLRU(10, n_buckets=3)
    pol.touch(torch.tensor([0, 1]))  # round 0
    pol.advance()
    pol.touch(torch.tensor([2, 3]))  # round 1
    pol.advance()
    pol.touch(torch.tensor([4]))  # round 2
    pol.advance()  # round 3: round-0 bucket retires to cold
    pol.touch(torch.tensor([5]))
    assert pol.victims(10).tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 4, -1]
    assert pol.bucket_of(torch.tensor([0, 2, 5, 9])).tolist() == [1, 3, 2, 0]


def test_touch_is_idempotent_within_round():
    pol = PBLRU(130, 4)
    for _ in range(3):
        pol.touch(torch.tensor([5, 64, 129]))
    pol.check_integrity()
    assert int(pol.eligible()) == 127


def test_bad_slot_tensor_rejected():
    with pytest.raises(ShapeError):
        PBLRU(8).touch(torch.tensor([1, 2], dtype=torch.int32))


def test_large_random_against_model():
    rng = random.Random(0)
    n = 5000
    pol, ref = PBLRU(n, 8), RefBuckets(n, 8)
    for _ in range(30):
        slots = rng.sample(range(n), 300)
        pol.touch(torch.tensor(slots))
        ref.touch(slots)
        if rng.random() < 0.3:
            rel = [s for s in rng.sample(range(n), 50) if s not in ref.free]
            pol.release(torch.tensor(rel, dtype=torch.int64))
            ref.release(rel)
        pol.advance()
        ref.advance()
        assert pol.victims(2000).tolist() == ref.victims(2000)
    pol.check_integrity()
