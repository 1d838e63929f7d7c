"""Contract test: ulacache's pool, allocator and coordinator driven through the call sequence
SGLang 0.5.23's scheduler, model runner and DSA backend make (prefill, staging, decode steps, a
speculative verify, a retract, an abort, finish), on CPU, with SGLang's own ReqToTokenPool,
paged allocator and DSA pool base class. After every call: the core's invariants, and every row
a swap-in returns holds exactly the latent bytes written for that token."""

from __future__ import annotations

import types

import pytest
import torch

from .helpers import sglang_alloc_decode, sglang_alloc_verify, sglang_topk, sglang_verify_topk

sglang = pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

KVL, ROPE, L, K, P = 64, 16, 4, 32, 64


@pytest.fixture(scope="module", autouse=True)
def published_args():
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu"])
    sa.resolve_once()
    publish(sa, role="scheduler")


class Harness:
    """Plays SGLang's side: req_to_token bookkeeping, KV writes, top-k positions."""

    def __init__(self, shared: bool, n_slots: int = 512, cpu_ratio: int = 3, max_reqs: int = 4,
                 validate: bool = True, draft_tokens: int = 2, **options):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from ulacache.config import SGLangOptions
        from ulacache.patches.classes import (
            UlaCacheCoordinator,
            UlaCacheDSATokenToKVPool,
            UlaCacheTokenToKVPoolAllocator,
        )

        opts = SGLangOptions(cpu_ratio=cpu_ratio, n_buckets=4, validate=validate, **options)
        ratio = opts.host_to_device_ratio
        self.rtp = ReqToTokenPool(size=max_reqs, max_context_len=4096, device="cpu",
                                  enable_memory_saver=False)
        skip = [i % 2 == 1 for i in range(L)] if shared else None
        self.pool = UlaCacheDSATokenToKVPool(
            n_slots, page_size=P, kv_lora_rank=KVL, dtype=torch.bfloat16,
            qk_rope_head_dim=ROPE, layer_num=L, device="cpu", index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=KVL + ROPE, max_running_requests=max_reqs,
            skip_topk_layers=skip, host_to_device_ratio=ratio, ulacache_options=opts)
        self.alloc = UlaCacheTokenToKVPoolAllocator(
            n_slots, page_size=P, dtype=torch.bfloat16, device="cpu", kvcache=self.pool,
            need_sort=False, host_to_device_ratio=ratio)
        self.coord = UlaCacheCoordinator(
            req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, top_k=K,
            device_buffer_size=0, device="cpu", tp_group=None, host_to_device_ratio=ratio,
            num_draft_tokens=draft_tokens)
        self.gen = torch.Generator().manual_seed(0)
        self.latent: dict[tuple[int, int], torch.Tensor] = {}  # (layer, logical loc) -> row
        self.lens: dict[int, int] = {}
        self.reqs: dict[int, types.SimpleNamespace] = {}
        self.staged_chunks = 0  # prefill chunks served through the pool's prefill stage

    # -- SGLang's writes ------------------------------------------------------------------
    def write_kv(self, locs: torch.Tensor) -> None:
        for layer in range(L):
            nope = torch.randn(locs.numel(), 1, KVL, generator=self.gen).to(torch.bfloat16)
            rope = torch.randn(locs.numel(), 1, ROPE, generator=self.gen).to(torch.bfloat16)
            self.pool.set_mla_kv_buffer(types.SimpleNamespace(layer_id=layer), locs, nope, rope)
            for i, loc in enumerate(locs.tolist()):
                self.latent[(layer, loc)] = torch.cat([nope[i, 0], rope[i, 0]])

    def check_rows(self, layer: int, rows: torch.Tensor, locs: torch.Tensor,
                   buf: torch.Tensor | None = None) -> None:
        """rows (of ``buf``, by default kv_buffer[layer]) must hold the latent written for
        locs; -1 stays -1."""
        assert rows.dtype == torch.int32
        assert torch.equal(rows < 0, locs < 0)
        buf = self.pool.kv_buffer[layer] if buf is None else buf
        for r, loc in zip(rows.reshape(-1).tolist(), locs.reshape(-1).tolist()):
            if loc >= 0:
                assert torch.equal(buf[r, 0], self.latent[(layer, loc)]), (layer, loc, r)

    def check(self) -> None:
        self.alloc.check_integrity()

    # -- the scheduler's calls ------------------------------------------------------------
    def prefill(self, idx: int, n: int, chunk: int) -> None:
        req = types.SimpleNamespace(rid=f"r{idx}", hisparse_staging=False)
        self.reqs[idx] = req
        done = 0
        while done < n:
            m = min(chunk, n - done)
            self.coord.allocate_spec_scratch([idx])
            last = self.rtp.req_to_token[idx, done - 1].long().view(1) if done else \
                torch.tensor([-1])
            locs = self.alloc.alloc_extend(torch.tensor([done]), torch.tensor([done]),
                                           torch.tensor([done + m]), torch.tensor([done + m]),
                                           last, m)
            assert locs is not None
            self.rtp.req_to_token[idx, done: done + m] = locs.to(torch.int32)
            self.write_kv(locs)
            self.check()
            # prefill attention: each query selects among 0..pos (page table of logical locs)
            pos = torch.randint(0, done + m, (m, K), generator=self.gen)
            pos[:, -3:] = -1
            table = torch.where(pos >= 0, self.rtp.req_to_token[idx][pos.clamp(min=0)].long(),
                                -1)
            self.staged_chunks += self.pool.staged([done + m])
            for layer in range(L):
                # what the forward_extend hook records and decides, then the backend's calls:
                # the key buffer (dsa_backend.py:2260), the page table's translation (:2343)
                self.pool.current_layer_id = layer
                self.pool.staging = self.pool.staged([done + m])
                try:
                    buf = self.pool.get_key_buffer(layer)
                    rows = self.pool.translate_loc_to_hisparse_device(table.to(torch.int32))
                    self.check_rows(layer, rows.to(torch.int32), table, buf)
                finally:
                    self.pool.staging = False
            self.check()
            done += m
        self.lens[idx] = n
        self.coord.admit_request_into_staging(req)
        assert req.hisparse_staging and self.coord.has_ongoing_staging()

    def decode_step(self, idxs: list[int], pad: int = 1) -> None:
        bs = len(idxs)
        ri, seq, out = sglang_alloc_decode(self, idxs)
        self.coord.map_last_loc_to_buffer(seq, out, ri, seq, ri)
        self.check()
        self.coord.wait_for_pending_backup()
        self.coord.num_real_reqs.fill_(bs)
        self.write_kv(out)
        # indexer: distinct positions per request (always the newest), -1 padded; plus padded
        # CUDA-graph rows (req_pool_idx 0) that must come back -1
        topk, ri_pad, seq_pad = sglang_topk(self, idxs, K, pad)
        shared_rows = None
        for layer in range(L):
            rows = self.coord.swap_in_selected_pages(ri_pad, seq_pad, topk, layer)
            assert rows.shape == (bs + pad, K) and (rows[bs:] == -1).all()
            locs = torch.where(topk[:bs] >= 0, self.rtp.req_to_token[ri.unsqueeze(1),
                               topk[:bs].long().clamp(min=0)].long(), -1)
            self.check_rows(layer, rows[:bs], locs)
            if layer % 2 == 1 and self.pool.core.layer_to_group[layer] == \
                    self.pool.core.layer_to_group[layer - 1]:
                assert rows.data_ptr() == shared_rows  # plan reused by the shared layer
            shared_rows = rows.data_ptr()
        self.check()

    def verify_step(self, idxs: list[int], steps: int = 2) -> None:
        bs = len(idxs)
        ri, prefix, locs = sglang_alloc_verify(self, idxs, steps)
        batch = types.SimpleNamespace(out_cache_loc=locs, req_pool_indices=ri)
        self.coord.prepare_spec_verify(batch)
        self.coord.num_real_reqs.fill_(bs)
        self.write_kv(locs)
        topk = sglang_verify_topk(self, idxs, steps, K)
        for layer in range(L):
            rows = self.coord.swap_in_selected_pages(ri, prefix + steps, topk, layer)
            assert rows.shape == (bs, steps, K)
            flat = topk.view(bs * steps, K).long()
            req = ri.repeat_interleave(steps)
            want = torch.where(flat >= 0, self.rtp.req_to_token[req.unsqueeze(1),
                               flat.clamp(min=0)].long(), -1)
            self.check_rows(layer, rows.view(bs * steps, K), want)
        # accept the first token of each request; the rejected one's address stays in its page
        # and is handed out again for the next position (paged allocators free whole pages)
        accept = torch.tensor([[b * steps, -1] for b in range(bs)])
        self.coord.commit_spec_accept_tokens(batch=batch, accept_indices=accept)
        for i in idxs:
            self.lens[i] += 1
        self.check()

    def finish(self, idx: int, how: str) -> None:
        req = self.reqs.pop(idx)
        if how == "retract":
            self.coord.retract_req(req)
        else:
            self.coord.request_finished(req)
        # release_kv_cache: free the request's logical addresses
        self.alloc.free(self.rtp.req_to_token[idx, : self.lens.pop(idx)].long())
        self.check()


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared-indexer"])
def test_call_sequence(shared):
    _call_sequence(Harness(shared))


