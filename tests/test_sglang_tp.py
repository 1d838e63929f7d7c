"""TP mode under SGLang 0.5.23 (``--ulacache-config '{"mode": "tp"}'``), on CPU.

Two spawned processes form a real TP group (SGLang's ``init_distributed_environment`` and
``initialize_model_parallel`` over gloo, pynccl and custom all-reduce off, args published with
``--tp 2``). Each rank builds ulacache's real pool, allocator and coordinator (the TP subclasses,
chosen at construction from the options) over SGLang's own ``ReqToTokenPool``, paged allocator
and DSA pool base, its ``kv_buffer`` shared with the peer through POSIX shared memory. Both
ranks run the same call sequence (SPMD) and check, per rank:

- every row ``swap_in_selected_pages`` / the prefill translation returns holds exactly the bytes
  written for that logical token (own rows, this round's buffer copies, rows fetched from the
  peer), and every live token reads back from its owner (GPU or CPU tier);
- own rows hold only tokens with ``loc % P == rank``, and all of them;
- per-rank pool rows (GPU + CPU) are ``1/P`` of the DP (replicated) pool's for the same ``N``;
- ``alloc_extend`` returns ``None`` on both ranks or on neither (natural and one-rank pressure);
- the ``topk_transform`` hook's sharded merge equals the full top-k on both ranks;
- a layer that shares its anchor's selection loads its own layer's peer rows (a mutant that
  skips that load is caught).

Not run here (no kernels on CPU): CUDA IPC peers, pynccl collectives and CUDA-graph capture,
fp8 (Triton) writes, DeepGEMM logits, a real model. Single-process tests cover the server-args
checks, the sizing hook and the TP hook verification.
"""

from __future__ import annotations

import json
import os
import traceback
import types

import pytest
import torch

from .helpers import (
    sglang_alloc_decode,
    sglang_alloc_verify,
    sglang_topk,
    sglang_tp_ranks_init,
    sglang_verify_topk,
    spawn_ranks,
)

sglang = pytest.importorskip("sglang")
# one worker sets the module's ranks up once (CI: --dist loadgroup), not one per worker
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang_tp")]

