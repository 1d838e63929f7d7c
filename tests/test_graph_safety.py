"""Invariant 6 on CPU: the decode-step path (sparse access with validation off) issues no op
that synchronises a device or has a data-dependent output shape, so the same code can be
captured in a CUDA graph. Checked at the dispatcher: the op sequence and every output shape
must be identical for two steps with different data, and no syncing op may appear."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ulacache.kernels.reference as ref
from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig

from .helpers import fill, row_bytes_for

SYNCING = {"aten.nonzero", "aten._local_scalar_dense", "aten.item", "aten.unique",
           "aten._unique2", "aten.unique_consecutive", "aten.masked_select", "aten.equal",
           "aten.is_nonzero", "aten.repeat_interleave.Tensor"}


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((str(func.overloadpacket), shapes))
        return out


@pytest.mark.parametrize("policy", ["pblru", "lru"])
def test_access_path_is_sync_free_and_fixed_shape(policy, monkeypatch):
    monkeypatch.setattr(ref, "COMPACT_ON_CPU", False)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, layers_per_group=2,
                         gpu_slots=64, cpu_slots=256, page_size=4, n_buckets=4, policy=policy,
                         validate=False)
    c = UlaCache(cfg)
    s = c.space
    c.admit("a", 200)
    for _ in range(5):
        s.begin_round()
        fill(s, c.extend("a", 40))
    addrs = c.addresses("a")
    out = torch.empty(2, 8, dtype=torch.int32)
    logs = []
    for seed in (0, 1):  # different selections: different hit/miss mixes
        g = torch.Generator().manual_seed(seed)
        sel = addrs[torch.randperm(addrs.numel(), generator=g)[:16]].view(2, 8)
        sel[0, -1 - seed] = -1
        s.begin_round()
        log = OpLog()
        with log:
            s.access(0, sel, out=out)
        logs.append(log.ops)
        got = s.gpu_rows(0)[out[sel >= 0].long()]
        assert torch.equal(got, row_bytes_for(sel[sel >= 0], 0, 0, 16))
    assert s.groups[0].counter_values()["promotions"] > 0
    names = {op for op, _ in logs[0]}
    assert not names & SYNCING, names & SYNCING
    assert logs[0] == logs[1], "op sequence or output shapes depend on the data"
    c.check_integrity()


def test_tp_plan_and_load_are_sync_free_and_fixed_shape(monkeypatch):
    """TP mode's step path (plan: own access, slot-table exchange, buffer gates; load: the peer
    gather of one layer), validate off, on every rank of a P = 2 group: no syncing op, and the
    same op sequence and shapes for two steps with different data (dispatch modes are per
    thread, so each rank logs its own ops)."""
    from ulacache.ipc import run_ranks
    from ulacache.tp import TPAddressSpace

    monkeypatch.setattr(ref, "COMPACT_ON_CPU", False)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, layers_per_group=2,
                         gpu_slots=24, cpu_slots=120, page_size=4, n_buckets=4, tp_size=2,
                         buffer_slots=24, validate=False)

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=256)
        for i in range(0, 200, 20):
            s.begin_round()
            s.place(torch.arange(i, i + 20))
        out = torch.empty(2, 8, dtype=torch.int32)
        logs = []
        for seed in (0, 1):
            sel = torch.randperm(200, generator=torch.Generator().manual_seed(seed))[:16]
            sel = sel.view(2, 8).clone()
            sel[0, -1 - seed] = -1
            s.begin_round()
            log = OpLog()
            with log:
                s.plan(0, sel, out=out)
                s.load(0)
                s.load(1)
            logs.append(log.ops)
        c = s.counters()[0]
        return logs, c["peer_fetches"], c["promotions"]
    for logs, fetched, promoted in run_ranks(2, body):
        assert fetched > 0 and promoted > 0
        names = {op for op, _ in logs[0]}
        assert not names & SYNCING, names & SYNCING
        assert logs[0] == logs[1], "op sequence or output shapes depend on the data"
