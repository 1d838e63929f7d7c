"""The look-ahead prefetch on a GPU (:mod:`ulacache.prefetch`): a decode step's per-group
sequence with previous-layer prefetches on the engine's side stream, captured in a CUDA graph
and replayed, leaves exactly what the same calls made eagerly leave; and no call of a step with
prefetch synchronises the host.

The step the graph holds, per group ``g``: ``plan(g, sel)`` (the caller's stream waits for
group ``g``'s prefetch event, the access, and the previous-layer source issues group ``g + 1``'s
prefetch on the side stream: a fork of the capture, recorded into group ``g + 1``'s event and
joined by the next plan; with ``shared_groups`` the access moves the anchor layer's bytes and
the other layer's are replayed on the side stream, joined by that layer's ``before_load``).
``begin_step``, the round start, the step's placements and ``round_started`` stay eager,
outside the graph, as a serving engine runs its scheduler between decode graphs.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from ulacache.config import PrefetchConfig, UlaCacheConfig
from ulacache.group import COUNTERS
from ulacache.prefetch import PrefetchEngine
from ulacache.space import AddressSpace

from .helpers import row_bytes_for

pytestmark = pytest.mark.gpu

# the geometry of tests/test_gpu_decode_graph.py (FP8 rows, two layers per group, 512 GPU slots,
# 4 buckets), so most fused-kernel variants are already compiled when this file runs
N_LAYERS, PER_GROUP, GPU, CPU, BUCKETS = 8, 2, 512, 4096, 4
N_GROUPS = N_LAYERS // PER_GROUP
BS, K, CAP = 4, 96, 24  # a step: 4 requests x top-96 per group; 24 prefetched rows per group
N_FILL, N_LOGICAL = 2000, 2400
RB = 656
PREF = COUNTERS.index("prefetches")


def _need(path: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ulacache.kernels import cuda_rows, fused_access

    if path == "fused" and not fused_access.available():
        pytest.skip("Triton is not installed")
    if path == "torch" and not cuda_rows.kernels_available():
        pytest.skip("no CUDA row-kernel backend: the torch path's reference copies synchronise")


SOURCE_SETS = pytest.mark.parametrize(
    "sources", [("previous_layer",), ("previous_layer", "shared_groups")], ids="+".join)


def _twin(path: str, sources: tuple[str, ...]) -> tuple[AddressSpace, PrefetchEngine]:
    """An address space filled with ``N_FILL`` identifiable rows (the last ``GPU`` placed on the
    GPU, the rest spilled) and its engine (``sources``, ``CAP`` rows per group)."""
    cfg = UlaCacheConfig(layout="fp8", n_layers=N_LAYERS, layers_per_group=PER_GROUP,
                         gpu_slots=GPU, cpu_slots=CPU, n_buckets=BUCKETS, validate=False,
                         access_path=path)
    space = AddressSpace(cfg, "cuda", n_logical=N_LOGICAL)
    for lo in range(0, N_FILL, 256):
        space.begin_round()
        _place(space, torch.arange(lo, min(N_FILL, lo + 256)))
    eng = PrefetchEngine(space, PrefetchConfig(sources=sources, fetch_cap=CAP),
                         cfg.n_groups, RB * PER_GROUP, space.device)
    return space, eng


def _place(space: AddressSpace, addrs: torch.Tensor) -> None:
    space.place(addrs.cuda())
    for layer in range(N_LAYERS):
        space.write(layer, addrs.cuda(), row_bytes_for(addrs, layer, 0, RB).cuda())


def _begin(space: AddressSpace, eng: PrefetchEngine, new: torch.Tensor) -> None:
    """The eager part of a step, in the engine's order: fence and budgets, the round start,
    the step's new tokens, then the prefetches that need no selection (none here)."""
    eng.begin_step()
    space.begin_round()
    _place(space, new)
    eng.round_started()


def _step(space: AddressSpace, eng: PrefetchEngine, sels: list[torch.Tensor],
          outs: list[torch.Tensor]) -> None:
    """The per-group sequence of a decode step (what the graph captures): the group's plan
    through the engine (its prefetch joined, the access, the next group's prefetch issued;
    shared_groups: the anchor's bytes, the other layer's replayed on the side stream), then
    each layer's own wait before it would read."""
    for g in range(N_GROUPS):
        eng.plan(g, sels[g], out=outs[g])
        for layer in space.groups[g].layers:
            eng.before_load(layer)


def _draw(gen: torch.Generator, n_live: int) -> list[torch.Tensor]:
    """Selections ``int64 [BS, K]`` per group: group 0 uniform over the live addresses, each
    later group keeping half of the previous group's entries (so previous-layer predictions
    are half right), ~10% padding."""
    sels, prev = [], None
    for _ in range(N_GROUPS):
        fresh = torch.randperm(n_live, generator=gen)[: BS * K]
        sel = fresh if prev is None else torch.where(
            torch.rand(BS * K, generator=gen) < 0.5, prev, fresh)
        sel = torch.where(torch.rand(BS * K, generator=gen) < 0.1, -1, sel)
        sels.append(sel.view(BS, K))
        prev = sel
    return sels


def _tables(space: AddressSpace) -> list[dict[str, torch.Tensor]]:
    from ulacache.kernels.fused_access import equivalence_state

    return [{k: v.clone() for k, v in equivalence_state(g, pools=False).items()}
            for g in space.groups]


