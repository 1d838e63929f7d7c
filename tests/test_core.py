"""Unit tests of the DP-mode core: admission, placement, sparse access, errors, ordering, and
deterministic cases for the bugs that matter (boundaries, recency order, counters)."""

from __future__ import annotations

import pytest
import torch

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
from ulacache.space import AddressSpace

from .helpers import WriteLog, assert_same, fill, grow, row_bytes_for, snapshot

RB = 16


def make(**kw) -> UlaCache:
    base = dict(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=32, cpu_slots=96,
                page_size=4, max_requests=8, n_buckets=4)
    base.update(kw)
    return UlaCache(UlaCacheConfig(**base))


def make_space(n_logical: int, **kw) -> AddressSpace:
    base = dict(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=8, cpu_slots=32,
                page_size=1, n_buckets=4)
    base.update(kw)
    return AddressSpace(UlaCacheConfig(**base), n_logical=n_logical)


def test_layouts_and_config_errors():
    assert RowLayout.named("fp8").row_bytes == 656
    assert RowLayout.named("bf16").row_bytes == 1152
    assert RowLayout.named("tiny", 48).row_bytes == 48
    assert RowLayout.of_size(656).name == "fp8" and RowLayout.of_size(20).name == "tiny"
    with pytest.raises(ConfigError, match="legal"):
        RowLayout.named("int4")
    with pytest.raises(ConfigError, match="divide"):
        UlaCacheConfig(n_layers=6, layers_per_group=4)
    with pytest.raises(ConfigError, match="legal keys"):
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
    c.space.begin_round()
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
        c.admit("b", 7)  # 10 + 7 > 16: necessary, as 10 + 6 is admitted next
    assert_same(before, snapshot(c))
    c.admit("b", 6)
    c.extend("a", 6)
    c.space.begin_round()
    before = snapshot(c)
    with pytest.raises(CapacityExhausted, match="outgrow"):
        c.extend("b", 7)  # would need one more than free capacity (0 free)
    assert_same(before, snapshot(c))
    c.free("a")
    c.extend("b", 7)  # reservation grows now that "a" is gone
    assert c.requests["b"].reserved == 7
    c.check_integrity()


