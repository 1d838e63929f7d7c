"""ulacache's stand-in for SGLang's ``HiSparseTokenToKVPoolAllocator``, one class for both
modes: SGLang's own paged allocator hands out logical addresses over ``N x (1 + cpu_ratio)``
tokens (= unique capacity, exclusive tiers); prefill tokens are placed in every group's GPU pool
at allocation, decode tokens by the coordinator, and ``free`` drops rows from both tiers.

TP mode: SGLang's TP schedulers run in lockstep (SPMD): every rank makes the same calls with
the same arguments, and every call here that reaches a collective of the core (``begin_round``,
``place`` / ``release`` / ``check_place`` with validate on) is made on every rank in the same
order. What could differ per rank is each rank's room, so every yes/no the scheduler sees is the
same on every rank: the prefill fit check (the core's ``prefill_fits``) counts each rank's share
from the sequence lengths alone, the logical allocation's success is agreed (the core's
``agree``: one host byte over gloo; DP: local), and with validate on the core's ``check_place``
agrees through its own all-gather. A batch is refused on every rank or on none.

Stream order: SGLang calls the allocator from its scheduler's ``schedule_stream`` while the
forward runs on ``forward_stream``; the address space issues every one of these mutations on
its core stream (the forward stream, set by the coordinator), so a free cannot overtake a
forward already launched that still reads the rows (``ulacache.streams``)."""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from ulacache.core import Core
from ulacache.errors import CapacityExhausted

from .sglang_page_classes import PositionClassedPageAllocator
from .sglang_pool import UlaCacheDSATokenToKVPool

logger = logging.getLogger(__name__)


class _GpuPoolView:
    """What other SGLang code reads as ``allocator.hisparse_attn_allocator``: the GPU pool of the
    first selection group (size and free/evictable slots)."""

    def __init__(self, core: Core):
        self.core = core
        self.size = core.config.gpu_slots

    def available_size(self) -> int:
        return int(self.core.groups[0].policy.eligible())


class UlaCachePrefillBudget(PrefillBudget):
    """SGLang's prefill budget (logical tokens: ulacache's unique capacity, GPU + CPU) plus the
    one thing it does not know: every token of every request in a prefill batch must be
    GPU-resident in the batch's round (the sparse prefill attention may select any of them),
    so a batch is refused by :meth:`UlaCacheTokenToKVPoolAllocator.alloc_extend` when their
    sum exceeds the GPU pool (DP) or a rank's share its pool or buffer (TP). SGLang turns that
    refusal into ``RuntimeError("Prefill out of memory")`` in its scheduler
    (``mem_cache/allocation.py`` ``alloc_paged_token_slots_extend``), so the budget refuses
    first: a request joins a prefill batch only when the whole prompts of the batch's
    requests, its own included, pass the allocator's :meth:`prefill_fits`; otherwise it waits
    for the next pass (``PrefillAdder`` returns ``NO_TOKEN``, SGLang's own "no room yet").

    It charges each request its whole prompt (``full_untruncated_fill_ids``), the length of
    its last chunk's batch, whatever chunk this pass runs: a chunked request's earlier chunks
    stay on the GPU until its last one. ``request``: the request ``PrefillAdder`` is deciding
    on, set by the AROUND hooks on its three entry points (:data:`ADMISSION_HOOKS`); the
    budget's checks come with no request argument."""

    def __init__(self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0):
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.admitted: list[int] = []  # whole prompt lengths of this batch's requests
        self.request = None

    def _prompt(self) -> int | None:
        r = self.request
        return None if r is None else len(r.full_untruncated_fill_ids)

    def gpu_fits(self) -> bool:
        n = self._prompt()
        return n is None or self.allocator.prefill_fits(self.admitted + [n])

    def check_prefill(self, **kwargs) -> tuple[bool, int | None]:
        if not self.gpu_fits():
            return False, None
        return super().check_prefill(**kwargs)

    def can_allocate_prefill(self, **kwargs) -> bool:
        return self.gpu_fits() and super().can_allocate_prefill(**kwargs)

    def fit_chunk(self, **kwargs) -> int | None:
        if not self.gpu_fits():
            return None
        return super().fit_chunk(**kwargs)

    def reserve(self, extend_input_len: int, max_new_tokens: int, **kwargs) -> None:
        super().reserve(extend_input_len, max_new_tokens, **kwargs)
        n = self._prompt()
        if n is not None:
            self.admitted.append(n)
            self.request = None


