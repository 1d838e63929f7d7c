"""ulacache's stand-in for SGLang's ``HiSparseDSATokenToKVPool``: ``kv_buffer`` rows are the
core's GPU pools.

One tensor per selection group ``[L_g, N + 2P, 1, kv_cache_dim]``. Region table of
``kv_buffer[layer]`` rows::

    [0, P)            padding sink (SGLang writes dummy tokens here)
    [P, P + N)        GPU slot (row - P) of the layer's selection group
    [P + N, N + 2P)   tail page; row P + N is the core's scratch row (the extra page keeps the
                      row count a multiple of 64 for FlashMLA)

Writes and the prefill page table are translated per layer group.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc

from ulacache.cache import UlaCache
from ulacache.config import SGLangOptions, UlaCacheConfig

logger = logging.getLogger(__name__)


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
