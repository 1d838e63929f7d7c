"""Defects found by driving the public API with hostile call sequences against a shadow store,
each pinned by a deterministic test that failed on the code before its fix, and behaviour the
code got right that no test held (a plausible one-line bug in each passed every other test).

Refusals leave the state identical (pages in the same hand-out order, no group or rank
changed); every rank of a TP group raises the same typed error for the same call; counters
name the same cause on every rank.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import assert_same, snapshot
from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import AddressError, CapacityExhausted, ShapeError
from ulacache.ipc import run_ranks
from ulacache.space import AddressSpace
from ulacache.tp import TPAddressSpace

try:
    import triton  # noqa: F401

    PATHS = ["torch", "fused"]
except ImportError:  # the fused path needs Triton (its interpreter on CPU)
    PATHS = ["torch", pytest.param("fused", marks=pytest.mark.skip(
        reason="the fused path needs Triton: pip install 'ulacache[cuda]'"))]


def _dp(**kw) -> UlaCacheConfig:
    base = dict(layout="tiny", row_bytes=16, n_layers=1, gpu_slots=8, cpu_slots=64,
                page_size=4, max_requests=4, validate=True)
    return UlaCacheConfig(**{**base, **kw})


def _tp(**kw) -> UlaCacheConfig:
    base = dict(layout="tiny", row_bytes=16, n_layers=1, gpu_slots=8, cpu_slots=16,
                page_size=4, n_buckets=2, tp_size=2, buffer_slots=8, validate=True)
    return UlaCacheConfig(**{**base, **kw})


def _rows(addrs: torch.Tensor, version: int) -> torch.Tensor:
    a = addrs.to(torch.int64).view(-1, 1)
    return ((a * 37 + version * 11 + torch.arange(16).view(1, -1)) % 251).to(torch.uint8)


# -- the request ledger ------------------------------------------------------------------------
def test_addresses_of_padding_on_a_request_with_no_tokens():
    cache = UlaCache(_dp())
    cache.admit(0, 8)
    assert cache.addresses(0, torch.tensor([-1, -1])).tolist() == [-1, -1]
    assert cache.addresses(0).numel() == 0
    with pytest.raises(AddressError):
        cache.addresses(0, torch.tensor([0]))


def test_refused_extend_batch_leaves_the_page_order_unchanged():
    """Two requests' pages are taken, then the placement is refused (12 rows, 8 GPU slots):
    the pages go back so that the next allocation hands out the same pages in the same order."""
    cache = UlaCache(_dp())
    cache.admit(0, 8)
    cache.admit(1, 8)
    cache.space.begin_round()
    before = snapshot(cache)
    with pytest.raises(CapacityExhausted, match="GPU slots"):
        cache.extend_batch({0: 6, 1: 6})
    assert_same(before, snapshot(cache))
    got = cache.extend_batch({0: 4, 1: 4})
    assert [a.tolist() for a in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    cache.check_integrity()


def test_refused_place_changes_no_group_when_a_later_group_refuses():
    """Validate on, two groups: this round group 1 pinned 6 of its 8 GPU slots (an access),
    group 0 pinned none; placing 4 rows fits group 0 but not group 1, so neither changes."""
    space = AddressSpace(_dp(n_layers=2, layers_per_group=1), n_logical=64)
    space.begin_round()
    space.place(torch.arange(8))
    space.begin_round()
    space.access(1, torch.arange(6).view(1, 6))
    before = snapshot(space)
    with pytest.raises(CapacityExhausted):
        space.place(torch.arange(8, 12))
    assert_same(before, snapshot(space))
    space.check_integrity()


# -- TP: every rank agrees before any rank changes anything ------------------------------------
def _placed(peers, cfg, n_logical=32, count=8):
    s = TPAddressSpace(cfg, peers, n_logical=n_logical)
    s.begin_round()
    addrs = torch.arange(count)
    s.place(addrs)
    for layer in range(cfg.n_layers):
        s.write(layer, addrs, _rows(addrs, 0))
    return s


def test_tp_write_naming_a_dead_address_changes_no_rank():
    """Address 0 (rank 0's, live) and 9 (rank 1's, never placed): rank 1 refuses; no rank may
    write (rank 1 holds a copy of address 0 that must stay equal to rank 0's row)."""
    def body(peers):
        s = _placed(peers, _tp())
        with pytest.raises(AddressError):
            s.write(0, torch.tensor([0, 9]), _rows(torch.tensor([0, 9]), 1))
        live = torch.zeros(32, dtype=torch.bool)
        live[:8] = True
        s.check_integrity(live)  # "stale buffer copy" before the fix, on rank 1
        return s.read(0, torch.tensor([0])).tolist()
    for got in run_ranks(2, body, timeout=10):
        assert got == _rows(torch.tensor([0]), 0).tolist()


def test_tp_read_of_an_address_its_owner_does_not_store_raises_on_every_rank():
    """Before the fix the owner raised and its peer waited in the all-gather until the barrier
    broke (with process groups: a hang)."""
    def body(peers):
        s = _placed(peers, _tp())
        try:
            s.read(0, torch.tensor([0, 9]))
        except AddressError as e:
            err = type(e).__name__
        s.read(0, torch.tensor([0, 1]))  # the ranks' collectives are still aligned
        return err
    assert run_ranks(2, body, timeout=10) == ["AddressError", "AddressError"]


@pytest.mark.parametrize("path", PATHS)
def test_tp_plan_refuses_an_out_of_the_wrong_shape(path):
    """DP ``access`` refuses it; TP ``plan`` accepted it (the torch path broadcast into it, the
    fused path filled part of it)."""
    def body(peers):
        s = _placed(peers, _tp(validate=False, access_path=path))
        s.begin_round()
        sel = torch.tensor([[0, 1, 2], [3, 4, 5]])
        before = s.counters()
        for out in (torch.empty(3, dtype=torch.int32), torch.empty(2, 4, dtype=torch.int32),
                    torch.empty(2, 3, dtype=torch.int64)):
            with pytest.raises(ShapeError, match="out must be int32"):
                s.plan(0, sel, out=out)
        assert s.counters() == before
        out = torch.full((2, 3), 7, dtype=torch.int32)
        assert s.plan(0, sel, out=out) is out
        return out.tolist()
    a, b = run_ranks(2, body, timeout=30)
    assert (torch.tensor(a) >= 0).all() and (torch.tensor(b) >= 0).all()


@pytest.mark.parametrize("path", PATHS)
def test_a_never_placed_peer_address_is_invalid_on_every_rank(path):
    """Validate off: address 9 (rank 1's) was never placed. Its owner counts it ``invalid``;
    before the fix rank 0 counted it ``peer_missing`` and warned "enlarge gpu_slots"."""
    def body(peers):
        s = _placed(peers, _tp(validate=False, access_path=path))
        s.begin_round()
        before = s.counters()[0]
        rows = s.access(0, torch.tensor([[0, 9, 9, 1]]))
        after = s.counters()[0]
        d = {k: after[k] - before[k] for k in ("invalid", "peer_missing")}
        return d, rows.tolist()
    for d, rows in run_ranks(2, body, timeout=30):
        assert d == {"invalid": 2, "peer_missing": 0}, d
        assert rows[0][1] == rows[0][2] == -1 and rows[0][0] >= 0 and rows[0][3] >= 0


@pytest.mark.parametrize("path", PATHS)
def test_tp_serves_the_last_address_when_n_logical_is_not_a_multiple_of_p(path):
    """n = 41, P = 2: rank 0 holds local positions 0..20, the last one being address 40."""
    cfg = _tp(validate=path == "torch", access_path=path, gpu_slots=24, cpu_slots=8,
              buffer_slots=24)

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=41)
        assert s.n_local == 21
        s.begin_round()
        addrs = torch.tensor([38, 39, 40])
        s.place(addrs)
        s.write(0, addrs, _rows(addrs, 3))
        s.begin_round()
        rows = s.access(0, addrs.view(1, 3))
        got = s.attn_rows(0)[rows.view(-1).long()]
        live = torch.zeros(41, dtype=torch.bool)
        live[38:] = True
        s.check_integrity(live)
        return torch.equal(got, _rows(addrs, 3)), torch.equal(s.read(0, addrs), _rows(addrs, 3))
    assert run_ranks(2, body, timeout=30) == [(True, True), (True, True)]


