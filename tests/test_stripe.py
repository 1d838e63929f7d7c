"""DCP TP mode (ulacache.stripe): each rank attends all heads over its own stripe and the
ranks merge partial outputs by log-sum-exp, so no rank holds a copy of a peer's row.

- the reference DSA-MLA model decoding through every rank's stripe is bit-identical to a
  resident run that merges the same way (ulacache's rows exact), with pools small enough that
  promotions and spills happen on every step, and within the merge's reassociation
  (``MERGE_TOLERANCE``) of an unsharded resident run; index-K striped by page as well;
- the merge itself against the resident attention on random inputs, including ranks with no
  selection; a merge that skips the rescale is far outside the tolerance;
- per-rank memory: ``N / P`` rows per layer and nothing else (no buffer), from the tensors;
- a stateful test across ranks against a dictionary model: random place / access / write /
  release / round sequences keep every rank's invariants, every live address reads back its
  last bytes from every rank, an access returns rows only for its own addresses, and refused
  calls change nothing on any rank.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from ulacache.config import UlaCacheConfig
from ulacache.errors import AddressError, CapacityExhausted, ConfigError, ShapeError
from ulacache.ipc import run_ranks
from ulacache.oracle.driver import MERGE_TOLERANCE, run_equality
from ulacache.oracle.refmodel import (
    ModelGeometry,
    merge_partials,
    sparse_mla_attention,
    sparse_mla_attention_lse,
)
from ulacache.stripe import StripeAddressSpace

from .test_tp import Ranks, TPMachine

PROMPTS = [150, 90, 40, 120]


def dcp_config(geom: ModelGeometry, P: int, **kw) -> UlaCacheConfig:
    """Per rank: a GPU pool well under half of the rank's live history (promotions and spills
    every step) but above a step's own share of the selections."""
    base = dict(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                layers_per_group=geom.layers_per_indexer, gpu_slots=max(160 // P, 56),
                cpu_slots=640 // P, page_size=64, max_requests=8, n_buckets=4, tp_size=P,
                tp_attention="dcp")
    return UlaCacheConfig(**{**base, **kw})


# -- the merge -------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4, 8])
def test_merged_partials_equal_the_attention_over_all_rows(P):
    """Random queries and rows, every selection owned by one of P ranks (a rank may own none
    of a query's): the LSE merge equals the resident attention within the tolerance; dropping
    the rescale (averaging the partials) is orders of magnitude off."""
    gen = torch.Generator().manual_seed(P)
    bs, H, R, E, k = 5, 4, 32, 8, 40
    q_lat, q_rope = torch.randn(bs, H, R, generator=gen), torch.randn(bs, H, E, generator=gen)
    latent = torch.randn(bs, k, R + E, generator=gen) * 2
    valid = torch.rand(bs, k, generator=gen) < 0.8
    valid[:, 0] = True
    owner = torch.randint(0, P, (bs, k), generator=gen)
    owner[0] = 0  # query 0: every row on rank 0, the others serve nothing
    scale = 1 / math.sqrt(R + E)
    want = sparse_mla_attention(q_lat, q_rope, latent, valid, scale)
    parts = [sparse_mla_attention_lse(q_lat, q_rope, latent, valid & (owner == r), scale)
             for r in range(P)]
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])
    assert bool(torch.isinf(lses[1:, 0]).all())  # ranks without a row: lse -inf
    got = merge_partials(outs, lses)
    assert float(((got - want).abs() / (1 + want.abs())).max()) <= 1e-5
    naive = outs.mean(0)
    assert float(((naive - want).abs() / (1 + want.abs())).max()) > 100 * MERGE_TOLERANCE


def test_a_query_no_rank_serves_merges_to_zero():
    outs = torch.randn(3, 2, 4, 8)
    lses = torch.full((3, 2, 4), -math.inf)
    assert torch.equal(merge_partials(outs, lses), torch.zeros(2, 4, 8))