@pytest.mark.parametrize("sources", [("previous_layer",), ("draft", "previous_layer")],
                         ids="+".join)
@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared-indexer"])
def test_call_sequence_with_prefetch(shared, sources):
    """The same calls with the look-ahead prefetch on (a small cap, so it binds): every row a
    swap-in returns still holds its token's bytes; rows were prefetched; each prefetch is
    issued inside the forward at the previous group's selection and waited for by its own
    group's access only (the stream log: what SGLang's graphs capture)."""
    from ulacache.config import PrefetchConfig

    h = Harness(shared, prefetch=PrefetchConfig(sources=sources, fetch_cap=16))
    pf = h.coord.prefetch
    assert pf is not None and pf.forward_only
    _call_sequence(h, extra_steps=6)
    assert sum(c["prefetches"] for c in h.pool.core.counters()) > 0
    log = [e for e in pf.stream_log if e[0] != "fence"]
    assert log and all(op == "prefetch" for op, _ in log[0::2])
    assert all(b == ("wait", a[1]) for a, b in zip(log[0::2], log[1::2]))
    assert all(g >= 1 for _, g in log)  # group 0: nothing runs before it in the forward


def test_call_sequence_with_shared_groups():
    """The shared_groups source on a shared-index model (beside previous_layer): every row a
    swap-in returns holds its token's bytes; each shared group's anchor issues one replay and
    each of its other layers waits for its own bytes only, in layer order, before the next
    group's access (SGLang calls swap_in_selected_pages for every layer: the non-anchor
    layers' waits are inside the captured forward too)."""
    from ulacache.config import PrefetchConfig

    h = Harness(True, prefetch=PrefetchConfig(sources=("shared_groups", "previous_layer"),
                                              fetch_cap=16))
    pf = h.coord.prefetch
    _call_sequence(h, extra_steps=3)
    log = pf.stream_log
    start = h.pool.start_layer
    groups = [[start + layer for layer in g] for g in h.pool.ula_groups]
    shared = [g for g in groups if len(g) > 1]
    assert shared
    replays = [i for i, e in enumerate(log) if e[0] == "replay"]
    assert len(replays) >= 10
    for i in replays:
        gi = log[i][1]
        waits = [e for e in log[i + 1:] if e[0] in ("wait_layer", "replay", "fence")]
        layers = [layer - start for layer in groups[gi][1:]]
        assert waits[: len(layers)] == [("wait_layer", layer) for layer in layers], waits[:4]


