"""Unit tests of the DP-mode core: admission, placement, sparse access, errors, ordering."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulacache.address import PageAllocator, addresses_of, local_position, owner_rank
from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import (
    AddressError,
    CapacityExhausted,
    ConfigError,
    DoubleFreeError,
    ShapeError,
    UnknownRequest,
)
from ulacache.layout import RowLayout

from .helpers import assert_same, row_bytes_for, snapshot

RB = 16


def make(**kw) -> UlaCache:
    base = dict(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=32, cpu_slots=96,
                page_size=4, max_requests=8, n_buckets=4, top_k=8, max_batch=4)
    base.update(kw)
    return UlaCache(UlaCacheConfig(**base))


def fill(cache: UlaCache, addrs: torch.Tensor, version: int = 0) -> None:
    for layer in range(cache.config.n_layers):
        cache.write(addrs, layer, row_bytes_for(addrs, layer, version, RB))


def grow(cache: UlaCache, rid, rounds: int, per_round: int) -> None:
    """Extend ``rid`` by ``per_round`` written tokens in each of ``rounds`` scheduling rounds."""
    for _ in range(rounds):
        cache.begin_round()
        fill(cache, cache.extend(rid, per_round))


def test_layouts_and_config_errors():
    assert RowLayout.named("fp8").row_bytes == 656
    assert RowLayout.named("bf16").row_bytes == 1152
    assert RowLayout.named("tiny", 48).row_bytes == 48
    with pytest.raises(ConfigError, match="legal"):
        RowLayout.named("int4")
    with pytest.raises(ConfigError, match="divide"):
        UlaCacheConfig(n_layers=6, layers_per_group=4)
    with pytest.raises(ConfigError, match="legal"):
        UlaCacheConfig.from_json('{"gpu_slot": 3}')
    with pytest.raises(ConfigError, match="JSON object"):
        UlaCacheConfig.from_json("[1]")
    assert UlaCacheConfig.from_json('{"gpu_slots": 7}').gpu_slots == 7


def test_address_math_and_pages():
    a = torch.arange(20)
    assert torch.equal(owner_rank(a, 4) * 1 + local_position(a, 4) * 4, a)
    assert owner_rank(torch.tensor([5]), 1).item() == 0
    pa = PageAllocator(4, 64)
    p = pa.alloc(2)
    assert p == [0, 1]
    assert addresses_of([3, 1], 64, 62, 66).tolist() == [254, 255, 64, 65]
    with pytest.raises(CapacityExhausted):
        pa.alloc(3)
    pa.free(p)
    with pytest.raises(DoubleFreeError):
        pa.free([0])
    pa.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_token_and_page_granular_addresses(page_size):
    c = make(page_size=page_size, gpu_slots=64, cpu_slots=128)
    c.admit("a", 70)
    c.admit("b", 10)
    a1 = c.extend("a", 5)
    b1 = c.extend("b", 3)
    c.begin_round()
    a2 = c.extend("a", 50)
    assert torch.equal(c.addresses("a"), torch.cat([a1, a2]))
    assert set(c.addresses("a").tolist()).isdisjoint(b1.tolist())
    if page_size > 1:  # positions fill the request's last partial page first
        assert a2[0] == a1[-1] + 1
    c.check_integrity()


def test_admission_refuses_cleanly_and_grows():
    c = make(gpu_slots=8, cpu_slots=8)
    c.admit("a", 10)
    before = snapshot(c)
    with pytest.raises(CapacityExhausted, match="unique slots"):
        c.admit("b", 7)
    assert_same(before, snapshot(c))
    c.admit("b", 6)
    c.extend("a", 6)
    c.begin_round()
    before = snapshot(c)
    with pytest.raises(CapacityExhausted, match="outgrows"):
        c.extend("b", 7)  # would need one more than free capacity (0 free)
    assert_same(before, snapshot(c))
    c.free("a")
    c.extend("b", 7)  # reservation grows now that "a" is gone
    assert c.requests["b"].reserved == 7
    c.check_integrity()


def test_errors_leave_state_unchanged():
    c = make()
    c.admit("a", 40)
    a = c.extend("a", 20)
    fill(c, a)
    cases = [
        (AddressError, lambda: c.access(0, torch.tensor([[int(c.n_logical)]]))),
        (AddressError, lambda: c.access(0, torch.tensor([[a[0].item() + 20]]))),  # not live
        (AddressError, lambda: c.write(torch.tensor([c.n_logical + 5]), 0,
                                       torch.zeros(1, RB, dtype=torch.uint8))),
        (ShapeError, lambda: c.write(a[:2], 0, torch.zeros(3, RB, dtype=torch.uint8))),
        (ShapeError, lambda: c.write(a[:2], 0, torch.zeros(2, RB, dtype=torch.int16))),
        (ShapeError, lambda: c.access(0, a.float().view(1, -1))),
        (ShapeError, lambda: c.access(0, a)),  # 1-D
        (ShapeError, lambda: c.write(a[:1], 9, torch.zeros(1, RB, dtype=torch.uint8))),
        (UnknownRequest, lambda: c.extend("zz", 1)),
        (DoubleFreeError, lambda: c.free("zz")),
        (CapacityExhausted, lambda: c.extend("a", 40)),  # more than this round's GPU room
        (ShapeError, lambda: c.admit("a", 1)),  # already admitted
    ]
    for exc, call in cases:
        before = snapshot(c)
        with pytest.raises(exc):
            call()
        assert_same(before, snapshot(c))
    c.free("a")
    with pytest.raises(DoubleFreeError):
        c.free("a")
    c.check_integrity()


def test_step_that_cannot_fit_is_refused_before_any_change():
    c = make(gpu_slots=8, cpu_slots=64)
    c.admit("a", 40)
    grow(c, "a", 5, 8)
    c.begin_round()
    before = snapshot(c)
    with pytest.raises(CapacityExhausted, match="promote"):
        c.access(0, c.addresses("a")[:12].view(1, -1))  # 12 distinct rows, 8 GPU slots
    assert_same(before, snapshot(c))


def test_access_promotes_swaps_and_preserves_padding():
    c = make(gpu_slots=16, cpu_slots=64, layers_per_group=2)
    c.admit("a", 64)
    grow(c, "a", 4, 12)  # 48 tokens, 16 GPU slots: 32 spilled
    addrs = c.addresses("a")
    c.begin_round()
    sel = torch.tensor([[int(addrs[0]), -1, int(addrs[47]), int(addrs[0])],
                        [int(addrs[5]), int(addrs[6]), -1, -1]])
    rows = c.access(0, sel)
    assert rows.dtype == torch.int32 and rows.shape == sel.shape
    assert (rows[sel < 0] == -1).all() and (rows[sel >= 0] >= 0).all()
    assert rows[0, 0] == rows[0, 3]  # duplicates resolve to one row
    for layer in (0, 1):
        got = c.gpu_rows(layer)[rows[sel >= 0].long()]
        assert torch.equal(got, row_bytes_for(sel[sel >= 0], layer, 0, RB))
    stats = c.groups[0].counter_values()
    assert stats["promotions"] >= 1 and stats["accesses"] == 4
    for layer in (0, 1):  # nothing lost by the swaps
        assert torch.equal(c.read(addrs, layer), row_bytes_for(addrs, layer, 0, RB))
    c.check_integrity()


def test_single_copy_when_victim_slot_free():
    """Promoting into a free GPU slot copies CPU -> GPU only: the vacated CPU slot is not
    overwritten (no write-back of a free slot's stale bytes)."""
    c = make(gpu_slots=16, cpu_slots=64)
    c.admit("a", 32)
    c.admit("b", 16)
    c.begin_round()
    fill(c, c.extend("b", 16))  # fills the GPU pool
    c.begin_round()
    a = c.extend("a", 16)  # spills all of b to CPU
    fill(c, a)
    c.free("a")  # 16 free GPU slots, b lives on CPU
    g = c.groups[0]
    b = c.addresses("b")
    cslots = g.loc[b] - g.G
    assert bool((cslots >= 0).all())
    before = g.pools.cpu[:, cslots].clone()
    c.begin_round()
    rows = c.access(0, b[:6].view(1, -1))
    assert torch.equal(g.pools.cpu[:, cslots], before)  # vacated CPU rows untouched
    assert torch.equal(c.gpu_rows(0)[rows.view(-1).long()], row_bytes_for(b[:6], 0, 0, RB))
    assert g.counter_values()["promotions"] == 6
    c.check_integrity()


class WriteLog(TorchDispatchMode):
    """Records (op, storage pointer) of every tensor an op mutates, in issue order."""

    def __init__(self, on_write=None):
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self.on_write = on_write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    self.events.append((str(func), ptr))
                    if self.on_write:
                        self.on_write(ptr)
        return out


def test_data_then_map_order():
    """Every copy into the pools is issued before the first mapping write, and a reader that
    observes a changed mapping entry reads the new data there (invariant 3)."""
    c = make(gpu_slots=16, cpu_slots=64)
    c.admit("a", 64)
    grow(c, "a", 4, 12)
    g = c.groups[0]
    addrs = c.addresses("a")
    expect = {int(a): row_bytes_for(a.view(1), 0, 0, RB)[0] for a in addrs}
    loc_ptr = g.loc.untyped_storage().data_ptr()
    pool_ptrs = {g.pools.gpu.untyped_storage().data_ptr(), g.pools.cpu.untyped_storage().data_ptr()}
    prev = g.loc.clone()
    checked = [0]

    def reader(ptr):
        if ptr != loc_ptr:
            return
        with torch._C._DisableTorchDispatch():
            changed = (g.loc[: g.n_logical] != prev[: g.n_logical]).nonzero().squeeze(1)
            for a in changed.tolist():
                p = int(g.loc[a])
                if p < 0 or a not in expect:  # unmapped, or newly placed (no data yet)
                    continue
                row = g.pools.gpu[0, p] if p < g.G else g.pools.cpu[0, p - g.G]
                assert torch.equal(row, expect[a]), f"mapping of {a} published before its data"
                checked[0] += 1
            prev.copy_(g.loc)

    c.begin_round()
    cold = addrs[:12].view(2, 6)  # mostly CPU-resident by now
    log = WriteLog(reader)
    with log:
        rows = c.access(0, cold)
    def kinds_of(log: WriteLog) -> list[str]:
        return ["pool" if p in pool_ptrs else "map" if p == loc_ptr else "other"
                for _, p in log.events]

    kinds = kinds_of(log)
    assert "pool" in kinds and "map" in kinds
    assert max(i for i, k in enumerate(kinds) if k == "pool") < kinds.index("map")
    assert checked[0] >= 12  # promoted rows and demoted victims were all checked
    assert torch.equal(g.pools.gpu[0][rows.view(-1).long()],
                       torch.stack([expect[int(a)] for a in cold.view(-1)]))
    # spills on placement follow the same order
    c.begin_round()
    log = WriteLog(reader)
    with log:
        new = c.extend("a", 10)
    kinds = kinds_of(log)
    assert kinds.index("pool") < kinds.index("map")
    fill(c, new)
    c.check_integrity()


def test_out_buffer_is_reused():
    c = make()
    c.admit("a", 20)
    a = c.extend("a", 10)
    fill(c, a)
    out = torch.empty(2, 3, dtype=torch.int32)
    r = c.access(0, a[:6].view(2, 3), out=out)
    assert r.data_ptr() == out.data_ptr()


def test_free_and_abort_return_everything():
    c = make(gpu_slots=16, cpu_slots=48)
    for rid in "abc":
        c.admit(rid, 20)
    for _ in range(2):
        for rid in "abc":
            c.begin_round()
            fill(c, c.extend(rid, 7))
    c.abort("b")
    c.check_integrity()
    c.free("a")
    c.free("c")
    c.check_integrity()
    for g in c.groups:
        assert int((g.gpu_owner[: g.G] >= 0).sum()) == 0 and int(g.pools.cpu_top) == g.C
    assert c.free_capacity == c.config.unique_capacity


def test_prometheus_text_reports_counters_and_bytes():
    from ulacache.metrics import prometheus_text

    c = make(gpu_slots=16, cpu_slots=64)
    c.admit("a", 40)
    grow(c, "a", 3, 10)
    c.begin_round()
    c.access(0, c.addresses("a")[:12].view(1, -1))
    text = prometheus_text(c)
    g = c.groups[0].counter_values()
    assert f'ulacache_promotions_total{{group="0"}} {g["promotions"]}' in text
    assert f'ulacache_bytes_moved_total{{group="0",link="h2d"}} {g["promotions"] * RB}' in text
    assert 'ulacache_gpu_used_slots{group="0"} 16' in text
    assert "# TYPE ulacache_spills_total counter" in text
