"""ulacache's stand-ins for SGLang 0.5.23's HiSparse leaf classes (pool, allocator, coordinator).

They keep HiSparse's constructor signatures and every method SGLang calls (see
``docs/sglang-notes.md``), and adapt those calls to the core:

- **pool** (:class:`UlaCacheDSATokenToKVPool`): ``kv_buffer[layer]`` rows are the core's GPU
  pool. One tensor per selection group ``[L_g, N + 2P, 1, kv_cache_dim]``; rows ``[0, P)`` are
  SGLang's padding sink, rows ``[P, P + N)`` are GPU slots ``0..N-1`` and row ``P + N`` is the
  core's scratch row (the extra tail page keeps the row count a multiple of 64 for FlashMLA).
  Writes and the prefill page table are translated per layer group.
- **allocator** (:class:`UlaCacheTokenToKVPoolAllocator`): SGLang's own paged allocator hands out
  logical addresses over ``N x (1 + cpu_ratio)`` tokens (= unique capacity, exclusive tiers);
  prefill tokens are placed in every group's GPU pool at allocation, decode tokens by the
  coordinator, and ``free`` drops rows from both tiers.
- **coordinator** (:class:`UlaCacheCoordinator`): ``swap_in_selected_pages`` turns top-k positions
  into addresses (``req_to_token``) and runs the core's sparse access on the group's anchor layer;
  the other layers of the group get the same graph-stable output tensor.

Region table of ``kv_buffer[layer]`` rows::

    [0, P)            padding sink (SGLang writes dummy tokens here)
    [P, P + N)        GPU slot (row - P) of the layer's selection group
    [P + N, N + 2P)   tail page; row P + N is the core's scratch row
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator, HiSparseTokenStats
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc

from ulacache.cache import UlaCache
from ulacache.config import SGLangOptions, UlaCacheConfig
from ulacache.errors import CapacityExhausted, ConfigError

logger = logging.getLogger(__name__)

__all__ = ["UlaCacheDSATokenToKVPool", "UlaCacheTokenToKVPoolAllocator", "UlaCacheCoordinator",
           "EXTRA_HOOKS", "layer_groups_from_skip", "sglang_options"]


def sglang_options() -> SGLangOptions:
    """The ``--ulacache-config`` of this launch (defaults when none is published)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        from ulacache.patches.server_args import parse_ulacache_config

        raw = getattr(get_server_args(), "ulacache_config", None)
        return SGLangOptions.from_dict(parse_ulacache_config(raw))
    except (ValueError, LookupError, AttributeError, ImportError):
        return SGLangOptions()


def layer_groups_from_skip(skip_topk_layers: list[bool] | None, layer_num: int,
                           start_layer: int = 0) -> list[list[int]]:
    """Selection groups (global layer ids): a layer that skips top-k reuses the previous layer's
    selection, so it joins that layer's group (SGLang's ``skip_topk_layers``)."""
    groups: list[list[int]] = []
    for i in range(layer_num):
        layer = start_layer + i
        if skip_topk_layers is not None and skip_topk_layers[i] and groups:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def _row_layout(kv_cache_dim: int, store_dtype: torch.dtype) -> tuple[str, int | None]:
    row_bytes = kv_cache_dim * torch._utils._element_size(store_dtype)
    if row_bytes == 656:
        return "fp8", None
    if row_bytes == 1152:
        return "bf16", None
    return "tiny", row_bytes


