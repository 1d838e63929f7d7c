"""TP mode (ulacache.tp): a striped address space over P simulated ranks (threads sharing
memory through :class:`ulacache.ipc.ThreadPeers`; the spawned-process runs over gloo and
shared memory are in tests/test_tp_processes.py).

- the reference DSA-MLA model decoding through every rank's share gives bit-identical
  logits, attention outputs, top-k and tokens to a fully resident single-rank run, with pools
  and buffers small enough that promotions, spills, buffer evictions and peer reads happen on
  every step;
- per-rank pool memory is 1/P of the replicated layout (from the allocated tensors);
- a stateful test across ranks: random place / access / write / release (abort) / round
  sequences keep every rank's invariants and every live address reads back its last bytes
  from every rank; refused calls change nothing on any rank.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import AddressError, CapacityExhausted, ShapeError
from ulacache.ipc import ThreadHub, run_ranks
from ulacache.oracle.driver import run_equality
from ulacache.oracle.refmodel import ModelGeometry
from ulacache.tp import TP_COUNTERS, TPAddressSpace

PROMPTS = [150, 90, 40, 120]


def tp_config(geom: ModelGeometry, P: int, **kw) -> UlaCacheConfig:
    """Per rank: a GPU pool well under half of the rank's live history, a buffer far smaller
    than the peers' history (evictions every step)."""
    base = dict(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                layers_per_group=geom.layers_per_indexer, gpu_slots=max(160 // P, 56),
                cpu_slots=640 // P, page_size=64, max_requests=8, n_buckets=4, tp_size=P,
                buffer_slots=128)
    return UlaCacheConfig(**{**base, **kw})


def assert_busy_equal(reports, P: int, n_steps: int, live_per_rank_floor: float) -> None:
    for rank, rep in enumerate(reports):
        assert rep.identical, (rank, rep.mismatches[:5])
        assert rep.steps == n_steps
        moved = rep.moved_per_step
        for what in ("promotions", "peer_fetches", "buffer_evictions"):
            assert all(v > 0 for v in moved[what]), (rank, what, moved[what])
        assert sum(moved["spills"]) > 0 and sum(moved["buffer_hits"]) > 0
        assert rep.gpu_slots < live_per_rank_floor / 2  # own pool under half the rank's share
        for k in ("access_overflow", "place_overflow", "invalid", "peer_missing",
                  "buffer_overflow"):
            assert sum(moved[k]) == 0, (rank, k)


@pytest.mark.parametrize("layers_per_indexer", [1, 2], ids=["per-layer", "shared"])
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_tp2_threads_decode_equals_resident(layout, layers_per_indexer):
    geom = ModelGeometry.tiny(layout=layout, layers_per_indexer=layers_per_indexer)
    cfg = tp_config(geom, 2)
    steps = 16
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, PROMPTS, steps, peers=peers))
    assert_busy_equal(reports, 2, steps, (sum(PROMPTS) + 4 * steps) / 2)
    # sharded indexer: each rank held and scored its own half of the index keys
    assert sum(r.index_keys_held for r in reports) == reports[0].index_keys_full
    assert all(r.index_keys_held * 2 == r.index_keys_full for r in reports)


@pytest.mark.parametrize("P", [2, 4])
def test_page_striped_indexer_decode_equals_resident(P):
    """Index-K striped by page (``stripe_index_k``'s ownership, a request's page ``p`` of 16
    positions on rank ``p mod P``): each rank keeps and scores its own pages' keys, the merge
    is exact, decoding is bit-identical to the resident reference, and the ranks' keys
    partition the replicated ones (each within a page per request and group of ``1/P``)."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = tp_config(geom, P)
    steps = 8
    reports = run_ranks(P, lambda peers: run_equality(geom, cfg, PROMPTS, steps, peers=peers,
                                                      index_page=16))
    for rank, rep in enumerate(reports):
        assert rep.identical, (rank, rep.mismatches[:5])
        assert all(v > 0 for v in rep.moved_per_step["peer_fetches"])
    full = reports[0].index_keys_full
    assert sum(r.index_keys_held for r in reports) == full
    slack = 16 * len(PROMPTS) * geom.n_groups
    assert all(abs(r.index_keys_held * P - full) <= P * slack for r in reports)
    assert max(r.index_keys_held for r in reports) < full  # no rank holds them all


def test_tp8_threads_replicated_indexer_decode_equals_resident():
    """P = 8 (the mission's TP8), replicated indexer keys (``shard_indexer`` off)."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = tp_config(geom, 8, gpu_slots=32, cpu_slots=64, buffer_slots=160,
                    shard_indexer=False)
    steps = 6
    reports = run_ranks(8, lambda peers: run_equality(geom, cfg, PROMPTS, steps, peers=peers))
    for rep in reports:
        assert rep.identical, rep.mismatches[:5]
        assert all(v > 0 for v in rep.moved_per_step["peer_fetches"])
        assert rep.index_keys_held == rep.index_keys_full  # replicated keys