KVL, ROPE, L, K, PAGE, P, N = 64, 16, 4, 32, 64, 2, 512
TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# the rank's side: SGLang's calls on one TP rank
# ---------------------------------------------------------------------------------------------
class TPHarness:
    """Plays SGLang's side on one rank (as the DP contract test's Harness does), plus the
    classification of every row it checks: own / this round's copy / other buffered copy."""

    def __init__(self, shared: bool, validate: bool, rank: int, max_reqs: int = 4,
                 buffer_slots: int = 400, mode: str = "tp", **options):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from ulacache.config import SGLangOptions
        from ulacache.patches.classes import (
            UlaCacheCoordinator,
            UlaCacheDSATokenToKVPool,
            UlaCacheTokenToKVPoolAllocator,
        )

        tp_only = dict(buffer_slots=buffer_slots, shard_indexer=True) if mode == "tp" else {}
        opts = SGLangOptions(mode=mode, cpu_ratio=3, n_buckets=4, validate=validate,
                             **tp_only, **options)
        ratio = opts.host_to_device_ratio
        self.rank = rank
        self.rtp = ReqToTokenPool(size=max_reqs, max_context_len=4096, device="cpu",
                                  enable_memory_saver=False)
        skip = [i % 2 == 1 for i in range(L)] if shared else None
        self.pool = UlaCacheDSATokenToKVPool(
            N, page_size=PAGE, kv_lora_rank=KVL, dtype=torch.bfloat16, qk_rope_head_dim=ROPE,
            layer_num=L, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=KVL + ROPE, max_running_requests=max_reqs, skip_topk_layers=skip,
            host_to_device_ratio=ratio, ulacache_options=opts)
        self.alloc = UlaCacheTokenToKVPoolAllocator(
            N, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=self.pool,
            need_sort=False, host_to_device_ratio=ratio)
        self.coord = UlaCacheCoordinator(
            req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, top_k=K,
            device_buffer_size=0, device="cpu", tp_group=self.pool.ula_tp.group.cpu_group,
            host_to_device_ratio=ratio, num_draft_tokens=2)
        self.core = self.pool.core
        self.G = self.core.config.gpu_slots
        self.gen = torch.Generator().manual_seed(0)  # same draws on both ranks (SPMD)
        self.latent: dict[tuple[int, int], torch.Tensor] = {}
        self.live: set[int] = set()
        self.lens: dict[int, int] = {}
        self.reqs: dict[int, types.SimpleNamespace] = {}
        self.seen = {"own": 0, "fresh": 0, "buffered": 0, "shared_buffered": 0}
        self.fresh: set[int] = set()
        self.strict, self.mismatches = True, 0  # strict off: count mismatches (mutant runs)
        self.staged_chunks = 0  # prefill chunks served through the prefill stage (mode "dcp")

    def close(self) -> None:
        self.coord.destroy()
        self.pool.close_peers()

    # -- writes and checks ------------------------------------------------------------------
    def write_kv(self, locs: torch.Tensor) -> None:
        for layer in range(L):
            nope = torch.randn(locs.numel(), 1, KVL, generator=self.gen).to(torch.bfloat16)
            rope = torch.randn(locs.numel(), 1, ROPE, generator=self.gen).to(torch.bfloat16)
            self.pool.set_mla_kv_buffer(types.SimpleNamespace(layer_id=layer), locs, nope, rope)
            for i, loc in enumerate(locs.tolist()):
                self.latent[(layer, loc)] = torch.cat([nope[i, 0], rope[i, 0]])
        self.live.update(locs.tolist())
        self.fresh = set(locs.tolist())

    def check_rows(self, layer: int, rows: torch.Tensor, locs: torch.Tensor,
                   buf: torch.Tensor | None = None) -> None:
        """rows (of ``buf``, default kv_buffer[layer]) hold the latent written for locs; -1
        stays -1."""
        assert rows.dtype == torch.int32
        assert torch.equal(rows < 0, locs < 0)
        buf = self.pool.kv_buffer[layer] if buf is None else buf
        anchor = self.core.groups[self.core.layer_to_group[layer]].layers[0] == layer
        for r, loc in zip(rows.reshape(-1).tolist(), locs.reshape(-1).tolist()):
            if loc < 0:
                continue
            if not torch.equal(buf[r, 0], self.latent[(layer, loc)]):
                assert not self.strict, (self.rank, layer, loc, r)
                self.mismatches += 1
                continue
            if PAGE <= r < PAGE + self.G:
                assert loc % P == self.rank, (loc, r)  # own rows: own tokens only
                self.seen["own"] += 1
            else:
                assert r > PAGE + self.G and loc % P != self.rank, (loc, r)
                what = "fresh" if loc in self.fresh else "buffered"
                self.seen[what] += 1
                if what == "buffered" and not anchor:
                    self.seen["shared_buffered"] += 1

    def check(self) -> None:
        """Allocator + core invariants (collective), own rows hold exactly this rank's live
        tokens with their bytes, and every live token reads back from its owner."""
        self.alloc.check_integrity()
        for gi, g in enumerate(self.core.local.groups):
            mapped = torch.nonzero(g.loc[: g.n_logical] >= 0).reshape(-1)
            mine = {int(u) * P + self.rank for u in mapped}
            assert mine == {t for t in self.live if t % P == self.rank}, gi
            slots = torch.nonzero(g.gpu_owner[: g.gpu_slots] >= 0).reshape(-1)
            for layer in g.layers:
                buf = self.pool.kv_buffer[layer]
                for s in slots.tolist():
                    t = int(g.gpu_owner[s]) * P + self.rank
                    assert torch.equal(buf[PAGE + s, 0], self.latent[(layer, t)]), (layer, t)
        addrs = torch.tensor(sorted(self.live), dtype=torch.int64)
        for layer in range(L if self.live else 0):  # collective: same order on both ranks
            got = self.core.read(layer, addrs).view(torch.bfloat16)
            want = torch.stack([self.latent[(layer, t)] for t in addrs.tolist()])
            assert torch.equal(got, want), layer

    # -- the scheduler's calls ----------------------------------------------------------------
    def prefill(self, idx: int, n: int, chunk: int) -> None:
        req = types.SimpleNamespace(rid=f"r{idx}", hisparse_staging=False)
        self.reqs[idx] = req
        done = 0
        while done < n:
            m = min(chunk, n - done)
            last = self.rtp.req_to_token[idx, done - 1].long().view(1) if done else \
                torch.tensor([-1])
            locs = self.alloc.alloc_extend(torch.tensor([done]), torch.tensor([done]),
                                           torch.tensor([done + m]), torch.tensor([done + m]),
                                           last, m)
            assert locs is not None
            self.rtp.req_to_token[idx, done: done + m] = locs.to(torch.int32)
            self.write_kv(locs)
            pos = torch.randint(0, done + m, (m, K), generator=self.gen)
            pos[:, -3:] = -1
            table = torch.where(pos >= 0, self.rtp.req_to_token[idx][pos.clamp(min=0)].long(),
                                -1)
            self.staged_chunks += self.pool.staged([done + m])
            for layer in range(L):
                # what the forward_extend hook records and decides (a batch longer than the
                # pool reads its selections from the prefill stage, mode "dcp"; never in "tp")
                self.pool.current_layer_id = layer
                self.pool.staging = self.pool.staged([done + m])
                try:
                    buf = self.pool.get_key_buffer(layer)
                    rows = self.pool.translate_loc_to_hisparse_device(table.to(torch.int32))
                    self.check_rows(layer, rows.to(torch.int32), table, buf)
                finally:
                    self.pool.staging = False
            done += m
        self.lens[idx] = n
        self.coord.admit_request_into_staging(req)

    def decode_step(self, idxs: list[int], pad: int = 1) -> None:
        bs = len(idxs)
        ri, seq, out = sglang_alloc_decode(self, idxs)
        self.coord.map_last_loc_to_buffer(seq, out, ri, seq, ri)
        self.coord.num_real_reqs.fill_(bs)
        self.write_kv(out)
        topk, ri_pad, seq_pad = sglang_topk(self, idxs, K, pad)
        for layer in range(L):
            rows = self.coord.swap_in_selected_pages(ri_pad, seq_pad, topk, layer)
            assert rows.shape == (bs + pad, K) and (rows[bs:] == -1).all()
            locs = torch.where(topk[:bs] >= 0, self.rtp.req_to_token[
                ri.unsqueeze(1), topk[:bs].long().clamp(min=0)].long(), -1)
            self.check_rows(layer, rows[:bs], locs)

    def verify_step(self, idxs: list[int], steps: int = 2) -> None:
        bs = len(idxs)
        ri, prefix, locs = sglang_alloc_verify(self, idxs, steps)
        self.coord.prepare_spec_verify(types.SimpleNamespace(out_cache_loc=locs,
                                                             req_pool_indices=ri))
        self.coord.num_real_reqs.fill_(bs)
        self.write_kv(locs)
        topk = sglang_verify_topk(self, idxs, steps, K)
        req = ri.repeat_interleave(steps)
        flat = topk.view(bs * steps, K).long()
        want = torch.where(flat >= 0, self.rtp.req_to_token[req.unsqueeze(1),
                           flat.clamp(min=0)].long(), -1)
        for layer in range(L):
            rows = self.coord.swap_in_selected_pages(ri, prefix + steps, topk, layer)
            self.check_rows(layer, rows.view(bs * steps, K), want)
        for b, i in enumerate(idxs):  # accept the first draft token; the second is dead
            self.live.discard(int(locs[b * steps + 1]))
            self.lens[i] += 1

    def finish(self, idx: int) -> None:
        self.coord.request_finished(self.reqs.pop(idx))
        freed = self.rtp.req_to_token[idx, : self.lens.pop(idx)].long()
        self.alloc.free(freed)
        self.live.difference_update(freed.tolist())
        pages = set((freed // PAGE).tolist())  # whole pages go (rejected draft tails too)
        self.live = {t for t in self.live if t // PAGE not in pages}


# ---------------------------------------------------------------------------------------------
# scenarios (run on both ranks, same order)
# ---------------------------------------------------------------------------------------------
def scenario_perlayer(rank: int) -> dict:
    h = TPHarness(shared=False, validate=True, rank=rank)
    for idx, n in ((1, 300), (2, 420), (3, 250)):  # 970 tokens: ~485 per rank > G = 256
        h.prefill(idx, n, chunk=160)
        h.check()
    assert len(h.coord.collect_ready_reqs()) == 3
    for _ in range(6):  # no request ends a page with its accepted draft token
        h.decode_step([1, 2, 3])
    h.check()
    h.verify_step([1, 2, 3])
    h.decode_step([1, 2, 3])
    h.check()
    h.finish(2)
    h.prefill(4, 90, chunk=90)
    for _ in range(2):
        h.decode_step([1, 3, 4])
    h.check()
    counters = h.core.counters()
    stats = h.coord.get_token_stats()
    for idx in (1, 3, 4):
        h.finish(idx)
    h.check()  # nothing buffered anywhere: the buffers' cross-check gathers nothing
    capacity_back = h.alloc.available_size() == h.alloc.size_full
    h.close()
    return {"seen": h.seen, "capacity_back": capacity_back, "device_tokens": stats.device_tokens,
            "counters": {k: sum(c[k] for c in counters) for k in
                         ("promotions", "spills", "peer_fetches", "buffer_hits",
                          "new_buffered", "buffer_evictions", "peer_missing",
                          "buffer_overflow", "access_overflow", "place_overflow")}}


def scenario_prefetch(rank: int) -> dict:
    """The per-layer scenario's calls with the look-ahead prefetch on (both sources, a small
    cap): each rank prefetches its own stripe, no collective; every row checked as before."""
    from ulacache.config import PrefetchConfig

    h = TPHarness(shared=False, validate=True, rank=rank,
                  prefetch=PrefetchConfig(sources=("previous_layer", "draft"), fetch_cap=16))
    for idx, n in ((1, 300), (2, 420), (3, 250)):
        h.prefill(idx, n, chunk=160)
    h.coord.collect_ready_reqs()
    for i in range(8):  # checked after decode steps: a verify leaves its dead draft mapped
        if i % 4 == 3:
            h.verify_step([1, 2, 3])
        else:
            h.decode_step([1, 2, 3])
            h.check()
    counters = h.core.counters()
    for idx in (1, 2, 3):
        h.finish(idx)
    h.check()
    capacity_back = h.alloc.available_size() == h.alloc.size_full
    h.close()
    return {"capacity_back": capacity_back,
            "counters": {k: sum(c[k] for c in counters) for k in
                         ("prefetches", "promotions", "peer_fetches", "peer_missing",
                          "access_overflow")}}


def scenario_shared(rank: int) -> dict:
    # the smallest buffer the coordinator accepts (4 requests x 2 tokens x 33): copies are
    # evicted, so every step fetches peers' rows again
    h = TPHarness(shared=True, validate=False, rank=rank, buffer_slots=264)
    for idx, n in ((1, 350), (2, 300)):
        h.prefill(idx, n, chunk=200)
    h.coord.collect_ready_reqs()
    for _ in range(4):
        h.decode_step([1, 2])
    h.check()
    seen = dict(h.seen)
    # mutant: shared layers skip their own load; their freshly fetched rows must read wrong
    anchors = {g.layers[0] for g in h.core.groups}
    load = h.core.load
    h.core.load = lambda layer: load(layer) if layer in anchors else None
    h.strict = False
    for _ in range(2):
        h.decode_step([1, 2])
    h.close()
    return {"seen": seen, "mutant_caught": h.mismatches}


def scenario_pressure(rank: int) -> dict:
    """alloc_extend: None on both ranks or on neither. Validate on: with it off the collective
    room check is skipped (room is certain once ``prefill_fits`` held), so the injected
    one-rank shortage below is only reachable with it on."""
    import ulacache.errors as errors

    h = TPHarness(shared=False, validate=True, rank=rank)
    h.prefill(1, 100, chunk=100)  # something live (and buffered) throughout
    z, before = torch.zeros(1, dtype=torch.int64), h.alloc.available_size()
    out = {}
    n = 2 * h.G + 2  # rank 0 owns G + 1 tokens: more than its own pool
    out["too_long"] = h.alloc.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]),
                                           torch.tensor([-1]), n) is None

    def try_prefill(m: int) -> bool:
        locs = h.alloc.alloc_extend(z, z, torch.tensor([m]), torch.tensor([m]),
                                    torch.tensor([-1]), m)
        if locs is not None:
            h.alloc.free(locs)
        return locs is None

    logical = h.alloc.logical_attn_allocator
    real = logical.alloc_extend
    if rank == 0:  # the logical allocator refuses on one rank only
        logical.alloc_extend = lambda *a, **k: None
    out["logical_one_rank"] = try_prefill(100)
    logical.alloc_extend = real
    group0 = h.core.local.groups[0]
    real_room = group0.check_place_room
    if rank == 0:  # this rank's own pool has no room this round
        def no_room(need):
            raise errors.CapacityExhausted("injected: no room on rank 0")
        group0.check_place_room = no_room
    out["room_one_rank"] = try_prefill(100)
    group0.check_place_room = real_room
    out["then_fits"] = not try_prefill(100)
    out["capacity_unchanged"] = h.alloc.available_size() == before
    h.check()
    h.close()
    return out


