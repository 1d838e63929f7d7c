"""Look-ahead prefetch (:mod:`ulacache.prefetch`): a hint that never changes an output, never
evicts a row pinned this round, spends at most its budget, admits its rows at the lowest
recency, and whose waits are layer-local."""

from __future__ import annotations

import pytest
import torch

from ulacache.config import PrefetchConfig, UlaCacheConfig
from ulacache.errors import ConfigError, ShapeError
from ulacache.group import SelectionGroup
from ulacache.ipc import run_ranks
from ulacache.oracle.driver import run_equality
from ulacache.oracle.refmodel import ModelGeometry
from ulacache.prefetch import PrefetchEngine, rank_order
from ulacache.space import AddressSpace

from .helpers import logged_decode_step, prefetch_test_config, random_drafts

PREV = ("previous_layer",)


PROMPTS = [150, 90, 40, 120]


SOURCE_SETS = [PREV, ("draft",), ("draft", "previous_layer")]


@pytest.mark.parametrize("validate", [True, False], ids=["checks-on", "production"])
@pytest.mark.parametrize("layers_per_indexer", [1, 2], ids=["per-layer", "shared"])
@pytest.mark.parametrize("sources", SOURCE_SETS, ids="+".join)
def test_dp_decoding_is_identical_with_prefetch_on_off_and_capped(sources, layers_per_indexer,
                                                                   validate):
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=layers_per_indexer)
    cfg = prefetch_test_config(geom, validate=validate)
    off = run_equality(geom, cfg, PROMPTS, n_steps=16)
    assert off.identical and "prefetches" in off.moved_per_step
    assert sum(off.moved_per_step["prefetches"]) == 0
    # groups that get a prediction each step: group 0 has no previous layer
    predicted = geom.n_groups - (0 if "draft" in sources else 1)
    for cap, want in ((100_000, "many"), (7, "capped"), (0, "none")):
        rep = run_equality(geom, cfg, PROMPTS, n_steps=16, draft_hint=random_drafts(cfg),
                           prefetch=PrefetchConfig(sources=sources, fetch_cap=cap))
        assert rep.identical, (cap, rep.mismatches[:5])
        per_step = rep.moved_per_step["prefetches"]
        if want == "none":
            assert sum(per_step) == 0
        else:
            assert sum(per_step) > 0
            assert all(p <= cap * predicted for p in per_step)  # the cap binds per group
        for k in ("access_overflow", "place_overflow", "invalid"):
            assert sum(rep.moved_per_step[k]) == 0, k


@pytest.mark.parametrize("sources", [PREV, ("previous_layer", "draft")], ids="+".join)
@pytest.mark.parametrize("cap", [100_000, 5])
def test_tp_decoding_is_identical_with_prefetch(cap, sources):
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=1)
    cfg = prefetch_test_config(geom, gpu_slots=80, cpu_slots=400, tp_size=2, buffer_slots=160)
    pf = PrefetchConfig(sources=sources, fetch_cap=cap)
    predicted = geom.n_groups - (0 if "draft" in sources else 1)
    reports = run_ranks(2, lambda peers: run_equality(
        geom, cfg, PROMPTS, 12, peers=peers, prefetch=pf, draft_hint=random_drafts(cfg)))
    for rep in reports:
        assert rep.identical, rep.mismatches[:5]
        assert 0 < sum(rep.moved_per_step["prefetches"]) <= 12 * cap * predicted
        assert sum(rep.moved_per_step["peer_fetches"]) > 0


def test_waits_are_layer_local_and_a_step_fences_every_prefetch():
    """The engine's stream log of a decode: each step starts with a fence (the round start
    advances every policy), each group's access waits for its own group only, and the
    previous-layer source prefetches group g + 1 right after group g's selection."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=1)
    _, log = logged_decode_step(geom, prefetch_test_config(geom),
                                PrefetchConfig(sources=PREV))
    G = geom.n_groups
    want = [("fence", -1)]  # group 0: no previous layer, no prefetch, nothing to wait for
    for g in range(1, G):
        want += [("prefetch", g), ("wait", g)]
    assert log == want


def _group(path: str = "torch", G: int = 8, C: int = 64, policy: str = "pblru",
           max_call: int | None = None) -> SelectionGroup:
    return SelectionGroup([0], 64, G, C, 8, "cpu", policy, n_buckets=2, validate=False,
                          access_path=path, max_call=max_call)


def _budget(n: int) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int64)


def _fill(g: SelectionGroup, n: int) -> None:
    """Place addresses 0..n-1 a GPU pool's worth per round (the rest spill)."""
    for a in range(0, n, g.gpu_slots):
        g.policy.advance()
        g.place(torch.arange(a, min(n, a + g.gpu_slots)))
    g.policy.advance()


