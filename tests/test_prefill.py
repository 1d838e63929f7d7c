"""Prefill without the whole request on the GPU (issue 21, item 3; :mod:`ulacache.prefill`).

- the reference DSA-MLA model prefilling, in chunks, a request four to five times longer
  than the GPU pool (TP: a rank's share of it, than the rank's pool) and decoding after,
  through ulacache, gives bit-identical logits, attention outputs, top-k and tokens to a fully
  resident run: DP with checks on and off, TP over P = 2 and 4 ranks (sharded indexer);
- the prefill is served in rounds and moves rows both ways (counted in the report);
- :func:`round_spans` covers every query once, in order, each span fitting a round and
  maximal; a pool smaller than one query's selections is refused;
- the same runs with a prefill stage (:class:`PrefillStage`, the SGLang seam's DP prefill):
  bit-identical, nothing promoted during the prefill, fewer rows moved than rounds; a stage
  gathers exactly the rows ``read`` returns and refuses a table it cannot hold, unchanged.
"""

from __future__ import annotations

import pytest
import torch

from ulacache.config import UlaCacheConfig
from ulacache.errors import CapacityExhausted, ShapeError
from ulacache.ipc import run_ranks
from ulacache.oracle.driver import run_equality
from ulacache.oracle.refmodel import ModelGeometry
from ulacache.prefill import PrefillStage, round_spans
from ulacache.space import AddressSpace
from ulacache.tp import TPAddressSpace

PROMPTS = [400, 130]  # the long one: 5x the DP pool; its TP2 / TP4 share 5x / 4.2x a pool
CHUNK = 48


def dp_config(geom: ModelGeometry, **kw) -> UlaCacheConfig:
    base = dict(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                layers_per_group=geom.layers_per_indexer, gpu_slots=80, cpu_slots=1024,
                page_size=64, max_requests=8, n_buckets=4)
    return UlaCacheConfig(**{**base, **kw})


def assert_long_prefill(rep, pool: int, longest_own: int) -> None:
    assert rep.identical, rep.mismatches[:5]
    assert longest_own >= 4 * pool  # the request is several times the pool
    moved = rep.prefill_moved
    assert rep.prefill_rounds > len(PROMPTS) * -(-max(PROMPTS) // CHUNK)  # sub-batched
    assert moved["promotions"] > 0 and moved["spills"] > 0  # rows came back from the CPU
    for k in ("access_overflow", "place_overflow", "invalid"):
        assert moved[k] == 0, k


@pytest.mark.parametrize("validate", [True, False], ids=["checks-on", "production"])
@pytest.mark.parametrize("layers_per_indexer", [1, 2], ids=["per-layer", "shared"])
def test_dp_prefill_longer_than_pool_equals_resident(layers_per_indexer, validate):
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=layers_per_indexer)
    cfg = dp_config(geom, validate=validate)
    rep = run_equality(geom, cfg, PROMPTS, n_steps=8, prefill_chunk=CHUNK)
    assert_long_prefill(rep, cfg.gpu_slots, max(PROMPTS))
    assert rep.live_history == sum(PROMPTS) + 2 * 8
    staged = run_equality(geom, cfg, PROMPTS, n_steps=8, prefill_chunk=CHUNK,
                          prefill_stage=sum(PROMPTS))
    assert_staged(staged, rep)


def assert_staged(staged, rounds) -> None:
    """A staged prefill: identical, no promotion and no round of its own, its CPU rows moved
    once per layer: fewer than the rounds' promotions."""
    assert staged.identical, staged.mismatches[:5]
    assert staged.prefill_rounds == 0 and staged.prefill_moved["promotions"] == 0
    assert 0 < staged.prefill_staged_from_cpu < staged.prefill_staged_rows
    assert staged.prefill_staged_from_cpu < rounds.prefill_moved["promotions"]