# -- memory --------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4, 8])
def test_per_rank_pool_memory_is_one_pth_of_replicated(P):
    """Replicated TP (SGLang today): every rank holds every token's row, ``N`` rows per layer.
    Striped: each rank holds ``N / P`` (GPU + CPU slots), plus the fixed buffer and two scratch
    rows; asserted from the tensors each rank allocated."""
    N, rb, layers = 4096, 80, 4
    cfg = UlaCacheConfig(layout="tiny", row_bytes=rb, n_layers=layers, layers_per_group=2,
                         gpu_slots=N // P // 4, cpu_slots=N // P - N // P // 4, page_size=64,
                         tp_size=P, buffer_slots=64)
    replicated = N * rb * layers

    def body(peers):
        space = TPAddressSpace(cfg, peers, n_logical=N)
        pools = sum(g.pools.gpu.numel() + g.pools.cpu.numel() for g in space.groups)
        scratch = 2 * rb * layers  # one scratch row per tier per layer
        storage = sum(s.numel() for s in space.storage)
        buffer = cfg.buffer_slots * rb * layers
        return pools - scratch, storage - (cfg.gpu_slots + 1) * rb * layers, buffer

    for unique, buffer_bytes, buffer in run_ranks(P, body):
        assert unique * P == replicated
        assert buffer_bytes == buffer  # the rest of the attention tensor is the buffer


# -- bad input refused on every rank -----------------------------------------------------------
def test_refusals_reach_every_rank_and_change_nothing():
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=4, cpu_slots=4,
                         page_size=2, max_requests=4, n_buckets=2, tp_size=2, buffer_slots=4)

    def body(peers):
        space = TPAddressSpace(cfg, peers, n_logical=32)
        space.begin_round()
        space.place(torch.arange(8))
        errors = []
        for call in (lambda: space.place(torch.tensor([40])),           # out of range
                     lambda: space.place(torch.arange(8, 18)),          # no room this round
                     lambda: space.plan(0, torch.tensor([[9, 1]])),     # 9 never placed
                     lambda: space.release(torch.tensor([1, 1])),       # duplicate
                     lambda: space.plan(0, torch.tensor([1, 2])),       # not [bs, k]
                     lambda: space.load(0) if False else space.load(7)):  # no such layer
            try:
                call()
            except (AddressError, CapacityExhausted, ShapeError) as e:
                errors.append(type(e).__name__)
        live = torch.zeros(32, dtype=torch.bool)
        live[:8] = True
        space.check_integrity(live)
        space.check_placed(live)
        return errors

    results = run_ranks(2, body)
    assert results[0] == results[1] == ["AddressError", "CapacityExhausted", "AddressError",
                                        "AddressError", "ShapeError", "ShapeError"]