def test_shared_groups_on_a_model_without_sharing_is_refused():
    from ulacache.config import PrefetchConfig
    from ulacache.errors import ConfigError

    with pytest.raises(ConfigError, match="two or more layers"):
        Harness(False, prefetch=PrefetchConfig(sources=("shared_groups",)))


def test_draft_prefetch_without_speculative_decoding_is_refused():
    from ulacache.config import PrefetchConfig
    from ulacache.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative"):
        Harness(False, draft_tokens=0, prefetch=PrefetchConfig(sources=("draft",)))
    assert Harness(False, draft_tokens=0,
                   prefetch=PrefetchConfig(sources=("previous_layer",))).coord.prefetch


def _call_sequence(h: Harness, extra_steps: int = 0) -> None:
    capacity = h.alloc.size_full
    assert capacity == 512 * 4 and h.alloc.available_size() == capacity
    for idx, n in ((1, 300), (2, 420), (3, 250)):  # 970 tokens > 512 GPU slots
        h.prefill(idx, n, chunk=160)
    ready = h.coord.collect_ready_reqs()
    assert len(ready) == 3 and not h.coord.has_ongoing_staging()
    assert all(not r.hisparse_staging for r in ready)
    for _ in range(6):
        h.decode_step([1, 2, 3])
    h.verify_step([1, 2, 3])
    h.decode_step([1, 2, 3])
    for i in range(extra_steps):  # verify steps back to back: the draft source's case
        h.verify_step([1, 2, 3]) if i % 3 else h.decode_step([1, 2, 3])
    stats = h.pool.core.counters()[0]
    assert stats["promotions"] > 0 and stats["spills"] > 0
    tok = h.coord.get_token_stats()
    assert tok.device_tokens > 0 and tok.host_tokens > 0 and 0 < tok.device_token_usage <= 1
    h.finish(2, "retract")
    h.prefill(4, 90, chunk=90)  # a new request while others decode
    h.coord.abort_staging_request(h.reqs[4])  # aborted during staging
    h.finish(4, "abort")
    for _ in range(3):
        h.decode_step([1, 3])
    h.finish(1, "finish")
    h.finish(3, "finish")
    assert h.alloc.available_size() == capacity
    for g in h.pool.core.groups:
        assert int((g.gpu_owner[: g.gpu_slots] >= 0).sum()) == 0
        assert int(g.pools.cpu_top) == g.cpu_slots
    h.coord.destroy()


