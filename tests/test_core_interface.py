"""The one interface the engine seam calls (:class:`ulacache.core.Core`), and the two mode
differences that live in the core: what a prefill round holds (``prefill_fits``) and what a
decode step needs (``check_step_capacity``), in DP and TP mode, checked against the placement
itself: a batch ``prefill_fits`` admits is placed in one round with nothing overflowing, and
one row more is refused."""

from __future__ import annotations

import pytest
import torch

from ulacache.config import UlaCacheConfig
from ulacache.core import Core
from ulacache.errors import ConfigError
from ulacache.ipc import run_ranks
from ulacache.space import AddressSpace
from ulacache.tp import TPAddressSpace, owned_counts

DP = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=64, cpu_slots=192,
                    page_size=4, n_buckets=4, validate=False)
TP = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=32, cpu_slots=96,
                    page_size=4, n_buckets=4, tp_size=2, buffer_slots=40, validate=False)


def test_every_address_space_is_the_core_interface():
    from ulacache.stripe import StripeAddressSpace

    assert isinstance(AddressSpace(DP, n_logical=256), Core)
    got = run_ranks(2, lambda peers: isinstance(TPAddressSpace(TP, peers, n_logical=256), Core))
    assert got == [True, True]
    dcp = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=32, cpu_slots=96,
                         page_size=4, n_buckets=4, tp_size=2, tp_attention="dcp",
                         validate=False)
    got = run_ranks(2, lambda peers: isinstance(StripeAddressSpace(dcp, peers, n_logical=256),
                                                Core))
    assert got == [True, True]


def test_dcp_prefill_fits_each_ranks_own_share_and_agrees_on_rounds():
    """DCP: a batch fits when every rank's own share fits its pool (no buffer); ``round_fits``
    is agreed, so ranks whose own selections differ take the same answer."""
    from ulacache.stripe import StripeAddressSpace

    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=32, cpu_slots=96,
                         page_size=4, n_buckets=4, tp_size=2, tp_attention="dcp",
                         validate=False)

    def body(peers):
        s = StripeAddressSpace(cfg, peers, n_logical=256)
        fits = (s.prefill_fits([64]), s.prefill_fits([65]), s.prefill_fits([40, 24]))
        # rank 0 passes 33 of its own addresses, rank 1 none: neither may say yes alone
        own = torch.arange(0, 66, 2) if peers.rank == 0 else torch.tensor([-1])
        rounds = (s.round_fits(own.view(1, -1)), s.round_fits(torch.arange(0, 64).view(1, -1)))
        s.begin_round()
        s.place(torch.arange(64))
        return fits, rounds, s.counters()[0]["place_overflow"]

    for fits, rounds, overflow in run_ranks(2, body):
        assert fits == (True, False, True) and rounds == (False, True) and overflow == 0


def test_dp_prefill_fits_exactly_the_gpu_pool():
    s = AddressSpace(DP, n_logical=256)
    assert s.prefill_fits([40, 24]) and not s.prefill_fits([40, 25])
    s.begin_round()
    s.place(torch.arange(64))  # what prefill_fits admitted: every row GPU-resident
    assert s.counters()[0]["spills"] == 0 and s.counters()[0]["place_overflow"] == 0
    s.check_integrity()


def test_dp_step_capacity():
    s = AddressSpace(DP, n_logical=256)
    s.check_step_capacity(2, 1, 31)  # 2 x (31 + 1) = 64 rows
    with pytest.raises(ConfigError, match="one step's selections"):
        s.check_step_capacity(2, 1, 32)


def test_owned_counts_follow_positions():
    assert owned_counts([5], 2) == [3, 2]
    assert owned_counts([4, 3], 4) == [2, 2, 2, 1]
    assert sum(owned_counts([17, 9, 1], 8)) == 27


