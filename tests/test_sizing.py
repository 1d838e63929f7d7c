"""Device bytes of ulacache's own tables (``ulacache.sizing.table_bytes``): what engines charge
for them (the SGLang sizing hook) and what the core's start-up check refuses against.

The formula is checked against real objects: an :class:`AddressSpace` (and a TP rank's
:class:`TPAddressSpace`, ranks as threads) is built for several geometries and every tensor
storage it owns, except the row pools, is summed (``helpers.device_table_bytes``). The formula
must be >= that sum and exceed it by at most the stated slack: under 1 B per slot (the per-slot
sum is rounded up once) plus, per replacement policy, one superblock of words per bucket row
and one entry of each count level (``rows x 204`` B; PB-LRU's word rounding is bounded from
above), plus the CUDA peer pointer tables in TP mode (not allocated on CPU). Forgetting a table
(the claim table is ``4 x ratio`` B per slot) or sizing one by ``ratio`` instead of ``ratio -
1`` (the CPU free stack: ``4`` B per slot per group) breaks one bound or the other. From 5,000
slots up the bound is within 1% of the allocation (issue 21: exact, or a gap <= 1%).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from ulacache.config import UlaCacheConfig
from ulacache.errors import CapacityExhausted, ConfigError
from ulacache.ipc import run_ranks
from ulacache.sizing import Affine, host_table_bytes, table_bytes, table_bytes_per_slot
from ulacache.space import AddressSpace
from ulacache.tp import TPAddressSpace

from .helpers import device_table_bytes

PAGE = 64


def slack(x: int, policies: int, n_buckets: int, policy: str, extra: int = 0) -> int:
    """The most the formula may exceed the allocation by (see the module docstring)."""
    rows = n_buckets + 3 if policy == "pblru" else 0
    return x + policies * rows * 204 + extra + 1


# (gpu slots, ratio, n_buckets, layers, layers per group, policy): superblock edges (1008 slots),
# ratio 1 (no CPU tier), exact LRU, many buckets, a pool past one hyper block (64512 slots)
GEOMETRIES = [(64, 5, 4, 4, 1, "pblru"), (1000, 2, 64, 2, 2, "pblru"),
              (1008, 3, 8, 3, 1, "pblru"), (1009, 3, 8, 3, 1, "pblru"),
              (5000, 1, 2, 3, 1, "lru"), (70_000, 5, 64, 2, 1, "pblru"),
              (777, 4, 4096, 1, 1, "pblru")]


def _path(path: str, policy: str = "pblru") -> bool:
    """Whether ``path`` allocates the fused scratch (skips without Triton; exact LRU has no
    fused path)."""
    if path == "fused":
        if policy != "pblru":
            pytest.skip("exact LRU has no fused path")
        pytest.importorskip("triton")
    return path == "fused"


# torch: the reference path allocates no per-call scratch (table_bytes(call_scratch=False));
# fused: the scratch is allocated once at construction and charged (call_scratch=True)
PATHS = pytest.mark.parametrize("path", ["torch", "fused"])


@PATHS
@pytest.mark.parametrize(("G", "ratio", "nb", "L", "lpg", "policy"), GEOMETRIES)
def test_dp_formula_bounds_the_allocated_tables(G, ratio, nb, L, lpg, policy, path):
    fused = _path(path, policy)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=1, n_layers=L, layers_per_group=lpg,
                         gpu_slots=G, cpu_slots=(ratio - 1) * G, n_buckets=nb, policy=policy,
                         page_size=PAGE, access_path=path)
    space = AddressSpace(cfg, n_logical=ratio * G + PAGE)
    rows = [t for g in space.groups for t in (g.pools.gpu, g.pools.cpu, g.pools.cpu_free_host)]
    parts = device_table_bytes(space, rows)
    real = sum(parts.values())
    per, fixed = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=nb,
                                      policy=policy, call_scratch=fused)
    bound = per * G + fixed
    extra = 128 * 28 + 16 if fused else 0  # the scratch's block rounding, bounded from above
    assert real <= bound <= real + slack(G, cfg.n_groups, nb, policy, extra), (bound, real,
                                                                              parts)
    # the CPU free stacks are host memory, charged there exactly
    host = sum(g.pools.cpu_free_host.untyped_storage().nbytes() for g in space.groups)
    assert host == host_table_bytes(cfg.n_groups, cfg.cpu_slots)
    assert all(g.pools.cpu_free.data_ptr() == g.pools.cpu_free_host.data_ptr()
               for g in space.groups)
    if G >= 5000:  # the constant slack (policy rounding) is amortised: within 1%
        assert bound - real <= 0.01 * real, (bound, real)
    # the same function with the sizes as constants gives the same bound (no per-slot part)
    assert table_bytes(cfg.n_groups, n_logical=ratio * G + PAGE, gpu_slots=G,
                       n_buckets=nb, policy=policy,
                       call_scratch=fused)[1] <= bound
    # every table the formula names was found (a walker that missed the pools' stacks' heights
    # or the policy would make the bound look loose, not wrong); the free stacks are not
    # device tables (host memory, above)
    names = {path.rsplit(".", 1)[-1] for path in parts}
    assert {"loc", "gpu_owner", "shadow", "cpu_top", "claim_table", "counter_table"} <= names
    assert not names & {"cpu_free", "cpu_free_host"}


@pytest.mark.parametrize(("P", "N", "ratio", "nb", "L", "lpg", "B"),
                         [(2, 1024, 5, 4, 4, 1, 300), (4, 4096, 3, 64, 4, 2, 5000),
                          (2, 2048, 1, 8, 2, 1, 64)])
@PATHS
def test_tp_formula_bounds_a_ranks_tables(P, N, ratio, nb, L, lpg, B, path):
    """``x`` is the group's global GPU token count ``N``; each rank's own tables are over its
    stripe, its buffers' maps over every global address."""
    fused = _path(path)
    G = N // P
    cfg = UlaCacheConfig(layout="tiny", row_bytes=1, n_layers=L, layers_per_group=lpg,
                         gpu_slots=G, cpu_slots=(ratio - 1) * G, n_buckets=nb, tp_size=P,
                         buffer_slots=B, page_size=PAGE, access_path=path)

    def rank(peers):
        space = TPAddressSpace(cfg, peers, n_logical=ratio * N + PAGE)
        rows = list(space.storage) + [t for g in space.groups for t in
                                      (g.pools.gpu, g.pools.cpu, g.pools.cpu_free_host)]
        return device_table_bytes(space, rows, skip_attrs=("_peer_layers",))

    per, fixed = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=nb,
                                      tp_size=P, buffer_slots=B, layers=L,
                                      call_scratch=fused)
    for parts in run_ranks(P, rank):
        real = sum(parts.values())
        assert {"table", "holder"} <= {p.rsplit(".", 1)[-1] for p in parts}
        extra = L * P * 8 + (128 * (36 * cfg.n_groups + 32) + 64 if fused else 0)
        assert real <= per * N + fixed <= real + slack(N, 2 * cfg.n_groups, nb, "pblru",
                                                       extra=extra), (per, fixed, real)