# -- stateful, across ranks --------------------------------------------------------------------
class Ranks:
    """P simulated ranks driven in lockstep: ``run(fn)`` calls ``fn(rank)`` on every rank at
    once (one thread each, as collectives require) and returns the results in rank order."""

    def __init__(self, P: int, cfg: UlaCacheConfig, n_logical: int, space_cls=TPAddressSpace):
        self.P = P
        self.hub = ThreadHub(P, timeout=30)
        self.pool = ThreadPoolExecutor(max_workers=P)
        peers = [self.hub.peers(r) for r in range(P)]
        self.spaces = self.run(lambda r: space_cls(cfg, peers[r], n_logical=n_logical),
                               raw=True)

    def run(self, fn, raw: bool = False):
        def guarded(arg):
            try:
                return fn(arg)
            except AssertionError:
                self.hub.abort()  # peers blocked in a collective leave at once
                raise
        futures = [self.pool.submit(guarded, r if raw else self.spaces[r])
                   for r in range(self.P)]
        out, errs = [], []
        for f in futures:
            try:
                out.append(f.result(timeout=60))
            except Exception as e:  # noqa: BLE001 -- compared across ranks by the caller
                out.append(e)
                errs.append(e)
        if errs and len(errs) != self.P:
            self.hub.abort()
            raise AssertionError(f"only some ranks raised: {out}")
        return out

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def check_every_rank(ranks: Ranks, n: int, layers: int, truth: dict[int, list[bytes]]) -> None:
    """Every rank's invariants (collective: buffered copies against their owners), every
    stored address placed, and every stored address reads back its bytes per layer
    (``truth[address][layer]``) from every rank."""
    live = torch.zeros(n, dtype=torch.bool)
    live[list(truth)] = True
    addrs = torch.tensor(sorted(truth) or [-1])

    def op(s):
        s.check_integrity(live)
        s.check_placed(live)
        return [s.read(layer, addrs) for layer in range(layers)]
    for res in ranks.run(op):
        assert not isinstance(res, Exception), f"a rank raised: {res!r}"
        for layer in range(layers):
            for i, a in enumerate(addrs.tolist()):
                if a >= 0:
                    assert bytes(res[layer][i].tolist()) == truth[a][layer], \
                        f"address {a} layer {layer} read back wrong"


class TPMachine(RuleBasedStateMachine):
    """Every rank's share of one striped address space against a dict of bytes.

    Small pools (G = 6, C = 10, B = 7 per rank) so that promotions, spills, buffer evictions
    and refusals are frequent; addresses are global, in one range of ``n_logical``.
    """

    N = 48
    LAYERS = 2
    RB = 16

    @initialize(P=st.sampled_from([2, 4]), shared=st.booleans(), validate=st.just(True),
                seed=st.integers(0, 2**16))
    def setup(self, P, shared, validate, seed):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=self.RB, n_layers=self.LAYERS,
                                  layers_per_group=2 if shared else 1, gpu_slots=6,
                                  cpu_slots=10, page_size=4, n_buckets=2, tp_size=P,
                                  buffer_slots=7, validate=validate)
        self.P = P
        self.ranks = Ranks(P, self.cfg, self.N)
        self.rng = random.Random(seed)
        self.truth: dict[int, list[bytes]] = {}  # live address -> bytes per layer
        self.ops = 0

    def teardown(self):
        if hasattr(self, "ranks"):
            self.ranks.close()

    def _rows(self, n):
        return torch.randint(0, 256, (n, self.RB), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))

    def _same(self, results):
        kinds = {type(r).__name__ for r in results}
        assert len(kinds) == 1, f"ranks disagree: {results}"
        return results[0]

    @rule()
    def new_round(self):
        self.ranks.run(lambda s: s.begin_round())

    @rule(n=st.integers(1, 8))
    def place(self, n):
        free = [a for a in range(self.N) if a not in self.truth]
        if not free:
            return
        addrs = torch.tensor(self.rng.sample(free, min(n, len(free))))
        rows = [self._rows(addrs.numel()) for _ in range(self.LAYERS)]

        def op(s):
            s.place(addrs)
            for layer in range(self.LAYERS):
                s.write(layer, addrs, rows[layer])
        res = self._same(self.ranks.run(op))
        if isinstance(res, CapacityExhausted):
            return  # refused on every rank; the invariant checks that nothing changed
        assert not isinstance(res, Exception), res
        for i, a in enumerate(addrs.tolist()):
            self.truth[a] = [bytes(rows[layer][i].tolist()) for layer in range(self.LAYERS)]
        self.ops += 1

    @rule(n=st.integers(1, 4))
    def rewrite(self, n):
        if not self.truth:
            return
        addrs = torch.tensor(self.rng.sample(sorted(self.truth), min(n, len(self.truth))))
        layer = self.rng.randrange(self.LAYERS)
        rows = self._rows(addrs.numel())
        self._same(self.ranks.run(lambda s: s.write(layer, addrs, rows)))
        for i, a in enumerate(addrs.tolist()):
            self.truth[a][layer] = bytes(rows[i].tolist())

    @rule(bs=st.integers(1, 3), k=st.integers(1, 5), pad=st.booleans())
    def access(self, bs, k, pad):
        if not self.truth:
            return
        # a few addresses per step, so duplicates (within and across rows) are common
        live = self.rng.sample(sorted(self.truth), min(len(self.truth), self.rng.randint(1, 6)))
        sel = torch.tensor([[self.rng.choice(live) if not (pad and self.rng.random() < 0.2)
                             else -1 for _ in range(k)] for _ in range(bs)])
        groups = len(self.ranks.spaces[0].groups)
        gi = self.rng.randrange(groups)
        layers = self.ranks.spaces[0].groups[gi].layers

        def op(s):
            rows = s.access(gi, sel)
            return rows, [s.attn_rows(layer)[rows.clamp(min=0).long()] for layer in layers]
        res = self.ranks.run(op)
        if isinstance(res[0], CapacityExhausted):
            self._same(res)
            return
        for rows, got in res:
            assert not isinstance(rows, Exception), rows
            assert torch.equal(rows < 0, sel < 0), "padding must stay padding and only it"
            for li, layer in enumerate(layers):
                for (b, j), a in zip(torch.cartesian_prod(torch.arange(bs), torch.arange(k))
                                     .tolist(), sel.reshape(-1).tolist()):
                    if a >= 0:
                        assert bytes(got[li][b, j].tolist()) == self.truth[a][layer], \
                            f"address {a} layer {layer} read wrong bytes"
        self.ops += 1

    @rule(n=st.integers(1, 6), dup=st.booleans())
    def release(self, n, dup):
        """Finish or abort: some live and some never-placed addresses (engines free whole
        pages); a duplicate must be refused on every rank with nothing changed."""
        pick = self.rng.sample(range(self.N), n)
        if dup:
            pick.append(pick[0])
        res = self._same(self.ranks.run(lambda s: s.release(torch.tensor(pick))))
        if dup:
            assert isinstance(res, AddressError), res
            return
        assert not isinstance(res, Exception), res
        for a in pick:
            self.truth.pop(a, None)

    @invariant()
    def every_rank_consistent(self):
        if hasattr(self, "ranks"):
            check_every_rank(self.ranks, self.N, self.LAYERS, self.truth)


TPMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=40, deadline=None)
test_tp_stateful = TPMachine.TestCase


def test_tp_counters_named_in_stats():
    geom = ModelGeometry.tiny()
    cfg = tp_config(geom, 2)

    def body(peers):
        cache = UlaCache(cfg, peers=peers, layer_groups=geom.selection_groups())
        return cache.stats()
    stats = run_ranks(2, body)[0]
    for name in TP_COUNTERS:
        assert f"group0_{name}" in stats


# -- plan reuse, engine-owned storage, metrics --------------------------------------------------
def _small(P=2, **kw):
    base = dict(layout="tiny", row_bytes=16, n_layers=2, layers_per_group=2, gpu_slots=8,
                cpu_slots=8, page_size=4, n_buckets=2, tp_size=P, buffer_slots=8)
    return UlaCacheConfig(**{**base, **kw})


def test_plan_once_per_group_each_layer_moves_only_its_bytes():
    """A shared group of 2 layers: after ``plan`` no peer byte has moved; ``load(0)`` fills
    layer 0's buffer rows only, ``load(1)`` layer 1's; the rows are the owner's."""
    cfg = _small()

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=32)
        s.begin_round()
        addrs = torch.arange(8)
        s.place(addrs)
        for layer in (0, 1):
            s.write(layer, addrs, (addrs * 10 + layer).to(torch.uint8).view(-1, 1)
                    .expand(-1, 16).contiguous())
        for b in s.buffers:  # forget the copies made at placement: force peer reads
            b.drop(torch.arange(33))
        s.storage[0][:, cfg.gpu_slots + 1:] = 0  # and their bytes
        s.begin_round()
        rows = s.plan(0, addrs.view(2, 4))
        theirs = (addrs % 2 != peers.rank).view(2, 4)
        assert bool((rows[theirs] > cfg.gpu_slots).all())  # in the buffer region
        peer_rows = rows[theirs].long()
        before = [s.attn_rows(layer)[peer_rows].clone() for layer in (0, 1)]
        assert all(bool((b == 0).all()) for b in before)
        want = [(addrs.view(2, 4)[theirs] * 10 + layer).to(torch.uint8) for layer in (0, 1)]
        s.load(0)
        assert torch.equal(s.attn_rows(0)[peer_rows][:, 0], want[0])
        assert bool((s.attn_rows(1)[peer_rows] == 0).all()), "layer 1 moved by layer 0's load"
        s.load(1)
        assert torch.equal(s.attn_rows(1)[peer_rows][:, 0], want[1])
        c = s.counters()[0]
        return c["peer_fetches"], c["own_rows"], c["selected"]
    for fetches, own, selected in run_ranks(2, body):
        assert (fetches, own, selected) == (4, 4, 8)