def scenario_memory(rank: int) -> dict:
    """Per-rank pool rows (GPU + CPU, from the allocated tensors) vs the DP pool's."""
    from ulacache.config import SGLangOptions
    from ulacache.patches.classes import UlaCacheDSATokenToKVPool

    def rows(core) -> tuple[int, int]:
        g = getattr(core, "local", core).groups[0]
        return g.pools.gpu.shape[1] - 1, g.pools.cpu.shape[1] - 1

    kw = dict(page_size=PAGE, kv_lora_rank=KVL, dtype=torch.bfloat16, qk_rope_head_dim=ROPE,
              layer_num=L, device="cpu", index_head_dim=128, enable_memory_saver=False,
              kv_cache_dim=KVL + ROPE, max_running_requests=4, host_to_device_ratio=4)
    dp = UlaCacheDSATokenToKVPool(N, ulacache_options=SGLangOptions(cpu_ratio=3), **kw)
    tp = UlaCacheDSATokenToKVPool(N, ulacache_options=SGLangOptions(
        mode="tp", cpu_ratio=3, buffer_slots=100), **kw)
    out = {"dp": rows(dp.core), "tp": rows(tp.core), "tp_kv_rows": tp.kv_buffer[0].shape[0],
           "tp_class": type(tp).__name__, "dp_class": type(dp).__name__}
    tp.close_peers()
    return out