# -- decoding -----------------------------------------------------------------------------------
def assert_close_and_busy(reports, n_steps: int, live_per_rank_floor: float) -> None:
    for rank, rep in enumerate(reports):
        assert rep.identical, (rank, rep.mismatches[:5], rep.max_deviation)
        assert 0 < rep.max_deviation <= MERGE_TOLERANCE  # merged, not bitwise by accident
        assert rep.steps == n_steps
        moved = rep.moved_per_step
        assert all(v > 0 for v in moved["promotions"]), (rank, moved["promotions"])
        assert sum(moved["spills"]) > 0
        assert rep.gpu_slots <= live_per_rank_floor / 2  # at most half the rank's share
        for k in ("access_overflow", "place_overflow", "invalid"):
            assert sum(moved[k]) == 0, (rank, k)


@pytest.mark.parametrize("layers_per_indexer", [1, 2], ids=["per-layer", "shared"])
@pytest.mark.parametrize("P", [2, 4])
def test_dcp_decode_matches_resident(P, layers_per_indexer):
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=layers_per_indexer)
    cfg = dcp_config(geom, P)
    steps = 12
    reports = run_ranks(P, lambda peers: run_equality(geom, cfg, PROMPTS, steps, peers=peers))
    assert_close_and_busy(reports, steps, (sum(PROMPTS) + 4 * steps) / P)
    # the sharded indexer: each rank held and scored 1/P of the index keys
    assert sum(r.index_keys_held for r in reports) == reports[0].index_keys_full


def test_dcp_with_page_striped_index_k_and_rounds_of_prefill():
    """Index-K striped by 16-position pages (``stripe_index_k``'s ownership, independent of
    the latent's token stripe), prefill chunks whose own selections outgrow a rank's pool
    (served in rounds), bf16 rows."""
    geom = ModelGeometry.tiny(layout="bf16", layers_per_indexer=2)
    cfg = dcp_config(geom, 2, gpu_slots=48, cpu_slots=400)
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, [300, 140], 6, peers=peers,
                                                      prefill_chunk=64, index_page=16))
    for rank, rep in enumerate(reports):
        assert rep.identical, (rank, rep.mismatches[:5], rep.max_deviation)
        assert rep.prefill_rounds > 0  # the long prompt's chunks did not fit one round
    full = reports[0].index_keys_full
    assert sum(r.index_keys_held for r in reports) == full
    assert max(r.index_keys_held for r in reports) < full


def test_dcp_prefill_through_a_stage():
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=1)
    cfg = dcp_config(geom, 2, gpu_slots=48, cpu_slots=400)
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, [260, 100], 4, peers=peers,
                                                      prefill_chunk=64, prefill_stage=160))
    for rank, rep in enumerate(reports):
        assert rep.identical, (rank, rep.mismatches[:5])
        assert rep.prefill_staged_from_cpu > 0


def test_a_dcp_stage_holds_own_rows_only_and_the_ranks_agree_on_its_refusals():
    """A rank's stage is sized and admitted by its own share (:meth:`stage_rows`: the largest
    rank's, not the batch over ``P``), stages exactly its own rows with their bytes (peers'
    ``-1``), and a refusal that only one rank can see (its own rows past the stage, its own
    dead address) raises the same error on every rank."""
    from ulacache.prefill import PrefillStage

    cfg = _small(gpu_slots=8, cpu_slots=8)

    def body(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=64)
        stage = PrefillStage(space, 2)
        fits = [stage.fits(lens) for lens in ([4], [2, 2], [1, 1, 1], [5])]
        space.begin_round()
        space.place(torch.arange(6))
        for a in range(6):
            space.write(1, torch.tensor([a]), torch.full((1, 16), 10 + a, dtype=torch.uint8))
        rows = stage.stage(1, torch.tensor([[0, 3, -1], [3, 4, 1]]))
        got = [int(stage.storage[0, r, 0]) if r >= 0 else -1 for r in rows.reshape(-1).tolist()]
        errors = []
        for table in (torch.tensor([[0, 2, 4]]),  # rank 0 owns three: past its stage of 2
                      torch.tensor([[1, 9]])):  # 9: rank 1's, never placed
            try:
                stage.stage(1, table)
            except (AddressError, CapacityExhausted) as e:
                errors.append(type(e).__name__)
        space.check_integrity()
        return fits, got, errors

    for rank, (fits, got, errors) in enumerate(run_ranks(2, body)):
        # [2, 2]: two rows each; [1, 1, 1]: rank 0 owns all three (the batch over P says 2)
        assert fits == [True, True, False, False], rank
        want = [10 + a if a >= 0 and a % 2 == rank else -1 for a in (0, 3, -1, 3, 4, 1)]
        assert got == want, rank
        assert errors == ["CapacityExhausted", "AddressError"], rank