def test_tp_prefill_fits_each_ranks_share_and_its_buffer():
    def body(peers):
        s = TPAddressSpace(TP, peers, n_logical=256)
        own_limit = s.prefill_fits([64])  # 32 own per rank, 32 peers' <= 40 buffer
        too_many_own = s.prefill_fits([66])  # 33 own on rank 0
        buffer_limit = s.prefill_fits([60]) and not s.prefill_fits([40, 40])  # 40 peers'
        s.begin_round()
        s.place(torch.arange(64))  # what was admitted: placed with no overflow anywhere
        c, tp = s.counters()[0], s.tp_counters.tolist()[0]
        s.check_integrity()
        return own_limit, too_many_own, buffer_limit, c["place_overflow"], c["spills"], tp

    for own_limit, too_many_own, buffer_limit, overflow, spills, _ in run_ranks(2, body):
        assert own_limit and not too_many_own and buffer_limit
        assert overflow == 0 and spills == 0


def test_tp_step_capacity_needs_the_buffer_and_a_share_with_margin():
    def body(peers):
        s = TPAddressSpace(TP, peers, n_logical=256)
        s.check_step_capacity(1, 1, 19)  # 20 rows: share 10 + 6 sd (ceil 6 x 2.24) = 24 <= 32
        out = []
        for args in ((2, 1, 20), (1, 2, 20)):  # 42 rows: more than the buffer
            with pytest.raises(ConfigError, match="local buffer"):
                s.check_step_capacity(*args)
            out.append(True)
        # 40 rows fit the buffer exactly, but the own pool (32) is below 20 + 19 = 39
        with pytest.raises(ConfigError, match="margin for uneven steps"):
            s.check_step_capacity(2, 1, 19)
        return out

    assert run_ranks(2, body) == [[True, True], [True, True]]


def test_step_share_bound_covers_uneven_steps():
    """The margin: the share of a step a rank may own, measured on random selections (64
    requests x 2,049 distinct positions of histories 4K..128K long on 8 ranks): the balanced
    share overflows on most steps; the bound never, in 2,000 steps."""
    from ulacache.striping import step_share_bound

    assert step_share_bound(0, 8) == 0 and step_share_bound(5, 8) == 5  # never over n
    assert step_share_bound(64 * 2049, 8) == 16392 + 719
    gen = torch.Generator().manual_seed(0)
    n = 64 * 2049
    lengths = torch.randint(4096, 131072, (64,), generator=gen)
    over_balanced = over_bound = 0
    for _ in range(2000):
        share = torch.zeros(8, dtype=torch.int64)
        for L in lengths.tolist():  # 2,049 distinct residues mod 8 of positions < L
            pos = torch.randint(0, L, (2049,), generator=gen)
            share += torch.bincount(pos % 8, minlength=8)
        over_balanced += int(share.max()) > -(-n // 8)
        over_bound += int(share.max()) > step_share_bound(n, 8)
    assert over_balanced > 1500 and over_bound == 0


@pytest.mark.parametrize("page,G,B", [(64, 4096, 0), (64, 39424, 131136), (4, 7, 3), (64, 1, 0)])
def test_pool_rows_lay_out_sink_slots_scratch_buffer_and_padding(page, G, B):
    from ulacache.layout import PoolRows

    r = PoolRows(page, G, B)
    assert r.row_base == page and r.core_rows == G + 1 + B
    assert r.total % page == 0 and r.total >= page + G + 1 + B > r.total - page
    assert r.total - G <= PoolRows.most_beside_slots(page, B)  # what the sizing hook charges
    if B == 0 and G % page == 0:
        assert r.total == G + 2 * page  # DP: sink page, slots, tail page with the scratch row


def test_pool_rows_refuse_an_empty_pool():
    from ulacache.layout import PoolRows

    with pytest.raises(ConfigError):
        PoolRows(64, 0)


def test_tp_prefill_fits_the_rank_with_the_most_peers_rows():
    """Odd lengths own unevenly: the rank owning fewest copies the most peers' rows."""
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=1, gpu_slots=32, cpu_slots=96,
                         page_size=4, n_buckets=4, tp_size=2, buffer_slots=24, validate=False)

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=256)
        # 47 tokens: own [24, 23], rank 1 copies 24 peers' rows (the buffer exactly);
        # 49 tokens: own [25, 24], rank 1 would copy 25
        return s.prefill_fits([47]), s.prefill_fits([49])

    assert run_ranks(2, body) == [(True, False), (True, False)]