def scenario_topk(rank: int) -> dict:
    """The topk_transform hook: this rank's columns j % P == rank are real, the others are
    rank-specific garbage; the merge must be the full top-k of the real scores on both ranks."""
    from ulacache.indexer import topk_reference
    from ulacache.patches import sglang_tp_support as tps

    gen = torch.Generator().manual_seed(7)
    T, W = 5, 200
    real = torch.randn(T, W, generator=gen)
    real[0, 3] = float("inf")  # what _mask_init_and_local_tokens writes
    lengths = torch.tensor([200, 150, 40, 17, 1], dtype=torch.int32)  # some <= K
    mine = (torch.arange(W) % P == rank)
    noise = torch.randn(T, W, generator=torch.Generator().manual_seed(100 + rank)) * 50
    logits = torch.where(mine, real, noise)
    meta = types.SimpleNamespace(force_unfused_topk=True, get_seqlens_expanded=lambda: lengths)
    calls = []
    orig = lambda self, lg, k, *a, **kw: calls.append(k) or "original"  # noqa: E731
    tps.sharding_group = lambda: tps.tp_group()  # as under mode "tp" with shard_indexer
    got = tps.topk_transform_around(orig, meta, logits.clone(), K)
    want = topk_reference(real, lengths, K).to(torch.int32)
    passthrough = [
        tps.topk_transform_around(orig, types.SimpleNamespace(force_unfused_topk=False),
                                  logits, K),
        tps.topk_transform_around(orig, meta, logits, K, ks=lengths),
    ]
    tps.sharding_group = lambda: None
    return {"equal": torch.equal(got, want), "dtype": str(got.dtype), "got": got.tolist(),
            "passthrough": passthrough, "calls": calls}


