"""ulacache's stand-in for SGLang's ``HiSparseTokenToKVPoolAllocator``: SGLang's own paged
allocator hands out logical addresses over ``N x (1 + cpu_ratio)`` tokens (= unique capacity,
exclusive tiers); prefill tokens are placed in every group's GPU pool at allocation, decode
tokens by the coordinator, and ``free`` drops rows from both tiers.

Stream order: SGLang calls the allocator from its scheduler's ``schedule_stream`` while the
forward runs on ``forward_stream``; the address space issues every one of these mutations on
its core stream (the forward stream, set by the coordinator), so a free cannot overtake a
forward already launched that still reads the rows (``ulacache.streams``)."""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

from ulacache.errors import CapacityExhausted
from ulacache.space import AddressSpace

from .sglang_pool import UlaCacheDSATokenToKVPool

logger = logging.getLogger(__name__)


class _GpuPoolView:
    """What other SGLang code reads as ``allocator.hisparse_attn_allocator``: the GPU pool of the
    first selection group (size and free/evictable slots)."""

    def __init__(self, core: AddressSpace):
        self.core = core
        self.size = core.config.gpu_slots

    def available_size(self) -> int:
        return int(self.core.groups[0].policy.eligible())


class UlaCacheTokenToKVPoolAllocator(HiSparseTokenToKVPoolAllocator):
    """Logical addresses from SGLang's paged allocator; rows placed and freed in the core.

    Over a TP-mode pool construction builds the TP subclass
    :class:`~ulacache.patches.sglang_tp_runtime.UlaCacheTPTokenToKVPoolAllocator` instead.
    """

    def __new__(cls, *args, **kwargs):
        if cls is UlaCacheTokenToKVPoolAllocator:
            kvcache = kwargs.get("kvcache", args[4] if len(args) > 4 else None)
            from .sglang_tp_pool import UlaCacheTPDSATokenToKVPool

            if isinstance(kvcache, UlaCacheTPDSATokenToKVPool):
                from .sglang_tp_runtime import UlaCacheTPTokenToKVPoolAllocator

                cls = UlaCacheTPTokenToKVPoolAllocator
        return super().__new__(cls)

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 kvcache: UlaCacheDSATokenToKVPool, need_sort: bool,
                 host_to_device_ratio: int = 2):
        # HiSparse's constructor builds a device-slot allocator and a 0-means-unmapped mapping
        # ulacache does not use; the state below is what SGLang and the base class read.
        self._kvcache = kvcache
        self.core: AddressSpace = kvcache.core
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