def _assert_same(a: AddressSpace, b: AddressSpace, outs_a, outs_b, what: str) -> None:
    torch.cuda.synchronize()
    for g in range(N_GROUPS):
        assert torch.equal(outs_a[g], outs_b[g]), f"{what}: group {g}'s rows differ"
    for g, (ta, tb) in enumerate(zip(_tables(a), _tables(b))):
        for name in ta:
            assert torch.equal(ta[name], tb[name]), f"{what}: group {g}'s {name} differs"


def _assert_rows(space: AddressSpace, n_live: int, sels, outs, what: str) -> None:
    """Every live address reads its own bytes (whichever tier holds it), and the rows the
    access returned hold the selected addresses' bytes."""
    live = torch.arange(n_live)
    for layer in range(N_LAYERS):
        want = row_bytes_for(live, layer, 0, RB)
        assert torch.equal(space.read(layer, live.cuda()).cpu(), want), f"{what}: layer {layer}"
        g = layer // PER_GROUP
        sel, rows = sels[g].reshape(-1), outs[g].reshape(-1).cpu().long()
        keep = sel >= 0
        got = space.gpu_rows(layer)[rows[keep].cuda()].cpu()
        assert torch.equal(got, want[sel[keep]]), f"{what}: layer {layer}'s accessed rows"


@SOURCE_SETS
@pytest.mark.parametrize("path", ["fused", "torch"])
def test_a_captured_step_with_prefetch_replays_like_the_eager_step(path, sources):
    """Three eager steps (every kernel compiled), then one step captured and replayed each
    step, against an eager twin fed the same placements and selections: identical rows
    returned, tables, counters, policy state and budgets after every step, and the bytes of
    every live row. Each step after a replay starts eagerly (``begin_step``): its fence must not
    wait on an event last recorded inside the capture (an uncaptured stream must not; the
    graph joined its prefetches itself)."""
    _need(path)
    (a, eng_a), (b, eng_b) = _twin(path, sources), _twin(path, sources)
    dev = torch.device("cuda")
    static = [torch.full((BS, K), -1, dtype=torch.int64, device=dev) for _ in range(N_GROUPS)]
    outs_a = [torch.empty(BS, K, dtype=torch.int32, device=dev) for _ in range(N_GROUPS)]
    outs_b = [torch.empty(BS, K, dtype=torch.int32, device=dev) for _ in range(N_GROUPS)]
    gen = torch.Generator().manual_seed(0)
    n_live, warm, steps, graph = N_FILL, 3, 12, None
    prefetched_before_capture = None
    for step in range(steps):
        new = torch.arange(n_live, n_live + BS)
        n_live += BS
        _begin(a, eng_a, new)
        _begin(b, eng_b, new)
        sels = _draw(gen, n_live)
        for s, t in zip(static, sels):
            s.copy_(t)
        if step < warm:  # eager on both: compiles every kernel before the capture
            _step(a, eng_a, static, outs_a)
        else:
            if graph is None:
                torch.cuda.synchronize()
                prefetched_before_capture = int(a.counter_table[:, PREF].sum())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _step(a, eng_a, static, outs_a)
            graph.replay()  # capture runs nothing: the replay is this step's work
        _step(b, eng_b, [t.cuda() for t in sels], outs_b)
        _assert_same(a, b, outs_a, outs_b, f"step {step} ({'eager' if step < warm else 'graph'})")
        assert torch.equal(eng_a.budgets, eng_b.budgets), f"step {step}: budgets differ"
        if step in (warm, steps - 1):
            _assert_rows(a, n_live, sels, outs_a, f"step {step}")
    prefetched = int(a.counter_table[:, PREF].sum()) - prefetched_before_capture
    assert prefetched > 0, "the replayed steps prefetched nothing"
    assert int(a.counter_table[0, PREF]) == 0  # group 0 has no previous layer
    a.check_integrity()
    b.check_integrity()


@SOURCE_SETS
@pytest.mark.parametrize("path", ["fused", "torch"])
def test_a_decode_step_with_prefetch_never_synchronises_the_host(path, sources):
    """``begin_step``, ``round_started`` and every group's ``before_access``, ``access``
    (validate off) and ``selected`` (which issues the next group's prefetch on the side
    stream) under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising op raises.
    The round start and the placements run between them, outside the check."""
    _need(path)
    space, eng = _twin(path, sources)
    dev = torch.device("cuda")
    outs = [torch.empty(BS, K, dtype=torch.int32, device=dev) for _ in range(N_GROUPS)]
    gen = torch.Generator().manual_seed(2)
    n_live = N_FILL
    for step in range(5):
        new = torch.arange(n_live, n_live + BS)
        n_live += BS
        sels = [s.cuda() for s in _draw(gen, n_live)]
        checked = step >= 2  # two eager steps first: kernels compiled, scratch allocated
        torch.cuda.synchronize()
        before = int(space.counter_table[:, PREF].sum())
        with _sync_errors(checked):
            eng.begin_step()
        space.begin_round()
        _place(space, new)
        with _sync_errors(checked):
            eng.round_started()
            _step(space, eng, sels, outs)
        torch.cuda.synchronize()
        assert int(space.counter_table[:, PREF].sum()) > before, f"step {step} prefetched nothing"
    space.check_integrity()


@contextmanager
def _sync_errors(on: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` inside (when ``on``): a synchronising op
    raises."""
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
