"""Striped index-K under SGLang 0.5.23 (``--ulacache-config '{"mode": "tp", "stripe_index_k":
true}'``), on CPU: ulacache's real TP pool in spawned ranks (P = 2 and P = 4, SGLang's own
distributed set-up over gloo), its index-K written and read through SGLang's seams and kernels.

Per rank, against SGLang's stock ``DSATokenToKVPool`` holding the same keys replicated:

- **storage**: the rank's index-K tensors hold ``ceil(pages / P) + 2`` pages per layer
  (asserted from the allocated tensors), and each owned token's bytes sit at its local row;
- **writes** through both seams: the pool's ``set_index_k_scale_buffer`` (SGLang's fallback
  store, its Triton kernel under the interpreter) and the ``_index_k_write_targets`` hook (what
  the fused CUDA store writes through), pages handed out in a shuffled order (not cycling
  through the ranks) to requests of lengths 1, 63, 65, 64P - 1, 64P + 1 and 1,000;
- **decode and verify**: SGLang's own ``Indexer._get_topk_paged`` (its torch paged-MQA-logits
  twin of DeepGEMM's kernel) through the ``_get_topk_paged`` hook gives, on every rank, the
  exact top-k of the same function over the replicated keys (ties planted), over decode steps
  whose tables grow and for a verify batch (rows at draft positions);
- **prefill**: ``get_index_k_scale_buffer`` (SGLang's gather kernel through each rank's read
  table, then the all-reduce) equals the stock pool's bytes exactly.
"""

from __future__ import annotations

import json
import os
import traceback
import types

import pytest
import torch

from .helpers import sglang_tp_ranks_init, spawn_ranks

pytest.importorskip("sglang")
# one worker sets the module's ranks up once (CI: --dist loadgroup), not one per worker
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang_tp_stripe")]

PAGE, D, H, K, L, N, RATIO = 64, 128, 8, 96, 2, 512, 8
TIMEOUT_S = 300


def _pools(rank: int):
    """(striped ulacache TP pool, stock replicated DSA pool) over the same logical space."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from ulacache.config import SGLangOptions
    from ulacache.patches.classes import UlaCacheDSATokenToKVPool

    opts = SGLangOptions(mode="tp", cpu_ratio=RATIO - 1, n_buckets=4, buffer_slots=128,
                         stripe_index_k=True)
    common = dict(page_size=PAGE, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
                  layer_num=L, device="cpu", index_head_dim=D, enable_memory_saver=False,
                  kv_cache_dim=80)
    pool = UlaCacheDSATokenToKVPool(N, **common, max_running_requests=8,
                                    host_to_device_ratio=RATIO, ulacache_options=opts)
    ref = DSATokenToKVPool(N, **common, index_buf_size=N * RATIO)
    return pool, ref


class Batch:
    """Requests over pages handed out in a shuffled order (every rank the same), or with
    ``allocator`` by a logical allocator's ``alloc_extend`` (ulacache's page-classed one)."""

    def __init__(self, P: int, lengths: list[int], gen: torch.Generator, n_pages: int,
                 allocator=None):
        self.gen = gen
        self.free = (torch.randperm(n_pages - 2, generator=gen) + 1).tolist()  # no sink page
        self.pages: list[list[int]] = [[] for _ in lengths]
        self.lengths = [0] * len(lengths)
        self.allocator = allocator

    def _new_locs(self, i: int, old: int, n: int) -> torch.Tensor:
        if self.allocator is not None:
            last = torch.tensor([self.pages[i][-1] * PAGE + (old - 1) % PAGE if old else -1])
            a, b = torch.tensor([old]), torch.tensor([n])
            locs = self.allocator.alloc_extend(a, a, b, b, last, n - old)
            assert locs is not None
            for j in range(-(-old // PAGE) * PAGE, n, PAGE):
                self.pages[i].append(int(locs[j - old]) // PAGE)
            return locs
        while len(self.pages[i]) * PAGE < n:
            self.pages[i].append(self.free.pop())
        pos = torch.arange(old, n)
        pages = torch.tensor(self.pages[i], dtype=torch.int64)
        return pages[pos // PAGE] * PAGE + pos % PAGE

    def grow(self, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """New tokens of each request: ``(locs, fp8 keys, fp32 scales)`` per request."""
        out = []
        for i, n in enumerate(lengths):
            old = self.lengths[i]
            locs = self._new_locs(i, old, n)
            keys = torch.randn(n - old, D, generator=self.gen).to(torch.float8_e4m3fn)
            scales = torch.rand(n - old, generator=self.gen) + 0.5
            if n - old > 8:  # exact ties
                keys[5], scales[5] = keys[2], scales[2]
            self.lengths[i] = n
            out.append((locs, keys, scales))
        return out

    def table(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        W = max(len(self.pages[i]) for i in rows)
        real = torch.zeros(len(rows), W, dtype=torch.int32)
        for b, i in enumerate(rows):
            real[b, : len(self.pages[i])] = torch.tensor(self.pages[i], dtype=torch.int32)
        return real, torch.tensor([self.lengths[i] for i in rows], dtype=torch.int32)


def _indexer():
    """SGLang's ``Indexer`` methods on the attributes ``_get_topk_paged`` reads (the module
    itself needs a CUDA build to construct)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    shim = types.SimpleNamespace(index_topk=K, sm_count=1 << 20, n_heads=H, num_init_tokens=0,
                                 num_local_tokens=0,
                                 paged_mqa_logits_backend=types.SimpleNamespace(
                                     is_cutedsl=lambda: False, is_aiter=lambda: False),
                                 _get_index_k_read_buffer=Indexer._get_index_k_read_buffer)
    shim._mask_init_and_local_tokens = types.MethodType(Indexer._mask_init_and_local_tokens,
                                                        shim)
    return shim