def test_gpu_pool_too_small_for_one_step_is_refused():
    from ulacache.errors import ConfigError

    with pytest.raises(ConfigError, match="one step's selections"):
        Harness(False, n_slots=128)


def test_layer_groups_from_skip():
    from ulacache.patches.classes import layer_groups_from_skip

    assert layer_groups_from_skip(None, 3) == [[0], [1], [2]]
    skip = [False, True, True, True, False, True]
    assert layer_groups_from_skip(skip, 6) == [[0, 1, 2, 3], [4, 5]]


def test_pool_groups_follow_the_models_sharing_when_sglang_passes_none():
    """Under HiSparse SGLang builds the DSA pool without ``skip_topk_layers``; the hook around
    ``_build_dsa_kv_pool`` records the model's pattern (SGLang's ``dsa_layer_skips_topk``) so
    the pool still groups shared layers with their anchor, and the coordinator checks the
    groups against SGLang's ``shared_index_layers`` at start-up."""
    from ulacache.errors import ConfigError
    from ulacache.patches import classes, launch
    from ulacache.patches.classes import UlaCacheCoordinator

    hook = classes.EXTRA_HOOKS[
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool"][0]
    cfg = types.SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"], index_topk=K,
                                index_topk_pattern="FSFS")  # F: runs the indexer, S: shares
    configurator = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=cfg), is_draft_worker=False,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=L))
    h = hook(lambda self: Harness(False), configurator)  # the pool sees skip_topk_layers=None
    assert h.pool.ula_groups == [[0, 1], [2, 3]]
    # ... and the shared layers get no index-K (0-row buffers, as stock SGLang elides them
    # without HiSparse); the anchors keep theirs
    rows = [b.shape[0] for b in h.pool.index_k_with_scale_buffer]
    assert rows[1] == rows[3] == 0 and rows[0] == rows[2] > 0
    assert launch.plan_being_built() is None  # scoped to the build
    draft = types.SimpleNamespace(**{**vars(configurator), "is_draft_worker": True})
    d = hook(lambda self: Harness(False), draft).pool
    assert d.ula_groups == [[0], [1], [2], [3]]
    assert all(b.shape[0] > 0 for b in d.index_k_with_scale_buffer)  # a draft elides nothing

    def coordinator(shared):
        return UlaCacheCoordinator(
            req_to_token_pool=h.rtp, token_to_kv_pool_allocator=h.alloc, top_k=K,
            device_buffer_size=0, device="cpu", tp_group=None, shared_index_layers=shared)
    coordinator([False, True, False, True])
    coordinator(None)
    with pytest.raises(ConfigError, match="disagree with the model's top-k sharing"):
        coordinator([False, False, False, True])


