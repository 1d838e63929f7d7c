"""The byte ledger ``ulacache rehearse`` counts with (:mod:`ulacache.tools.ledger`), on the meta
device: live and peak bytes of a phase, call sites, data-dependent ops at their largest output,
value reads answered 0 and counted, and accounting per thread."""

from __future__ import annotations

import threading

import torch

from ulacache.tools.ledger import Ledger

META = torch.device("meta")


def test_peak_counts_what_is_alive_together_above_the_mark():
    ledger = Ledger()
    with ledger:
        base = torch.empty(1000, dtype=torch.int64, device=META)  # 8,000 B before the mark
        ledger.mark()
        a = torch.empty(1 << 20, dtype=torch.uint8, device=META)  # 1 MiB
        b = a.to(torch.int32)  # 4 MiB alive with a: 5 MiB
        del a, b
        c = torch.empty(3 << 20, dtype=torch.uint8, device=META)  # 3 MiB alone: below the peak
        v = c.view(torch.int32)  # a view allocates nothing
    peak, sites = ledger.peak_since_mark()
    assert peak == 5 << 20
    assert sum(sites.values()) == 5 << 20
    assert all("test_ledger.py" in s for s in sites)
    live = sum(x.nbytes for x in ledger.live())
    assert live == 8000 + (3 << 20)  # base + c (v shares c's storage)
    del base, v


def test_data_dependent_ops_take_their_largest_output():
    ledger = Ledger()
    with ledger:
        x = torch.empty(1000, dtype=torch.int64, device=META)
        u = torch.unique(x)
        u2, inv = torch.unique(x, return_inverse=True)
        nz = (x > 0).nonzero()
        ms = x.masked_select(x > 0)
    assert u.shape == (1000,) and u2.shape == (1000,) and inv.shape == (1000,)
    assert nz.shape == (1000, 1) and ms.shape == (1000,)


def test_value_reads_are_answered_zero_and_counted_by_site():
    ledger = Ledger()
    with ledger:
        x = torch.empty(10, dtype=torch.int64, device=META)
        n = int(x.sum())
        flag = bool((x > 0).any())
        host = x.to("cpu")
    assert n == 0 and flag is False
    assert host.device.type == "cpu" and torch.equal(host, torch.zeros(10, dtype=torch.int64))
    assert sum(ledger.value_reads.values()) == 3
    assert all("test_ledger.py" in s for s in ledger.value_reads)


def test_each_thread_counts_its_own_allocations():
    mine, theirs = Ledger(), Ledger()
    made = []

    def other():
        with theirs:
            made.append(torch.empty(1 << 20, dtype=torch.uint8, device=META))

    with mine:
        mine.mark()
        t = threading.Thread(target=other)
        t.start()
        t.join()
        own = torch.empty(1 << 10, dtype=torch.uint8, device=META)
    assert mine.peak_since_mark()[0] == 1 << 10
    assert sum(a.nbytes for a in theirs.live()) == 1 << 20
    del own