def test_begin_round_fences_a_rank_that_runs_ahead(monkeypatch):
    """The thread transport runs ranks in lockstep at every collective, so nothing observed the
    fence. Here rank 0's ``load`` (its copy of peers' rows) is held back until rank 1 is
    blocked in a collective, i.e. until rank 1 has run as far ahead as it can. Validate off.
    Round 1: both ranks plan addresses 1, 3, 5, 7 (rank 1's, promoted into its 4-slot pool)
    and rank 0 lists their copies. Round 2: rank 1 promotes 9..15 over those slots. The fence
    in ``begin_round`` stops rank 1 before round 2 until rank 0 has loaded; without it rank 0
    copies 9..15's bytes as 1..7's."""
    import ulacache.tp as tp

    cfg = _tp(validate=False, gpu_slots=4, cpu_slots=12, buffer_slots=4)
    real_gather = tp.gather_rows_peers
    held = {}

    def held_back_gather(*args, **kw):
        hub = held.get("hub")
        if hub is not None and threading.current_thread().name == "ula-rank-0":
            deadline = time.monotonic() + 10
            while hub.barrier.n_waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.002)  # rank 1 runs until a collective stops it
        return real_gather(*args, **kw)
    monkeypatch.setattr(tp, "gather_rows_peers", held_back_gather)

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=32)
        odd = torch.arange(1, 24, 2)  # rank 1's addresses: 12 rows for 4 GPU slots
        for chunk in odd.view(3, 4):
            s.begin_round()
            s.place(chunk)
            s.write(0, chunk, _rows(chunk, 0))
        s.begin_round()
        sel = torch.tensor([[1, 3, 5, 7]])  # on rank 1's CPU tier: promoted now
        rows = s.plan(0, sel)
        if peers.rank == 0:
            held["hub"] = peers.hub
        s.load(0)  # rank 0: held back while rank 1 runs ahead
        if peers.rank == 0:
            held.clear()
        first = s.attn_rows(0)[rows.view(-1).long()].clone()
        s.begin_round()
        s.plan(0, torch.tensor([[9, 11, 13, 15]]))  # rank 1 promotes over 1..7's slots
        s.load(0)
        return torch.equal(first, _rows(sel.view(-1), 0))
    assert run_ranks(2, body, timeout=20) == [True, True]