@pytest.mark.parametrize(("P", "N", "ratio", "nb", "L", "lpg"),
                         [(2, 1024, 5, 4, 4, 1), (4, 8192, 3, 64, 4, 2), (8, 2048, 1, 8, 2, 1)])
@PATHS
def test_dcp_formula_bounds_a_ranks_tables(P, N, ratio, nb, L, lpg, path):
    """DCP TP (``tp_attention`` "dcp"): each rank's tables are the DP core's over its stripe
    (``N / P`` GPU slots, ``ceil((ratio N + page) / P)`` positions), nothing else."""
    from ulacache.stripe import StripeAddressSpace

    fused = _path(path)
    G = N // P
    cfg = UlaCacheConfig(layout="tiny", row_bytes=1, n_layers=L, layers_per_group=lpg,
                         gpu_slots=G, cpu_slots=(ratio - 1) * G, n_buckets=nb, tp_size=P,
                         tp_attention="dcp", page_size=PAGE, access_path=path)

    def rank(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=ratio * N + PAGE)
        rows = [t for g in space.groups for t in (g.pools.gpu, g.pools.cpu,
                                                  g.pools.cpu_free_host)]
        return device_table_bytes(space, rows)

    per, fixed = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=nb,
                                      tp_size=P, dcp=True, call_scratch=fused)
    for parts in run_ranks(P, rank):
        real = sum(parts.values())
        extra = 128 * 28 + 16 if fused else 0
        assert real <= per * N + fixed <= real + slack(N // P, cfg.n_groups, nb, "pblru",
                                                       extra=extra), (per, fixed, real)
    # the tables (scratch aside: DCP's calls are sized by the own pool, like DP's) are the
    # buffered mode's without a buffer: below them at any buffer size
    dcp_tables = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE,
                                      n_buckets=nb, tp_size=P, dcp=True, call_scratch=False)
    buffered = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=nb,
                                    tp_size=P, buffer_slots=1, layers=L, call_scratch=False)
    assert dcp_tables[0] <= buffered[0] and dcp_tables[1] < buffered[1]
    with pytest.raises(ConfigError):
        table_bytes_per_slot(1, ratio=ratio, page_size=PAGE, tp_size=P, buffer_slots=64,
                             dcp=True)