def scenario_pieces(rank: int) -> dict:
    """Prefill page tables of 160 x 32 entries taken in pieces of call_entries 600 (one
    plan + the group's loads per piece, in one round), shared layers only translating;
    production mode; every row checked against the bytes written for its token."""
    h = TPHarness(shared=True, validate=False, rank=rank, buffer_slots=270, call_entries=600)
    for idx, n in ((1, 300), (2, 420), (3, 250)):  # 485 peers' rows per rank > 270 buffered
        h.prefill(idx, n, chunk=160)
        h.check()
    h.coord.collect_ready_reqs()
    for _ in range(3):
        h.decode_step([1, 2, 3])
    h.check()
    counters = h.core.counters()
    for idx in (1, 2, 3):
        h.finish(idx)
    h.check()
    h.close()
    return {"seen": h.seen, "counters": {k: sum(c[k] for c in counters) for k in
                                         ("peer_fetches", "buffer_overflow", "peer_missing",
                                          "access_overflow", "invalid")}}


SCENARIOS = {"perlayer": scenario_perlayer, "shared": scenario_shared, "pieces": scenario_pieces,
             "pressure": scenario_pressure, "memory": scenario_memory, "topk": scenario_topk,
             "prefetch": scenario_prefetch}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: SGLang's distributed set-up on gloo, then every scenario in order."""
    os.environ["SGLANG_DSA_TOPK_BROADCAST"] = "1"
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        sglang_tp_ranks_init(rank, P, port)
        results = {name: fn(rank) for name, fn in SCENARIOS.items()}
    except BaseException:  # noqa: BLE001 - reported to the parent
        results = {"error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(results, f)
    os._exit(0)  # skip SGLang's atexit teardown of the process groups


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, P, tmp_path_factory.mktemp("ula_sgl_tp"), TIMEOUT_S)


