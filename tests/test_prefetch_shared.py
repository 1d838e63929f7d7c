"""The ``shared_groups`` prefetch source (:class:`ulacache.prefetch.SharedGroups`): a shared
group's access moves only its anchor layer's bytes, the other layers' bytes of the same moves
are replayed later (the prefetch stream on a GPU; each layer's own wait on CPU), and decoding
stays bit-identical; the deferred access equals the access on both paths, its replay is one
launch per layer, and the engine refuses what it cannot serve."""

from __future__ import annotations

import pytest
import torch

from ulacache.config import PrefetchConfig
from ulacache.errors import ConfigError, ShapeError
from ulacache.group import SelectionGroup
from ulacache.ipc import run_ranks
from ulacache.kernels.fused_access import equivalence_state
from ulacache.oracle.driver import run_equality
from ulacache.oracle.refmodel import ModelGeometry
from ulacache.pblru import PBLRUArena
from ulacache.prefetch import PrefetchEngine
from ulacache.space import AddressSpace

from .helpers import logged_decode_step, prefetch_test_config, random_drafts

SHARED = ("shared_groups",)
PROMPTS = [150, 90, 40, 120]


@pytest.mark.parametrize("validate", [True, False], ids=["checks-on", "production"])
@pytest.mark.parametrize("layers_per_indexer", [2, 4])
@pytest.mark.parametrize("sources", [SHARED, ("previous_layer", "shared_groups"),
                                     ("draft", "shared_groups", "previous_layer")], ids="+".join)
def test_dp_decoding_is_identical_with_shared_groups(sources, layers_per_indexer, validate):
    """Bit-identical decoding with the source on (alone, and beside the predicting sources,
    capped and not) against the resident reference; promotions are the same rows as with
    prefetch off when shared_groups is alone (it moves bytes later, it changes no decision)."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=layers_per_indexer)
    cfg = prefetch_test_config(geom, validate=validate)
    off = run_equality(geom, cfg, PROMPTS, n_steps=16)
    assert off.identical
    for cap in (100_000, 5):
        rep = run_equality(geom, cfg, PROMPTS, n_steps=16, draft_hint=random_drafts(cfg),
                           prefetch=PrefetchConfig(sources=sources, fetch_cap=cap))
        assert rep.identical, (cap, rep.mismatches[:5])
        assert sum(rep.moved_per_step["promotions"]) > 0  # there were moves to defer
        if sources == SHARED:
            assert rep.moved_per_step == off.moved_per_step
        for k in ("access_overflow", "place_overflow", "invalid"):
            assert sum(rep.moved_per_step[k]) == 0, k


def test_a_skipped_layer_wait_reads_stale_bytes():
    """The wait is load-bearing: with before_load a no-op (CPU replays run at the wait), a
    non-anchor layer reads rows whose bytes have not moved and the run is caught."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = prefetch_test_config(geom, validate=True)
    original = PrefetchEngine.before_load
    PrefetchEngine.before_load = lambda self, layer: None
    try:
        with pytest.raises(AssertionError):
            rep = run_equality(geom, cfg, PROMPTS, n_steps=16,
                               prefetch=PrefetchConfig(sources=SHARED))
            assert rep.identical  # (check_integrity usually fails first: a stale shadow)
    finally:
        PrefetchEngine.before_load = original