def _metadata(real, lengths, expanded, verify: bool, exact: bool):
    """SGLang's ``DSAIndexerMetadata`` of a paged batch; ``exact``: its ``topk_transform`` is
    the reference: SGLang's torch top-k (``_topk_unfused``, dsa_topk_backend.py:272) over a
    stable descending sort, as the CPU servers run it (cpu_stand_ins.py section 10: the FP8
    logits tie often, ties to the lower position); positions in score order."""
    from sglang.srt.layers.attention.dsa import dsa_topk_backend
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    from tests.sglang_server.site.cpu_stand_ins import stable_topk

    class Exact(DSAIndexerMetadata):
        def topk_transform(self, logits, topk, *a, **kw):
            return dsa_topk_backend._topk_unfused(logits, self.get_seqlens_expanded(), topk,
                                                  topk_op=stable_topk,
                                                  topk_op_kwargs={"dim": -1})

    attn = types.SimpleNamespace(real_page_table=real, cache_seqlens_int32=lengths,
                                 dsa_seqlens_expanded=expanded,
                                 dsa_extend_seq_lens_list=[1] * real.shape[0])
    cls = Exact if exact else DSAIndexerMetadata
    return cls(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
               force_unfused_topk=True)


def _topk(pool, meta, mode, q, w, layer: int, striped: bool):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from ulacache.patches.sglang_index_stripe import get_topk_paged_around

    fb = types.SimpleNamespace(forward_mode=mode)
    with forward_context(ForwardContext(attn_backend=types.SimpleNamespace(
            token_to_kv_pool=pool))):
        if striped:
            return get_topk_paged_around(Indexer._get_topk_paged, _indexer(), fb, layer, q, w,
                                         meta)
        return Indexer._get_topk_paged(_indexer(), fb, layer, q, w, meta)


