"""Index-K striped by page, scored by SGLang 0.5.23's own paged MQA-logits function
(``layers/attention/dsv4/indexer.py: fp8_paged_mqa_logits_torch``, the CPU twin of DeepGEMM's
``fp8_paged_mqa_logits`` that ``dsa/utils.py`` selects) over per-rank caches, in 8 spawned CPU
processes joined by gloo (sub-groups of P = 2, 4 and 8 ranks).

Each rank's cache holds only the pages it owns (SGLang's ``PageInterleavePlacement``: page
``l`` on rank ``l % P`` at local page ``l // P``), filled from GLM-5-shaped FP8 keys (128
values and an fp32 scale per token, 64-token pages); page tables come as SGLang's classed
allocator hands them out (a request's ``k``-th page from class ``(b + k) % P``). Every rank's
merged top-k (:func:`ulacache.index_stripe.striped_topk`) must equal the top-k of the same
function over one replicated cache, for lengths 1, 63, 65, 64P - 1, 64P + 1 and longer (so
some ranks hold no token of a request), over decode steps whose tables grow, and for a verify
batch (each request's rows at its draft positions, the kernel's ``next_n = 1`` rows); a
prefill batch's pages gathered from the ranks (:meth:`PageStripe.assemble`) equal the
replicated cache's rows byte for byte.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

WORLD = 8
PG, D, H, K = 64, 128, 8, 96  # page, key width, indexer heads, top-k
N_PAGES = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Case:
    """The batch every rank rebuilds identically (seeded): page tables from per-class free
    lists with a rotation base per request, FP8 keys and scales, queries and weights."""

    def __init__(self, P: int, lengths: list[int], seed: int):
        self.P, self.gen = P, torch.Generator().manual_seed(seed)
        per = N_PAGES // P
        self.free = [((torch.randperm(per - 1, generator=self.gen) + 1) * P + r).tolist()
                     for r in range(P)]
        self.base = [int(torch.randint(0, P, (1,), generator=self.gen)) for _ in lengths]
        self.pages: list[list[int]] = [[] for _ in lengths]
        self.lengths = [0] * len(lengths)
        self.glob = torch.zeros(N_PAGES, PG * (D + 4), dtype=torch.uint8)
        self.extend(lengths)

    def extend(self, lengths: list[int]) -> None:
        """Grow request ``i`` to ``lengths[i]`` tokens: new pages from the next class of its
        cycle, new keys written (a few copied from earlier tokens: exact ties)."""
        for i, L in enumerate(lengths):
            old = self.lengths[i]
            while len(self.pages[i]) * PG < L:
                k = len(self.pages[i])
                self.pages[i].append(self.free[(self.base[i] + k) % self.P].pop())
            if L > old:
                keys = torch.randn(L - old, D, generator=self.gen).to(torch.float8_e4m3fn)
                scales = torch.rand(L - old, generator=self.gen) + 0.5
                if L - old > 8:
                    keys[5], scales[5] = keys[2], scales[2]
                self._write(i, torch.arange(old, L), keys, scales)
            self.lengths[i] = L

    def _write(self, i: int, pos: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor):
        pages = torch.tensor(self.pages[i])[pos // PG]
        cache = self.glob
        cache[:, : PG * D].view(-1, PG, D)[pages, pos % PG] = keys.view(torch.uint8)
        cache[:, PG * D:].view(-1, PG, 4)[pages, pos % PG] = scales.view(torch.uint8).view(-1, 4)

    def table(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``real int32 [rows, W]`` (``W`` a multiple of ``P``) and ``lengths int32 [rows]``."""
        rows = list(range(len(self.pages))) if rows is None else rows
        W = max(len(self.pages[i]) for i in rows)
        W = -(-W // self.P) * self.P
        real = torch.zeros(len(rows), W, dtype=torch.int32)
        for b, i in enumerate(rows):
            real[b, : len(self.pages[i])] = torch.tensor(self.pages[i], dtype=torch.int32)
        return real, torch.tensor([self.lengths[i] for i in rows], dtype=torch.int32)

    def local_cache(self, rank: int) -> torch.Tensor:
        return self.glob[rank::self.P].clone()  # global page l -> local page l // P


def _logits(cache, q, weights, lengths, table):
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    return fp8_paged_mqa_logits_torch(q, cache.view(cache.shape[0], PG, 1, D + 4), weights,
                                      lengths, table, None, table.shape[1] * PG,
                                      clean_logits=False)


def _check(case: Case, rank: int, gather, real, lengths, gen) -> bool:
    """One batch: every rank's merged top-k against the replicated cache's."""
    from ulacache.index_stripe import PageStripe, striped_topk
    from ulacache.indexer import topk_exact

    q = (torch.randn(real.shape[0], 1, H, D, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    w = torch.randn(real.shape[0], H, generator=gen)
    want = topk_exact(_logits(case.glob, q, w, lengths, real), lengths.long(), K)
    st = PageStripe(case.P, rank, PG)
    st.check_balanced(real, lengths)
    view = st.view(real, lengths)
    got = striped_topk(_logits(case.local_cache(rank), q, w, view.lengths, view.table), view,
                       lengths, K, gather)
    return bool(torch.equal(got, want))


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        results = {}
        for P in (2, 4, 8):
            group = dist.new_group(list(range(P)))  # every rank takes part in creating it
            if rank >= P:
                continue

            def gather(t, group=group, P=P):
                parts = [torch.empty_like(t) for _ in range(P)]
                dist.all_gather(parts, t.contiguous(), group=group)
                return torch.stack(parts)

            from ulacache.index_stripe import PageStripe

            gen = torch.Generator().manual_seed(100 + P)  # queries: the same on every rank
            lengths = [1, 63, 65, 64 * P - 1, 64 * P + 1, 3000, 5000 + P]
            case = Case(P, lengths, seed=P)
            ok = []
            for step in range(3):  # decode steps: one token more each, tables grow
                real, lens = case.table()
                ok.append(_check(case, rank, gather, real, lens, gen))
                case.extend([n + 1 + 63 * (step == 1) for n in case.lengths])
            real, lens = case.table([i for i in range(len(lengths)) for _ in range(3)])
            lens = lens - torch.tensor([2, 1, 0] * len(lengths), dtype=torch.int32)
            ok.append(_check(case, rank, gather, real, lens.clamp(min=1), gen))  # verify
            pages = torch.tensor([p for i in (2, 4, 6) for p in case.pages[i]])  # prefill
            rows = PageStripe(P, rank, PG).assemble(case.local_cache(rank), pages, gather)
            results[str(P)] = {"topk": ok, "prefill": bool(torch.equal(rows,
                                                                      case.glob[pages]))}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_sglang_logits_over_page_striped_index_k_give_the_replicated_topk(tmp_path):
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for P in (2, 4, 8):
            if rank >= P:
                assert str(P) not in results
                continue
            res = results[str(P)]
            assert res["topk"] == [True] * 4, (rank, P, res)
            assert res["prefill"], (rank, P)
