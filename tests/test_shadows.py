"""Evictions without write-back (shadows): a row promoted from the CPU tier keeps its CPU copy,
and evicting it remaps it there instead of copying it back.

- Twin runs, shadows on and off, of the same random operations (hostile entries included,
  validate off as under SGLang): the GPU side (mapping of GPU rows, owners, PB-LRU state, GPU
  bytes) and every live row's bytes are identical after every operation; only the CPU side
  and the D2H traffic differ, and shadows never move more bytes.
- The torch and fused paths stay identical with the CPU tier so tight that placements must
  reclaim shadows.
- Release frees a row's shadow with it; a write reaches the shadow; check_integrity after
  every operation (every CPU slot free, primary or shadow; shadows exact copies).
"""

from __future__ import annotations

import pytest
import torch

from tests.fused_helpers import TwinDriver, assert_same, make_twins
from ulacache.group import BORN, COUNTERS, SelectionGroup, live_shadows, occupancy
from ulacache.kernels import fused_access

GPU_SIDE = ("loc_gpu", "gpu_owner", "bits", "counts", "round_of", "ring_of", "gpu_pool")


def gpu_side(g: SelectionGroup) -> dict[str, torch.Tensor]:
    """What shadows must not change: where GPU rows are, the policy, the GPU bytes."""
    G, p = g.gpu_slots, g.policy
    loc = g.loc[: g.n_logical]
    return {"loc_gpu": torch.where(loc < G, loc, -3), "gpu_owner": g.gpu_owner[:G],
            "bits": p.bits, "counts": p.counts, "round_of": p.round_of[:G],
            "ring_of": p.ring_of[:G], "gpu_pool": g.pools.gpu[:, :G]}


class OnOffDriver(TwinDriver):
    """The same random operations on a group with shadows (``fused`` slot) and one without
    (``ref`` slot), compared on the GPU side and by every live row's bytes."""

    def both(self, fn, *args) -> tuple:
        self.serial += 1
        r, f = fn(self.ref, *args), fn(self.fused, *args)
        if isinstance(r, torch.Tensor):
            assert torch.equal(r, f), f"op {self.serial}: results differ"
        a, b = gpu_side(self.ref), gpu_side(self.fused)
        for name in GPU_SIDE:
            assert torch.equal(a[name], b[name]), f"op {self.serial}: {name} differs"
        live = torch.tensor(sorted(self.live), dtype=torch.int64)
        mapped = self.ref.loc[live] >= 0  # (a release in progress: live until it returns)
        assert torch.equal(mapped, self.fused.loc[live] >= 0), f"op {self.serial}: mapped"
        live = live[mapped]
        if live.numel() and self.ref.pools.n_layers:
            assert torch.equal(self.ref.read_all(live), self.fused.read_all(live)), \
                f"op {self.serial}: a live row reads back differently"
        for g in (self.ref, self.fused):
            g.check_integrity()
        return r, f


def on_off(path: str, **geometry) -> tuple[SelectionGroup, SelectionGroup]:
    kw = dict(n_layers=2, n_logical=300, gpu_slots=48, cpu_slots=252, row_bytes=8,
              n_buckets=4) | geometry
    ref, fused = make_twins(**kw)
    pick = 0 if path == "torch" else 1
    off = make_twins(**kw, shadows=False)[pick]
    return off, (ref, fused)[pick]