def _paths() -> list[str]:
    try:
        from ulacache.kernels import fused_access
    except ImportError:  # pragma: no cover
        return ["torch"]
    return ["torch", "fused"] if fused_access.available() and fused_access.INTERPRETED \
        else ["torch"]


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("policy", ["pblru", "lru"])
def test_a_prefetch_never_evicts_a_row_pinned_this_round(path, policy):
    if path == "fused" and policy == "lru":
        pytest.skip("the fused path implements PB-LRU")
    g = _group(path, policy=policy)
    _fill(g, 40)  # 8 on the GPU, 32 on the CPU
    gpu_now = [a for a in range(40) if 0 <= int(g.loc[a]) < 8]
    pinned = gpu_now[:5]
    g.access(torch.tensor([pinned]))  # pins 5 of the 8 slots this round
    slots = g.loc[pinned].clone()
    cpu_rows = [a for a in range(40) if int(g.loc[a]) >= 8]
    budget = _budget(100)
    g.prefetch(torch.tensor(cpu_rows), budget)
    assert torch.equal(g.loc[pinned], slots), "a pinned row was evicted by a prefetch"
    assert int(budget) == 100 - 3  # only the 3 unpinned slots could take a row
    assert g.counter_values()["prefetches"] == 3
    assert all(0 <= int(g.loc[a]) < 8 for a in cpu_rows[:3])  # rank order: the first three
    g.check_integrity()


@pytest.mark.parametrize("path", _paths())
def test_budget_is_spent_in_rank_order_and_predictions_past_a_call_are_dropped(path):
    g = _group(path, G=16, C=64, max_call=8)
    _fill(g, 60)
    cpu_rows = [a for a in range(60) if int(g.loc[a]) >= 16]
    pred = torch.tensor([-1, 99, cpu_rows[0], cpu_rows[0], *cpu_rows[1:10]])  # pad, bad, dup
    budget = _budget(3)
    g.prefetch(pred, budget)
    assert int(budget) == 0
    assert [a for a in cpu_rows[:10] if int(g.loc[a]) < 16] == cpu_rows[:3]
    c = g.counter_values()
    assert c["prefetches"] == 3 and c["invalid"] == 0 and c["promotions"] == 0
    g.prefetch(torch.tensor(cpu_rows[6:]), budget)  # spent: nothing more this step
    assert g.counter_values()["prefetches"] == 3
    budget = _budget(100)  # a call takes the first max_call = 8 entries: c3, c4 are new
    g.prefetch(pred, budget)
    assert int(budget) == 100 - 2 and g.counter_values()["prefetches"] == 5
    assert all(int(g.loc[a]) < 16 for a in cpu_rows[3:5])
    assert all(int(g.loc[a]) >= 16 for a in cpu_rows[5:10])
    g.check_integrity()


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("policy", ["pblru", "lru"])
def test_prefetched_rows_are_the_next_victims_unless_selected(path, policy):
    """Admitted at the lowest recency: a wrong guess is evicted before any row the pool chose
    to keep, a right one is touched by the access and stays."""
    if path == "fused" and policy == "lru":
        pytest.skip("the fused path implements PB-LRU")
    g = _group(path, policy=policy)
    _fill(g, 40)
    g.policy.advance()
    on_gpu = [a for a in range(40) if 0 <= int(g.loc[a]) < 8]
    g.access(torch.tensor([on_gpu]))  # every GPU row recently selected
    g.policy.advance()
    cpu_rows = [a for a in range(40) if int(g.loc[a]) >= 8]
    right, wrong = cpu_rows[0], cpu_rows[1]
    g.prefetch(torch.tensor([right, wrong]), _budget(2))
    g.policy.advance()
    # the access selects the right guess and one more CPU row: that row's victim is the wrong
    # guess, not one of the recently selected rows
    g.access(torch.tensor([[right, cpu_rows[2]]]))
    assert int(g.loc[wrong]) >= 8, "the wrong guess should have been the victim"
    assert 0 <= int(g.loc[right]) < 8 and 0 <= int(g.loc[cpu_rows[2]]) < 8
    kept = sum(0 <= int(g.loc[a]) < 8 for a in on_gpu)
    assert kept == 6  # 8 recent rows, two displaced by the two prefetched rows, none more
    c = g.counter_values()
    assert c["prefetches"] == 2 and c["promotions"] == 1
    g.check_integrity()


def test_prefetch_inputs_are_checked_by_metadata_only():
    g = _group()
    with pytest.raises(ShapeError):
        g.prefetch(torch.tensor([1.0]), _budget(1))
    with pytest.raises(ShapeError):
        g.prefetch(torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ShapeError):
        g.prefetch(torch.tensor([1]), torch.tensor(1, dtype=torch.int32))