def test_rows_hold_the_written_bytes_per_layer_groups(ranks):
    for rank, res in enumerate(ranks):
        r = res["perlayer"]
        assert all(v > 0 for k, v in r["seen"].items() if k != "shared_buffered"), r["seen"]
        c = r["counters"]
        for what in ("promotions", "spills", "peer_fetches", "buffer_hits", "new_buffered",
                     "buffer_evictions"):
            assert c[what] > 0, (rank, what, c)
        for what in ("peer_missing", "buffer_overflow", "access_overflow", "place_overflow"):
            assert c[what] == 0, (rank, what, c)
        assert r["capacity_back"] and r["device_tokens"] > 0


def test_prefetch_keeps_every_rows_bytes(ranks):
    for rank, res in enumerate(ranks):
        r = res["prefetch"]
        c = r["counters"]
        assert c["prefetches"] > 0 and c["peer_fetches"] > 0, (rank, c)
        assert c["peer_missing"] == c["access_overflow"] == 0, (rank, c)
        assert r["capacity_back"]


def test_prefill_in_pieces_serves_the_written_bytes(ranks):
    for rank, res in enumerate(ranks):
        c = res["pieces"]["counters"]
        assert c["peer_fetches"] > 0, (rank, c)
        assert c["buffer_overflow"] == c["peer_missing"] == c["access_overflow"] == 0, c
        assert c["invalid"] == 0, (rank, c)


def test_shared_layers_load_their_own_rows(ranks):
    for res in ranks:
        r = res["shared"]
        assert r["seen"]["shared_buffered"] > 0 and r["seen"]["own"] > 0, r["seen"]
        assert r["mutant_caught"] > 0, "skipping the shared layers' load went unnoticed"


def test_alloc_extend_agrees_across_ranks(ranks):
    got = [res["pressure"] for res in ranks]
    assert got[0] == got[1]
    assert got[0] == {"too_long": True, "logical_one_rank": True, "room_one_rank": True,
                      "then_fits": True, "capacity_unchanged": True}


def test_per_rank_pool_is_one_pth_of_replicated(ranks):
    for res in ranks:
        m = res["memory"]
        assert m["tp_class"] == "UlaCacheDSATokenToKVPool"  # one class, mode chosen inside
        assert m["dp_class"] == "UlaCacheDSATokenToKVPool"
        (g_dp, c_dp), (g_tp, c_tp) = m["dp"], m["tp"]
        assert (g_dp, c_dp) == (N, 3 * N)
        assert (g_tp * P, c_tp * P) == (g_dp, c_dp)
        assert m["tp_kv_rows"] == -(-(PAGE + N // P + 1 + 100) // PAGE) * PAGE


def test_sharded_topk_hook_equals_full_topk_on_every_rank(ranks):
    got = [res["topk"] for res in ranks]
    for r in got:
        assert r["equal"] and r["dtype"] == "torch.int32"
        assert r["passthrough"] == ["original", "original"] and r["calls"] == [K, K]
    assert got[0]["got"] == got[1]["got"]


# ---------------------------------------------------------------------------------------------
# single-process: server args, sizing hook, TP hook verification
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    """``UlaServerArgs.__post_init__`` exports the backend; undo it. Top-k broadcast on."""
    from ulacache.patches import server_args as ula_args

    monkeypatch.delenv(ula_args.ENV_KV_BACKEND, raising=False)
    monkeypatch.setenv("SGLANG_DSA_TOPK_BROADCAST", "1")
    return monkeypatch


def _tp_args(**kw):
    from ulacache.patches.server_args import UlaServerArgs

    return UlaServerArgs(model_path="dummy", device="cpu", kv_backend="ulacache",
                         ulacache_config={"mode": "tp"}, **kw)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"tp_size": 1}, "--tp 1"),
    ({"tp_size": 16}, "--tp 16"),
    ({"tp_size": 6}, "--tp 6"),
    ({"tp_size": 8, "attn_dp_size": 8}, "--attn-dp-size 8 with --tp 8"),
    ({"tp_size": 8, "attn_dp_size": 3}, "--attn-dp-size 3"),
])
def test_tp_mode_refuses_illegal_parallelism_naming_flags(clean_env, kw, fragment):
    from ulacache.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _tp_args(**kw)
    msg = str(info.value)
    assert fragment in msg and "Legal:" in msg and "mode 'tp'" in msg, msg


