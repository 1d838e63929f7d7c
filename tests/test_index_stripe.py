"""Index-K striped by page (:mod:`ulacache.index_stripe`), without SGLang: each rank's view
equals a brute-force walk of the page table, the striped top-k over thread ranks equals the
unsharded top-k (ties planted), the prefill gather rebuilds the replicated rows, and tables
whose pages do not cycle through the ranks are refused on the host and never written out of
bounds. SGLang's own paged MQA-logits kernel over per-rank caches, in spawned gloo
processes: ``tests/test_sglang_index_stripe.py``."""

from __future__ import annotations

import pytest
import torch

from ulacache.errors import ShapeError
from ulacache.index_stripe import PageStripe, striped_topk
from ulacache.indexer import topk_exact
from ulacache.ipc import run_ranks

PS = 8  # a small page keeps the brute force fast; SGLang's is 64 (the SGLang test uses it)


def cyclic_tables(lengths: list[int], P: int, n_pages: int, gen: torch.Generator,
                  page: int = PS) -> torch.Tensor:
    """Request page tables as SGLang's classed allocator hands them out: request ``i``'s
    ``k``-th page from class ``(b_i + k) % P`` (random rotation base ``b_i``), each class's
    pages in random order, page 0 of every rank reserved. ``int32 [rows, W]``, ``W`` a
    multiple of ``P``, 0 padding."""
    per = n_pages // P
    free = [((torch.randperm(per - 1, generator=gen) + 1) * P + r).tolist() for r in range(P)]
    rows = []
    for L in lengths:
        b = int(torch.randint(0, P, (1,), generator=gen))
        rows.append([free[(b + k) % P].pop() for k in range(-(-L // page))])
    W = max(1, max(len(r) for r in rows))
    W = -(-W // P) * P
    real = torch.zeros(len(rows), W, dtype=torch.int32)
    for i, r in enumerate(rows):
        real[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return real


def walk(real: torch.Tensor, lengths: list[int], P: int, rank: int, page: int = PS):
    """The view by hand: (local table, local length, position per local column) per row."""
    out = []
    for row, L in zip(real.tolist(), lengths):
        table, positions = [], []
        for j, p in enumerate(row[: -(-L // page)]):
            if p % P == rank:
                table.append(p // P)
                positions += [page * j + o if page * j + o < L else -1 for o in range(page)]
        out.append((table, sum(x >= 0 for x in positions), positions))
    return out


def lengths_for(P: int, page: int = PS) -> list[int]:
    return [0, 1, page - 1, page, page + 1, page * P - 1, page * P + 1, 5 * page * P + 3, 217]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_each_ranks_view_equals_a_walk_of_the_page_table(P):
    gen = torch.Generator().manual_seed(P)
    lengths = lengths_for(P)
    real = cyclic_tables(lengths, P, 64 * P, gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    total = torch.zeros(len(lengths), dtype=torch.int64)
    for rank in range(P):
        st = PageStripe(P, rank, PS)
        v = st.view(real, lens)
        st.check_balanced(real, lens)
        Wl = st.width(real.shape[1])
        assert v.table.shape == (len(lengths), Wl) and v.table.dtype == torch.int32
        assert v.positions.shape == (len(lengths), Wl * PS)
        for b, (table, n, positions) in enumerate(walk(real, lengths, P, rank)):
            assert v.table[b, : len(table)].tolist() == table
            assert int(v.lengths[b]) == n
            assert v.positions[b, : len(positions)].tolist() == positions
            assert (v.positions[b, len(positions):] == -1).all()
            # the valid local columns are exactly [0, length): what the kernel scores
            assert ((v.positions[b] >= 0).nonzero().flatten() == torch.arange(n)).all()
        total += v.lengths
    assert total.tolist() == lengths  # the ranks' tokens partition every request


def score(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A stand-in indexer score: one dot product per key (``[rows, d] x [.., n, d]``)."""
    return torch.einsum("rd,rnd->rn", q, keys)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_striped_topk_equals_the_unsharded_topk(P):
    """Per-rank caches holding only owned pages, each rank scoring its own local columns:
    every rank's merged top-k equals the unsharded top-k over all keys, exact ties (repeated
    keys) included, for rows with no token on some ranks and rows shorter than k."""
    gen = torch.Generator().manual_seed(10 + P)
    lengths = lengths_for(P)
    real = cyclic_tables(lengths, P, 64 * P, gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    n_pages, d, K = 64 * P, 4, 24
    cache = torch.randint(-3, 4, (n_pages, PS, d)).float()  # small integers: many exact ties
    q = torch.randint(-2, 3, (len(lengths), d)).float()
    W = real.shape[1]
    full = cache[real.long()].reshape(len(lengths), W * PS, d)
    ref = topk_exact(score(q, full), lens.long(), K)

    def rank_main(peers):
        st = PageStripe(P, peers.rank, PS)
        local = cache[peers.rank::P]  # this rank's pages, at local page l // P
        v = st.view(real, lens)
        keys = local[v.table.long()].reshape(len(lengths), -1, d)
        logits = torch.cat([score(q, keys), torch.zeros(len(lengths), 5)], 1)  # wider: cut
        return striped_topk(logits, v, lens, K, peers.all_gather)

    for got in run_ranks(P, rank_main):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("P", [2, 3, 8])
def test_assemble_rebuilds_the_replicated_rows(P):
    gen = torch.Generator().manual_seed(20 + P)
    real = cyclic_tables([40, 1, 77, 8 * P], P, 32 * P, gen)
    pages = real[real > 0].long()  # a prefill batch's pages, concatenated
    cache = torch.randint(0, 256, (32 * P, 12), dtype=torch.uint8, generator=gen)

    def rank_main(peers):
        st = PageStripe(P, peers.rank, PS)
        return st.assemble(cache[peers.rank::P].clone(), pages, peers.all_gather)

    for got in run_ranks(P, rank_main):
        assert torch.equal(got, cache[pages])


def test_tables_that_do_not_cycle_are_refused_on_the_host_and_dropped_in_production():
    P = 2
    real = torch.tensor([[2, 4, 6, 8]], dtype=torch.int32)  # every page on rank 0
    lens = torch.tensor([4 * PS], dtype=torch.int32)
    st = PageStripe(P, 0, PS)
    with pytest.raises(ShapeError, match="do not cycle"):
        st.check_balanced(real, lens)
    v = st.view(real, lens)  # production: the pages past the width are left out, no overrun
    assert v.table.tolist() == [[1, 2]] and int(v.lengths[0]) == 2 * PS
    full = st.view(real, lens, width=4)  # the replicated table's width serves any order
    assert full.table.tolist() == [[1, 2, 3, 4]] and int(full.lengths[0]) == 4 * PS
    assert full.positions[0].tolist() == list(range(4 * PS))


@pytest.mark.parametrize("P", [2, 4])
def test_full_width_views_serve_pages_in_any_order(P):
    """Pages from one shuffled free list (no class cycle: a plain paged allocator after
    frees): with ``width = W`` every rank's top-k still merges to the unsharded one."""
    gen = torch.Generator().manual_seed(30 + P)
    lengths = lengths_for(P)
    free = (torch.randperm(64 * P - 1, generator=gen) + 1).tolist()
    W = max(-(-L // PS) for L in lengths)
    real = torch.zeros(len(lengths), W, dtype=torch.int32)
    for b, L in enumerate(lengths):
        n = -(-L // PS)
        real[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    d, K = 4, 24
    cache = torch.randint(-3, 4, (64 * P, PS, d)).float()
    q = torch.randint(-2, 3, (len(lengths), d)).float()
    ref = topk_exact(score(q, cache[real.long()].reshape(len(lengths), W * PS, d)),
                     lens.long(), K)

    def rank_main(peers):
        st = PageStripe(P, peers.rank, PS)
        v = st.view(real, lens, width=W)
        keys = cache[peers.rank::P][v.table.long()].reshape(len(lengths), -1, d)
        return striped_topk(score(q, keys), v, lens, K, peers.all_gather)

    for got in run_ranks(P, rank_main):
        assert torch.equal(got, ref)
    with pytest.raises(ShapeError, match="do not cycle"):  # the same verdict on every rank
        PageStripe(P, 1, PS).check_balanced(real, lens)


def test_bad_arguments_are_refused():
    for bad in [(0, 0), (2, 2), (2, -1), (True, 0)]:
        with pytest.raises(ShapeError):
            PageStripe(*bad)
    st = PageStripe(2, 0, PS)
    with pytest.raises(ShapeError, match="page table"):
        st.view(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ShapeError, match="lengths"):
        st.view(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    v = st.view(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ShapeError, match="local_logits"):
        striped_topk(torch.zeros(2, 3), v, torch.zeros(2, dtype=torch.int32), 4, lambda t: t)