@pytest.mark.parametrize("P,layers_per_indexer,pool", [(2, 1, 40), (4, 2, 24)])
def test_tp_prefill_longer_than_pool_equals_resident(P, layers_per_indexer, pool):
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=layers_per_indexer)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                         layers_per_group=layers_per_indexer, gpu_slots=pool, cpu_slots=512,
                         page_size=64, max_requests=8, n_buckets=4, tp_size=P,
                         buffer_slots=80)
    reports = run_ranks(P, lambda peers: run_equality(geom, cfg, PROMPTS, 4, peers=peers,
                                                      prefill_chunk=CHUNK))
    for rep in reports:
        assert_long_prefill(rep, cfg.gpu_slots, max(PROMPTS) // P)
        assert rep.moved_per_step["peer_fetches"] and rep.prefill_moved["peer_fetches"] > 0
    if P == 2:  # the stage over TP (the reference model's all-gather; not an SGLang path)
        staged = run_ranks(P, lambda peers: run_equality(
            geom, cfg, PROMPTS, 4, peers=peers, prefill_chunk=CHUNK,
            prefill_stage=sum(PROMPTS)))
        for rep, rounds in zip(staged, reports):
            assert_staged(rep, rounds)
    # the sharded indexer: each rank held its own positions' index keys, about 1/P of them
    full = reports[0].index_keys_full
    assert sum(r.index_keys_held for r in reports) == full
    assert all(abs(r.index_keys_held * P - full) <= P * 2 * geom.n_groups for r in reports)


def test_a_pool_smaller_than_one_querys_selections_is_refused():
    """No split can serve a query whose top-k outgrows the pool: refused, not served wrong."""
    geom = ModelGeometry.tiny(layout="fp8")
    cfg = dp_config(geom, gpu_slots=geom.index_topk - 1)
    with pytest.raises(CapacityExhausted, match="top-k"):
        run_equality(geom, cfg, [100], n_steps=1, prefill_chunk=16)


# -- the splitter --------------------------------------------------------------------------
def _space(gpu_slots: int) -> AddressSpace:
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=1, gpu_slots=gpu_slots,
                         cpu_slots=4096, page_size=64)
    return AddressSpace(cfg, n_logical=4096)


@pytest.mark.parametrize("seed", range(6))
def test_round_spans_cover_fit_and_are_maximal(seed):
    gen = torch.Generator().manual_seed(seed)
    pool = [8, 24, 64][seed % 3]
    n, k = 57, 8
    table = torch.randint(0, 300, (n, k), generator=gen)
    table[torch.rand(n, k, generator=gen) < 0.2] = -1  # padding
    space = _space(pool)
    spans = round_spans(space, table)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a < b for a, b in spans) and all(spans[i][1] == spans[i + 1][0]
                                                for i in range(len(spans) - 1))
    for a, b in spans:
        distinct = table[a:b][table[a:b] >= 0].unique().numel()
        assert distinct <= pool
        if b < n:  # one more query would not fit
            more = table[a:b + 1][table[a:b + 1] >= 0].unique().numel()
            assert more > pool


def test_round_spans_refusals():
    space = _space(8)
    with pytest.raises(CapacityExhausted, match="top-k"):
        round_spans(space, torch.arange(9).view(1, 9))
    with pytest.raises(ShapeError):
        round_spans(space, torch.arange(9))
    assert round_spans(space, torch.full((5, 16), -1)) == [(0, 5)]  # padding only: one round
    assert round_spans(space, torch.zeros((0, 4), dtype=torch.int64)) == []


def test_tp_round_fits_counts_each_ranks_own_rows_and_its_buffer():
    """TP: a round fits when every rank's own distinct rows fit its pool (8) and every rank's
    peers' rows its buffer (12, then 7); the same verdict on both ranks."""
    even = torch.arange(0, 40, 2)  # rank 0's addresses (address t lives on rank t % 2)
    cases = {  # name: (table, fits at buffer 12, fits at buffer 7)
        "8 own each": (torch.arange(16).view(2, 8), True, False),  # peers' rows: 8
        "9 own on rank 0": (even[:9].view(1, 9), False, False),
        "duplicates and padding": (torch.cat((even[:8], even[:8], torch.full((5,), -1)))
                                   .view(1, -1), True, False),  # 8 distinct, all rank 0's
        "5 + 5": (torch.cat((even[:5], even[:5] + 1)).view(1, -1), True, True),
    }

    for column, buffer in ((1, 12), (2, 7)):
        cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=1, gpu_slots=8,
                             cpu_slots=64, page_size=64, tp_size=2, buffer_slots=buffer)

        def body(peers, cfg=cfg):
            space = TPAddressSpace(cfg, peers, n_logical=256)
            return {name: space.round_fits(c[0]) for name, c in cases.items()}

        want = {name: c[column] for name, c in cases.items()}
        assert run_ranks(2, body) == [want, want], buffer