@pytest.mark.parametrize("mode", ["dp", "tp"])
@pytest.mark.parametrize(("kw", "fragment"), [
    ({"pp_size": 2}, "--pp-size 2"),
    ({"attn_cp_size": 2}, "--attn-cp-size 2"),
    ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
    ({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"),
    ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm NGRAM"),
    ({"speculative_algorithm": "ngram"}, "--speculative-algorithm NGRAM"),
])
def test_deployments_not_built_are_refused_in_every_mode(clean_env, mode, kw, fragment):
    """PD disaggregation (decode crashed at disaggregation/decode.py reading mem_pool_host),
    pipeline stages and context-parallel attention: refused when the arguments are built,
    naming the flag and the legal alternative."""
    from ulacache.errors import ConfigError
    from ulacache.patches.server_args import UlaServerArgs

    with pytest.raises(ConfigError) as info:
        UlaServerArgs(model_path="dummy", device="cpu", kv_backend="ulacache",
                      ulacache_config={"mode": mode}, tp_size=2, **kw)
    msg = str(info.value)
    assert fragment in msg and "Legal:" in msg, msg
    # the stock pool and HiSparse are not affected by ulacache's refusals
    UlaServerArgs(model_path="dummy", device="cpu", kv_backend="default", tp_size=2, **kw)


def test_tp_mode_needs_the_topk_broadcast(clean_env):
    from ulacache.errors import ConfigError

    for value in (None, "0", "false"):
        if value is None:
            clean_env.delenv("SGLANG_DSA_TOPK_BROADCAST")
        else:
            clean_env.setenv("SGLANG_DSA_TOPK_BROADCAST", value)
        with pytest.raises(ConfigError, match="SGLANG_DSA_TOPK_BROADCAST=1"):
            _tp_args(tp_size=2)


def test_tp_mode_accepts_legal_parallelism(clean_env):
    for kw in ({"tp_size": 2}, {"tp_size": 4}, {"tp_size": 8}, {"tp_size": 8, "attn_dp_size": 2},
               {"tp_size": 8, "attn_dp_size": 4}):
        args = _tp_args(**kw)
        assert json.loads(args.ulacache_config) == {"mode": "tp"}
    clean_env.delenv("SGLANG_DSA_TOPK_BROADCAST")
    from ulacache.patches.server_args import UlaServerArgs

    UlaServerArgs(model_path="dummy", device="cpu", kv_backend="ulacache", tp_size=1)  # dp


def test_sizing_hook_charges_one_pth_of_the_latent_and_the_buffer(monkeypatch):
    """DeepSeek-V3.2 fp8 numbers: latent 656 B x 61 layers per token, index-K 132 B x 61 x 5
    (cpu_ratio 4) charged in full; at P = 4 the latent costs ceil(40016 / 4) per token per
    rank, the rows per layer beside the own rows (B = R x (K + 1) buffer rows, sink page,
    scratch, page padding: B + 128) are fixed overhead, and ulacache's tables of the 61
    selection groups are added per token and fixed (``ulacache.sizing.table_bytes_per_slot``;
    in DP mode with the pool's tail page). tests/test_sglang_sizing.py runs the hook on SGLang's
    real configurator."""
    import sglang.srt.mem_cache.kv_cache_configurator as kvcm
    import sglang.srt.runtime_context as rc

    from ulacache.config import SGLangOptions
    from ulacache.errors import ConfigError
    from ulacache.patches import launch
    from ulacache.patches import sglang_sizing as sz
    from ulacache.sizing import coordinator_output_bytes, table_bytes_per_slot

    monkeypatch.setattr(kvcm, "calculate_mla_kv_cache_dim", lambda **kw: 656)
    monkeypatch.setattr(rc, "get_schedule", lambda: types.SimpleNamespace(max_running_requests=8))
    monkeypatch.setattr(launch, "tp_group", lambda: types.SimpleNamespace(world_size=4))
    monkeypatch.setattr(launch, "draft_tokens", lambda: 0)
    hf = types.SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    kvc = types.SimpleNamespace(
        is_draft_worker=False, use_mla_backend=True, kv_cache_dtype=torch.float8_e4m3fn,
        pool_page_size=64,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=61, num_effective_layers=61),
        model_config=types.SimpleNamespace(hf_config=hf, hf_text_config=hf))
    latent, index_k = 656 * 61, 132 * 61 * 5

    def stock(self, kvc):
        self._cell_size, self._fixed_overhead_bytes = latent + index_k, 0

    def run(opts, **kvc_changes):
        monkeypatch.setattr(launch, "sglang_options", lambda: opts)
        cfg = types.SimpleNamespace()
        sz.pool_configurator_init_around(stock, cfg, types.SimpleNamespace(
            **{**vars(kvc), **kvc_changes}))
        return cfg._cell_size, cfg._fixed_overhead_bytes

    out = coordinator_output_bytes(61, 8 + 1, 2048, 0)  # the coordinator's rows, 8 + 1 slots
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64)
    assert run(SGLangOptions()) == (latent + index_k + per, fixed + 64 * 61 * 656 + out)  # DP
    tp = SGLangOptions(mode="tp")
    assert run(tp, is_draft_worker=True) == (latent + index_k, 0)
    assert run(tp, use_mla_backend=False) == (latent + index_k, 0)
    B = 8 * 1 * 2049
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64, tp_size=4, buffer_slots=B,
                                      layers=61)
    assert run(tp) == (10004 + index_k + per, (B + 128) * 61 * 656 + fixed + out)
    lp = launch.plan_launch(kvc)  # the plan the pool-building hook hands the pool
    assert (lp.tp_size, lp.buffer_slots) == (4, B)
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64, tp_size=4, buffer_slots=1000,
                                      layers=61)
    assert run(SGLangOptions(mode="tp", buffer_slots=1000))[1] == 1128 * 61 * 656 + fixed + out
    monkeypatch.setattr(rc, "get_schedule",
                        lambda: types.SimpleNamespace(max_running_requests=None))
    with pytest.raises(ConfigError, match="--max-running-requests"):
        run(tp)


