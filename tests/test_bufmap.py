"""The TP buffer's hash map (ulacache/bufmap.py) against a dict, its fused twin (Triton helpers
in kernels/fused_tp.py) against it, what a full bucket pair does, and the fullest bucket at
production size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache.buffer import LocalBuffer
from ulacache.bufmap import LOAD, WAYS, BufferMap, buckets, map_bytes

N_ADDR = 1 << 20


def crowded(n_buckets: int, count: int, bucket: int = 0) -> torch.Tensor:
    """``count`` distinct addresses whose two buckets are both ``bucket``."""
    a = torch.arange(N_ADDR)
    b1, b2 = buckets(a, n_buckets)
    out = a[(b1 == bucket) & (b2 == bucket)][:count]
    assert out.numel() == count
    return out


class Model:
    """A buffer map and its holders, driven like LocalBuffer drives them, beside a dict."""

    def __init__(self, n_slots: int):
        self.m = BufferMap(n_slots, torch.device("cpu"))
        self.holder = torch.full((n_slots + 1,), -1, dtype=torch.int64)
        self.ref: dict[int, int] = {}

    def put(self, addrs: list[int], slots: list[int]) -> None:
        """Map new addresses to these slots (each slot's old address, if any, unmapped)."""
        a, s = torch.tensor(addrs, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
        ok, pos = self.m.insert(a, s, torch.ones_like(a, dtype=torch.bool))
        old = self.holder[s]
        self.m.erase(s, old, ok & (old >= 0), pos)
        self.holder[s[ok]] = a[ok]
        for ai, si, oi, good in zip(a.tolist(), s.tolist(), old.tolist(), ok.tolist()):
            if good:
                self.ref.pop(oi, None)
                self.ref[ai] = si

    def drop(self, addrs: list[int]) -> None:
        a = torch.tensor(addrs, dtype=torch.int64)
        slot, pos = self.m.find(a, self.holder)
        self.m.erase_at(pos, slot >= 0)
        self.holder[slot[slot >= 0]] = -1
        for ai in addrs:
            self.ref.pop(ai, None)

    def check(self) -> None:
        self.m.check_integrity(self.holder)
        probe = torch.tensor(sorted(self.ref) + [0, 1, 5, N_ADDR - 1], dtype=torch.int64)
        slot, _ = self.m.find(probe, self.holder)
        want = [self.ref.get(x, -1) for x in probe.tolist()]
        assert slot.tolist() == want


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 2**16)),
                                     min_size=1, max_size=25))
def test_map_agrees_with_a_dict(n_slots, ops):
    """Random rounds of placements (free slots first, then the oldest) and drops, integrity and
    every lookup checked after each; addresses drawn from a small range, so buckets crowd."""
    mdl = Model(n_slots)
    rng = torch.Generator().manual_seed(n_slots)
    age = list(range(n_slots))
    for drop, seed in ops:
        if drop and mdl.ref:
            keys = sorted(mdl.ref)
            mdl.drop(keys[seed % len(keys):][:3])
        else:
            k = 1 + seed % n_slots
            fresh = torch.randperm(4 * n_slots + 64, generator=rng)[:k] * 7 + seed % 5
            new = [a for a in fresh.tolist() if a not in mdl.ref]
            free = [s for s in age if int(mdl.holder[s]) < 0]
            slots = (free + [s for s in age if s not in free])[: len(new)]
            age = [s for s in age if s not in slots] + slots
            mdl.put(new, slots)
        mdl.check()