def test_extra_hooks_track_layer_and_size_from_cpu_ratio(monkeypatch):
    """The forward_extend hook tells the pool which layer's group a prefill page table is for;
    the parse_hisparse_config hook sizes the logical space as (1 + cpu_ratio) x GPU slots."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    from ulacache.config import SGLangOptions
    from ulacache.patches import classes

    h = Harness(False)
    backend = types.SimpleNamespace(token_to_kv_pool=h.pool)
    seen = []
    hook = classes.EXTRA_HOOKS[
        "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend"][0]
    out = hook(lambda self, *a, **k: seen.append(self.token_to_kv_pool.current_layer_id) or 7,
               backend, "q", "k", "v", types.SimpleNamespace(layer_id=3), "fb")
    assert out == 7 and seen == [3]
    monkeypatch.setattr(classes, "sglang_options", lambda: SGLangOptions(cpu_ratio=6))
    parse = classes.EXTRA_HOOKS["sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config"][0]
    assert parse(lambda: SparseConfig()).host_to_device_ratio == 7


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_swap_in_is_sync_free_and_fixed_shape(monkeypatch, prefetch):
    """What runs inside SGLang's decode CUDA graph (``swap_in_selected_pages`` on the anchor
    layer; with prefetch, the next group's prefetch it issues too) issues no syncing op, and
    its op sequence and shapes do not depend on the data."""
    import ulacache.kernels.reference as ref
    from ulacache.config import PrefetchConfig

    from .test_graph_safety import SYNCING, OpLog

    monkeypatch.setattr(ref, "COMPACT_ON_CPU", False)
    pf = PrefetchConfig(sources=("previous_layer", "draft"), fetch_cap=8) if prefetch else \
        PrefetchConfig()
    h = Harness(False, validate=False, prefetch=pf)
    for idx, n in ((1, 300), (2, 420)):
        h.prefill(idx, n, chunk=200)
    h.coord.collect_ready_reqs()
    logs = []
    for _ in range(2):
        h.decode_step([1, 2])  # checks the bytes behind the returned rows
        ri = torch.tensor([1, 2, 0])
        topk = torch.full((3, K), -1, dtype=torch.int32)
        for b, i in enumerate((1, 2)):
            topk[b, :K - 2] = torch.randperm(h.lens[i], generator=h.gen)[:K - 2].to(torch.int32)
        h.coord.num_real_reqs.fill_(2)
        log = OpLog()
        with log:
            h.coord.swap_in_selected_pages(ri, torch.tensor([1, 1, 1]), topk, 0)
        logs.append(log.ops)
    assert not {op for op, _ in logs[0]} & SYNCING
    assert logs[0] == logs[1]
    if prefetch:  # layer 0's selection issued group 1's prefetch inside the call
        assert h.coord.prefetch.stream_log[-1] == ("prefetch", 1)


def test_prefill_longer_than_gpu_pool_is_refused_not_corrupted():
    h = Harness(False)
    z = torch.zeros(1, dtype=torch.int64)
    before = h.alloc.available_size()
    n = 600  # > 512 GPU slots: its prefill attention could not have every token resident
    assert h.alloc.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]),
                                n) is None
    assert h.alloc.available_size() == before
    h.check()


def test_prefill_that_exactly_fills_the_gpu_pool_is_served():
    """512 tokens into a 512-slot GPU pool: one round, every slot; the rows read back, the next
    decode step spills a victim to the CPU tier, and finishing frees both tiers."""
    h = Harness(False)
    h.prefill(0, 512, chunk=512)
    assert int(h.pool.core.groups[0].policy.eligible()) == 0  # every slot taken this round
    h.decode_step([0])
    h.finish(0, "finish")


def test_every_core_mutation_is_on_the_producer_stream():
    """Under SGLang the scheduler calls the allocator and coordinator from its own stream; with
    the forward stream set as producer, the core issues every mutation on it (a stream-order
    recorder sees the core stream active at each write into core state)."""
    from .test_streams import StreamOrderRecorder, core_storages

    h = Harness(True)
    producer = object()
    h.coord.set_decode_producer_stream(producer)
    write_kv = h.write_kv

    def forward_writes(locs):  # SGLang's KV writes run inside the forward (producer stream)
        with h.pool.core.stream.scope():
            write_kv(locs)

    h.write_kv = forward_writes
    rec = StreamOrderRecorder(core_storages(h.pool.core))
    with rec:
        h.prefill(1, 200, chunk=100)
        h.prefill(2, 150, chunk=150)
        h.coord.collect_ready_reqs()
        for _ in range(3):
            h.decode_step([1, 2])
        h.finish(2, "finish")
        h.decode_step([1])
    assert len(rec.writes) > 200
    off = [op for op, s in rec.writes if s is not producer]
    assert not off, f"core state mutated off the producer stream: {off[:5]}"


def test_shared_layer_before_its_anchor_is_a_stale_read():
    """A layer sharing its anchor's selection must not get last step's rows: with validate on,
    running it before the anchor in a step raises (decode and prefill)."""
    from ulacache.errors import StaleSelectionError

    h = Harness(True)  # groups [0, 1] and [2, 3]
    h.prefill(1, 200, chunk=200)
    h.coord.collect_ready_reqs()
    h.decode_step([1])  # a complete step: anchors then shared layers
    ri, seq = torch.tensor([1]), torch.tensor([h.lens[1] + 1])
    out = h.alloc.alloc_decode(seq, seq, h.rtp.req_to_token[1, h.lens[1] - 1].long().view(1))
    h.rtp.req_to_token[1, h.lens[1]] = out[0]
    h.lens[1] += 1
    h.coord.map_last_loc_to_buffer(seq, out, ri, seq, ri)  # a new step starts
    h.coord.num_real_reqs.fill_(1)
    topk = torch.arange(K, dtype=torch.int32).view(1, K)
    with pytest.raises(StaleSelectionError, match="anchor"):
        h.coord.swap_in_selected_pages(ri, seq, topk, 1)  # layer 1 before layer 0
    h.coord.swap_in_selected_pages(ri, seq, topk, 0)
    h.coord.swap_in_selected_pages(ri, seq, topk, 1)  # now fine
    # prefill: a new round, the shared layer translated before its anchor
    h.alloc.core.begin_round()
    table = h.rtp.req_to_token[1, :K].long().view(1, K)
    with pytest.raises(StaleSelectionError, match="anchor"):
        h.pool.prefill_rows(3, table)
    h.pool.prefill_rows(2, table)
    h.pool.prefill_rows(3, table)


def test_prefill_translation_counts_once_per_group():
    h = Harness(True)  # 4 layers, 2 selection groups of 2
    h.prefill(1, 120, chunk=120)
    before = [c["accesses"] for c in h.pool.core.counters()]
    h.alloc.core.begin_round()
    table = torch.cat([h.rtp.req_to_token[1, :40].long(), torch.full((8,), -1)]).view(1, -1)
    for layer in range(L):
        h.pool.current_layer_id = layer
        h.pool.translate_loc_to_hisparse_device(table)
    after = [c["accesses"] for c in h.pool.core.counters()]
    assert [a - b for a, b in zip(after, before)] == [40, 40]


def test_bad_ulacache_config_stops_start_up(monkeypatch):
    """No fallback to defaults: the key and its legal values are named."""
    import sglang.srt.runtime_context as rc

    from ulacache.errors import ConfigError
    from ulacache.patches.classes import sglang_options

    for raw, key in (('{"cpu_ratio": 1.5}', "cpu_ratio"), ('{"validate": "no"}', "validate"),
                     ('{"policy": "fifo"}', "policy"), ('{"fetch_cap": 4}', "fetch_cap")):
        monkeypatch.setattr(rc, "get_server_args",
                            lambda raw=raw: types.SimpleNamespace(ulacache_config=raw))
        with pytest.raises(ConfigError, match=key) as e:
            sglang_options()
        assert "legal" in str(e.value)
    monkeypatch.setattr(rc, "get_server_args",
                        lambda: types.SimpleNamespace(ulacache_config='{"cpu_ratio": 2}'))
    assert sglang_options().cpu_ratio == 2


def test_validate_survives_the_graph_runners_warmup_batch():
    """SGLang's decode graph runner warms up and captures every batch size with a dummy batch:
    req_pool_indices 0, seq_lens its fill value, num_real_reqs = bs
    (decode_cuda_graph_runner.py:1242), so the indexer's positions read req_to_token entries
    on SGLang's reserved sink page (address < page size). With validate on these were refused
    as dead addresses and start-up failed; they are padding (-1), and a real request beside
    them is still served and checked."""
    h = Harness(False, validate=True)
    h.prefill(1, 200, chunk=200)
    h.coord.collect_ready_reqs()
    bs = 3
    h.coord.core.begin_round()
    h.coord.num_real_reqs.fill_(bs)
    topk = torch.full((bs, K), -1, dtype=torch.int32)
    topk[:, 0] = 0  # seq_len fill value 1: position 0 selected
    ri = torch.zeros(bs, dtype=torch.int64)
    for layer in range(L):
        rows = h.coord.swap_in_selected_pages(ri, torch.ones(bs, dtype=torch.int64), topk, layer)
        assert (rows == -1).all()
    h.check()
    # a live request's bad position (a dead address) is still refused with validate on
    from ulacache.errors import AddressError

    h.coord.num_real_reqs.fill_(1)
    bad = torch.full((1, K), -1, dtype=torch.int32)
    bad[0, 0] = 300  # past the request's 200 tokens: req_to_token holds no live address there
    h.rtp.req_to_token[1, 300] = 5000  # a stale, never-allocated address above the sink page
    with pytest.raises(AddressError):
        h.coord.swap_in_selected_pages(torch.tensor([1]), torch.tensor([200]), bad, 0)
    h.check()
    h.decode_step([1])


@pytest.mark.parametrize("validate", [False, True], ids=["production", "validate"])
@pytest.mark.parametrize("path", ["torch", "fused"])
def test_prefill_tables_larger_than_a_call_run_in_pieces(path, validate):
    """A prefill page table of T x top-k entries (2^24 at an 8K chunk on H200) is taken in
    pieces of call_entries, in one round: every row served holds the bytes written for its
    token (check_rows), on both paths, and the fused scratch is the one allocated at
    construction, never replaced, so tensors a captured decode graph holds (the scratch and
    the coordinator's output rows) keep their addresses across a larger eager prefill."""
    if path == "fused":
        pytest.importorskip("triton")
    h = Harness(True, validate=validate, access_path=path, call_entries=256)
    g = h.pool.core.groups[0]
    assert g.max_call == 256
    h.prefill(1, 300, chunk=150)  # 150 x 32 = 4800 entries per layer: 19 pieces
    h.coord.collect_ready_reqs()
    h.decode_step([1])  # the shape a decode graph captures
    held = [t.data_ptr() for t in h.coord._rows_out]
    if path == "fused":
        held += [t.data_ptr() for t in g.fused.shared_scratch.tensors]
        assert all(gr.fused.shared_scratch is g.fused.shared_scratch for gr in h.pool.core.groups)
    h.prefill(2, 420, chunk=210)  # a larger eager prefill
    h.coord.collect_ready_reqs()
    h.decode_step([1, 2])
    now = [t.data_ptr() for t in h.coord._rows_out]
    if path == "fused":
        now += [t.data_ptr() for t in g.fused.shared_scratch.tensors]
    assert now == held
    h.finish(1, "finish")
    h.finish(2, "retract")


def test_finishing_through_free_segment_is_sync_free_and_releases_every_page():
    """SGLang 0.5.23 frees a finished request's row with ``free_segments`` (page-aligned,
    contiguous per page: ``mem_cache/common.py:152``). ulacache's ``free_segment`` releases
    the same pages as ``free`` without ``torch.unique`` (a host sync on the scheduler's path),
    and a production-mode prefill makes no host room check."""
    import ulacache.kernels.reference as ref

    from .test_graph_safety import SYNCING, OpLog

    h = Harness(False, validate=False)
    h.prefill(1, 300, chunk=300)
    h.prefill(2, 130, chunk=130)
    h.coord.collect_ready_reqs()
    h.decode_step([1, 2])
    h.check()
    before_free = h.alloc.available_size()
    ref_compact, ref.COMPACT_ON_CPU = ref.COMPACT_ON_CPU, False
    try:
        log = OpLog()
        n = h.lens.pop(1)
        h.coord.request_finished(h.reqs.pop(1))
        with log:
            h.alloc.free_segment(h.rtp.req_to_token[1, :n].long(), start_pos=0)
    finally:
        ref.COMPACT_ON_CPU = ref_compact
    assert not {op for op, _ in log.ops} & SYNCING, sorted({op for op, _ in log.ops} & SYNCING)
    assert h.alloc.available_size() == before_free + -(-n // P) * P
    h.check()  # every row of request 1 released in both tiers (liveness from SGLang's pages)
    h.decode_step([2])
    with pytest.raises(ValueError, match="page-aligned"):
        h.alloc.free_segment(h.rtp.req_to_token[2, 1:5].long(), start_pos=1)
    h.finish(2, "finish")
    assert h.alloc.available_size() == h.alloc.size


def test_prefill_over_a_still_mapped_address_leaves_no_stale_shadow(monkeypatch):
    """Production mode: a prefill handed an address that is still mapped (an upstream double
    allocation) releases it before placing it, so SGLang's KV write for it lands in a fresh
    row instead of a resident row whose shadow (its CPU copy) would then be stale; integrity
    (every shadow equals its GPU row) holds and the new bytes read back."""
    h = Harness(False, validate=False)
    h.prefill(0, 300, chunk=300)
    h.prefill(1, 300, chunk=300)  # spills request 0's oldest rows to the CPU tier
    for _ in range(4):
        h.decode_step([0, 1])  # promotes some of them back: shadows kept
    g = h.pool.core.groups[0]
    G = g.gpu_slots
    loc = g.loc[: g.n_logical]
    gpu = (loc >= 0) & (loc < G)
    shadowed = torch.nonzero(gpu & (g.shadow[loc.clamp(0, G)] >= 0)).view(-1)
    assert shadowed.numel() > 0
    addr = int(shadowed[0])
    logical = h.alloc.logical_attn_allocator
    monkeypatch.setattr(logical, "alloc_extend", lambda *a, **k: torch.tensor([addr]))
    z = torch.zeros(1, dtype=torch.int64)
    locs = h.alloc.alloc_extend(z, z, torch.tensor([1]), torch.tensor([1]), torch.tensor([-1]),
                                1)
    assert locs.tolist() == [addr]
    assert int(g.shadow[int(g.loc[addr])]) < 0  # placed afresh: no shadow
    h.write_kv(locs)
    h.pool.core.check_integrity()
    rows = h.pool.rows_of(0, locs)
    h.check_rows(0, rows.to(torch.int32), locs)