def test_start_up_check_refuses_exactly_past_the_formula(monkeypatch):
    """``_check_memory`` charges the device exactly the GPU pool plus :func:`table_bytes`: one
    byte less of free device memory refuses, that much passes (so sizing and the check agree)."""
    import ulacache.space as space_mod

    cfg = UlaCacheConfig(layout="tiny", row_bytes=8, n_layers=3, gpu_slots=500, cpu_slots=1500,
                         n_buckets=16)
    n = 4 * 500 + PAGE
    tables = table_bytes(3, n_logical=n, gpu_slots=500, n_buckets=16)[1]
    assert tables > table_bytes(3, n_logical=n, gpu_slots=500, n_buckets=16,
                                call_scratch=False)[1]  # the fused scratch is charged too
    gpu_pool = 3 * 501 * 8
    gpu = torch.device("cuda")  # only named (free_bytes is replaced): distinct from the host
    monkeypatch.setattr(space_mod, "free_bytes",
                        lambda dev: avail if dev.type == "cuda" else None)
    probe = object.__new__(AddressSpace)
    probe.config, probe.device, probe.n_logical = cfg, gpu, n
    groups = [[0], [1], [2]]
    avail = gpu_pool + tables
    probe._check_memory(groups, engine_pools=False)
    avail -= 1
    with pytest.raises(CapacityExhausted, match="the mapping tables, claim table and policy state"):
        probe._check_memory(groups, engine_pools=False)
    avail = tables  # engine-owned pools (SGLang's kv_buffer) are not charged again
    probe._check_memory(groups, engine_pools=True)
    # the host: the CPU pool's rows and the CPU free stacks, exactly
    host = 3 * 1501 * 8 + host_table_bytes(3, 1500)
    assert host_table_bytes(3, 1500) == 3 * 4 * 1501
    monkeypatch.setattr(space_mod, "free_bytes",
                        lambda dev: host_avail if dev.type == "cpu" else None)
    host_avail = host
    probe._check_memory(groups, engine_pools=True)
    host_avail -= 1
    with pytest.raises(CapacityExhausted, match="the CPU free stacks"):
        probe._check_memory(groups, engine_pools=True)