def test_full_bucket_pair_leaves_state_unchanged():
    """More copies than one bucket pair holds: the rest are refused (slot -1, counted by the
    caller) and the buffer is exactly as if they had not been asked for."""
    buf = LocalBuffer(1 << 20, 40, torch.device("cpu"))
    nb = buf.map.n_buckets
    addrs = crowded(nb, WAYS + 6)
    slot, evicted = buf.claim(addrs, torch.ones_like(addrs, dtype=torch.bool))
    assert int((slot >= 0).sum()) == WAYS and int(evicted) == 0
    assert torch.equal(slot[:WAYS] >= 0, torch.ones(WAYS, dtype=torch.bool))  # lane order
    held, hslots = buf.buffered()
    assert sorted(held.tolist()) == sorted(addrs[:WAYS].tolist())
    assert int(buf.eligible()) == 40 - WAYS  # the refused wants took no slot
    buf.check_integrity()
    # another address of that bucket pair is refused too; one elsewhere is not
    more = crowded(nb, WAYS + 7)[-1:]
    other = crowded(nb, 1, bucket=1)
    slot2, _ = buf.claim(torch.cat([more, other]), torch.ones(2, dtype=torch.bool))
    assert slot2[0] == -1 and slot2[1] >= 0
    buf.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_long_drop_walks_the_slots_to_the_same_state(seed):
    """A release longer than the buffer (walks the B slots through claim-table marks) leaves
    the same holders, map and count as the same release in short pieces (map lookups), and
    exactly the released addresses' copies are gone. Duplicates and the scratch index ride
    along, as a real release pads."""
    n_logical, B = 4096, 48
    gen = torch.Generator().manual_seed(seed)
    long, short = (LocalBuffer(n_logical, B, torch.device("cpu")) for _ in range(2))
    for _ in range(6):
        a = torch.randint(0, n_logical, (40,), generator=gen).unique()
        a = a[torch.randperm(a.numel(), generator=gen)]
        for buf in (long, short):
            want = buf.first(a, buf.lookup(a) < 0)
            buf.claim(a, want)
            buf.advance()
    held_before = set(long.buffered()[0].tolist())
    assert held_before == set(short.buffered()[0].tolist())
    gone = torch.randint(0, n_logical, (3 * B,), generator=gen)
    gone = torch.cat([gone, gone[:5], torch.full((4,), n_logical)])  # dup + scratch padding
    assert gone.numel() > B
    dropped = int(long.drop(gone))
    dropped_short = sum(int(short.drop(p)) for p in gone.split(B))
    assert dropped == dropped_short == len(held_before & set(gone.tolist()))
    for buf in (long, short):
        buf.check_integrity()
    assert torch.equal(long.holder, short.holder)
    assert torch.equal(long.map.dense(n_logical, long.holder),
                       short.map.dense(n_logical, short.holder))
    assert set(long.buffered()[0].tolist()) == held_before - set(gone.tolist())