def test_engine_owned_storage_with_a_row_offset():
    """SGLang's kv_buffer carries a 64-row sink page first: the striped space works on rows
    [offset, offset + G + 1 + B) of an engine tensor shared through the peers."""
    cfg = _small(layers_per_group=1)
    off, total = 64, 64 + 8 + 1 + 8 + 7

    def body(peers):
        storage = [(f"kv{g}", peers.alloc_shared(f"kv{g}", (1, total, 16), torch.uint8))
                   for g in range(2)]
        s = TPAddressSpace(cfg, peers, n_logical=32, storage=storage, row_offset=off)
        s.begin_round()
        addrs = torch.arange(6)
        s.place(addrs)
        rows_in = torch.randint(0, 256, (6, 16), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(3))
        s.write(0, addrs, rows_in)
        for b in s.buffers:
            b.drop(torch.arange(33))
        s.begin_round()
        rows = s.access(0, addrs.view(1, 6))
        got = storage[0][1][0, rows.view(-1).long()]  # rows of the engine's tensor
        assert torch.equal(got, rows_in)
        assert bool((storage[0][1][0, :off] == 0).all()), "the sink page was written"
        return True
    assert run_ranks(2, body) == [True, True]


def test_tp_prometheus_text_has_the_gate_counters():
    from ulacache.metrics import prometheus_text
    cfg = _small()

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=32)
        s.begin_round()
        s.place(torch.arange(8))
        s.access(0, torch.arange(8).view(2, 4))
        s.begin_round()  # polls the counters (CPU: immediately)
        return prometheus_text(s), s.counters()[0]
    for rank, (text, c) in enumerate(run_ranks(2, body)):
        assert f'ulacache_tp_own_rows_total{{group="0",rank="{rank}"}} {float(c["own_rows"])}' \
            in text
        assert f'ulacache_tp_buffer_hits_total{{group="0",rank="{rank}"}} 4.0' in text
        assert f'ulacache_tp_buffer_used_slots{{group="0",rank="{rank}"}} 4.0' in text
        assert f'ulacache_tp_peer_bytes_total{{group="0",rank="{rank}"}} 0.0' in text
        assert 'ulacache_placed_total{group="0"} 4.0' in text


# -- production mode (validate off): overflow masked, counted, never served wrong ---------------
def test_production_mode_masks_and_counts_overflow_on_every_gate(caplog):
    """Validate off, as under SGLang: a buffer too small for a step's peer rows, an owner whose
    pool cannot take a step's rows, out-of-range and never-placed addresses. Nothing raises,
    every served row holds its own bytes, the rest read as padding and are counted, integrity
    holds on every rank, and the round boundary warns."""
    cfg = _small(layers_per_group=1, gpu_slots=4, cpu_slots=28, buffer_slots=3, validate=False)
    rows_in = torch.randint(0, 256, (24, 16), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(5))

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=32)
        for chunk in (torch.arange(0, 6), torch.arange(6, 12), torch.arange(12, 18),
                      torch.arange(18, 24)):
            s.begin_round()  # new rows of a round: 3 each per rank, within G and B
            s.place(chunk)
            s.write(0, chunk, rows_in[chunk])
        s.begin_round()
        before = s.counters()[0]
        # 12 distinct addresses: 6 per owner (> G = 4: owner overflow), 6 peers' (> B = 3)
        sel = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [40, -1, 25, 25, 1, 0]])
        rows = s.access(0, sel)
        got = s.attn_rows(0)[rows.clamp(min=0).long()]
        for b in range(3):
            for j in range(6):
                a = int(sel[b, j])
                if int(rows[b, j]) >= 0:
                    assert 0 <= a < 24 and torch.equal(got[b, j], rows_in[a])
        assert int(rows[2, 0]) == int(rows[2, 1]) == -1  # out of range, padding
        assert int(rows[2, 2]) == int(rows[2, 3]) == -1  # never placed
        after = s.counters()[0]
        d = {k: after[k] - before[k] for k in after}
        live = torch.zeros(32, dtype=torch.bool)
        live[:24] = True
        s.check_integrity(live)
        s.begin_round()  # the monitor reports the overflow
        return d, int((rows >= 0).sum())
    results = run_ranks(2, body)
    for d, served in results:
        assert d["access_overflow"] > 0  # own rows beyond the pool
        assert d["peer_missing"] + d["buffer_overflow"] > 0
        assert d["invalid"] >= 1  # 25 (never placed) on its owner; 40 out of range
        assert served < 15
    assert any("buffer slot" in r.getMessage() or "owner could not" in r.getMessage()
               for r in caplog.records)


