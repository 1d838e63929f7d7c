"""TP mode's allocator and coordinator (``--ulacache-config '{"mode": "tp"}'``).

SGLang's TP schedulers run in lockstep (SPMD): every rank makes the same calls with the same
arguments, and every call here that reaches a collective of :class:`ulacache.tp.TPAddressSpace`
(``begin_round``, ``place``/``release``/``check_place`` with validate on, ``plan``) is made on
every rank in the same order. What could differ per rank is each rank's room (its own pool,
its buffer), so every yes/no the scheduler sees is agreed first: the prefill fit check (the
core's ``prefill_fits``) counts each rank's share from the sequence lengths alone (identical on
every rank), the logical allocation is agreed through an all-reduce MIN over the gloo group
(:func:`~ulacache.patches.sglang_tp_support.agree`), and with validate on the core's
``check_place`` agrees through its own all-gather (off, room is certain once the fit check
held, and the check's host reads are skipped). A batch is refused (``None``: SGLang's
out-of-memory path) on every rank or on none.

Decode: ``map_last_loc_to_buffer`` starts a round (the core's group fence) and places the new
tokens (the owner's pool; everyone else's buffer copy, filled by the rank's own write);
``swap_in_selected_pages`` turns positions into addresses, plans them on the group's anchor
layer (own promotions, one all-gather of slot tables, buffer claims) and loads every layer's
own bytes of the planned peer rows, shared layers included.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.managers.hisparse_coordinator import HiSparseTokenStats

from ulacache.errors import CapacityExhausted
from ulacache.tp import owned_counts

from . import sglang_tp_support as tps
from .sglang_allocator import UlaCacheTokenToKVPoolAllocator
from .sglang_coordinator import UlaCacheCoordinator

logger = logging.getLogger(__name__)


class UlaCacheTPTokenToKVPoolAllocator(UlaCacheTokenToKVPoolAllocator):
    """Logical addresses from SGLang's paged allocator (the same on every rank); each rank
    places the tokens it owns and buffer copies of the rest; decisions agreed across ranks."""

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort,
                 host_to_device_ratio: int = 2):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort,
                         host_to_device_ratio)
        self.group = kvcache.ula_group
        self.tp_size = kvcache.ula_P

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens):
        """Prefill: logical addresses, a new round, then own rows in every group's pool and
        buffer copies of peers' new rows.

        The batch's sparse prefill attention may select any token of its requests, prefix
        included, in this round: each rank's own share must fit its GPU pool and the rest its
        buffer, or the batch is refused (``None``) on every rank.
        """
        cfg = self.core.config
        lens = [int(n) for n in seq_lens_cpu.reshape(-1).tolist()]
        own = owned_counts(lens, self.tp_size)
        total = sum(lens)
        if not self.prefill_fits(lens):
            logger.warning("ulacache TP: prefill batch spans %d tokens; a rank owns up to %d "
                           "(GPU pool %d rows) and copies up to %d of its peers' (buffer %d "
                           "rows); lower --chunked-prefill-size / the prompt length, or raise "
                           "buffer_slots", total, max(own), cfg.gpu_slots, total - min(own),
                           cfg.buffer_slots)
            return None
        locs = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if not tps.agree(self.group, locs is not None):
            if locs is not None:
                self.logical_attn_allocator.free(locs)
            return None
        with self.core.stream.scope():  # the fence is ordered on the forward stream, not ours
            self.core.begin_round()
        try:
            # After begin_round every buffer slot is free or evictable, prefill_fits held each
            # rank's own share to its GPU pool and its peers' share to its buffer, and the
            # logical allocator holds the batch to the unique capacity: room is certain, so
            # only validate pays the collective check's host syncs (one per group per check)
            if self.core.validate:
                self.core.check_place(locs)  # collective: the same verdict on every rank
        except CapacityExhausted as exc:
            logger.warning("ulacache TP: prefill batch does not fit this round (%s)", exc)
            self.logical_attn_allocator.free(locs)
            return None
        self.core.place(locs)
        return locs


class UlaCacheTPCoordinator(UlaCacheCoordinator):
    """The coordinator of one TP rank (see the module docstring)."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int,
                 device_buffer_size: int, device, tp_group, host_to_device_ratio: int = 2,
                 swap_in_block_size: int = 960, shared_index_layers=None,
                 num_draft_tokens: int = 0):
        tps.require_topk_agreement()
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, top_k,
                         device_buffer_size, device, tp_group, host_to_device_ratio,
                         swap_in_block_size, shared_index_layers, num_draft_tokens)
        self.group = self.mem_pool_device.ula_group
        self._start_layer = self.mem_pool_device.start_layer

    def set_decode_producer_stream(self, stream) -> None:
        self._producer_stream = stream
        self.core.local.set_stream(stream)

    def _begin_round(self) -> None:
        with self.core.stream.scope():  # the group fence is ordered on the forward stream
            self.core.begin_round()

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu,
                               req_pool_indices_cpu) -> None:
        """A decode step starts: the group's round fence, then the new tokens' rows (owner)
        and buffer copies (every other rank)."""
        self._begin_round()
        self._place_fresh(out_cache_loc)
        self.metrics.update()

    def prepare_spec_verify(self, batch) -> None:
        self._begin_round()
        self._place_fresh(batch.out_cache_loc)

    def get_token_stats(self) -> HiSparseTokenStats:
        """This rank's occupancy of the first group (its own stripe: ``G`` GPU, ``C`` CPU)."""
        snap = self.core.local.health.snapshot()[0]
        G, C = self.core.config.gpu_slots, self.core.config.cpu_slots
        gpu, cpu = snap["gpu_used"], snap["cpu_used"]
        return HiSparseTokenStats(device_tokens=gpu, device_token_usage=gpu / max(1, G),
                                  host_tokens=cpu, host_token_usage=cpu / max(1, C))

    # -- model side ----------------------------------------------------------------------
    def _serve_anchor(self, gi: int, layer_id: int, addrs: torch.Tensor) -> torch.Tensor:
        """Plan the group's step (collective) and load the anchor layer's peer rows."""
        rows = self.core.plan(gi, addrs)
        self.core.load(layer_id - self._start_layer)
        return rows

    def _serve_shared(self, layer_id: int) -> None:
        """A layer sharing its anchor's plan still copies its own bytes of the peer rows."""
        self.core.load(layer_id - self._start_layer)