def test_a_broken_merge_is_caught(monkeypatch):
    """The decode comparison is not vacuous: ranks that attend their own rows without
    rescaling by the LSE (a plain mean of the partials) fail it."""
    import ulacache.oracle.refmodel as refmodel

    monkeypatch.setattr(refmodel, "merge_partials", lambda outs, lses: outs.mean(0))
    geom = ModelGeometry.tiny(layout="fp8")
    cfg = dcp_config(geom, 2)
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, PROMPTS[:2], 2, peers=peers))
    assert all(not rep.identical for rep in reports)


# -- memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4, 8])
def test_per_rank_memory_is_one_pth_and_no_buffer(P):
    N, rb, layers = 4096, 80, 4
    cfg = UlaCacheConfig(layout="tiny", row_bytes=rb, n_layers=layers, layers_per_group=2,
                         gpu_slots=N // P // 4, cpu_slots=N // P - N // P // 4, page_size=64,
                         tp_size=P, tp_attention="dcp")

    def body(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=N)
        pools = sum(g.pools.gpu.numel() + g.pools.cpu.numel() for g in space.groups)
        attn = sum(space.attn_rows(layer).numel() for layer in range(layers))
        return pools - 2 * rb * layers, attn

    for unique, attn in run_ranks(P, body):
        assert unique * P == N * rb * layers
        assert attn == (cfg.gpu_slots + 1) * rb * layers  # own slots and a scratch row only


def test_config_refusals():
    with pytest.raises(ConfigError, match="tp_attention"):
        UlaCacheConfig(tp_size=2, tp_attention="dcp", buffer_slots=64)
    with pytest.raises(ConfigError, match="tp_attention"):
        UlaCacheConfig(tp_attention="dcp")
    assert UlaCacheConfig(tp_size=2, tp_attention="dcp", gpu_slots=500).call_capacity >= 500


# -- refusals and production mode ----------------------------------------------------------------
def _small(P: int = 2, **kw) -> UlaCacheConfig:
    return UlaCacheConfig(**{**dict(layout="tiny", row_bytes=16, n_layers=2, gpu_slots=4,
                                    cpu_slots=4, page_size=64, tp_size=P, tp_attention="dcp",
                                    n_buckets=4), **kw})


def test_refusals_reach_every_rank_and_change_nothing():
    """A bad call found on one rank only (its own pool is full, or a duplicate among its own
    addresses) raises the same error type on every rank, and no rank changes."""
    cfg = _small()

    def body(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=64)
        space.begin_round()
        space.place(torch.tensor([0, 2, 4, 6, 1]))  # rank 0 full (4 own), rank 1 holds one
        ones = torch.ones(1, 16, dtype=torch.uint8)
        errors = []
        for call in (lambda: space.place(torch.tensor([8])),  # rank 0: no room
                     lambda: space.place(torch.tensor([3, 3])),  # duplicate (rank 1's)
                     lambda: space.place(torch.tensor([64])),  # out of range
                     lambda: space.release(torch.tensor([5, 5])),
                     lambda: space.access(0, torch.tensor([[9]])),  # not live (rank 1's)
                     lambda: space.write(0, torch.tensor([7]), ones)):
            before = [g.loc.clone() for g in space.groups]
            try:
                call()
            except (AddressError, CapacityExhausted, ShapeError) as e:
                errors.append(type(e).__name__)
            assert all(torch.equal(b, g.loc) for b, g in zip(before, space.groups))
        space.check_integrity()
        return errors

    a, b = run_ranks(2, body)
    assert a == b == ["CapacityExhausted", "AddressError", "AddressError", "AddressError",
                      "AddressError", "AddressError"]


