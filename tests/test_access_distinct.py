"""One access on a large table's distinct addresses (``access_distinct``, DP and TP): what a
prefill page table of ``T x top-k`` entries goes through on its group's anchor layer.

- :func:`distinct_addresses` equals ``torch.unique`` of the in-range entries at or above
  ``first``, truncated to ``size``, on random tables, and leaves the claim table clean;
- after it every distinct address is GPU-readable and :meth:`translate` (no side effects)
  reads back each entry's bytes; the access saw each address once (``accesses`` counts
  distinct rows, not entries); TP: the ranks fetch each peer row once however often the
  table names it;
- refusals (validate on) change nothing; production mode (validate off) masks and counts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import AddressError, CapacityExhausted
from ulacache.group import NO_CLAIM, distinct_addresses, new_claim_table
from ulacache.ipc import run_ranks
from ulacache.tp import TPAddressSpace

from .helpers import assert_same, grow, row_bytes_for, snapshot

RB = 16


def make(**kw) -> UlaCache:
    base = dict(layout="tiny", n_layers=2, layers_per_group=2, gpu_slots=48, cpu_slots=96,
                page_size=4, max_requests=8, n_buckets=4, call_entries=128)
    base.update(kw)
    return UlaCache(UlaCacheConfig(**base))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 200), entries=st.integers(0, 600), size=st.integers(1, 64),
       first=st.integers(0, 8), piece=st.integers(1, 97), seed=st.integers(0, 2**31 - 1))
def test_distinct_addresses_equals_unique(n, entries, size, first, piece, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(-3, n + 3, (entries,), generator=gen, dtype=torch.int32)
    claim = new_claim_table(n, torch.device("cpu"))
    found, n_distinct, bad = distinct_addresses(claim, table.view(-1, 3) if entries % 3 == 0
                                                else table, size, first=first, piece=piece)
    t = table.to(torch.int64)
    want = torch.unique(t[(t >= first) & (t < n)])
    assert int(n_distinct) == want.numel()
    assert int(bad) == int(((t != -1) & ((t < 0) | (t >= n))).sum())
    assert found.dtype == torch.int64 and found.shape == (size,)
    k = min(size, want.numel())
    assert torch.equal(found[:k], want[:k]) and bool((found[k:] == -1).all())
    assert bool((claim == NO_CLAIM).all())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 200), entries=st.integers(0, 600), size=st.integers(1, 64),
       first=st.integers(0, 8), piece=st.integers(1, 97), P=st.integers(2, 4),
       seed=st.integers(0, 2**31 - 1))
def test_a_tp_ranks_share_is_its_own_distinct_addresses(n, entries, size, first, piece, P, seed):
    """``stripe=(P, rank, n)``: each rank lists exactly the distinct addresses it owns (``a %
    P == rank``) from its local claim table (``ceil(n / P)`` positions), and counts the whole
    table's out-of-range entries."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(-3, n + 3, (entries,), generator=gen, dtype=torch.int64)
    t = table
    for rank in range(P):
        claim = new_claim_table(-(-n // P), torch.device("cpu"))
        found, n_distinct, bad = distinct_addresses(claim, table, size, first=first,
                                                    piece=piece, stripe=(P, rank, n))
        want = torch.unique(t[(t >= first) & (t < n) & (t % P == rank)])
        assert int(n_distinct) == want.numel()
        assert int(bad) == int(((t != -1) & ((t < 0) | (t >= n))).sum())
        k = min(size, want.numel())
        assert torch.equal(found[:k], want[:k]) and bool((found[k:] == -1).all())
        assert bool((claim == NO_CLAIM).all())


def _prefill_like_table(addrs: torch.Tensor, rows: int, k: int, seed: int) -> torch.Tensor:
    """``[rows, k]`` entries drawn from ``addrs`` (each many times), ``-1`` padding and the
    sink page (``0..3``), like a prefill page table."""
    gen = torch.Generator().manual_seed(seed)
    table = addrs[torch.randint(0, addrs.numel(), (rows, k), generator=gen)]
    table[torch.rand(rows, k, generator=gen) < 0.2] = -1
    table[torch.rand(rows, k, generator=gen) < 0.05] = 2  # the engine's sink page
    return table.to(torch.int32)


@pytest.mark.parametrize("validate", [True, False], ids=["checked", "production"])
def test_dp_one_access_then_translate_reads_every_entry(validate):
    c = make(validate=validate)
    c.admit("a", 64)
    grow(c, "a", 4, 10)  # 40 tokens; then 40 more spill the first ones to the CPU
    c.admit("b", 64)
    grow(c, "b", 4, 10)
    a = c.addresses("a")
    s, g = c.space, c.space.groups[0]
    assert bool((g.loc[a] >= g.gpu_slots).any()), "some of a must sit in the CPU tier"
    table = _prefill_like_table(a, 64, 16, seed=1)  # 1024 entries > call_capacity (128)
    before = g.counter_values()
    s.begin_round()
    s.access_distinct(0, table, first=4)
    after = g.counter_values()
    assert after["accesses"] - before["accesses"] == torch.unique(
        table[table >= 4]).numel()  # each distinct address once, not each entry
    assert after["promotions"] > before["promotions"]
    real = table.to(torch.int64) >= 4
    rows = s.translate(0, torch.where(real, table.to(torch.int64), -1))
    assert bool((rows[real] >= 0).all()) and bool((rows[~real] == -1).all())
    for layer in (0, 1):
        got = s.gpu_rows(layer)[rows[real].long()]
        assert torch.equal(got, row_bytes_for(table[real].to(torch.int64), layer, 0, RB))
    assert bool((s.claim_table == NO_CLAIM).all())
    s.begin_round()  # a table shorter than the pool: an access of its own length
    short = torch.cat([a[:2], a[:1]]).view(1, -1)
    s.access_distinct(0, short)
    assert bool((s.translate(0, short) >= 0).all())
    c.check_integrity()


def test_dp_refusals_change_nothing():
    c = make(gpu_slots=16, cpu_slots=96)
    c.admit("a", 64)
    grow(c, "a", 4, 10)  # 40 live tokens, 16 GPU slots
    a = c.addresses("a")
    s = c.space
    s.begin_round()
    snap = snapshot(c)
    out_of_range = _prefill_like_table(a[:8], 4, 8, seed=2)
    out_of_range[3, 5] = s.n_logical + 7
    with pytest.raises(AddressError, match="out of range"):
        s.access_distinct(0, out_of_range, first=4)
    assert_same(snap, snapshot(c))
    with pytest.raises(CapacityExhausted, match="17 distinct rows"):
        s.access_distinct(0, a[:17].view(1, -1))
    assert_same(snap, snapshot(c))
    s.access_distinct(0, a[:16].view(1, -1))  # exactly the pool: served, every row
    assert bool((s.translate(0, a[:16].view(1, -1)) >= 0).all())
    c.check_integrity()


def test_dp_production_masks_and_counts():
    c = make(gpu_slots=16, cpu_slots=96, validate=False)
    c.admit("a", 64)
    grow(c, "a", 4, 10)
    a = c.addresses("a")
    s, g = c.space, c.space.groups[0]
    s.begin_round()
    table = torch.cat([a[:20], torch.tensor([s.n_logical + 3, -5, -1])]).view(1, -1)
    before = g.counter_values()
    s.access_distinct(0, table)
    after = g.counter_values()
    assert after["invalid"] - before["invalid"] == 2
    assert after["access_overflow"] - before["access_overflow"] == 4  # 20 distinct, 16 slots
    rows = s.translate(0, a[:16].view(1, -1))  # the 16 it kept are readable
    assert bool((rows >= 0).all())
    assert bool((s.claim_table == NO_CLAIM).all())
    c.check_integrity()


def _tp_config(**kw) -> UlaCacheConfig:
    base = dict(layout="tiny", row_bytes=16, n_layers=2, layers_per_group=2, gpu_slots=40,
                cpu_slots=64, page_size=4, n_buckets=2, tp_size=2, buffer_slots=48,
                call_entries=128)
    return UlaCacheConfig(**{**base, **kw})


@pytest.mark.parametrize("validate", [True, False], ids=["checked", "production"])
def test_tp_exchanges_each_distinct_peer_row_once(validate):
    """Two ranks: a 1024-entry table over 80 live addresses (40 per rank, every one named
    many times). Each rank fetches each of its peer's named rows once, and reads every
    entry's bytes through its translation."""
    cfg = _tp_config(validate=validate)

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=256)
        s.begin_round()
        addrs = torch.arange(4, 84)
        s.place(addrs)
        for layer in (0, 1):
            s.write(layer, addrs, row_bytes_for(addrs, layer, 0, 16))
        for b in s.buffers:  # forget placement's copies: every peer row is fetched
            b.drop(torch.arange(257))
        s.begin_round()
        table = _prefill_like_table(addrs, 64, 16, seed=3)
        s.access_distinct(0, table, first=4)
        real = table.to(torch.int64) >= 4
        rows = s.translate(0, torch.where(real, table.to(torch.int64), -1))
        ok = bool((rows[real] >= 0).all())
        same = all(torch.equal(s.attn_rows(layer)[rows[real].long()],
                               row_bytes_for(table[real].to(torch.int64), layer, 0, 16))
                   for layer in (0, 1))
        named = torch.unique(table[real].to(torch.int64))
        theirs = int((named % 2 != peers.rank).sum())
        s.check_integrity()
        return ok, same, s.counters()[0]["peer_fetches"], theirs

    for ok, same, fetches, theirs in run_ranks(2, body):
        assert ok and same
        assert fetches == theirs  # once per distinct peer row, not per entry