def test_new_rows_that_find_no_buffer_slot_are_read_from_their_owner():
    """Validate off: a round places more peers' rows than the buffer holds; the extra rows are
    counted (``buffer_overflow``) and left to their owner, and a later round reads them from
    the owner's pool, byte for byte."""
    cfg = _small(layers_per_group=1, gpu_slots=8, cpu_slots=8, buffer_slots=2, validate=False)
    rows_in = torch.randint(0, 256, (8, 16), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(6))

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=32)
        s.begin_round()
        s.place(torch.arange(8))  # 4 peers' rows per rank, 2 buffer slots
        s.write(0, torch.arange(8), rows_in)
        overflow = s.counters()[0]["buffer_overflow"]
        s.begin_round()  # the rows that overflowed (each rank's last two peers' rows)
        rows = s.access(0, torch.arange(4, 8).view(1, 4))
        got = s.attn_rows(0)[rows.long()].view(4, 16)
        return overflow, torch.equal(got, rows_in[4:]), s.counters()[0]["peer_fetches"]
    for overflow, same, fetched in run_ranks(2, body):
        assert overflow == 2 and same and fetched == 2


class ProductionTPMachine(RuleBasedStateMachine):
    """Validate off, as under SGLang, across ranks: nothing raises; hostile entries
    (out-of-range, never placed, duplicates, re-placing a live address) and capacity overflow
    (tiny pools: G = 4, C = 6, B = 4 per rank) are masked and counted. Predicted from what the
    ranks observe: a placed address is stored iff its owner mapped it (else it stays free); a
    served row holds exactly its address's bytes on every rank; a live selection read as
    padding is matched by an overflow counter that grew in that step; every rank's integrity
    holds and every stored address reads back from every rank."""

    N = 40
    RB = 16

    @initialize(P=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
    def setup(self, P, seed):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=self.RB, n_layers=1, gpu_slots=4,
                                  cpu_slots=6, page_size=4, n_buckets=2, tp_size=P,
                                  buffer_slots=4, validate=False)
        self.P = P
        self.ranks = Ranks(P, self.cfg, self.N)
        self.rng = random.Random(seed)
        self.truth: dict[int, bytes] = {}

    def teardown(self):
        if hasattr(self, "ranks"):
            self.ranks.close()

    def _ok(self, results):
        for r in results:
            assert not isinstance(r, Exception), f"production mode raised: {r!r}"
        return results

    @rule()
    def new_round(self):
        self._ok(self.ranks.run(lambda s: s.begin_round()))

    @rule(n=st.integers(1, 6), hostile=st.booleans())
    def place(self, n, hostile):
        free = [a for a in range(self.N) if a not in self.truth]
        new = self.rng.sample(free, min(n, len(free)))
        if not new:
            return
        addrs = list(new)
        if hostile:  # a duplicate, a live address, an out-of-range one: masked
            addrs += [new[0], self.N + 3] + ([next(iter(self.truth))] if self.truth else [])
        addrs = torch.tensor(addrs)
        rows = torch.randint(0, 256, (addrs.numel(), self.RB), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        live_before = sorted(self.truth)

        fresh = torch.tensor(new)

        def op(s):
            s.place(addrs)
            mine = fresh % self.P == s.rank
            stored = s.groups[0].loc[fresh // self.P] >= 0  # own rows the owner mapped
            return torch.where(mine, stored, False)
        stored = torch.stack(self._ok(self.ranks.run(op))).any(0)
        # the engine writes the new rows (only what was stored: the rest stay free; a live
        # address placed again keeps its bytes)
        keep = torch.where(stored, fresh, -1)
        self._ok(self.ranks.run(lambda s: s.write(0, keep, rows[: len(new)])))
        for i, a in enumerate(new):
            if bool(stored[i]):
                self.truth[a] = bytes(rows[i].tolist())
        # a re-placed live address kept its row (checked by the invariant's read-back)
        assert all(a in self.truth for a in live_before)

    @rule(bs=st.integers(1, 3), k=st.integers(1, 5), hostile=st.booleans())
    def access(self, bs, k, hostile):
        pool = self.rng.sample(sorted(self.truth), min(len(self.truth), 3)) or [-1]
        extra = [self.N + 1, -1] + [a for a in range(self.N) if a not in self.truth][:1]
        choices = pool + (extra if hostile else [])
        sel = torch.tensor([[self.rng.choice(choices) for _ in range(k)] for _ in range(bs)])

        def op(s):
            before = s.counters()[0]
            rows = s.access(0, sel)
            after = s.counters()[0]
            grew = sum(after[c] - before[c] for c in
                       ("access_overflow", "peer_missing", "buffer_overflow"))
            return rows, s.attn_rows(0)[rows.clamp(min=0).long()], grew
        for rows, got, grew in self._ok(self.ranks.run(op)):
            for (b, j), a in zip(torch.cartesian_prod(torch.arange(bs), torch.arange(k))
                                 .tolist(), sel.reshape(-1).tolist()):
                r = int(rows[b, j])
                if a not in self.truth:
                    assert r == -1, f"address {a} (not stored) served row {r}"
                elif r >= 0:
                    assert bytes(got[b, j].tolist()) == self.truth[a], f"address {a} wrong"
                else:
                    assert grew > 0, f"live address {a} read as padding, nothing counted"

    @rule(n=st.integers(1, 5))
    def release(self, n):
        pick = self.rng.sample(range(self.N + 4), n) + [-1]  # some out of range, some free
        self._ok(self.ranks.run(lambda s: s.release(torch.tensor(pick))))
        for a in pick:
            self.truth.pop(a, None)

    @invariant()
    def every_rank_consistent(self):
        if hasattr(self, "ranks"):
            check_every_rank(self.ranks, self.N, 1, {a: [b] for a, b in self.truth.items()})


ProductionTPMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=40,
                                                 deadline=None)
test_tp_production_stateful = ProductionTPMachine.TestCase


def test_a_refused_chunked_tp_access_changes_nothing_on_any_rank():
    """TP ``access`` of more than ``call_capacity`` entries runs in chunks, each a collective
    plan; with validate on the whole call is checked first and agreed, so an address that only
    the second chunk holds (dead on its owner) refuses the call on both ranks before any chunk
    planned: no rank's tables, buffers or counters change. The same call without it runs."""
    from ulacache.kernels.fused_access import equivalence_state

    cfg = _small(gpu_slots=64, cpu_slots=64, buffer_slots=64, validate=True, call_entries=128)

    def state(s):
        out = {f"g{gi}.{k}": v.clone() for gi, g in enumerate(s.local.groups)
               for k, v in equivalence_state(g).items()}
        for gi, b in enumerate(s.buffers):
            out[f"b{gi}.slots"] = b.map.dense(b.n_logical, b.holder)
            out[f"b{gi}.holder"] = b.holder.clone()
        out["tp"] = s.tp_counters.clone()
        return out

    def body(peers):
        s = TPAddressSpace(cfg, peers, n_logical=256)
        s.begin_round()
        s.place(torch.arange(120))
        s.begin_round()
        before = state(s)
        good = torch.arange(120).repeat(2)  # 240 entries: two chunks of <= 128
        bad = good.clone()
        bad[200] = 130  # never placed; owned by rank 0; in the second chunk only
        with pytest.raises(AddressError):
            s.access(0, bad.view(1, -1))
        after = state(s)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        rows = s.access(0, good.view(1, -1))
        s.check_integrity()
        return changed, int((rows >= 0).sum())

    out = run_ranks(2, body)
    assert out == [([], 240), ([], 240)]