def test_stage_gathers_what_read_returns_and_refuses_unchanged():
    geom = ModelGeometry.tiny(layout="fp8")
    cfg = dp_config(geom, gpu_slots=64, cpu_slots=256)
    space = AddressSpace(cfg, n_logical=512, layer_groups=geom.selection_groups())
    gen = torch.Generator().manual_seed(3)
    addrs = torch.randperm(512, generator=gen)[:300]
    space.begin_round()
    space.place(addrs[:64])  # then 236 more: the first ones spill to the CPU tier
    for piece in addrs[64:].split(59):
        space.begin_round()
        space.place(piece)
    for layer in range(geom.n_layers):
        rows = torch.randint(0, 256, (300, geom.row_bytes), dtype=torch.uint8, generator=gen)
        space.write(layer, addrs, rows)
    stage = PrefillStage(space, 200, row_base=3)
    table = addrs[torch.randint(0, 150, (40, 16), generator=gen)]
    table[0, :4] = -1
    table[1, :2] = torch.tensor([0, 1])  # below first=2: padding too (an engine's sink page)
    table_before = table.clone()
    before = space.counters()
    got = stage.stage(2, table, first=2)
    assert got.shape == table.shape and bool((got[0, :4] == -1).all())
    keep = table >= 2
    assert bool((got[~keep] == -1).all()) and bool((got[keep] >= 3).all())
    want = space.read(2, table[keep])
    assert torch.equal(stage.storage[0][got[keep]], want)
    assert stage.staged_rows == table[keep].unique().numel() and stage.staged_from_cpu > 0
    assert space.counters() == before  # nothing promoted, evicted or counted
    space.check_integrity()
    with pytest.raises(CapacityExhausted, match="stage holds 200"):
        stage.stage(2, addrs[:201].view(1, -1))
    assert stage.staged_rows == table[keep].unique().numel() and space.counters() == before
    assert torch.equal(table, table_before)
    with pytest.raises(ShapeError):
        PrefillStage(space, 0)
    with pytest.raises(ShapeError):
        PrefillStage(space, 10, storage=torch.zeros((1, 5, geom.row_bytes), dtype=torch.uint8))


def test_production_stage_reads_nothing_back_and_never_serves_another_tokens_row():
    """Validate off: no host read; distinct addresses past the stage's capacity, and addresses
    not live, come back -1 (attention skips them), and every row served is its own."""
    geom = ModelGeometry.tiny(layout="fp8")
    cfg = dp_config(geom, gpu_slots=64, cpu_slots=256, validate=False)
    space = AddressSpace(cfg, n_logical=512, layer_groups=geom.selection_groups())
    gen = torch.Generator().manual_seed(5)
    live = torch.randperm(512, generator=gen)[:250]
    for piece in live.split(50):
        space.begin_round()
        space.place(piece)
    rows = torch.randint(0, 256, (250, geom.row_bytes), dtype=torch.uint8, generator=gen)
    space.write(1, live, rows)
    dead = torch.tensor([a for a in range(512) if a not in set(live.tolist())][:20])
    table = torch.cat((live[:120], dead)).view(4, 35)
    stage = PrefillStage(space, 100)  # 120 live distinct addresses: 20 past the capacity
    before = space.counters()
    got = stage.stage(1, table)
    flat, out = table.view(-1), got.view(-1)
    served = out >= 0
    # the stage takes the 100 smallest distinct addresses; of those, the live ones are served
    taken = set(table.unique()[:100].tolist()) - set(dead.tolist())
    assert set(flat[served].tolist()) == taken and stage.staged_rows == len(taken) > 50
    assert not bool(torch.isin(flat[served], dead).any())  # dead addresses: -1
    want = {int(a): rows[i] for i, a in enumerate(live.tolist())}
    for a, r in zip(flat[served].tolist(), out[served].tolist()):
        assert torch.equal(stage.storage[0, r], want[a])
    assert space.counters() == before
    space.check_integrity()