def _deciding_on(original_fn, self, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req`` / ``add_one_req_ignore_eos`` / ``add_chunked_req``:
    tell a ulacache budget which request the adder is deciding on."""
    budget = getattr(self, "memory_budget", None)
    if not isinstance(budget, UlaCachePrefillBudget):
        return original_fn(self, req, *args, **kwargs)
    budget.request = req
    try:
        return original_fn(self, req, *args, **kwargs)
    finally:
        budget.request = None


ADMISSION_HOOKS = {
    f"sglang.srt.managers.schedule_policy.PrefillAdder.{name}": (_deciding_on, "around")
    for name in ("add_one_req", "add_one_req_ignore_eos", "add_chunked_req")
}
"""Registered with the class swaps (``classes.EXTRA_HOOKS``)."""


class UlaCacheTokenToKVPoolAllocator(HiSparseTokenToKVPoolAllocator):
    """Logical addresses from SGLang's paged allocator; rows placed and freed in the core (TP:
    each rank places the tokens it owns and buffer copies of the rest)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 kvcache: UlaCacheDSATokenToKVPool, need_sort: bool,
                 host_to_device_ratio: int = 2):
        # HiSparse's constructor builds a device-slot allocator and a 0-means-unmapped mapping
        # ulacache does not use; the state below is what SGLang and the base class read.
        self._kvcache = kvcache
        self.core: Core = kvcache.core
        self._size_full = size * host_to_device_ratio
        self._size_hisparse = size
        self.compress_ratio = 1
        self.dtype, self.device = dtype, device
        self.page_size, self.need_sort = page_size, need_sort
        self._spec_scratch_capacity = 0
        self._spec_device_buffer_size = 0
        classes = kvcache.page_classes
        if classes:  # index-K striped by page: a request's k-th page on rank k mod P
            self.logical_attn_allocator = PositionClassedPageAllocator(
                self._size_full, page_size, dtype, device, kvcache, need_sort, classes)
            kvcache.pages_cycle()
        else:
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
        """The GPU pool is shared: no per-request device buffer to reserve; the logical
        allocator's own reserve (a page-classed one's class rounding, else 0)."""
        return self.logical_attn_allocator.request_slot_reserve(
            has_req_pool_slot=has_req_pool_slot, prefill_tokens=prefill_tokens)

    # -- admission: refuse what cannot be served, never hand SGLang a None ------------------
    def prefill_fits(self, seq_lens: list[int]) -> bool:
        """Whether a prefill batch whose requests reach these lengths (prefix + extend, tokens)
        can be served: in one round, every token GPU-resident at once (the core's
        ``prefill_fits``, DP or TP), or else through the pool's prefill stage, which holds
        them all (DP; DCP: each rank its own share; :class:`ulacache.prefill.PrefillStage`).
        :meth:`alloc_extend` refuses exactly what this refuses (and a staged batch whose new
        tokens outgrow the pool, which SGLang's chunk size, at most the pool when the stage is
        on, rules out)."""
        stage = self._kvcache.usable_stage()
        return self.core.prefill_fits(seq_lens) or (stage is not None and stage.fits(seq_lens))

    def max_new_tokens_for_memory(self, input_tokens: int, max_new_tokens: int, *,
                                  token_capacity: int, sliding_window_size: int | None,
                                  chunk_size: int | None) -> int | None:
        """SGLang's queue-time clip (``scheduler.py`` ``_clip_max_new_tokens``): ``None`` (the
        request is aborted with "Request prompt exceeds the KV memory budget") for a prompt
        whose prefill can never fit the GPU pool, else SGLang's own clip against
        ``token_capacity``, the unique capacity (GPU + CPU) that ``logical_token_capacity``
        reports for a ulacache pool."""
        if not self.prefill_fits([input_tokens]):
            return None
        return super().max_new_tokens_for_memory(
            input_tokens, max_new_tokens, token_capacity=token_capacity,
            sliding_window_size=sliding_window_size, chunk_size=chunk_size)

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens: int = 0):
        """SGLang's prefill budget with the GPU pool's room (:class:`UlaCachePrefillBudget`)."""
        return UlaCachePrefillBudget(self, tree_cache,
                                     num_mixed_decode_tokens=num_mixed_decode_tokens)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens):
        """Prefill: logical addresses, a new round, then a GPU slot for each in every group
        (TP: own rows in this rank's pool, buffer copies of peers' rows).

        The prefill attention of this batch may select any token of its requests, prefix
        included: all of them GPU-resident in the same round, or (DP, a batch longer than the
        pool) gathered into the prefill stage, with only the new tokens placed in the pool. A
        batch :meth:`prefill_fits` refuses, or whose new tokens outgrow the pool, is refused
        here (``None``, SGLang's out-of-memory path) on every rank, instead of served wrongly.
        Admission (:class:`UlaCachePrefillBudget`, :meth:`max_new_tokens_for_memory`) refuses
        such batches first.
        """
        lens = [int(n) for n in seq_lens_cpu.reshape(-1).tolist()]
        new = [n - int(p) for n, p in zip(lens, prefix_lens_cpu.reshape(-1).tolist())]
        if not self.prefill_fits(lens) or not self.core.prefill_fits(new):
            logger.warning("ulacache: prefill batch spans %d tokens, more than one round of the "
                           "GPU pool (%d own slots, %d buffer rows per rank) holds; lower "
                           "--chunked-prefill-size / the prompt length, or give the KV cache "
                           "more memory", sum(lens), self.core.config.gpu_slots,
                           self.core.config.buffer_slots)
            return None
        locs = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if not self.core.agree(locs is not None):
            if locs is not None:
                self.logical_attn_allocator.free(locs)
            return None
        self.core.begin_round()
        try:
            # After begin_round every GPU slot (TP: and buffer slot) is free or evictable, the
            # checks above held the new tokens (staged: only they are placed) or the whole
            # batch to one round and the logical allocator to the unique capacity: room is
            # certain, so only validate pays the check's host syncs (they
            # would stall the scheduler's CPU side of the next batch under overlap scheduling)
            if self.core.validate:
                self.core.check_place(locs)  # TP: collective, the same verdict on every rank
        except CapacityExhausted as exc:
            logger.warning("ulacache: prefill batch does not fit this round (%s)", exc)
            self.logical_attn_allocator.free(locs)
            return None
        if not self.core.validate:
            # Production: an address still mapped (only an upstream bug could hand one out)
            # is released first, so that it is placed afresh and SGLang's write of its KV
            # cannot land in a resident row whose shadow would then be stale (with validate
            # on, check_place refused it above).
            self.core.release(locs)
        self.core.place(locs)
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
        return self._addresses_of_pages(torch.unique(index.reshape(-1).to(torch.int64) //
                                                     self.page_size))

    def _addresses_of_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Every address of these (distinct) pages, ``int64 [pages x page_size]``."""
        P = self.page_size
        return (pages.view(-1, 1) * P + torch.arange(P, device=pages.device)).reshape(-1)

    def free_hisparse(self, free_index: torch.Tensor) -> None:
        self.core.release(self._page_addresses(free_index))

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.core.release(self._page_addresses(free_index))
        self.logical_attn_allocator.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """SGLang's release path for a finished or retracted request (``release_kv_cache`` ->
        ``free_kv_row_segments``, ``mem_cache/common.py:152``; ``allocator/base.py:284``):
        ``kv_row[start_pos:]`` of one request, ``start_pos`` page-aligned and each page's
        tokens contiguous, so ``free_index[::page_size]`` names every page once. Neither side
        needs :func:`torch.unique` (a host sync on the scheduler's path, as :meth:`free`):
        the core releases those pages' addresses and SGLang's paged allocator its
        ``free_segment`` (``allocator/paged.py:340``, fixed-shape)."""
        if free_index.numel() == 0:
            return
        P = self.page_size
        if start_pos % P:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page {P})")
        self.core.release(self._addresses_of_pages(free_index[::P].to(torch.int64) // P))
        self.logical_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.core.release(torch.arange(self.core.n_logical, device=self.core.device))

    def live_mask(self) -> torch.Tensor:
        """``bool [n_logical]``: addresses in pages SGLang's allocator has handed out."""
        a = self.logical_attn_allocator
        P = self.page_size
        free = a.get_all_free_pages()  # staged frees (need_sort) included
        page_live = torch.ones(self.core.n_logical // P, dtype=torch.bool, device=free.device)
        page_live[0] = False  # the padding page
        page_live[free.long()] = False
        return page_live.repeat_interleave(P).to(self.core.device)

    def check_integrity(self) -> None:
        """Core invariants, with liveness taken from SGLang's allocator."""
        self.core.check_integrity(self.live_mask())