def test_affine_rounding_is_an_upper_bound():
    """``ceil_div`` bounds ``ceil(value / d)`` at every integer value of ``per x + fixed``."""
    a = Affine(Fraction(5, 4), Fraction(64))
    for x in range(0, 4000, 4):  # x a multiple of 4: the value is an integer
        for d in (63, 1008, 64):
            b = a.ceil_div(d)
            assert -(-(5 * x // 4 + 64) // d) <= b.per * x + b.fixed


def test_deepseek_v32_figures():
    """The figures docs/sglang.md quotes: DeepSeek-V3.2 (61 layers, 61 selection groups),
    cpu_ratio 4 (ratio 5), PB-LRU's default 32 buckets: 2,416 B of tables and fused-call scratch
    per GPU token in DP mode (2,388 B of tables alone), against SGLang's 80,276 B cell (656 B
    latent + 132 B index-K x 5, per layer); TP8 with the buffer of 64 requests (64 x 2049
    rows): 299 B per global token per rank, tables only (the fused scratch is sized by the
    buffer, fixed: 391 MB with the tables' fixed part; the buffer maps are fixed, 2.1 MB a
    group: before they were hash tables, 1,586 B of tables per global token; until 2026-12-07
    a claim table over the global addresses cost 4 B per global logical token, 319 B in all).
    With 64 buckets (the default before 2026-12-06): 2,796 / 2,767 B and 346 B."""
    assert table_bytes_per_slot(61, ratio=5, page_size=64) == (2416, 1166453)
    assert table_bytes_per_slot(61, ratio=5, page_size=64, call_scratch=False) == \
        (2388, 932253)
    tp8 = dict(tp_size=8, buffer_slots=64 * 2049, layers=61)
    assert table_bytes_per_slot(61, ratio=5, page_size=64, **tp8) == (299, 391286184)
    assert table_bytes_per_slot(61, ratio=5, page_size=64, call_scratch=False, **tp8)[0] == 299
    assert table_bytes_per_slot(61, ratio=5, page_size=64, n_buckets=64) == (2796, 1978105)
    assert table_bytes_per_slot(61, ratio=5, page_size=64, n_buckets=64, **tp8)[0] == 346
    assert table_bytes_per_slot(78, ratio=5, page_size=64)[0] == 3076  # GLM-5, 78 groups
    assert table_bytes_per_slot(21, ratio=5, page_size=64)[0] == 864  # GLM-5.2, 21 groups


def test_bad_geometry_is_refused():
    with pytest.raises(ConfigError, match="buffer_slots"):
        table_bytes_per_slot(2, ratio=5, page_size=64, tp_size=2)
    with pytest.raises(ConfigError, match="buffer_slots"):
        table_bytes_per_slot(2, ratio=5, page_size=64, buffer_slots=8)
    with pytest.raises(ConfigError, match="policy"):
        table_bytes_per_slot(2, ratio=5, page_size=64, policy="fifo")


@PATHS
@pytest.mark.parametrize(("G", "ratio", "L"), [(1000, 3, 2), (5000, 5, 3)])
def test_prefetch_tables_are_charged(G, ratio, L, path):
    """With prefetch on, the engine's own claim table, fused scratch and budgets are inside
    ``table_bytes(prefetch=True)``, within the same slack; without it they would break the
    bound (the claim table alone is 4 x ratio B per slot)."""
    from ulacache.config import PrefetchConfig
    from ulacache.prefetch import PrefetchEngine

    fused = _path(path)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=1, n_layers=L, gpu_slots=G,
                         cpu_slots=(ratio - 1) * G, n_buckets=8, page_size=PAGE,
                         access_path=path)
    space = AddressSpace(cfg, n_logical=ratio * G + PAGE)
    engine = PrefetchEngine(space, PrefetchConfig(sources=("previous_layer",)), cfg.n_groups, 1,
                            space.device)
    rows = [t for g in space.groups for t in (g.pools.gpu, g.pools.cpu, g.pools.cpu_free_host)]
    real = sum(device_table_bytes(space, rows).values()) + engine.budgets.numel() * 8
    per, fixed = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=8,
                                      call_scratch=fused, prefetch=True)
    extra = 2 * (128 * 28 + 16) if fused else 0
    assert real <= per * G + fixed <= real + slack(G, cfg.n_groups, 8, "pblru", extra)
    per0, fixed0 = table_bytes_per_slot(cfg.n_groups, ratio=ratio, page_size=PAGE, n_buckets=8,
                                        call_scratch=fused)
    assert per0 * G + fixed0 < real


@PATHS
@pytest.mark.parametrize(("G", "ratio"), [(1000, 3), (5000, 5)])
def test_shared_groups_move_list_is_charged(G, ratio, path):
    """The ``shared_groups`` source's move list (``int32 [3, call_capacity]``) is inside
    ``table_bytes(deferred_moves=True)``, within the same slack, and breaks the bound without."""
    from ulacache.config import PrefetchConfig
    from ulacache.prefetch import PrefetchEngine

    fused = _path(path)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=1, n_layers=6, layers_per_group=3,
                         gpu_slots=G, cpu_slots=(ratio - 1) * G, n_buckets=8, page_size=PAGE,
                         access_path=path)
    space = AddressSpace(cfg, n_logical=ratio * G + PAGE)
    engine = PrefetchEngine(space, PrefetchConfig(sources=("shared_groups",)), cfg.n_groups, 1,
                            space.device)
    assert space.groups[0].moves is not None
    rows = [t for g in space.groups for t in (g.pools.gpu, g.pools.cpu, g.pools.cpu_free_host)]
    real = sum(device_table_bytes(space, rows).values()) + engine.budgets.numel() * 8
    kw = dict(ratio=ratio, page_size=PAGE, n_buckets=8, call_scratch=fused, prefetch=True)
    per, fixed = table_bytes_per_slot(cfg.n_groups, deferred_moves=True, **kw)
    extra = 2 * (128 * 28 + 16) if fused else 0
    assert real <= per * G + fixed <= real + slack(G, cfg.n_groups, 8, "pblru", extra)
    per0, fixed0 = table_bytes_per_slot(cfg.n_groups, **kw)
    assert per0 * G + fixed0 < real
