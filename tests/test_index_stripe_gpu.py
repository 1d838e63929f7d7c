"""Striped index-K scored by DeepGEMM's ``fp8_paged_mqa_logits`` over per-rank page tables
(issue 21's device check; ``bench/device_check.sh`` runs it with every ``gpu`` test).

One process plays the ``P`` ranks on one GPU: rank ``r``'s cache holds only its pages
(``glob[r::P]``, page ``l`` at local page ``l // P``), its table and context lengths are
:meth:`PageStripe.view` of the batch's page table, DeepGEMM scores each rank's table, and the
ranks' candidates are merged as the all-gather would (``merge_candidates`` over the stacked
candidates). The merged top-k must equal the exact top-k of DeepGEMM's logits over the
replicated cache, pages handed out in a shuffled order (not cycling through the ranks), for
lengths 1, 63, 65, 64P +- 1 and thousands. Needs CUDA and DeepGEMM (skipped otherwise).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
deep_gemm = pytest.importorskip("deep_gemm")

from ulacache.index_stripe import PageStripe  # noqa: E402
from ulacache.indexer import local_candidates, merge_candidates, topk_exact  # noqa: E402

PG, D, H, K, N_PAGES = 64, 128, 64, 2048, 4096


def _logits(cache, q, w, lengths, table):
    """DeepGEMM's paged MQA logits ``float32 [rows, W * 64]`` as SGLang calls it
    (``dsa_indexer._get_topk_paged``: next_n 1, ``[rows, 1]`` context lengths)."""
    ctx = lengths.to(torch.int32).view(-1, 1).contiguous()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = deep_gemm.get_paged_mqa_logits_metadata(ctx, PG, sms)
    return deep_gemm.fp8_paged_mqa_logits(q, cache.view(cache.shape[0], PG, 1, D + 4), w, ctx,
                                          table.to(torch.int32).contiguous(), sched,
                                          table.shape[1] * PG, clean_logits=False)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_deepgemm_over_per_rank_tables_merges_to_the_replicated_topk(P):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(P)
    glob = torch.zeros(N_PAGES, PG * (D + 4), dtype=torch.uint8)
    keys = torch.randn(N_PAGES * PG, D, generator=gen).to(torch.float8_e4m3fn)
    glob[:, : PG * D] = keys.view(torch.uint8).view(N_PAGES, PG * D)
    scales = (torch.rand(N_PAGES * PG, generator=gen) + 0.5).view(torch.uint8)
    glob[:, PG * D:] = scales.view(N_PAGES, PG * 4)
    lengths = torch.tensor([1, 63, 65, 64 * P - 1, 64 * P + 1, 3000, 20000 + P],
                           dtype=torch.int32)
    W = -(-int(lengths.max()) // PG)
    free = (torch.randperm(N_PAGES - 1, generator=gen) + 1).tolist()
    real = torch.zeros(len(lengths), W, dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):
        for j in range(-(-n // PG)):
            real[b, j] = free.pop()
    glob, real, lengths = glob.to(dev), real.to(dev), lengths.to(dev)
    q = (torch.randn(len(lengths), 1, H, D, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    w = torch.randn(len(lengths), H, generator=gen)
    q, w = q.to(dev), w.to(dev)
    want = topk_exact(_logits(glob, q, w, lengths, real), lengths.long(), K)
    cands = []
    for r in range(P):
        view = PageStripe(P, r, PG).view(real, lengths, width=W)
        local = _logits(glob[r::P].contiguous(), q, w, view.lengths, view.table)
        cands.append(local_candidates(local[:, : view.positions.shape[1]], view.positions,
                                      lengths, K))
    got = merge_candidates(torch.stack(cands), K)
    assert torch.equal(got, want)