def test_fullest_bucket_at_production_size():
    """A 64-request buffer (64 x 2049 rows) filled in one batch, then turned over by a tenth 40
    times: the fullest bucket stays far from WAYS (peak 10 of 16 when written; the mean is
    LOAD)."""
    B = 64 * 2049
    m = BufferMap(B, torch.device("cpu"))
    holder = torch.full((B + 1,), -1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 1 << 30, (6 * B,), generator=gen).unique()
    addrs = pool[torch.randperm(pool.numel(), generator=gen)]  # distinct, random order
    slots = torch.arange(B)
    ok, pos = m.insert(addrs[:B], slots, torch.ones(B, dtype=torch.bool))
    assert bool(ok.all())
    holder[:B] = addrs[:B]
    nxt, peak = B, 0
    for _ in range(40):
        s = torch.randperm(B, generator=gen)[: B // 10]
        new = addrs[nxt: nxt + s.numel()]
        nxt += s.numel()
        ok, pos = m.insert(new, s, torch.ones_like(s, dtype=torch.bool))
        assert bool(ok.all())
        m.erase(s, holder[s], ok, pos)
        holder[s] = new
        peak = max(peak, int((m.table[:-1].view(-1, WAYS) >= 0).sum(1).max()))
    m.check_integrity(holder)
    assert torch.equal(m.find(holder[:B], holder)[0], torch.arange(B))  # in pieces
    assert B / m.n_buckets <= LOAD and peak <= 11, peak
    assert map_bytes(B) == m.table.numel() * 4 <= 16 * B + 68


# -- the Triton helpers (kernels/fused_tp.py), interpreted on CPU ----------------------------
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from ulacache.kernels import fused_tp  # noqa: E402


@triton.jit
def _put(table, holder, addrs, slots, ok_out, pos_out, n, NBK, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    a = tl.load(addrs + i, mask=live, other=-1)
    s = tl.load(slots + i, mask=live, other=-1)
    ok, pos = fused_tp.map_insert(table, a, s, live, NBK)
    old = tl.load(holder + tl.where(ok, s, 0), mask=ok, other=-1)
    fused_tp.map_erase(table, old, s, ok & (old >= 0), pos, NBK)
    tl.store(ok_out + i, ok.to(tl.int8), mask=live)
    tl.store(pos_out + i, pos, mask=live)


@triton.jit
def _find(table, holder, addrs, out, n, NBK, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    a = tl.load(addrs + i, mask=live, other=-1)
    tl.store(out + i, fused_tp.map_find(table, holder, a, live, NBK), mask=live)


@pytest.mark.parametrize("n_slots,seed", [(7, 0), (40, 1), (300, 2)])
def test_fused_helpers_make_the_same_map(n_slots, seed):
    """Rounds of replacements through the Triton helpers (several programs racing by CAS) and
    through the torch map: the same address -> slot map after each, both intact."""
    gen = torch.Generator().manual_seed(seed)
    torch_m, fused_m = BufferMap(n_slots, torch.device("cpu")), BufferMap(n_slots,
                                                                          torch.device("cpu"))
    holder = torch.full((n_slots + 1,), -1, dtype=torch.int64)
    used: set[int] = set()
    for _ in range(6):
        k = int(torch.randint(1, n_slots + 1, (1,), generator=gen))
        slots = torch.randperm(n_slots, generator=gen)[:k]
        cand = torch.randperm(8 * n_slots + 32, generator=gen) * 3
        new = torch.tensor([a for a in cand.tolist() if a not in used][:k], dtype=torch.int64)
        used |= set(new.tolist())
        ok_t, pos_t = torch_m.insert(new, slots, torch.ones(k, dtype=torch.bool))
        torch_m.erase(slots, holder[slots], ok_t & (holder[slots] >= 0), pos_t)
        ok_f = torch.zeros(k, dtype=torch.int8)
        pos_f = torch.zeros(k, dtype=torch.int64)
        _put[(-(-k // 16),)](fused_m.table, holder, new, slots, ok_f, pos_f, k,
                             fused_m.n_buckets, BLOCK=16)
        assert torch.equal(ok_f.bool(), ok_t) and bool(ok_t.all())
        holder[slots] = new
        for m in (torch_m, fused_m):
            m.check_integrity(holder)
        probe = torch.cat([new, torch.tensor(sorted(used)[:50]), torch.tensor([-1, 1])])
        found = torch.empty_like(probe)
        _find[(-(-probe.numel() // 16),)](fused_m.table, holder, probe, found, probe.numel(),
                                          fused_m.n_buckets, BLOCK=16)
        assert torch.equal(found, torch_m.find(probe, holder)[0])
        assert torch.equal(fused_m.dense(8 * 3 * n_slots + 100, holder),
                           torch_m.dense(8 * 3 * n_slots + 100, holder))


def test_fused_insert_refuses_past_a_full_bucket_pair():
    """22 lanes racing for one bucket pair of 16 entries: 16 win, 6 are refused, no entry is
    written twice."""
    m = BufferMap(40, torch.device("cpu"))
    holder = torch.full((41,), -1, dtype=torch.int64)
    addrs = crowded(m.n_buckets, WAYS + 6)
    slots = torch.arange(WAYS + 6)
    ok = torch.zeros(WAYS + 6, dtype=torch.int8)
    pos = torch.zeros(WAYS + 6, dtype=torch.int64)
    _put[(2,)](m.table, holder, addrs, slots, ok, pos, WAYS + 6, m.n_buckets, BLOCK=16)
    assert int(ok.sum()) == WAYS and bool((pos[ok.bool()] >= 0).all())
    assert bool((pos[~ok.bool()] == -1).all())
    holder[slots[ok.bool()]] = addrs[ok.bool()]
    m.check_integrity(holder)