def scenario(rank: int, P: int) -> dict:
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from ulacache.index_stripe import PageStripe
    from ulacache.indexer import topk_exact
    from ulacache.patches.sglang_index_stripe import index_k_write_targets_around

    pool, ref = _pools(rank)
    store = pool.index_key_cache
    pages = (N * RATIO + PAGE + 1) // PAGE
    out: dict = {"stored_pages": [b.shape[0] for b in store.buffer],
                 "ref_pages": [b.shape[0] for b in ref.index_key_cache.buffer],
                 "bytes": sum(b.nbytes for b in store.buffer),
                 "ref_bytes": sum(b.nbytes for b in ref.index_key_cache.buffer),
                 "global_pages": pages}
    gen = torch.Generator().manual_seed(11 + P)
    batch_lengths = [1, 63, 65, 64 * P - 1, 64 * P + 1, 1000]
    batch = Batch(P, batch_lengths, gen, pages)

    def write(news):
        for locs, keys, scales in news:
            for layer in range(L):
                ref.set_index_k_scale_buffer(layer, locs, keys, scales)
            pool.set_index_k_scale_buffer(0, locs, keys, scales)  # the fallback seam
            for buf, rows, sel in index_k_write_targets_around(  # the fused store's seam
                    dsa_indexer._index_k_write_targets, pool, 1, locs):
                assert sel is None
                from sglang.kernels.ops.kvcache.dsa_index_k_cache import SetKAndS

                SetKAndS.execute(pool=pool, buf=buf, loc=rows, index_k=keys,
                                 index_k_scale=scales)

    write(batch.grow(batch_lengths))

    # storage: each owned token's bytes at its local row, in both layers
    st = PageStripe(P, rank, PAGE)
    live = torch.cat([_locs(batch, i) for i in range(len(batch.lengths))])
    mine = live[st.owner(live // PAGE) == rank]
    ok = True
    for layer in range(L):
        a = _token_bytes(store.buffer[layer], st.local_rows(mine))
        b = _token_bytes(ref.index_key_cache.buffer[layer], mine)
        ok &= bool(torch.equal(a, b))
    out["owned_bytes_equal"], out["owned_tokens"] = ok, int(mine.numel())

    rows = list(range(len(batch.lengths)))

    def decode_steps(batch: Batch) -> tuple[list[bool], list[tuple[int, int]]]:
        """Decode steps whose tables grow: per layer, whether the striped top-k equals the
        replicated one, and per step (this rank's table width, the replicated one's)."""
        results, widths = [], []
        for step in range(3):
            if step:
                write(batch.grow([n + 1 + 40 * step for n in batch.lengths]))
            real, lengths = batch.table(rows)
            q = (torch.randn(len(rows), H, D, generator=gen) * 0.5).to(torch.float8_e4m3fn)
            w = torch.randn(len(rows), H, 1, generator=gen)
            meta = _metadata(real, lengths, lengths, False, False)
            fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)
            widths.append((store.stripe.decode_metadata(meta, fb, 0).get_page_table_64()
                           .shape[1], real.shape[1]))
            for layer in range(L):
                want = _topk(ref, _metadata(real, lengths, lengths, False, True),
                             ForwardMode.DECODE, q, w, layer, striped=False)
                got = _topk(pool, _metadata(real, lengths, lengths, False, False),
                            ForwardMode.DECODE, q, w, layer, striped=True)
                # the same positions in the same (score) order: a sum over them rounds alike
                results.append(bool(torch.equal(got, want)))
                exact = topk_exact(_replicated_logits(ref, layer, q, w, lengths, real),
                                   lengths.long(), K)  # the same set of positions
                assert bool(torch.equal(want.long().sort(-1).values, exact.sort(-1).values))
        return results, widths

    out["decode_equal"], out["decode_widths"] = decode_steps(batch)

    # verify: 3 rows per request at its last three positions
    steps = 3
    real, lengths = batch.table(rows)
    real_x = real.repeat_interleave(steps, 0)
    expanded = (lengths.repeat_interleave(steps) - torch.tensor([2, 1, 0] * len(rows))
                ).clamp(min=1).to(torch.int32)
    q = (torch.randn(len(rows) * steps, H, D, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    w = torch.randn(len(rows) * steps, H, 1, generator=gen)
    v = []
    for layer in range(L):
        want = _topk(ref, _metadata(real_x, lengths, expanded, True, True),
                     ForwardMode.TARGET_VERIFY, q, w, layer, striped=False)
        got = _topk(pool, _metadata(real_x, lengths, expanded, True, False),
                    ForwardMode.TARGET_VERIFY, q, w, layer, striped=True)
        v.append(bool(torch.equal(got, want)))
    out["verify_equal"] = v

    # prefill: the ragged gather of the batch's keys
    pf = []
    for sel in ([5, 0, 2], rows):
        real, lengths = batch.table(sel)
        for layer in range(L):
            args = (lengths, real, int(lengths.sum()), int(lengths.max()))
            a = pool.get_index_k_scale_buffer(layer, *args)
            b = ref.get_index_k_scale_buffer(layer, *args)
            pf.append(all(bool(torch.equal(x, y)) for x, y in zip(a, b)))
    out["prefill_equal"] = pf

    # the same decode steps over pages from ulacache's own allocator, page-classed with the
    # index-K striped: every rank's table is ceil(W / P) pages wide, the top-k unchanged
    from ulacache.patches.classes import UlaCacheTokenToKVPoolAllocator

    alloc = UlaCacheTokenToKVPoolAllocator(N, page_size=PAGE, dtype=torch.bfloat16,
                                           device="cpu", kvcache=pool, need_sort=False,
                                           host_to_device_ratio=RATIO)
    out["allocator"] = [type(alloc.logical_attn_allocator).__name__, store.stripe.pages_cycle,
                        alloc.request_slot_reserve(has_req_pool_slot=True)]
    classed = Batch(P, batch_lengths, gen, pages, allocator=alloc.logical_attn_allocator)
    write(classed.grow(batch_lengths))
    out["classed_decode_equal"], out["classed_widths"] = decode_steps(classed)
    pool.close_peers()
    return out


def _locs(batch: Batch, i: int) -> torch.Tensor:
    pos = torch.arange(batch.lengths[i])
    pages = torch.tensor(batch.pages[i], dtype=torch.int64)
    return pages[pos // PAGE] * PAGE + pos % PAGE


def _token_bytes(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Key and scale bytes of token rows of an index-K buffer ``[pages, 64 * 132]``."""
    p, o = rows // PAGE, rows % PAGE
    keys = buf[:, : PAGE * D].view(-1, PAGE, D)[p, o]
    scales = buf[:, PAGE * D:].view(-1, PAGE, 4)[p, o]
    return torch.cat([keys, scales], 1)


def _replicated_logits(ref, layer, q, w, lengths, real):
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    cache = ref.index_key_cache.buffer[layer]
    return fp8_paged_mqa_logits_torch(q.unsqueeze(1), cache.view(cache.shape[0], PAGE, 1, D + 4),
                                      w.squeeze(2), lengths, real, None,
                                      real.shape[1] * PAGE, clean_logits=False)


def _rank_main(rank: int, port: int, out_dir: str, P: int) -> None:
    os.environ["SGLANG_DSA_TOPK_BROADCAST"] = "1"
    os.environ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        sglang_tp_ranks_init(rank, P, port)
        results = scenario(rank, P)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results = {"error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(results, f)
    os._exit(0)  # skip SGLang's atexit teardown of the process groups


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    P = request.param
    out = tmp_path_factory.mktemp(f"ula_stripe_{P}")
    return P, spawn_ranks(_rank_main, P, out, TIMEOUT_S, P)


def test_each_rank_stores_one_pth_of_index_k(ranks):
    P, results = ranks
    for res in results:
        stored = -(-res["global_pages"] // P) + 2
        assert res["stored_pages"] == [stored] * L
        assert res["ref_pages"] == [res["global_pages"]] * L
        assert res["bytes"] * res["global_pages"] == res["ref_bytes"] * stored
    assert sum(r["owned_tokens"] for r in results) == sum([1, 63, 65, 64 * P - 1,
                                                           64 * P + 1, 1000])


def test_both_write_seams_put_owned_tokens_at_their_local_rows(ranks):
    _, results = ranks
    assert all(r["owned_bytes_equal"] for r in results)


def test_decode_topk_equals_the_replicated_one_on_every_rank(ranks):
    _, results = ranks
    for r in results:
        assert r["decode_equal"] == [True] * (3 * L)


def test_page_classed_tables_are_one_pth_as_wide_and_the_topk_unchanged(ranks):
    """Pages from ulacache's page-classed allocator (a request's k-th page on rank k mod P):
    each rank's decode table is ceil(W / P) pages wide (against W for pages in any order) and
    the merged top-k still equals the replicated one."""
    P, results = ranks
    for res in results:
        assert res["allocator"] == ["PositionClassedPageAllocator", True, P * PAGE], res
        assert res["classed_decode_equal"] and all(res["classed_decode_equal"]), res
        assert all(w == -(-W // P) for w, W in res["classed_widths"]), res["classed_widths"]
        assert all(w == W for w, W in res["decode_widths"]), res["decode_widths"]


def test_verify_topk_equals_the_replicated_one_on_every_rank(ranks):
    _, results = ranks
    for r in results:
        assert r["verify_equal"] == [True] * L


def test_prefill_gather_equals_the_replicated_bytes(ranks):
    _, results = ranks
    for r in results:
        assert r["prefill_equal"] == [True] * (2 * L)


def test_indexers_that_mask_by_position_or_read_the_replicated_table_are_refused():
    """``check_indexer`` refuses, in one line, an indexer whose paged path assumes local column
    == request position (``index_init_tokens`` / ``index_local_tokens``) or whose logits
    backend reads the replicated page table (cutedsl, aiter); a DeepGEMM indexer with neither
    passes. The paged top-k hook checks each indexer once (its config is fixed), not per
    layer call."""
    from ulacache.errors import ConfigError
    from ulacache.patches import sglang_index_stripe as stripe

    def backend(name=None):
        return types.SimpleNamespace(is_cutedsl=lambda: name == "cutedsl",
                                     is_aiter=lambda: name == "aiter")

    ok = types.SimpleNamespace(num_init_tokens=0, num_local_tokens=0,
                               paged_mqa_logits_backend=backend())
    stripe.check_indexer(ok)
    for bad, match in [(dict(num_init_tokens=4), "index_init_tokens"),
                       (dict(num_local_tokens=128), "index_local_tokens"),
                       (dict(paged_mqa_logits_backend=backend("cutedsl")), "cutedsl"),
                       (dict(paged_mqa_logits_backend=backend("aiter")), "aiter")]:
        with pytest.raises(ConfigError, match=match):
            stripe.check_indexer(types.SimpleNamespace(**{**vars(ok), **bad}))

    import sglang.srt.model_executor.forward_context as fc
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata

    calls = []
    store = types.SimpleNamespace(stripe=types.SimpleNamespace(
        decode_metadata=lambda metadata, batch, layer: ("striped", layer)))
    orig_store, orig_check = stripe.striped_store, stripe.check_indexer
    got_pool = fc.get_token_to_kv_pool
    stripe.striped_store = lambda pool: store
    stripe.check_indexer = calls.append
    fc.get_token_to_kv_pool = lambda: None
    try:
        meta = DSAIndexerMetadata.__new__(DSAIndexerMetadata)
        indexer = types.SimpleNamespace()
        for layer in range(3):
            out = stripe.get_topk_paged_around(lambda *a: a[5], indexer, None, layer, None,
                                               None, meta)
            assert out == ("striped", layer)
        assert calls == [indexer]
    finally:
        stripe.striped_store, stripe.check_indexer = orig_store, orig_check
        fc.get_token_to_kv_pool = got_pool