def test_waits_are_per_layer_and_replays_follow_their_access():
    """The engine's stream log of one decode step, 2 groups of 4 layers: each group's access
    issues its replay, each non-anchor layer waits for its own replay (never the anchor, never
    another group's), previous_layer's prefetch of group g + 1 is issued after group g's
    replay, and the next step fences everything."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=4)
    store, log = logged_decode_step(
        geom, prefetch_test_config(geom),
        PrefetchConfig(sources=("previous_layer", "shared_groups")))
    groups = geom.selection_groups()
    want = [("fence", -1)]
    for g, layers in enumerate(groups):
        if g:
            want.append(("wait", g))
        want.append(("replay", g))
        if g + 1 < len(groups):
            want.append(("prefetch", g + 1))
        want += [("wait_layer", layer) for layer in layers[1:]]
    assert log == want
    log.clear()
    store.begin_step()
    store.prefetch.before_load(groups[0][1])  # the fence joined it: nothing left to wait for
    assert log == [("fence", -1)]


def make_group(path: str, L: int = 3, G: int = 32, C: int = 200, N: int = 300,
               rb: int = 16, **kw) -> SelectionGroup:
    return SelectionGroup(list(range(L)), N, G, C, rb, "cpu",
                          PBLRUArena(1, G, 4, "cpu", hyper=64).policies[0], 4, False,
                          access_path=path, **kw)


def paths() -> list[str]:
    from ulacache.kernels import fused_access

    return ["torch", "fused"] if fused_access.available() and fused_access.INTERPRETED \
        else ["torch"]


@pytest.mark.parametrize("shadows", [True, False], ids=["shadows", "write-back"])
@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("seed", [0, 1])
def test_deferred_access_then_replay_equals_the_access(seed, path, shadows):
    """Random steps (placements that spill, selections with padding, duplicates and hostile
    entries, releases) on a reference group running ``access`` and a twin running
    ``access_deferred``: after the deferred access every table, counter and the anchor layer's
    bytes equal the reference's and the other layers have not moved; after the replays, every
    byte equals."""
    gen = torch.Generator().manual_seed(seed)
    ref, twin = make_group("torch", shadows=shadows), make_group(path, shadows=shadows)
    twin.use_move_list(torch.full((3, twin.max_call), -1, dtype=torch.int32))
    live: list[int] = []
    free = torch.randperm(ref.n_logical, generator=gen).tolist()
    deferred_moves = 0
    for step in range(14):
        for g in (ref, twin):
            g.policy.advance()
        new = torch.tensor([free.pop() for _ in range(12)])
        slots = ref.place(new)
        assert torch.equal(twin.place(new), slots)
        placed = new[slots >= 0]
        live += placed.tolist()
        for layer in ref.layers:
            rows = torch.randint(0, 256, (placed.numel(), ref.pools.row_bytes),
                                 dtype=torch.uint8, generator=gen)
            ref.write(layer, placed, rows)
            twin.write(layer, placed, rows)
        pool = torch.tensor(live)
        sel = pool[torch.randint(0, len(live), (4, 9), generator=gen)]
        sel[torch.rand(4, 9, generator=gen) < 0.15] = -1
        sel[0, 0] = ref.n_logical + 5  # hostile: out of range (masked, validate off)
        before = {k: v.clone() for k, v in equivalence_state(twin).items()}
        rows_ref = ref.access(sel)
        rows_twin = twin.access_deferred(sel)
        assert torch.equal(rows_ref, rows_twin)
        a, b = equivalence_state(ref, pools=False), equivalence_state(twin, pools=False)
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        assert torch.equal(ref.pools.gpu[0], twin.pools.gpu[0])
        assert torch.equal(ref.pools.cpu[0], twin.pools.cpu[0])
        assert torch.equal(twin.pools.gpu[1:, : twin.gpu_slots], before["gpu_pool"][1:])
        assert torch.equal(twin.pools.cpu[1:, : twin.cpu_slots], before["cpu_pool"][1:])
        moved = int((twin.moves[0, : sel.numel()] >= 0).sum())
        deferred_moves += moved
        for li in range(1, len(twin.layers)):
            twin.replay_layer(li)
        a, b = equivalence_state(ref), equivalence_state(twin)
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        if step % 4 == 3:
            gone = pool[torch.randperm(len(live), generator=gen)[:6]]
            ref.release(gone)
            twin.release(gone)
            live = sorted(set(live) - set(gone.tolist()))
        ref.check_integrity()
        twin.check_integrity()
    assert deferred_moves > 20


def test_replay_is_one_launch_per_layer_and_the_access_stays_four():
    pytest.importorskip("triton")
    from ulacache.kernels import fused_access

    if not fused_access.INTERPRETED:
        pytest.skip("counts launches through the interpreter on CPU")
    g = make_group("fused", L=4)
    g.use_move_list(torch.full((3, g.max_call), -1, dtype=torch.int32))
    g.policy.advance()
    g.place(torch.arange(20))
    g.policy.advance()
    n0 = fused_access.launch_count()
    g.access_deferred(torch.arange(8).view(2, 4))
    assert fused_access.launch_count() - n0 == fused_access.LAUNCHES_PER_CALL
    n0 = fused_access.launch_count()
    for li in (1, 2, 3):
        g.replay_layer(li)
    assert fused_access.launch_count() - n0 == 3


def test_bad_calls_are_refused_and_change_nothing():
    g = make_group("torch", L=2)
    with pytest.raises(ShapeError, match="move list"):
        g.access_deferred(torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ShapeError, match="int32"):
        g.use_move_list(torch.full((3, g.max_call), -1, dtype=torch.int64))
    with pytest.raises(ShapeError, match=">= 2 layers"):
        make_group("torch", L=1).use_move_list(torch.full((3, 300), -1, dtype=torch.int32))
    g.use_move_list(torch.full((3, g.max_call), -1, dtype=torch.int32))
    before = {k: v.clone() for k, v in equivalence_state(g).items()}
    with pytest.raises(ShapeError, match="call capacity"):
        g.access_deferred(torch.zeros(1, g.max_call + 1, dtype=torch.int64))
    for li in (0, 2, True):
        with pytest.raises(ShapeError, match="layer index"):
            g.replay_layer(li)
    after = equivalence_state(g)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_engine_refuses_a_model_without_shared_groups_and_tp_mode():
    per_layer = prefetch_test_config(ModelGeometry.tiny(layout="fp8", layers_per_indexer=1))
    space = AddressSpace(per_layer, n_logical=1024)
    with pytest.raises(ConfigError, match="two or more layers"):
        PrefetchEngine(space, PrefetchConfig(sources=SHARED), per_layer.n_groups, 8,
                       space.device)
    shared = prefetch_test_config(ModelGeometry.tiny(layout="fp8", layers_per_indexer=2),
                                  gpu_slots=80, cpu_slots=400, tp_size=2, buffer_slots=160)
    from ulacache.tp import TPAddressSpace

    def build(peers):
        tp = TPAddressSpace(shared, peers, n_logical=1024)
        with pytest.raises(ConfigError, match="needs DP mode"):
            PrefetchEngine(tp, PrefetchConfig(sources=SHARED), shared.n_groups, 8, tp.device)
        return True

    assert all(run_ranks(2, build))


def test_a_call_past_the_call_capacity_moves_every_layer_at_once():
    """A prefill-sized plan through the engine is not deferred (it would need chunks): every
    layer's bytes are in place when it returns, with no replay outstanding."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = prefetch_test_config(geom, call_entries=128)
    space = AddressSpace(cfg, n_logical=1024)
    eng = PrefetchEngine(space, PrefetchConfig(sources=SHARED), cfg.n_groups, 8, space.device)
    space.begin_round()
    space.place(torch.arange(40))
    eng.begin_step()
    space.begin_round()
    eng.round_started()
    eng.stream_log.clear()
    eng.plan(0, (torch.arange(140) % 40).view(2, 70))
    eng.before_load(space.groups[0].layers[1])
    assert eng.stream_log == []
    eng.plan(1, torch.arange(12).view(2, 6))
    eng.before_load(space.groups[1].layers[1])
    assert eng.stream_log == [("replay", 1), ("wait_layer", space.groups[1].layers[1])]
