"""The fused access path (four Triton launches) against the torch reference path.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), so CI checks every
decision: after every operation the mapping, owners, CPU free stack, counters, every PB-LRU
word and count, stamps, returned rows and every pool byte must equal the reference's. GPU-marked
tests repeat it on CUDA, count kernels with ``torch.profiler`` and replay the fused step from a
CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from tests.fused_helpers import DeviceOps, TwinDriver, assert_same, make_twins  # noqa: E402
from ulacache.errors import AddressError, CapacityExhausted, ConfigError, ShapeError  # noqa: E402
from ulacache.group import COUNTERS, SelectionGroup  # noqa: E402
from ulacache.kernels import fused_access  # noqa: E402
from ulacache.tools.traces import load_trace  # noqa: E402

GEOMETRIES = [  # (layers, gpu_slots, cpu_slots, row_bytes, n_buckets)
    (0, 8, 60, 16, 2),     # residency only, tiny pool: overflow everywhere
    (1, 40, 100, 24, 3),   # odd row size (int64 words), 3 buckets
    (2, 64, 300, 7, 4),    # row size not a word multiple (byte copies)
    (3, 130, 200, 656, 8),  # FP8 GLM-5 row, a shared group of three layers, pool > 2 words
]


def test_counter_columns_match_the_group():
    for name, col in fused_access.COUNTER_COLUMNS.items():
        assert COUNTERS[col] == name


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_match_the_reference(seed):
    """Placement rounds fill the GPU pool and spill, then rounds of accesses (int32 and int64
    selections, duplicates, padding, empty rows; hostile entries on some seeds), placements
    and releases: every victim source (free, cold, recent), swaps and single copies, access
    and place overflow, CPU-stack exhaustion."""
    _random_sequence(seed)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_sequences_match_the_reference_across_the_stamps_wrap(seed):
    """PB-LRU's int16 stamps wrap at 2**16 rounds: both paths started 6 rounds before it run
    the same sequence (11 round starts) and agree on every state, stamps included."""
    _random_sequence(seed, start_round=2**16 - 6)


def test_the_compiled_sub_block_size_matches_the_reference_too(monkeypatch):
    """The interpreter runs K3 / G3 with 64-entry sub-blocks (it pays per op); the GPU's 16
    (eight sub-blocks per block) must make the same decisions."""
    assert fused_access.FusedAccess.SUB == (64 if fused_access.INTERPRETED else 16)
    monkeypatch.setattr(fused_access.FusedAccess, "SUB", 16)
    for seed in (3, 6):
        _random_sequence(seed)


def _random_sequence(seed: int, start_round: int = 0) -> None:
    """Seeds 0-3 keep shadows (write-back-free evictions), 4-7 do not: every geometry runs
    both, hostile and not. ``start_round``: both twins' PB-LRU round counter starts there
    (and the epoch counter that far along the ring)."""
    layers, G, C, rb, nb = GEOMETRIES[seed % 4]
    shadows = seed < 4
    ref, fused = make_twins(layers, 300, G, C, rb, nb, shadows=shadows)
    for g in (ref, fused):
        g.policy.round_t.fill_(start_round)
        g.policy.epoch_t.fill_(start_round)
    d = TwinDriver(ref, fused, seed)
    for _ in range(6):
        d.advance()
        d.place(max(4, G // 2), hostile=seed % 2 == 0)
    for r in range(5):
        d.advance()
        d.prefetch(48, cap=(5, 0, 200, 17, 9)[r])  # a capped look-ahead, then the access
        d.access(8, 32, hostile=seed % 3 == 0, dtype=(torch.int32, torch.int64)[r % 2])
        d.access(2, 7, hostile=True)
        d.place(6, hostile=r % 2 == 0)
        if r % 2:
            d.release(10, hostile=seed % 2 == 1)
        ref.check_integrity()
        fused.check_integrity()
    c = ref.counter_values()
    if seed % 4:  # the workload reaches the paths it claims to (tiny pools overflow instead)
        assert c["prefetches"]
        assert c["promotions"] and c["spills"] and c["gpu_hits"] and c["access_overflow"]
        # swaps and single copies
        assert c["writebacks"] and c["promotions"] + c["prefetches"] > c["writebacks"]
        if shadows:  # evictions onto shadows (reclaims: tests/test_shadows.py)
            assert c["remaps"] and c["shadowed"]
        else:  # rows written back a second time
            assert c["rewrites"] and not (c["remaps"] or c["shadowed"] or c["reclaims"])


def test_deep_victim_search_matches_the_reference():
    """A pool of 2,100 slots (34 words, 3 superblocks) with hyper blocks of 2 superblocks:
    free, cold and recent members scattered over every word, superblock and hyper block, so
    victims are found at every level of the fused search (the default hyper = 64 reaches its
    second hyper block only past 64,512 slots)."""
    ref, fused = make_twins(1, 4000, 2100, 1500, 16, 4, hyper=2)
    d = TwinDriver(ref, fused, 17)
    for _ in range(8):
        d.advance()
        d.place(600, hostile=False)
    d.advance()
    d.release(300, hostile=False)  # free slots all over the pool
    d.place(350, hostile=False)    # free slots first, then cold ones, spilled
    for r in range(3):
        d.advance()
        d.access(4, 128, hostile=r == 1)
    c = ref.counter_values()
    assert c["spills"] > 500 and c["promotions"] > 100 and c["writebacks"] > 50
    assert ref.policy.n_hyper == 2
    ref.check_integrity()


def test_placement_when_the_cpu_tier_runs_dry():
    """GPU and CPU tiers fill up; later placements find victims but no CPU slot to spill them
    to (the pop runs dry part-way through a call): those rows are refused, the rest stored."""
    ref, fused = make_twins(2, 200, 16, 20, 16, 2)
    d = TwinDriver(ref, fused, 23)
    for _ in range(7):
        d.advance()
        d.place(9, hostile=False)
    c = ref.counter_values()
    assert c["spills"] == 20 and c["place_overflow"] > 0
    assert c["placed"] - c["spills"] == 16
    ref.check_integrity()


class FusedTwinMachine(RuleBasedStateMachine):
    """Hypothesis chooses the operations (rounds, placements, accesses, releases, hostile or
    not, batch and top-k) on twin groups; every operation compares the two paths in full."""

    @initialize(geometry=st.sampled_from(GEOMETRIES[1:]), seed=st.integers(0, 2**16))
    def setup(self, geometry, seed):
        layers, G, C, rb, nb = geometry
        self.ref, self.fused = make_twins(layers, 300, G, C, rb, nb)
        self.d = TwinDriver(self.ref, self.fused, seed)

    @rule()
    def new_round(self):
        self.d.advance()

    @rule(n=st.integers(1, 40), hostile=st.booleans())
    def place(self, n, hostile):
        self.d.place(n, hostile)

    @rule(bs=st.integers(1, 4), k=st.integers(1, 48), hostile=st.booleans(),
          wide=st.booleans())
    def access(self, bs, k, hostile, wide):
        self.d.access(bs, k, hostile, torch.int64 if wide else torch.int32)

    @rule(n=st.integers(1, 60), cap=st.integers(0, 70))
    def prefetch(self, n, cap):
        self.d.prefetch(n, cap)

    @rule(n=st.integers(1, 12), hostile=st.booleans())
    def release(self, n, hostile):
        self.d.release(n, hostile)

    @invariant()
    def both_intact(self):
        self.ref.check_integrity()
        self.fused.check_integrity()


TestFusedTwinMachine = FusedTwinMachine.TestCase
TestFusedTwinMachine.settings = settings(max_examples=20, stateful_step_count=20, deadline=None)


def test_victims_from_every_source_in_order():
    """Free slots, then cold, then recent buckets oldest first: a pool with all three, one
    access missing more rows than the free slots hold."""
    ref, fused = make_twins(1, 200, 32, 200, 16, 2)
    d = TwinDriver(ref, fused, 11)
    for _ in range(8):  # 8 rounds x 4 rows: epochs turn over, early rows go cold
        d.advance()
        d.place(4, hostile=False)
    d.both(lambda g, a: g.release(a), torch.tensor(sorted(d.live)[:3]))  # 3 free slots
    d.live -= set(sorted(d.live)[:3])
    d.advance()
    d.place(40, hostile=False)  # spills: the oldest rows move to the CPU tier
    d.advance()
    on_cpu = [a for a in sorted(d.live) if int(ref.loc[a]) >= ref.gpu_slots]
    assert len(on_cpu) >= 12
    d.both(lambda g, a: g.access(a), torch.tensor(on_cpu[:12]).view(2, 6))
    c = ref.counter_values()
    assert c["promotions"] == 12 and c["writebacks"] >= 9


def test_real_trace_steps_match_the_reference():
    """Two requests decoding the bundled SmolLM2 trace (layers 0 and 5 as the two requests),
    one new token placed per request and step, a pool of 96 rows for ~700-token contexts."""
    trace = load_trace("tests/fixtures/typing-py-1024-k64.trace.npz")
    start, steps, span = 600, 24, 1024
    ref, fused = make_twins(2, 2 * span, 96, 2 * span, 32, 8)
    d = TwinDriver(ref, fused, 5)
    pos = trace.positions
    first = int(pos[start])
    for lo in range(0, first, 64):  # prefill in rounds of 64 tokens per request
        d.advance()
        batch = torch.cat([torch.arange(lo, min(lo + 64, first)) + r * span for r in (0, 1)])
        slots, _ = d.both(lambda g, a: g.place(a), batch)
        d._write(batch, slots)
    for s in range(start, start + steps):
        d.advance()
        new = torch.tensor([int(pos[s]), int(pos[s]) + span])
        slots, _ = d.both(lambda g, a: g.place(a), new)
        d._write(new, slots)
        sel = torch.from_numpy(trace.selections[[0, 5], s].astype("int64"))
        sel = torch.where(sel >= 0, sel + torch.tensor([[0], [span]]), -1)
        d.both(lambda g, a: g.access(a), sel)
    c = ref.counter_values()
    assert c["promotions"] > 50 and c["gpu_hits"] > c["promotions"]
    ref.check_integrity()


def test_validate_mode_raises_the_same_errors_and_changes_nothing():
    ref, fused = make_twins(1, 100, 8, 100, 16, 2, validate=True)
    d = TwinDriver(ref, fused, 3)
    d.advance()
    d.place(8, hostile=False)
    live = sorted(d.live)
    dead = sorted(set(range(100)) - d.live)
    cases = [
        (lambda g: g.access(torch.tensor([[live[0], 101]])), AddressError),
        (lambda g: g.access(torch.tensor([[live[0], dead[0]]])), AddressError),
        (lambda g: g.place(torch.tensor([dead[0], dead[0]])), AddressError),
        (lambda g: g.place(torch.tensor([live[0]])), AddressError),
        (lambda g: g.place(torch.tensor(dead[:20])), CapacityExhausted),
    ]
    d.advance()
    for fn, err in cases:
        for g in (ref, fused):
            with pytest.raises(err):
                fn(g)
        assert_same(ref, fused, f"after {err.__name__}")
    d.both(lambda g, a: g.access(a), torch.tensor([live[:4]]))


def test_fused_path_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="PB-LRU"):
        SelectionGroup([0], 10, 4, 4, 16, "cpu", "lru", access_path="fused")
    with pytest.raises(ConfigError, match="access_path"):
        SelectionGroup([0], 10, 4, 4, 16, "cpu", access_path="triton")
    assert SelectionGroup([0], 10, 4, 4, 16, "cpu").fused is None  # auto: torch on CPU
    assert SelectionGroup([0], 10, 4, 4, 16, "cpu", "lru").fused is None


@pytest.mark.parametrize("shape", [(1, 64), (8, 32), (3, 300)])
def test_one_access_is_four_launches_and_nothing_else(shape):
    """Through the dispatch layer: one access (and one placement, whose first launch also
    reclaims shadows) of the fused path issues exactly four kernel launches and no other
    device op, whatever the batch and top-k."""
    _, fused = make_twins(2, 2000, 256, 2000, 32, 4)
    fused.place(torch.arange(1500))
    fused.policy.advance()
    addrs = torch.randint(0, 1500, shape)
    out = torch.empty(shape, dtype=torch.int32)
    fused.access(addrs, out)
    fused.policy.advance()
    before = fused_access.launch_count()
    with DeviceOps() as mode:
        fused.access(addrs, out)
    assert fused_access.launch_count() - before == fused_access.LAUNCHES_PER_CALL == 4
    assert mode.ops == [], f"device ops outside the fused launches: {mode.ops}"
    before = fused_access.launch_count()
    new = torch.arange(1500, 1500 + shape[1])
    with DeviceOps() as mode:
        fused.place(new)
    assert fused_access.launch_count() - before == 4
    assert mode.ops == [], f"device ops outside the fused launches: {mode.ops}"


def test_scratch_is_allocated_once_and_larger_calls_run_in_chunks():
    """The fused scratch is allocated at construction for ``max_call`` entries and never
    replaced (a captured decode graph keeps valid pointers after a larger eager prefill);
    place / access / release calls larger than it run in chunks in the same round, on both
    paths alike, and every selected row is resident with its own bytes afterwards."""
    ref, fused = make_twins(1, 900, 160, 900, 16, 4, max_call=128)
    scratch = fused.fused.shared_scratch
    assert scratch.cap == 128 and fused.fused_release.shared_scratch is scratch
    ptrs = [t.data_ptr() for t in scratch.tensors]
    d = TwinDriver(ref, fused, 4)
    for n in (300, 60, 250):  # placements over the chunk size (and below it)
        d.advance()
        d.place(n, hostile=False)
    for bs, k in [(1, 5), (3, 100), (1, 7), (2, 150), (1, 129)]:
        d.advance()
        d.access(bs, k, hostile=False)
    d.advance()
    d.release(200, hostile=True)
    assert [t.data_ptr() for t in scratch.tensors] == ptrs  # never replaced
    assert all(t.numel() in (128, 3) for t in scratch.tensors)  # 3: per-block counts
    # a chunked access serves every selection from a resident row holding its bytes
    live = torch.tensor(sorted(d.live))
    addrs = live[torch.randperm(live.numel(), generator=torch.Generator().manual_seed(1))
                 [:140]].view(1, -1)
    d.advance()
    for g, rows in zip((ref, fused), d.both(lambda g, a: g.access(a), addrs)):
        assert (rows >= 0).all()
        assert torch.equal(g.pools.gpu[0, rows.view(-1).long()], g.read(0, addrs.view(-1)))
        g.check_integrity()
    with pytest.raises(ShapeError, match="exceeds its scratch"):
        scratch.get(129)


def test_translate_kernel_matches_the_group_translate():
    ref, fused = make_twins(1, 300, 32, 300, 16, 4)
    d = TwinDriver(ref, fused, 9)
    for _ in range(4):
        d.advance()
        d.place(20, hostile=False)
    addrs = torch.tensor([[-1, 0, 5, 299, 17, 40], [3, 3, 2, 1, 0, 250]])
    out = torch.empty(addrs.shape, dtype=torch.int32)
    got = fused_access.translate(fused.loc, addrs.reshape(-1), out.view(-1), 300, 32, 64)
    want = ref.translate(addrs)
    assert torch.equal(got.view(addrs.shape), torch.where(want >= 0, want + 64, -1))


# -- CUDA ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_cuda_random_sequences_match_the_reference(seed):
    layers, G, C, rb, nb = GEOMETRIES[seed % 4]
    ref, fused = make_twins(layers, 3000, G * 8, C * 8, rb, nb, device="cuda")
    from ulacache.kernels.pinned import is_registered

    for g in (ref, fused):  # the CPU free stack: host memory, addressed from the device
        assert g.pools.cpu_free.is_cuda and is_registered(g.pools.cpu_free_host)
        assert g.pools.cpu_free.data_ptr() == g.pools.cpu_free_host.data_ptr()
    d = TwinDriver(ref, fused, seed)
    for _ in range(6):
        d.advance()
        d.place(G * 4, hostile=seed % 2 == 0)
    for r in range(6):
        d.advance()
        d.access(64, 256, hostile=seed % 3 == 0, dtype=(torch.int32, torch.int64)[r % 2])
        d.place(40, hostile=r % 2 == 0)
        if r % 2:
            d.release(30, hostile=False)
    ref.check_integrity()
    fused.check_integrity()


@pytest.mark.gpu
def test_cuda_profiler_counts_four_kernels():
    _, fused = make_twins(2, 1 << 16, 4096, 1 << 16, 656, 64, device="cuda")
    fused.place(torch.arange(40000, device="cuda"))
    fused.policy.advance()
    addrs = torch.randint(0, 40000, (8, 2048), device="cuda")
    out = torch.empty(addrs.shape, dtype=torch.int32, device="cuda")
    fused.access(addrs, out)
    fused.policy.advance()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused.access(addrs, out)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 4, [e.name for e in kernels]


@pytest.mark.gpu
def test_cuda_graph_replay_matches_the_reference():
    """The fused step captured once in a CUDA graph, replayed on fresh selections (copied into
    the captured input) across rounds, against the reference run eagerly."""
    ref, fused = make_twins(2, 1 << 14, 1024, 1 << 14, 656, 16, device="cuda")
    d = TwinDriver(ref, fused, 21)
    for _ in range(8):
        d.advance()
        d.place(1200, hostile=False)
    live = torch.tensor(sorted(d.live), device="cuda")
    addrs = torch.empty(16, 256, dtype=torch.int64, device="cuda")
    out = torch.empty(16, 256, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw():
        return live[torch.randint(0, live.numel(), (16, 256), device="cuda", generator=gen)]

    addrs.copy_(draw())
    fused.access(addrs, out)  # warm-up: compile, scratch
    ref.access(addrs)
    d.advance()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fused.access(addrs, out)
    for _ in range(6):
        d.advance()
        addrs.copy_(draw())
        graph.replay()
        want = ref.access(addrs)
        assert torch.equal(out, want)
        assert_same(ref, fused, "graph replay")