def test_errors_leave_state_unchanged():
    c = make()
    s = c.space
    c.admit("a", 40)
    a = c.extend("a", 20)
    fill(s, a)
    cases = [
        (AddressError, lambda: s.access(0, torch.tensor([[s.n_logical]]))),
        (AddressError, lambda: s.access(0, torch.tensor([[a[0].item() + 20]]))),  # not live
        (AddressError, lambda: s.access(0, torch.tensor([[-2]]))),  # not the -1 padding
        (AddressError, lambda: s.write(0, torch.tensor([s.n_logical + 5]),
                                       torch.zeros(1, RB, dtype=torch.uint8))),
        (AddressError, lambda: s.write(0, a[[0, 0]], torch.zeros(2, RB, dtype=torch.uint8))),
        (ShapeError, lambda: s.write(0, a[:2], torch.zeros(3, RB, dtype=torch.uint8))),
        (ShapeError, lambda: s.write(0, a[:2], torch.zeros(2, RB, dtype=torch.int16))),
        (ShapeError, lambda: s.access(0, a.float().view(1, -1))),
        (ShapeError, lambda: s.access(0, a.bool().view(1, -1))),
        (ShapeError, lambda: s.access(0, a)),  # 1-D
        (ShapeError, lambda: s.access(-1, a.view(1, -1))),  # no negative group index
        (ShapeError, lambda: s.access(0, a.view(1, -1), out=torch.empty(1, 19, dtype=torch.int32))),
        (ShapeError, lambda: s.access(0, a.view(1, -1), out=torch.empty(1, 20))),
        (ShapeError, lambda: s.write(9, a[:1], torch.zeros(1, RB, dtype=torch.uint8))),
        (AddressError, lambda: s.release(a[[0, 0]])),  # duplicates
        (AddressError, lambda: s.release(torch.tensor([-3]))),
        (ShapeError, lambda: s.release(a.float())),
        (AddressError, lambda: s.place(a[:1])),  # already has a row
        (UnknownRequest, lambda: c.extend("zz", 1)),
        (ShapeError, lambda: c.extend("a", 1.0)),
        (ShapeError, lambda: c.extend("a", True)),
        (ShapeError, lambda: c.admit("b", float("nan"))),
        (ShapeError, lambda: c.admit("b", 2.5)),
        (ShapeError, lambda: c.admit("b", -1)),
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


def test_step_that_cannot_fit_is_refused_and_the_refusal_is_necessary():
    """9 distinct rows can never be GPU-resident at once in 8 slots: refused with nothing
    changed. 8 (the pool size, all of them misses) are served: the refusal was not slack."""
    c = make(gpu_slots=8, cpu_slots=64)
    c.admit("a", 40)
    grow(c, "a", 5, 8)  # 40 tokens: the first 32 now live on the CPU
    addrs = c.addresses("a")
    c.space.begin_round()
    before = snapshot(c)
    with pytest.raises(CapacityExhausted, match="promote"):
        c.space.access(0, addrs[:9].view(1, -1))
    assert_same(before, snapshot(c))
    rows = c.space.access(0, addrs[:8].view(1, -1))
    assert sorted(rows.view(-1).tolist()) == list(range(8))
    got = c.space.gpu_rows(0)[rows.view(-1).long()]
    assert torch.equal(got, row_bytes_for(addrs[:8], 0, 0, RB))
    c.check_integrity()


def test_misses_that_exactly_fill_the_free_room_are_served():
    """Free + evictable slots == distinct misses: served (no off-by-one refusal)."""
    s = make_space(64, gpu_slots=8)
    s.begin_round()
    s.place(torch.arange(8))  # GPU full
    s.begin_round()
    s.place(torch.arange(8, 13))  # 5 spilled; 5 slots pinned this round
    fill(s, torch.arange(13))
    s.begin_round()
    s.release(torch.tensor([8]))  # one free slot; 7 evictable
    sel = torch.tensor([[0, 1, 2, 3, 9], [10, 11, 12, -1, -1]])  # 4 spilled + 4 GPU hits
    hits = int((s.groups[0].loc[sel[sel >= 0]] < 8).sum())
    misses = int((sel >= 0).sum()) - hits
    eligible = int(s.groups[0].policy.eligible()) - hits
    assert misses == eligible == 4  # 0..3 spilled; room: slot of 8 (free) + 3 unpinned
    rows = s.access(0, sel)
    assert bool((rows[sel >= 0] >= 0).all())
    assert torch.equal(s.gpu_rows(0)[rows[sel >= 0].long()], row_bytes_for(sel[sel >= 0], 0, 0, RB))
    s.check_integrity()


def test_last_logical_address_is_live_in_an_engine_owned_space():
    """The address next to the scratch entry keeps its row through place, write, spill,
    promotion and release, in calls full of masked entries (padding, hits) that write to the
    scratch entry: an off-by-one there would clobber the last address's mapping."""
    n = 20
    s = make_space(n, gpu_slots=4, cpu_slots=16)
    g = s.groups[0]
    last = torch.tensor([n - 1])
    s.begin_round()
    s.place(torch.tensor([-1, n - 1, -1]))
    fill(s, last, version=3)
    for chunk in (torch.tensor([0, 1, -1, 2, 3]), torch.tensor([4, -1, 5, 6, 7])):
        s.begin_round()  # spills it to the CPU tier
        s.place(chunk)
        fill(s, chunk[chunk >= 0])
    assert int(g.loc[n - 1]) >= g.gpu_slots and int(g.loc[n]) == -1
    for sel in ([[5, n - 1, -1, 6]], [[n - 1, 7, -1, -1]], [[0, -1, 1, 2]]):
        s.begin_round()
        rows = s.access(0, torch.tensor(sel))
        assert int(g.loc[n]) == -1 and int(g.loc[n - 1]) >= 0
        assert bool((rows[torch.tensor(sel) >= 0] >= 0).all())
        assert torch.equal(s.read(0, last), row_bytes_for(last, 0, 3, RB))
        s.check_integrity()
    s.release(torch.tensor([-1, 3, -1]))
    assert torch.equal(s.read(1, last), row_bytes_for(last, 1, 3, RB))
    s.release(last)
    assert int(g.loc[n - 1]) == -1 and int(g.loc[n]) == -1
    s.check_integrity()


@pytest.mark.parametrize("policy", ["pblru", "lru"])
def test_recency_order_inside_recent_buckets(policy):
    """With no free and no cold slot, victims are taken oldest first, and a re-touched row is
    no longer among the oldest."""
    s = make_space(64, gpu_slots=8, cpu_slots=32, n_buckets=8, policy=policy)
    for r in range(4):  # 2 rows per round: epochs [0,1] [2,3] [4,5] [6,7]
        s.begin_round()
        s.place(torch.arange(2 * r, 2 * r + 2))
    g = s.groups[0]
    if policy == "pblru":
        assert int((g.policy.bucket_of(torch.arange(8)) <= 1).sum()) == 0  # nothing free/cold
    s.begin_round()
    s.access(0, torch.tensor([[0]]))  # address 0 becomes the most recent
    s.begin_round()
    s.place(torch.arange(8, 11))  # 3 victims: oldest first, address 0 spared
    on_cpu = sorted(a for a in range(8) if int(g.loc[a]) >= g.gpu_slots)
    assert on_cpu == [1, 2, 3]
    s.check_integrity()


def test_access_promotes_swaps_and_preserves_padding():
    c = make(gpu_slots=16, cpu_slots=64, layers_per_group=2)
    c.admit("a", 64)
    grow(c, "a", 4, 12)  # 48 tokens, 16 GPU slots: 32 spilled
    addrs = c.addresses("a")
    c.space.begin_round()
    sel = torch.tensor([[int(addrs[0]), -1, int(addrs[47]), int(addrs[0])],
                        [int(addrs[5]), int(addrs[6]), -1, -1]])
    rows = c.space.access(0, sel)
    assert rows.dtype == torch.int32 and rows.shape == sel.shape
    assert (rows[sel < 0] == -1).all() and (rows[sel >= 0] >= 0).all()
    assert rows[0, 0] == rows[0, 3]  # duplicates resolve to one row
    for layer in (0, 1):
        got = c.space.gpu_rows(layer)[rows[sel >= 0].long()]
        assert torch.equal(got, row_bytes_for(sel[sel >= 0], layer, 0, RB))
    stats = c.space.groups[0].counter_values()
    assert stats["promotions"] >= 1 and stats["accesses"] == 4
    for layer in (0, 1):  # nothing lost by the swaps
        assert torch.equal(c.space.read(layer, addrs), row_bytes_for(addrs, layer, 0, RB))
    c.check_integrity()


def test_single_copy_when_victim_slot_free():
    """Promoting into a free GPU slot copies CPU -> GPU only: the vacated CPU slot is not
    overwritten (no write-back of a free slot's stale bytes)."""
    c = make(gpu_slots=16, cpu_slots=64)
    s = c.space
    c.admit("a", 32)
    c.admit("b", 16)
    s.begin_round()
    fill(s, c.extend("b", 16))  # fills the GPU pool
    s.begin_round()
    a = c.extend("a", 16)  # spills all of b to CPU
    fill(s, a)
    c.free("a")  # 16 free GPU slots, b lives on CPU
    g = s.groups[0]
    b = c.addresses("b")
    cslots = g.loc[b] - g.gpu_slots
    assert bool((cslots >= 0).all())
    before = g.pools.cpu[:, cslots].clone()
    s.begin_round()
    rows = s.access(0, b[:6].view(1, -1))
    assert torch.equal(g.pools.cpu[:, cslots], before)  # vacated CPU rows untouched
    assert torch.equal(s.gpu_rows(0)[rows.view(-1).long()], row_bytes_for(b[:6], 0, 0, RB))
    assert g.counter_values()["promotions"] == 6 and g.counter_values()["writebacks"] == 0
    c.check_integrity()


def test_counters_and_bytes_match_an_independent_count():
    """Every counter, and the Prometheus byte totals, equal counts taken from the state before
    and after each operation (rows that changed tier), over a mixed workload."""
    from ulacache.metrics import prometheus_text

    c = make(gpu_slots=20, cpu_slots=96, layers_per_group=2, policy="pblru")
    s, g = c.space, c.space.groups[0]
    G = g.gpu_slots
    exp = dict.fromkeys(("accesses", "gpu_hits", "promotions", "writebacks", "placed", "spills",
                         "remaps", "rewrites"), 0)
    been_on_cpu = torch.zeros_like(g.loc, dtype=torch.bool)  # seen in the CPU tier so far

    def evicted(before, shadow_before):
        """(copied, remapped): rows that left the GPU, by a copy or onto their shadow; copies
        of rows seen in the CPU tier before are rewrites."""
        down = (before < G) & (before >= 0) & (g.loc >= G)
        onto = down & (g.loc - G == shadow_before[before.clamp(0, G)].to(torch.int64))
        exp["rewrites"] += int((down & ~onto & been_on_cpu).sum())
        been_on_cpu.logical_or_(g.loc >= G)
        return int((down & ~onto).sum()), int(onto.sum())

    gen = torch.Generator().manual_seed(7)
    for rid in range(3):
        c.admit(rid, 30)
    for step in range(12):
        s.begin_round()
        before, shadow_before = g.loc.clone(), g.shadow.clone()
        new = torch.cat(c.extend_batch(dict.fromkeys(range(3), 2 if step < 6 else 1)))
        fill(s, new)
        copied, remapped = evicted(before, shadow_before)
        exp["placed"] += new.numel()
        exp["spills"] += copied
        exp["remaps"] += remapped
        live = torch.cat([c.addresses(r) for r in range(3)])
        sel = live[torch.randint(0, live.numel(), (2, 6), generator=gen)]
        before, shadow_before = g.loc.clone(), g.shadow.clone()
        distinct = sel.view(-1).unique()
        s.access(0, sel)
        exp["accesses"] += distinct.numel()
        exp["gpu_hits"] += int((before[distinct] < G).sum())
        exp["promotions"] += int((before[distinct] >= G).sum())
        copied, remapped = evicted(before, shadow_before)
        exp["writebacks"] += copied
        exp["remaps"] += remapped
        c.check_integrity()
    got = g.counter_values()
    assert {k: got[k] for k in exp} == exp
    assert got["access_overflow"] == got["place_overflow"] == got["invalid"] == 0
    assert exp["promotions"] > 0 and exp["writebacks"] > 0 and exp["spills"] > 0
    s.health.flush()
    text = prometheus_text(s)
    per_row = RB * 2
    assert f'ulacache_bytes_moved_total{{group="0",link="h2d"}} ' \
           f'{float(exp["promotions"] * per_row)}' in text
    assert f'ulacache_bytes_moved_total{{group="0",link="d2h"}} ' \
           f'{float((exp["writebacks"] + exp["spills"]) * per_row)}' in text
    assert f'ulacache_promotions_total{{group="0"}} {float(exp["promotions"])}' in text


def test_data_then_map_order():
    """Every copy into the pools is issued before the first mapping write, and a reader that
    observes a changed mapping entry reads the new data there (invariant 3)."""
    c = make(gpu_slots=16, cpu_slots=64)
    c.admit("a", 64)
    grow(c, "a", 4, 12)
    g = c.space.groups[0]
    G = g.gpu_slots
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
                row = g.pools.gpu[0, p] if p < G else g.pools.cpu[0, p - G]
                assert torch.equal(row, expect[a]), f"mapping of {a} published before its data"
                checked[0] += 1
            prev.copy_(g.loc)

    def kinds_of(log: WriteLog) -> list[str]:
        return ["pool" if p in pool_ptrs else "map" if p == loc_ptr else "other"
                for _, p, _ in log.events]

    c.space.begin_round()
    cold = addrs[:12].view(2, 6)  # mostly CPU-resident by now
    log = WriteLog(reader)
    with log:
        rows = c.space.access(0, cold)
    kinds = kinds_of(log)
    assert "pool" in kinds and "map" in kinds
    assert max(i for i, k in enumerate(kinds) if k == "pool") < kinds.index("map")
    assert checked[0] >= 12  # promoted rows and demoted victims were all checked
    assert torch.equal(g.pools.gpu[0][rows.view(-1).long()],
                       torch.stack([expect[int(a)] for a in cold.view(-1)]))
    # spills on placement follow the same order
    c.space.begin_round()
    log = WriteLog(reader)
    with log:
        new = c.extend("a", 10)
    kinds = kinds_of(log)
    assert kinds.index("pool") < kinds.index("map")
    fill(c.space, new)
    c.check_integrity()


def test_out_buffer_is_reused():
    c = make()
    c.admit("a", 20)
    a = c.extend("a", 10)
    fill(c.space, a)
    out = torch.empty(2, 3, dtype=torch.int32)
    r = c.space.access(0, a[:6].view(2, 3), out=out)
    assert r.data_ptr() == out.data_ptr()


def test_free_and_abort_return_everything():
    c = make(gpu_slots=16, cpu_slots=48)
    for rid in "abc":
        c.admit(rid, 20)
    for _ in range(2):
        for rid in "abc":
            c.space.begin_round()
            fill(c.space, c.extend(rid, 7))
    c.abort("b")
    c.check_integrity()
    c.free("a")
    c.free("c")
    c.check_integrity()
    for g in c.space.groups:
        assert int((g.gpu_owner[: g.gpu_slots] >= 0).sum()) == 0
        assert int(g.pools.cpu_top) == g.cpu_slots
    assert c.free_capacity == c.config.unique_capacity


def test_prometheus_text_reports_counters_and_occupancy():
    from ulacache.metrics import prometheus_text

    c = make(gpu_slots=16, cpu_slots=64)
    c.admit("a", 40)
    grow(c, "a", 3, 10)
    c.space.begin_round()
    c.space.access(0, c.addresses("a")[:12].view(1, -1))
    c.space.health.flush()
    text = prometheus_text(c.space, reserved_tokens=lambda: c.reserved_total)
    g = c.space.groups[0].counter_values()
    assert f'ulacache_promotions_total{{group="0"}} {float(g["promotions"])}' in text
    assert 'ulacache_gpu_used_slots{group="0"} 16.0' in text
    assert 'ulacache_cpu_used_slots{group="0"} 14.0' in text
    assert "# TYPE ulacache_spills_total counter" in text
    assert "ulacache_reserved_tokens 40.0" in text
    assert 'ulacache_place_overflow_total{group="0"} 0.0' in text


def test_a_refused_chunked_call_changes_nothing():
    """Calls over ``max_call`` entries run in chunks; with validate on the whole call is
    checked first, so a bad entry in a later chunk refuses the call before any chunk ran."""
    from ulacache.group import SelectionGroup
    from ulacache.kernels.fused_access import equivalence_state

    g = SelectionGroup([0], 400, 200, 400, 16, "cpu", "pblru", 4, True, max_call=128)
    for part in (torch.arange(1, 151), torch.arange(151, 300)):  # 2 chunks each; spills
        g.place(part)
        g.policy.advance()
    g.check_integrity()
    before = {k: v.clone() for k, v in equivalence_state(g).items()}
    cases = [
        (g.access, torch.cat([torch.arange(1, 40), torch.tensor([350])]).repeat(4).view(1, -1),
         AddressError),  # a dead address in every chunk but the first... and the first
        (g.access, torch.cat([torch.arange(1, 200), torch.tensor([399])]).view(1, -1),
         AddressError),  # a dead address in the second chunk only
        (g.release, torch.cat([torch.arange(1, 150), torch.tensor([5])]), AddressError),
        # 100 fresh + 28 padding in the first piece, a duplicate alone in the second
        (g.place, torch.cat([torch.arange(300, 400), torch.full((28,), -1), torch.tensor([300])]),
         AddressError),
        (g.access, torch.arange(1, 260).view(1, -1), CapacityExhausted),  # > 200 GPU slots
    ]
    for call, addrs, error in cases:
        with pytest.raises(error):
            call(addrs)
        after = equivalence_state(g)
        for k in before:
            assert torch.equal(before[k], after[k]), (call.__name__, k)
    g.release(torch.arange(1, 300))  # chunked release of everything
    assert int(g.policy.used_count()) == 0
    g.check_integrity()


@pytest.mark.parametrize("shadows", [True, False])
def test_address_zero_is_evicted_like_any_other(shadows):
    """Address 0, the least recently used row (exact LRU), is the victim of a promotion: it is
    written back (or remapped) and keeps its bytes like any other address (an owner test of
    ``> 0`` instead of ``>= 0`` would leave it mapped to a slot another row now holds)."""
    from ulacache.group import SelectionGroup

    g = SelectionGroup([0], 16, 4, 12, 8, "cpu", "lru", 2, validate=True, shadows=shadows)
    rows = {a: torch.full((1, 8), 10 + a, dtype=torch.uint8) for a in range(8)}
    for batch in ([4, 5, 6, 7], [0], [1, 2, 3]):  # 4..7 spilled; 0 the oldest on the GPU
        g.policy.advance()
        g.place(torch.tensor(batch))
        for a in batch:
            g.write(0, torch.tensor([a]), rows[a])
    assert int(g.loc[0]) < g.gpu_slots and int(g.loc[4]) >= g.gpu_slots
    g.policy.advance()
    g.access(torch.tensor([[4]]))
    assert int(g.loc[0]) >= g.gpu_slots  # 0 was the victim
    g.check_integrity()
    for a in range(8):
        assert torch.equal(g.read(0, torch.tensor([a])), rows[a]), a


def test_int32_tables_refuse_what_they_cannot_index():
    """The mapping and GPU owners are int32 and the CPU free stack holds int32 slot numbers:
    a group over 2**31 - 1 addresses, or whose slots do not fit one int32, is refused with a
    ShapeError before anything is allocated (the sizes below would need terabytes)."""
    from ulacache.group import MAP_LIMIT, SelectionGroup

    for n, g, c in [(MAP_LIMIT, 16, 16), (1 << 10, 16, MAP_LIMIT - 15),
                    (1 << 10, MAP_LIMIT, 1)]:
        with pytest.raises(ShapeError, match="int32 mapping"):
            SelectionGroup([0], n, g, c, 8, "cpu", "lru", 64, True, access_path="torch")