class UlaCacheDSATokenToKVPool(HiSparseDSATokenToKVPool):
    """DSA latent pool whose rows are ulacache's GPU pools (see the module docstring)."""

    def __init__(self, size: int, page_size: int, kv_lora_rank: int, dtype: torch.dtype,
                 qk_rope_head_dim: int, layer_num: int, device: str, index_head_dim: int,
                 enable_memory_saver: bool, kv_cache_dim: int, start_layer: int | None = None,
                 end_layer: int | None = None, index_kpool: int = 1,
                 index_kpool_compress: bool = False, tail_extra_slots: int = 0,
                 max_running_requests: int | None = None,
                 skip_topk_layers: list[bool] | None = None, host_to_device_ratio: int = 2,
                 ulacache_options: SGLangOptions | None = None):
        self.ula_options = ulacache_options or sglang_options()
        self.ula_groups = layer_groups_from_skip(skip_topk_layers, layer_num, start_layer or 0)
        super().__init__(size, page_size, kv_lora_rank, dtype, qk_rope_head_dim, layer_num,
                         device, index_head_dim, enable_memory_saver, kv_cache_dim,
                         start_layer=start_layer, end_layer=end_layer, index_kpool=index_kpool,
                         index_kpool_compress=index_kpool_compress,
                         tail_extra_slots=tail_extra_slots,
                         max_running_requests=max_running_requests,
                         skip_topk_layers=skip_topk_layers,
                         host_to_device_ratio=host_to_device_ratio)
        ratio = int(host_to_device_ratio)
        layout, row_bytes = _row_layout(self.kv_cache_dim, self.store_dtype)
        opts = self.ula_options
        cfg = UlaCacheConfig(layout=layout, row_bytes=row_bytes, n_layers=layer_num,
                             gpu_slots=size, cpu_slots=(ratio - 1) * size, page_size=page_size,
                             max_requests=max(1, max_running_requests or 1),
                             n_buckets=opts.n_buckets, policy=opts.policy,
                             validate=opts.validate, fetch_cap=opts.fetch_cap)
        P, rb = page_size, cfg.row_layout.row_bytes
        storage = [big.view(torch.uint8).view(big.shape[0], big.shape[1], rb)[:, P: P + size + 1]
                   for big in self._group_buffers]
        layer_ids = [[x - self.start_layer for x in g] for g in self.ula_groups]
        self.core = UlaCache(cfg, self.device, layer_groups=layer_ids, gpu_storage=storage,
                             n_logical=size * ratio + page_size)
        self.current_layer_id = self.start_layer  # set by the forward_extend hook
        host_gib = cfg.cpu_slots * rb * layer_num / 2**30
        logger.info("ulacache pool: %d selection group(s); GPU %d slots x %d layers x %d B; "
                    "CPU %d slots (%.2f GiB pinned host); logical/indexer capacity %d tokens",
                    len(self.ula_groups), size, layer_num, rb, cfg.cpu_slots, host_gib,
                    size * ratio)

    def _create_buffers(self) -> None:
        """One tensor per selection group so a group's layers move in one launch; two extra
        pages per layer beyond SGLang's padding page (see the module docstring)."""
        saver = getattr(self, "memory_saver_adapter", None)
        pool = getattr(self, "custom_mem_pool", None)
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        with saver.region(GPU_MEMORY_TYPE_KV_CACHE) if saver is not None else nullcontext():
            with torch.cuda.use_mem_pool(pool) if pool else nullcontext():
                self._group_buffers = [
                    torch.zeros((len(g), self.size + 2 * self.page_size, 1, self.kv_cache_dim),
                                dtype=self.store_dtype, device=self.device)
                    for g in self.ula_groups]
        self.kv_buffer = [buf[i] for buf in self._group_buffers for i in range(buf.shape[0])]

    def _clear_buffers(self) -> None:
        del self.kv_buffer, self._group_buffers

    # -- translation ---------------------------------------------------------------------
    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        # The core keeps one mapping per selection group; a single table cannot describe them.
        self.full_to_hisparse_device_index_mapping = full_to_hisparse_device_index_mapping

    def _group_index(self, layer_id: int) -> int:
        return self.core.layer_to_group[layer_id - self.start_layer]

    def rows_of(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """``kv_buffer[layer]`` rows of GPU-resident logical ``loc`` (int64, same shape); padding
        (``-1``), the sink page and anything not GPU-resident go to row 0 (the dummy sink)."""
        g = self.core.groups[self._group_index(layer_id)]
        flat = loc.reshape(-1).to(torch.int64)
        ok = (flat >= self.page_size) & (flat < g.n_logical)
        slot = g.loc[torch.where(ok, flat, g.n_logical)]
        rows = torch.where(ok & (slot >= 0) & (slot < g.G), slot + self.page_size, 0)
        return rows.view(loc.shape)

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Prefill page table (logical, ``-1`` padded) -> rows of the current layer's group.
        Selected rows that sit in the CPU tier are promoted first (sparse access); ``-1`` stays
        ``-1`` and the sink page stays row 0."""
        idx = compressed_indices
        gi = self._group_index(self.current_layer_id)
        flat = idx.reshape(1, -1).to(torch.int64)
        sink = (flat >= 0) & (flat < self.page_size)
        slots = self.core.access(gi, torch.where(sink, -1, flat)).to(torch.int64)
        rows = torch.where(slots >= 0, slots + self.page_size, torch.where(sink, 0, -1))
        return rows.view(idx.shape).to(idx.dtype)

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        return self.rows_of(self.current_layer_id, compressed_indices)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor):
        return self.rows_of(self.current_layer_id, full_indices)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
        loc, _, _ = unwrap_write_loc(loc_info)
        DSATokenToKVPool.set_kv_buffer(self, layer, self.rows_of(layer.layer_id, loc),
                                       cache_k, cache_v)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope):
        loc, _, _ = unwrap_write_loc(loc_info)
        DSATokenToKVPool.set_mla_kv_buffer(self, layer, self.rows_of(layer.layer_id, loc),
                                           cache_k_nope, cache_k_rope)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        self.current_layer_id = layer.layer_id
        rows = self.translate_loc_to_hisparse_device(loc)
        return DSATokenToKVPool.get_mla_kv_buffer(self, layer, rows, dst_dtype)

    def transfer_values_on_device(self, dst_indices, src_indices) -> None:
        raise NotImplementedError("ulacache keeps speculative tokens in place; stock HiSparse's "
                                  "slot-to-slot commit copy is never needed")


class _GpuPoolView:
    """What other SGLang code reads as ``allocator.hisparse_attn_allocator``: the GPU pool of the
    first selection group (size and free/evictable slots)."""

    def __init__(self, core: UlaCache):
        self.core = core
        self.size = core.config.gpu_slots

    def available_size(self) -> int:
        return int(self.core.groups[0].policy.eligible())


class UlaCacheTokenToKVPoolAllocator(HiSparseTokenToKVPoolAllocator):
    """Logical addresses from SGLang's paged allocator; rows placed and freed in the core."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 kvcache: UlaCacheDSATokenToKVPool, need_sort: bool,
                 host_to_device_ratio: int = 2):
        # HiSparse's constructor builds a device-slot allocator and a 0-means-unmapped mapping
        # ulacache does not use; the state below is what SGLang and the base class read.
        self._kvcache = kvcache
        self.core: UlaCache = kvcache.core
        self._size_full = size * host_to_device_ratio
        self._size_hisparse = size
        self.compress_ratio = 1
        self.dtype, self.device = dtype, device
        self.page_size, self.need_sort = page_size, need_sort
        self._spec_scratch_capacity = 0
        self._spec_device_buffer_size = 0
        self.logical_attn_allocator = PagedTokenToKVPoolAllocator(
            self._size_full, page_size, dtype, device, kvcache, need_sort)
        self.hisparse_attn_allocator = _GpuPoolView(self.core)
        self.free_pages = None
        self.release_pages = None
        self.free_group = None
        self.clear()

    def available_size(self) -> int:
        """Free logical tokens = free unique capacity (GPU + CPU slots, exclusive tiers)."""
        return self.logical_attn_allocator.available_size()

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        return 0  # the GPU pool is shared: no per-request device buffer to reserve

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens):
        """Prefill: logical addresses, then a GPU slot for each in every group (new round).

        The prefill attention of this batch may select any token of its requests, and all of
        them must be GPU-resident in the same round: a batch whose total length exceeds the GPU
        pool is refused (``None``, SGLang's out-of-memory path) instead of served wrongly.
        """
        total = int(seq_lens_cpu.sum())
        if total > self.core.config.gpu_slots:
            logger.warning("ulacache: prefill batch spans %d tokens, more than the %d-slot GPU "
                           "pool; lower --chunked-prefill-size / the prompt length, or give the "
                           "KV cache more memory", total, self.core.config.gpu_slots)
            return None
        locs = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if locs is None:
            return None
        self.core.begin_round()
        try:
            self.core.check_room(locs.numel())  # prefill runs eagerly: a host check is fine here
            self.core.place(locs)
        except CapacityExhausted as exc:
            logger.warning("ulacache: prefill batch does not fit this round's GPU room (%s)", exc)
            self.logical_attn_allocator.free(locs)
            return None
        return locs

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        """Decode: logical only; the coordinator places the token (``map_last_loc_to_buffer``)."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                           extend_num_tokens):
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)

    def _page_addresses(self, index: torch.Tensor) -> torch.Tensor:
        """Every address of the pages ``index`` touches: SGLang's paged allocator frees whole
        pages, so rows of a page's unreturned tail (e.g. rejected draft tokens) go too."""
        P = self.page_size
        pages = torch.unique(index.reshape(-1).to(torch.int64) // P)
        return (pages.view(-1, 1) * P + torch.arange(P, device=pages.device)).reshape(-1)

    def free_hisparse(self, free_index: torch.Tensor) -> None:
        self.core.release(self._page_addresses(free_index))

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.core.release(self._page_addresses(free_index))
        self.logical_attn_allocator.free(free_index)

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.core.release(torch.arange(self.core.n_logical, device=self.core.device))

    def live_mask(self) -> torch.Tensor:
        """``bool [n_logical]``: addresses in pages SGLang's allocator has handed out."""
        a = self.logical_attn_allocator
        P = self.page_size
        free = torch.cat([t for t in (a.free_pages, a.release_pages) if t is not None])
        page_live = torch.ones(self.core.n_logical // P, dtype=torch.bool, device=free.device)
        page_live[0] = False  # the padding page
        page_live[free.long()] = False
        return page_live.repeat_interleave(P).to(self.core.device)

    def check_integrity(self) -> None:
        """Core invariants, with liveness taken from SGLang's allocator."""
        self.core.check_integrity(self.live_mask())


class _Staged(NamedTuple):
    """An entry of ``ack_staging_queue`` (the scheduler reads ``.req``)."""

    req: Any


class UlaCacheCoordinator(HiSparseCoordinator):
    """The one object SGLang's scheduler, model runner and DSA backend call (DP mode)."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int,
                 device_buffer_size: int, device, tp_group, host_to_device_ratio: int = 2,
                 swap_in_block_size: int = 960, shared_index_layers=None,
                 num_draft_tokens: int = 0):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.mem_pool_device: UlaCacheDSATokenToKVPool = token_to_kv_pool_allocator.get_kvcache()
        self.core: UlaCache = self.mem_pool_device.core
        self.top_k, self.device, self.tp_group = top_k, device, tp_group
        self.device_buffer_size = device_buffer_size
        self.padded_buffer_size = 0
        self.page_size = self.mem_pool_device.page_size
        self.mem_pool_host = None  # no host mirror: exclusive tiers live in the core
        R = req_to_token_pool.req_to_token.shape[0]
        steps = max(1, num_draft_tokens)
        worst = (R - 1) * steps * top_k + (R - 1) * steps
        if self.core.config.gpu_slots < worst:
            raise ConfigError(
                f"ulacache: the GPU pool ({self.core.config.gpu_slots} slots) must hold one step's "
                f"selections: ({R - 1} requests x {steps} tokens) x (top-k {top_k} + 1) = {worst}. "
                "Lower --max-running-requests (or --cuda-graph-max-bs), or give the KV cache more "
                "memory (--mem-fraction-static)")
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self._row_ids = torch.arange(R * steps, device=device)
        self._rows_out = [torch.full((R * steps, top_k), -1, dtype=torch.int32, device=device)
                          for _ in self.core.groups]
        self._anchor = {g.layers[0] + self.mem_pool_device.start_layer: i
                        for i, g in enumerate(self.core.groups)}
        self.ack_staging_queue: list[_Staged] = []
        self._producer_stream = None
        logger.info("ulacache coordinator: %d request rows, top-k %d, %d selection groups",
                    R, top_k, len(self.core.groups))

    # -- scheduler side ------------------------------------------------------------------
    def set_decode_producer_stream(self, stream) -> None:
        self._producer_stream = stream

    def _on_producer(self):
        s = self._producer_stream
        return torch.cuda.stream(s) if s is not None and torch.cuda.is_available() else \
            nullcontext()

    def allocate_spec_scratch(self, req_pool_indices) -> None:
        return None  # speculative tokens get ordinary GPU slots at prepare_spec_verify

    def admit_request_into_staging(self, req) -> None:
        """Prompt rows are already placed (GPU or spilled): nothing to copy, ready at once."""
        req.hisparse_staging = True
        self.ack_staging_queue.append(_Staged(req))

    def collect_ready_reqs(self) -> list:
        ready = [s.req for s in self.ack_staging_queue]
        self.ack_staging_queue.clear()
        for req in ready:
            req.hisparse_staging = False
        return ready

    def has_ongoing_staging(self) -> bool:
        return bool(self.ack_staging_queue)

    def abort_staging_request(self, req) -> None:
        self.ack_staging_queue = [s for s in self.ack_staging_queue if s.req is not req]
        req.hisparse_staging = False

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu,
                               req_pool_indices_cpu) -> None:
        """A decode step starts: new PB-LRU round, then the new tokens get GPU slots."""
        with self._on_producer():
            self.core.begin_round()
            self._place_fresh(out_cache_loc)

    def prepare_spec_verify(self, batch) -> None:
        with self._on_producer():
            self.core.begin_round()
            self._place_fresh(batch.out_cache_loc)

    def _place_fresh(self, locs: torch.Tensor) -> None:
        """GPU slots for tokens about to be written. A paged allocator hands a position the
        address a rejected draft token used in the same page; that row is dead, drop it first."""
        self.core.release(locs)
        self.core.place(locs)

    def commit_spec_accept_tokens(self, batch, accept_indices) -> None:
        # Accepted tokens keep the rows they were verified in; rejected ones are freed through
        # the allocator like any other logical address.
        return None

    def wait_for_pending_backup(self) -> None:
        return None  # every ulacache copy is on the forward stream, in order

    def request_finished(self, req) -> None:
        """Rows are released when SGLang frees the request's logical addresses right after."""
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)

    def retract_req(self, req) -> None:
        self.request_finished(req)

    def admit_request_direct(self, req) -> None:
        raise NotImplementedError("ulacache does not support PD-disaggregated decode yet; "
                                  "legal: colocated prefill+decode")

    def host_token_len(self, n: int) -> int:
        return n

    def get_token_stats(self) -> HiSparseTokenStats:
        g = self.core.groups[0]
        gpu = int((g.gpu_owner[: g.G] >= 0).sum())
        cpu = g.C - int(g.pools.cpu_top)
        return HiSparseTokenStats(device_tokens=gpu, device_token_usage=gpu / max(1, g.G),
                                  host_tokens=cpu, host_token_usage=cpu / max(1, g.C))

    def destroy(self) -> None:
        self.ack_staging_queue.clear()
        self._rows_out = []

    # -- model side (inside the CUDA graph) ----------------------------------------------
    def swap_in_selected_pages(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               top_k_result: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Top-k positions -> ``int32`` rows of ``kv_buffer[layer_id]`` (graph-stable view).

        ``top_k_result`` is ``int32 [bs, K]`` (decode) or ``[bs, steps, K]`` (verify) positions
        of each request, ``-1`` padded; rows ``>= num_real_reqs`` are padding and come back
        ``-1``. The group's anchor layer runs the sparse access; its other layers reuse it.
        """
        shape = top_k_result.shape
        bs, K = shape[0], shape[-1]
        steps = shape[1] if top_k_result.dim() == 3 else 1
        n = bs * steps
        gi = self._anchor.get(layer_id)
        if gi is None:  # a layer that shares its anchor's selection
            gi = self.mem_pool_device._group_index(layer_id)
            return self._rows_out[gi][:n].view(shape)
        pos = top_k_result.reshape(n, K).to(torch.int64)
        req = req_pool_indices.to(torch.int64)
        real = self._row_ids[:bs] < self.num_real_reqs
        if steps > 1:
            req = req.repeat_interleave(steps)
            real = real.repeat_interleave(steps)
        valid = (pos >= 0) & real.unsqueeze(1)
        table = self.req_to_token_pool.req_to_token
        addrs = table[req.unsqueeze(1), pos.clamp(min=0)].to(torch.int64)
        slots = self.core.access(gi, torch.where(valid, addrs, -1))
        out = self._rows_out[gi][:n]
        out.copy_(torch.where(slots >= 0, slots + self.page_size, -1))
        return out.view(shape)


def _forward_extend_around(original_fn, self, *args, **kwargs):
    """Tell a ulacache pool which layer the prefill page table it translates next belongs to."""
    layer = args[3] if len(args) > 3 else kwargs.get("layer")
    pool = getattr(self, "token_to_kv_pool", None)
    if isinstance(pool, UlaCacheDSATokenToKVPool) and layer is not None:
        pool.current_layer_id = layer.layer_id
    return original_fn(self, *args, **kwargs)


def _parse_hisparse_config_around(original_fn, *args, **kwargs):
    """Size SGLang's logical space and indexer cache from ``cpu_ratio`` (one memory budget)."""
    cfg = original_fn(*args, **kwargs)
    cfg.host_to_device_ratio = sglang_options().host_to_device_ratio
    return cfg


EXTRA_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend":
        (_forward_extend_around, "around"),
    "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config":
        (_parse_hisparse_config_around, "around"),
}
"""Hooks the plugin registers with the class swaps when the ulacache backend is selected."""
