"""ulacache's stand-in for SGLang's ``HiSparseCoordinator``, one class for both modes: the one
object the scheduler, the model runner and the DSA backend call. ``swap_in_selected_pages``
turns top-k positions into addresses (``req_to_token``) and plans them on the group's anchor
layer (the core's ``plan``: DP, the sparse access; TP, own promotions, one all-gather of slot
tables and buffer claims); every layer of the group then ``load``s its own bytes of the planned
rows (DP: nothing to move; TP: one gather of peers' rows) and gets the same graph-stable output
tensor.

Streams: ``set_decode_producer_stream`` makes SGLang's forward stream the core stream, so every
core mutation (the scheduler's allocation, placement and frees included) is ordered with the
forwards (``ulacache.streams``); ``request_finished`` also makes the scheduler's stream wait for
it, as HiSparse does, before SGLang recycles the request's tables."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator, HiSparseTokenStats

from ulacache.core import Core
from ulacache.errors import ConfigError, StaleSelectionError
from ulacache.prefetch import PrefetchEngine
from ulacache.streams import capturing

from .sglang_metrics import MetricsBridge
from .sglang_pool import UlaCacheDSATokenToKVPool

logger = logging.getLogger(__name__)


class _Staged(NamedTuple):
    """An entry of ``ack_staging_queue`` (the scheduler reads ``.req``)."""

    req: Any


class UlaCacheCoordinator(HiSparseCoordinator):
    """The one object SGLang's scheduler, model runner and DSA backend call (both modes)."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int,
                 device_buffer_size: int, device, tp_group, host_to_device_ratio: int = 2,
                 swap_in_block_size: int = 960, shared_index_layers=None,
                 num_draft_tokens: int = 0):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.mem_pool_device: UlaCacheDSATokenToKVPool = token_to_kv_pool_allocator.get_kvcache()
        self.core: Core = self.mem_pool_device.core
        self.top_k, self.device, self.tp_group = top_k, device, tp_group
        self.device_buffer_size = device_buffer_size
        self.padded_buffer_size = 0
        self.page_size = self.mem_pool_device.page_size
        self.mem_pool_host = None  # no host mirror: exclusive tiers live in the core
        R = req_to_token_pool.req_to_token.shape[0]
        steps = max(1, num_draft_tokens)
        self._check_sizes(R - 1, steps, top_k)
        self._check_groups(shared_index_layers)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self._row_ids = torch.arange(R * steps, device=device)
        self._rows_out = [torch.full((R * steps, top_k), -1, dtype=torch.int32, device=device)
                          for _ in self.core.groups]
        self._start_layer = self.mem_pool_device.start_layer
        self._anchor = {g.layers[0] + self._start_layer: i
                        for i, g in enumerate(self.core.groups)}
        self._anchor_step = [(-1, -1)] * len(self.core.groups)  # (round, rows) of last access
        self.ack_staging_queue: list[_Staged] = []
        self._producer_stream = None
        # ulacache's counters in SGLang's /metrics (--enable-metrics), from the host snapshot
        self.metrics = MetricsBridge(self.core)
        self.prefetch = self._prefetch_engine(R, top_k, num_draft_tokens)
        logger.info("ulacache coordinator: %d request rows, top-k %d, %d selection groups",
                    R, top_k, len(self.core.groups))

    def _prefetch_engine(self, rows: int, top_k: int, draft_tokens: int
                         ) -> PrefetchEngine | None:
        """The look-ahead prefetch of ``--ulacache-config`` ``prefetch`` (off: ``None``).
        Every prefetch is issued inside the forward (``forward_only``: group g's once group
        g - 1's selection is known), so SGLang's decode and verify graphs capture it whole;
        the draft source's buffers (one row per request slot) exist before any capture."""
        cfg = self.mem_pool_device.ula_options.prefetch
        if not cfg.enabled:
            return None
        if "draft" in cfg.sources and draft_tokens < 2:
            raise ConfigError("--ulacache-config prefetch source 'draft' reads the selections "
                              "of a speculative verify batch: it needs EAGLE/EAGLE3/MTP with "
                              "--speculative-num-draft-tokens >= 2 (this launch has none); "
                              "legal without: previous_layer")
        layers = max(len(g.layers) for g in self.core.groups)
        engine = PrefetchEngine(self.core, cfg, len(self.core.groups),
                                self.core.config.row_layout.row_bytes * layers, self.core.device,
                                forward_only=True, draft_shape=(rows, top_k))
        logger.info("ulacache prefetch: sources %s, %d rows per group per step",
                    ", ".join(cfg.sources), engine.cap)
        return engine

    def _check_groups(self, shared_index_layers: list[bool] | None) -> None:
        """Refuse to start when the pool's selection groups disagree with the model's top-k
        sharing (SGLang's ``shared_index_layers``): a shared layer must be in its anchor's
        group, an indexer layer must start one. ``None``: SGLang did not resolve the pattern
        (no sharing, or its prefetch is off); nothing to compare."""
        if shared_index_layers is None:
            return
        wrong = [layer for g in self.mem_pool_device.ula_groups for layer in g
                 if layer < len(shared_index_layers)
                 and bool(shared_index_layers[layer]) != (layer != g[0])]
        if wrong:
            raise ConfigError(
                f"ulacache: the pool's selection groups {self.mem_pool_device.ula_groups} "
                f"disagree with the model's top-k sharing at layers {wrong[:8]}; a shared layer "
                "must reuse its anchor's rows. The pool's skip_topk_layers did not reach it")

    def _check_sizes(self, requests: int, steps: int, top_k: int) -> None:
        """Refuse to start unless a decode step's selections fit (the core's
        ``check_step_capacity``: the GPU pool in DP mode; the buffer and each rank's share of
        them in TP mode), naming the SGLang flags that change it."""
        try:
            self.core.check_step_capacity(requests, steps, top_k)
        except ConfigError as exc:
            raise ConfigError(
                f"ulacache: {exc}. Lower --max-running-requests (or --cuda-graph-max-bs-decode), "
                "give the KV cache more memory (--mem-fraction-static), or in TP mode raise "
                "'buffer_slots' in --ulacache-config") from None

    # -- scheduler side ------------------------------------------------------------------
    def set_decode_producer_stream(self, stream) -> None:
        """SGLang's forward stream: from now on every core mutation is issued on it."""
        self._producer_stream = stream
        self.core.set_stream(stream)

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
        self._start_step(out_cache_loc)
        self.metrics.update()

    def prepare_spec_verify(self, batch) -> None:
        self._start_step(batch.out_cache_loc)

    def _start_step(self, locs: torch.Tensor) -> None:
        """A new PB-LRU round and the step's tokens placed; with prefetch, every earlier
        prefetch has landed first and the per-step budgets are refilled (on the core stream,
        which the forward's accesses run on)."""
        pf = self.prefetch
        with self.core.stream.scope():
            if pf is not None:
                pf.begin_step()
            self.core.begin_round()
            self._place_fresh(locs)
            if pf is not None:
                pf.round_started()

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
        """Rows are released when SGLang frees the request's logical addresses right after
        (on the core stream, so after any forward already launched that reads them). The
        scheduler's stream also waits for that forward, as in HiSparse, before SGLang hands the
        request's ``req_to_token`` row to another request."""
        self.core.stream.fence()
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        self.metrics.update()

    def retract_req(self, req) -> None:
        self.request_finished(req)

    def admit_request_direct(self, req) -> None:
        raise NotImplementedError("ulacache does not support PD-disaggregated decode yet; "
                                  "legal: colocated prefill+decode")

    def host_token_len(self, n: int) -> int:
        return n

    def get_token_stats(self) -> HiSparseTokenStats:
        """Occupancy of the first group from the counter monitor's last snapshot (taken at a
        round boundary without syncing the device)."""
        snap = self.core.health.snapshot()[0]
        G, C = self.core.config.gpu_slots, self.core.config.cpu_slots
        gpu, cpu = snap["gpu_used"], snap["cpu_used"]
        return HiSparseTokenStats(device_tokens=gpu, device_token_usage=gpu / max(1, G),
                                  host_tokens=cpu, host_token_usage=cpu / max(1, C))

    def destroy(self) -> None:
        self.ack_staging_queue.clear()
        self._rows_out = []

    # -- model side (inside the CUDA graph) ----------------------------------------------
    def swap_in_selected_pages(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               top_k_result: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Top-k positions -> ``int32`` rows of ``kv_buffer[layer_id]`` (graph-stable view).

        ``top_k_result`` is ``int32 [bs, K]`` (decode) or ``[bs, steps, K]`` (verify) positions
        of each request, ``-1`` padded; rows ``>= num_real_reqs`` are padding and come back
        ``-1``, and so do entries whose address is on SGLang's reserved sink page. The group's
        anchor layer runs the sparse access; its other layers reuse it.
        """
        shape = top_k_result.shape
        bs, K = shape[0], shape[-1]
        steps = shape[1] if top_k_result.dim() == 3 else 1
        n = bs * steps
        gi = self._anchor.get(layer_id)
        if gi is None:  # a layer that shares its anchor's selection: this step's rows
            gi = self.mem_pool_device.group_index(layer_id)
            if self.core.validate and not capturing(self.core.device) and \
                    self._anchor_step[gi] != (self.core.round_serial, n):
                raise StaleSelectionError(
                    f"layer {layer_id} reuses the selection of its group's anchor layer, which "
                    f"has not run in this step ({n} rows); it would read last step's rows")
            if self.prefetch is not None:  # shared_groups: this layer's replayed bytes only
                self.prefetch.before_load(layer_id - self._start_layer)
            self.core.load(layer_id - self._start_layer)  # TP: its bytes of the peer rows
            return self._rows_out[gi][:n].view(shape)
        pos = top_k_result.reshape(n, K).to(torch.int64)
        req = req_pool_indices.to(torch.int64)
        real = self._row_ids[:bs] < self.num_real_reqs
        if steps > 1:
            req = req.repeat_interleave(steps)
            real = real.repeat_interleave(steps)
        table = self.req_to_token_pool.req_to_token
        addrs = table[req.unsqueeze(1), pos.clamp(min=0)].to(torch.int64)
        # SGLang's reserved first page is its padding sink, never a token's address (the paged
        # allocator hands out pages from 1: mem_cache/allocator/paged.py:396). The decode
        # graph runner's warmup and capture batches (req_pool_indices 0, seq_lens its fill
        # value, every row "real": decode_cuda_graph_runner.py:1242) select entries that read
        # it: padding, as in prefill_rows (validate on used to refuse them as dead addresses).
        valid = (pos >= 0) & real.unsqueeze(1) & (addrs >= self.page_size)
        out = self._rows_out[gi][:n]
        addrs = torch.where(valid, addrs, -1)
        pf = self.prefetch
        # kv_buffer rows straight into the graph-stable output (the kernels add row_base)
        if pf is None:
            self.core.plan(gi, addrs, out)  # TP: collective
        else:
            # waits for this group's prefetch (issued at the previous group's selection),
            # plans (shared_groups: the anchor's bytes; the rest on the prefetch stream) and
            # issues group gi + 1's prefetch (previous_layer)
            pf.plan(gi, addrs, out)
            if steps > 1:  # a verify batch: its last draft position looks one step ahead
                pf.draft_selected(gi, addrs.view(bs, steps, K)[:, -1])
        self.core.load(layer_id - self._start_layer)
        self._anchor_step[gi] = (self.core.round_serial, n)
        return out.view(shape)