def workload(d: TwinDriver, rounds: int, hostile: bool, G: int) -> None:
    """Fill the GPU pool and spill, then rounds of skewed accesses, placements and releases."""
    for _ in range(4):
        d.advance()
        d.place(G // 2 + 4, hostile=False)
    for r in range(rounds):
        d.advance()
        d.access(4, 12, hostile=hostile and r % 2 == 0)
        d.access(2, 9, hostile=False)
        d.place(5, hostile=hostile and r % 3 == 0)
        if r % 3 == 2:
            d.release(12, hostile=hostile)


@pytest.mark.parametrize("seed", range(4))
def test_shadows_change_nothing_on_the_gpu_side_and_move_fewer_bytes(seed):
    """Production mode (validate off, hostile entries on odd seeds), torch path; the pool is
    tight on even seeds (placements reclaim shadows, then overflow alike)."""
    C = 80 if seed % 2 == 0 else 600  # 80: the tier fills up (placements overflow)
    off, on = on_off("torch", cpu_slots=C)
    d = OnOffDriver(off, on, seed)
    workload(d, 24, hostile=seed % 2 == 1, G=48)
    a, b = off.counter_values(), on.counter_values()
    for name in ("accesses", "gpu_hits", "promotions", "placed", "access_overflow",
                 "place_overflow", "invalid", "released_gpu", "released_cpu"):
        assert a[name] == b[name], name
    assert occupancy(a) == occupancy(b)
    d2h_off, d2h_on = a["writebacks"] + a["spills"], b["writebacks"] + b["spills"]
    assert b["remaps"] > 0 and d2h_on + b["remaps"] == d2h_off  # every remap saved a copy
    assert b["rewrites"] < a["rewrites"]
    assert a["remaps"] == a["shadowed"] == a["reclaims"] == 0
    if seed % 2 == 0:
        assert b["reclaims"] > 0


def test_fused_path_with_shadows_matches_the_torch_path_under_a_tight_cpu_tier():
    """A CPU tier the workload fills: the free stack runs dry, so placements reclaim shadows and
    victims remap onto them in access and place; the fused kernels leave every table, counter
    and byte as the torch path does (tests.fused_helpers.assert_same after each operation)."""
    ref, fused = make_twins(2, 200, 40, 70, 8, 4)
    d = TwinDriver(ref, fused, 5)
    workload(d, 14, hostile=True, G=40)
    for g in (ref, fused):
        g.check_integrity()
    c = ref.counter_values()
    assert c["remaps"] and c["shadowed"] and c["reclaims"] and c["shadows_released"]


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_release_frees_the_shadow_and_a_write_reaches_it(path):
    ref, fused = make_twins(1, 64, 8, 56, 8, 2)
    g = ref if path == "torch" else fused
    addrs = torch.arange(32)
    for i in range(0, 32, 8):  # 32 rows: 8 on the GPU, 24 spilled
        g.policy.advance()
        g.place(addrs[i:i + 8])
        for a in addrs[i:i + 8].tolist():
            g.write(0, torch.tensor([a]), torch.full((1, 8), a, dtype=torch.uint8))
    g.policy.advance()
    g.release(addrs[24:])  # the 8 on the GPU: their slots are free again
    g.policy.advance()
    g.access(torch.arange(8).view(1, -1))  # promoted into free GPU slots: 8 shadows
    c = g.counter_values()
    assert c["promotions"] == 8 and c["shadowed"] == 8 and live_shadows(c) == 8
    g.check_integrity()
    # a write to a shadowed row reaches both copies: evicting it later keeps the new bytes
    g.write(0, torch.tensor([3]), torch.full((1, 8), 99, dtype=torch.uint8))
    g.check_integrity()
    g.policy.advance()
    g.access(torch.arange(8, 16).view(1, -1))  # evicts the eight onto their shadows
    c = g.counter_values()
    assert c["remaps"] == 8 and c["writebacks"] == 0
    assert int(g.read(0, torch.tensor([3]))[0, 0]) == 99
    g.check_integrity()
    g.release(torch.arange(24))
    c = g.counter_values()
    assert c["shadows_released"] == 8 and live_shadows(c) == 0
    assert int(g.pools.cpu_top) == g.cpu_slots and bool((g.shadow == BORN).all())
    g.check_integrity()


def test_counter_columns_include_the_shadow_counters():
    assert set(fused_access.COUNTER_COLUMNS) == set(COUNTERS)


@pytest.mark.parametrize("seed", range(2))
def test_fused_shadows_on_off_gpu_side_identical(seed):
    """The same on/off comparison on the fused path (interpreted on CPU)."""
    off, on = on_off("fused", cpu_slots=252 if seed == 0 else 600)
    d = OnOffDriver(off, on, 10 + seed)
    workload(d, 10, hostile=seed == 1, G=48)
    assert on.counter_values()["remaps"] > 0


def test_tp_owners_keep_their_shadows_locally():
    """TP mode, two ranks over the bundled trace: each owner's evictions remap onto its own
    shadows (its CPU tier), the buffer of peers' copies writes nothing back, and the GPU side
    (promotions, peer fetches, buffer hits) is the same with shadows off."""
    from pathlib import Path

    from ulacache.tools.replay_tp import replay_tp
    from ulacache.tools.traces import load_trace

    trace = load_trace(Path(__file__).resolve().parents[1] / "ulacache" / "tools" / "data"
                       / "gpl3.trace.npz")
    kw = dict(tp_size=2, requests=2, steps=48, layers=[3, 20])
    on, off = (replay_tp(trace, shadows=s, **kw) for s in (True, False))
    for a, b in zip(on.ranks, off.ranks):
        assert (a.promoted, a.peer_fetches, a.buffer_hits, a.unique_rows) == \
            (b.promoted, b.peer_fetches, b.buffer_hits, b.unique_rows)
        assert a.remaps > 0 and b.remaps == 0
        assert a.eviction_d2h_bytes_per_step < b.eviction_d2h_bytes_per_step
        assert a.pcie_bytes_per_step < b.pcie_bytes_per_step


def test_reclaim_gives_back_recently_touched_rows_shadows_first_torch_and_fused():
    """Eight GPU rows with shadows: 0-3 last touched two rounds back, 4-7 in the last round
    (the next victims are 0-3, whose shadows make their eviction free). Reclaims take 4-7's
    shadows first, in cursor order, and move the cursor only for the older ones; both paths
    agree step by step."""
    ref, fused = make_twins(1, 64, 8, 24, 8, 2)
    for g in (ref, fused):
        addrs = torch.arange(32)
        for i in range(0, 32, 8):  # 32 rows: 8 on the GPU, 24 in a full CPU tier
            g.policy.advance()
            g.place(addrs[i:i + 8])
        g.policy.advance()
        g.release(addrs[24:])  # eight free GPU slots
        g.policy.advance()
        g.access(torch.arange(4).view(1, -1))  # rows 0-3 promoted: four shadows
        g.policy.advance()
        g.access(torch.arange(4, 8).view(1, -1))  # rows 4-7: four more, one round later
        g.policy.advance()
        assert int(g.pools.cpu_top) == 0

    def shadowed(g: SelectionGroup, rows: range) -> list[int]:
        return [a for a in rows if int(g.shadow[int(g.loc[a])]) >= 0]

    cursor_moves = []
    for need, old_left, new_left in ((2, 4, 2), (4, 4, 0), (6, 2, 0)):
        for g in (ref, fused):
            before = int(g.reclaim_cursor)
            g.reclaim(need)
            g.check_integrity()
            assert int(g.pools.cpu_top) == need
            assert len(shadowed(g, range(4))) == old_left, (g.fused, need)
            assert len(shadowed(g, range(4, 8))) == new_left, (g.fused, need)
            cursor_moves.append(int(g.reclaim_cursor) != before)
        assert_same(ref, fused, f"reclaim({need})")
    assert cursor_moves == [False, False, False, False, True, True]