def test_engine_config_and_link_budget():
    assert PrefetchConfig().enabled is False
    cfg = PrefetchConfig(sources=PREV, fetch_cap=1000, link_gbps=50.0, step_ms=20.0)
    # 50 GB/s x 20 ms = 1 GB per step over 78 groups of 656 B rows
    assert cfg.rows_per_group(656, 78) == 1000
    assert PrefetchConfig(sources=PREV, fetch_cap=10**6, link_gbps=1.0, step_ms=1.0) \
        .rows_per_group(656, 78) == int(1e6 // (78 * 656))
    with pytest.raises(ConfigError, match="go together"):
        PrefetchConfig(sources=PREV, link_gbps=1.0)
    with pytest.raises(ConfigError, match="twice"):
        PrefetchConfig(sources=("draft", "draft"))
    from ulacache.config import SGLangOptions

    opts = SGLangOptions.from_json('{"prefetch": {"sources": ["previous_layer", "draft"]}}')
    assert opts.prefetch.sources == ("previous_layer", "draft")
    with pytest.raises(ConfigError):
        SGLangOptions.from_json('{"prefetch": {"sources": ["ngram"]}}')
    assert SGLangOptions.from_json('{"prefetch": {"fetch_cap": 8}}').prefetch.fetch_cap == 8
    space = AddressSpace(UlaCacheConfig(layout="tiny", row_bytes=8, n_layers=2, gpu_slots=8,
                                        cpu_slots=8, page_size=1), n_logical=16)
    with pytest.raises(ConfigError, match="at least one"):
        PrefetchEngine(space, PrefetchConfig(), 2, 8, space.device)
    eng = PrefetchEngine(space, PrefetchConfig(sources=("draft",), fetch_cap=3), 2, 8,
                         space.device)
    eng.begin_step()
    space.begin_round()
    eng.round_started()
    assert eng.budgets.tolist() == [3, 3]
    eng.selected(0, torch.tensor([[1, 2]]))  # the draft source predicts nothing from this
    eng.draft_selected(1, torch.tensor([[1, 2]]))  # ... but the same group's next step
    assert [op for op, _ in eng.stream_log] == ["fence"]
    eng.begin_step()
    space.begin_round()
    eng.round_started()
    assert eng.stream_log[-2:] == [("fence", -1), ("prefetch", 1)]
    with pytest.raises(ShapeError):
        eng.selected(0, torch.tensor([1, 2]))


def test_rank_order_interleaves_requests():
    sel = torch.tensor([[1, 2, 3], [4, 5, -1]])
    assert rank_order(sel).tolist() == [1, 4, 2, 5, 3, -1]


@pytest.mark.gpu
def test_cuda_access_waits_only_for_its_own_groups_prefetch():
    """On a GPU: a slow prefetch of group 1 (a spin kernel queued on the prefetch stream
    before it) does not delay group 0's access, which waits on group 0's event only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    space = AddressSpace(UlaCacheConfig(layout="tiny", row_bytes=64, n_layers=2, gpu_slots=64,
                                        cpu_slots=256, page_size=1, validate=False),
                         dev, n_logical=512)
    for a in range(0, 300, 64):
        space.begin_round()
        space.place(torch.arange(a, min(300, a + 64), device=dev))
    eng = PrefetchEngine(space, PrefetchConfig(sources=PREV), 2, 128, dev)
    eng.begin_step()
    space.begin_round()
    eng.round_started()
    with torch.cuda.stream(eng.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the prefetch stream
    eng.issue(1, torch.arange(0, 64, device=dev))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    eng.before_access(0)
    space.access(0, torch.arange(100, 140, device=dev).view(1, -1))
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) < 50.0, "group 0 waited for group 1's prefetch"
    eng.before_access(1)
    torch.cuda.synchronize()
    space.check_integrity()


def test_replay_with_an_exact_draft_cuts_misses_without_extra_transfers():
    """The bundled trace with the draft source fed the true next step's selections (a draft
    always accepted): most critical-path misses go, and (prefetches issued after the step's
    placements, whose victims would otherwise be the cold prefetched rows) nothing is fetched
    twice: every prefetched row is used and H2D rows stay those of the run without."""
    import dataclasses

    import numpy as np

    from ulacache.tools.cli import bundled_trace
    from ulacache.tools.replay import replay
    from ulacache.tools.traces import load_trace

    trace = load_trace(bundled_trace())
    sel = trace.selections
    exact = dataclasses.replace(trace, draft_selections=np.concatenate(
        [sel[:, 1:], np.full_like(sel[:, :1], -1)], axis=1))
    kw = dict(requests=4, steps=32, layers=[0, 5, 10, 15], gpu_slots=1024)
    off = replay(trace, **kw)
    on = replay(exact, prefetch=PrefetchConfig(sources=("draft",)), **kw)
    assert on.critical_path_misses <= 0.4 * off.critical_path_misses
    assert on.prefetched_used == on.prefetched_rows > 0
    assert on.h2d_rows <= 1.01 * off.h2d_rows
    with pytest.raises(ValueError, match="draft selections"):
        replay(dataclasses.replace(trace, draft_selections=None),
               prefetch=PrefetchConfig(sources=("draft",)), **kw)