def test_production_mode_masks_bad_input_and_serves_only_own_rows():
    """Validate off: out-of-range and dead addresses come back ``-1`` (never another row, never
    the buffered mode's ``-2`` verdict) and are counted ``invalid``; peers' addresses are
    ``-1`` and not counted."""
    cfg = _small(validate=False, gpu_slots=8, cpu_slots=8)

    def body(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=64)
        space.begin_round()
        space.place(torch.arange(6))
        space.begin_round()
        rows = space.access(0, torch.tensor([[0, 1, 2, 3, 4, 5, 40, 41, 99, -1]]))
        return rows.tolist()[0], space.counters()[0]["invalid"], space.translate(
            0, torch.arange(6).view(1, -1)).tolist()[0]

    for rank, (rows, invalid, trans) in enumerate(run_ranks(2, body)):
        own = [a for a in range(6) if a % 2 == rank]
        assert all((r >= 0) == (a % 2 == rank) for a, r in zip(range(6), rows[:6]))
        assert sorted(r for r in rows[:6] if r >= 0) == sorted(set(rows[:6]) - {-1})
        assert len({r for r in rows[:6] if r >= 0}) == len(own)
        assert rows[6:] == [-1, -1, -1, -1]
        assert invalid == 2  # its own dead address (40 or 41) and 99 (out of range), once
        assert trans == rows[:6]


# -- stateful, across ranks ----------------------------------------------------------------------
class DCPMachine(TPMachine):
    """:class:`tests.test_tp.TPMachine`'s rules (place + write, rewrite, access, release with
    duplicates, rounds; every rank's invariants and every live address read back from every
    rank after each) over stripe spaces: G = 6, C = 10 per rank, no buffer. An access returns
    a row exactly for each rank's own selections, holding the address's bytes."""

    @initialize(P=st.sampled_from([2, 4]), shared=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, P, shared, seed):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=self.RB, n_layers=self.LAYERS,
                                  layers_per_group=2 if shared else 1, gpu_slots=6,
                                  cpu_slots=10, page_size=4, n_buckets=2, tp_size=P,
                                  tp_attention="dcp")
        self.P = P
        self.ranks = Ranks(P, self.cfg, self.N, space_cls=StripeAddressSpace)
        self.rng = random.Random(seed)
        self.truth = {}
        self.ops = 0

    @rule(bs=st.integers(1, 3), k=st.integers(1, 5), pad=st.booleans())
    def access(self, bs, k, pad):
        if not self.truth:
            return
        live = self.rng.sample(sorted(self.truth), min(len(self.truth), self.rng.randint(1, 9)))
        sel = torch.tensor([[self.rng.choice(live) if not (pad and self.rng.random() < 0.2)
                             else -1 for _ in range(k)] for _ in range(bs)])
        gi = self.rng.randrange(len(self.ranks.spaces[0].groups))
        layers = self.ranks.spaces[0].groups[gi].layers

        def op(s):
            rows = s.access(gi, sel)
            return rows, [s.attn_rows(layer)[rows.clamp(min=0).long()] for layer in layers]
        res = self.ranks.run(op)
        if isinstance(res[0], CapacityExhausted):
            self._same(res)
            return
        for rank, (rows, got) in enumerate(res):
            assert not isinstance(rows, Exception), rows
            own = (sel >= 0) & (sel % self.P == rank)
            assert torch.equal(rows >= 0, own), "a row exactly for each own selection"
            for li, layer in enumerate(layers):
                for (b, j), a in zip(torch.cartesian_prod(torch.arange(bs), torch.arange(k))
                                     .tolist(), sel.reshape(-1).tolist()):
                    if a >= 0 and a % self.P == rank:
                        assert bytes(got[li][b, j].tolist()) == self.truth[a][layer], \
                            f"address {a} layer {layer} read wrong bytes"
        self.ops += 1


DCPMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=40, deadline=None)
test_dcp_stateful = DCPMachine.TestCase