def test_tp_hooks_are_registered_with_the_swaps_and_verified():
    from ulacache.patches import classes
    from ulacache.patches.verify import TP_HOOK_TARGETS, HookVerificationError, verify_tp_hooks

    assert set(TP_HOOK_TARGETS) <= set(classes.EXTRA_HOOKS)
    with pytest.raises(HookVerificationError) as info:
        verify_tp_hooks([])
    for target in TP_HOOK_TARGETS:
        assert target in str(info.value)


def test_tp_pool_stops_when_its_hooks_are_missing(monkeypatch):
    """With the plugin's class swaps installed but the TP hooks absent, constructing the TP
    pool raises before it touches any process group."""
    from ulacache.config import SGLangOptions
    from ulacache.patches import plugin
    from ulacache.patches.classes import UlaCacheDSATokenToKVPool
    from ulacache.patches.verify import ExpectedHook, HookVerificationError

    target = next(iter(plugin.CLASS_TARGETS))
    monkeypatch.setattr(plugin, "expected_hooks",
                        lambda: [ExpectedHook(target, UlaCacheDSATokenToKVPool, "replace")])
    with pytest.raises(HookVerificationError, match="mode 'tp' needs these hooks"):
        UlaCacheDSATokenToKVPool(
            N, page_size=PAGE, kv_lora_rank=KVL, dtype=torch.bfloat16, qk_rope_head_dim=ROPE,
            layer_num=L, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=KVL + ROPE, max_running_requests=4, host_to_device_ratio=4,
            ulacache_options=SGLangOptions(mode="tp", buffer_slots=8),
            ulacache_tp_group=object())
