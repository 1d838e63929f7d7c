"""ulacache's stand-in for SGLang's ``HiSparseDSATokenToKVPool``: ``kv_buffer`` rows are the
core's GPU pools.

One tensor per selection group ``[L_g, N + 2P, 1, kv_cache_dim]``, rows laid out by
:class:`ulacache.layout.PoolRows` (``ula_rows``): the padding sink page ``[0, P)``, GPU slot
``s`` at row ``P + s``, the core's scratch row ``P + N``, the rest of that tail page (row
counts stay a multiple of 64 for FlashMLA).

Writes and the prefill page table are translated per selection group; the core is an
:class:`~ulacache.space.AddressSpace` over SGLang's logical addresses (SGLang's paged allocator
hands them out, so no ledger).
"""

from __future__ import annotations

import contextvars
import logging
from contextlib import nullcontext

import torch
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc

from ulacache.config import SGLangOptions, UlaCacheConfig
from ulacache.errors import StaleSelectionError
from ulacache.layout import PoolRows, RowLayout
from ulacache.space import AddressSpace
from ulacache.streams import capturing

logger = logging.getLogger(__name__)


def sglang_options() -> SGLangOptions:
    """The ``--ulacache-config`` of this launch; defaults only when SGLang has published no
    server args (tests, tools). A bad value raises :class:`~ulacache.errors.ConfigError` naming
    the key and its legal values: start-up stops instead of serving with settings nobody asked
    for."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except (ImportError, ValueError):  # "Global server args is not set yet!"
        logger.info("ulacache: no SGLang server args published; default --ulacache-config")
        return SGLangOptions()
    from ulacache.patches.server_args import parse_ulacache_config

    return SGLangOptions.from_dict(parse_ulacache_config(getattr(args, "ulacache_config", None)))


MODEL_SKIPS: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "ulacache_model_skips", default=None)
"""The model's "reuses the previous layer's top-k" flag of each layer of the pool being built,
set around SGLang's DSA pool construction (``classes._build_dsa_kv_pool_around``): SGLang passes
``skip_topk_layers`` to the pool only when it elides the shared layers' index-K, which it never
does under HiSparse, so without this every layer would be its own selection group."""


def layer_groups_from_skip(skip_topk_layers: list[bool] | None, layer_num: int,
                           start_layer: int = 0) -> list[list[int]]:
    """Selection groups (global layer ids): a layer that skips top-k reuses the previous layer's
    selection, so it joins that layer's group (SGLang's ``skip_topk_layers``, else the model's
    pattern recorded in :data:`MODEL_SKIPS` while the pool is built)."""
    if skip_topk_layers is None:
        recorded = MODEL_SKIPS.get()
        if recorded is not None and len(recorded) != layer_num:
            logger.warning("ulacache: the model's top-k sharing pattern covers %d layers, the pool"
                           " %d; one selection group per layer", len(recorded), layer_num)
            recorded = None
        skip_topk_layers = recorded
    groups: list[list[int]] = []
    for i in range(layer_num):
        layer = start_layer + i
        if skip_topk_layers is not None and skip_topk_layers[i] and groups:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


class UlaCacheDSATokenToKVPool(HiSparseDSATokenToKVPool):
    """DSA latent pool whose rows are ulacache's GPU pools (see the module docstring).

    Construction picks the mode: with ``--ulacache-config`` mode ``"tp"`` (read from
    ``ulacache_options`` or the published server args) it builds the TP subclass
    :class:`~ulacache.patches.sglang_tp_pool.UlaCacheTPDSATokenToKVPool` instead, so SGLang's
    construction site (which sees this class through the REPLACE hook) needs no change.
    """

    def __new__(cls, *args, **kwargs):
        if cls is UlaCacheDSATokenToKVPool:
            opts = kwargs.get("ulacache_options") or sglang_options()
            if opts.mode == "tp":
                from .sglang_tp_pool import UlaCacheTPDSATokenToKVPool

                cls = UlaCacheTPDSATokenToKVPool
        return super().__new__(cls)

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
        self.ula_rows = PoolRows(page_size, size)  # read by _create_buffers, called below
        super().__init__(size, page_size, kv_lora_rank, dtype, qk_rope_head_dim, layer_num,
                         device, index_head_dim, enable_memory_saver, kv_cache_dim,
                         start_layer=start_layer, end_layer=end_layer, index_kpool=index_kpool,
                         index_kpool_compress=index_kpool_compress,
                         tail_extra_slots=tail_extra_slots,
                         max_running_requests=max_running_requests,
                         skip_topk_layers=skip_topk_layers,
                         host_to_device_ratio=host_to_device_ratio)
        ratio = int(host_to_device_ratio)
        cfg = self.core_config(size, ratio, max_running_requests)
        rb, rows = cfg.row_layout.row_bytes, self.ula_rows
        storage = [big.view(torch.uint8).view(big.shape[0], big.shape[1], rb)
                   [:, rows.row_base: rows.row_base + rows.core_rows]
                   for big in self._group_buffers]
        layer_ids = [[x - self.start_layer for x in g] for g in self.ula_groups]
        self.core = AddressSpace(cfg, self.device, n_logical=size * ratio + page_size,
                                 layer_groups=layer_ids, gpu_storage=storage)
        self._prefill_round = [-1] * len(self.ula_groups)  # round of each anchor's last access
        self.current_layer_id = self.start_layer  # set by the forward_extend hook
        host_gib = cfg.cpu_slots * rb * layer_num / 2**30
        logger.info("ulacache pool: %d selection group(s); GPU %d slots x %d layers x %d B; "
                    "CPU %d slots (%.2f GiB pinned host); logical/indexer capacity %d tokens",
                    len(self.ula_groups), size, layer_num, rb, cfg.cpu_slots, host_gib,
                    size * ratio)

    def core_config(self, gpu_slots: int, host_to_device_ratio: int,
                    max_running_requests: int | None, **tp) -> UlaCacheConfig:
        """The core's configuration for this pool, in both modes: rows in SGLang's store
        format, ``gpu_slots`` GPU and ``(ratio - 1) x gpu_slots`` CPU slots per group and
        layer, the ``--ulacache-config`` options; TP mode adds ``tp_size``, ``buffer_slots``
        and ``shard_indexer`` through ``tp``."""
        row = RowLayout.of_size(self.kv_cache_dim * torch._utils._element_size(self.store_dtype))
        opts = self.ula_options
        return UlaCacheConfig(
            layout=row.name, row_bytes=row.row_bytes if row.name == "tiny" else None,
            n_layers=self.layer_num, gpu_slots=gpu_slots,
            cpu_slots=(int(host_to_device_ratio) - 1) * gpu_slots, page_size=self.page_size,
            max_requests=max(1, max_running_requests or 1), n_buckets=opts.n_buckets,
            policy=opts.policy, validate=opts.validate, access_path=opts.access_path,
            call_entries=opts.call_entries, **tp)

    def _create_buffers(self) -> None:
        """One tensor per selection group so a group's layers move in one launch; two extra
        pages per layer beyond SGLang's padding page (see the module docstring)."""
        saver = getattr(self, "memory_saver_adapter", None)
        pool = getattr(self, "custom_mem_pool", None)
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        with saver.region(GPU_MEMORY_TYPE_KV_CACHE) if saver is not None else nullcontext():
            with torch.cuda.use_mem_pool(pool) if pool else nullcontext():
                self._group_buffers = [
                    torch.zeros((len(g), self.ula_rows.total, 1, self.kv_cache_dim),
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
        """``kv_buffer[layer]`` rows of GPU-resident logical ``loc`` (int64, same shape) for
        writes; padding (``-1``), the sink page and anything not GPU-resident go to row 0 (the
        dummy sink SGLang writes padding tokens to). Pure: no side effect."""
        g = self.core.groups[self._group_index(layer_id)]
        flat = loc.reshape(-1).to(torch.int64)
        ok = (flat >= self.page_size) & (flat < g.n_logical)
        slot = g.loc[torch.where(ok, flat, g.n_logical)]
        rows = torch.where(ok & (slot >= 0) & (slot < g.gpu_slots),
                           slot + self.ula_rows.row_base, 0)
        return rows.view(loc.shape)

    def prefill_rows(self, layer_id: int, page_table: torch.Tensor) -> torch.Tensor:
        """Prefill page table of one layer (logical addresses, ``-1`` padded) -> its rows in
        ``kv_buffer[layer_id]``; ``-1`` stays ``-1`` and the sink page stays row 0.

        MUTATES on the group's anchor (first) layer: the selected rows that sit in the CPU
        tier are promoted (a sparse access: swaps, mapping updates, counters, once per group
        and forward). The group's other layers share the anchor's selection (SGLang's
        ``skip_topk``), so they only translate; a row that is not GPU-resident there means
        the anchor did not run this round: :class:`StaleSelectionError` with validate on,
        ``-1`` (never another token's row) with it off.

        The table (``T x top-k`` entries: 2^24 for an 8K chunk at top-k 2048) is taken in
        pieces of the core's ``call_capacity`` entries, in one round, so neither the kernels'
        scratch nor this method's temporaries grow with it (validate on: the core checks the
        whole table first, then runs the same pieces).
        """
        gi = self._group_index(layer_id)
        anchor = layer_id - self.start_layer == self.core.groups[gi].layers[0]
        flat = page_table.reshape(-1)
        piece = flat.numel() if self.core.validate else self.core.config.call_capacity
        out = torch.empty_like(flat)
        for src, dst in zip(flat.split(piece), out.split(piece)):
            src = src.view(1, -1).to(torch.int64)
            sink = (src >= 0) & (src < self.page_size)
            slots = self._prefill_slots(gi, layer_id, anchor, torch.where(sink, -1, src))
            dst.copy_(torch.where(slots >= 0, slots + self.ula_rows.row_base,
                                  torch.where(sink, 0, -1)).view(-1))
        if anchor:
            self._prefill_round[gi] = self.core.round_serial
        return out.view(page_table.shape)

    def _prefill_slots(self, gi: int, layer_id: int, anchor: bool, addrs: torch.Tensor
                       ) -> torch.Tensor:
        """Core rows (``int64 [1, m]``, ``-1``: none) of one piece of a prefill table: the
        anchor's access, a shared layer's translation (checked with validate on)."""
        if anchor:
            return self.core.access(gi, addrs).to(torch.int64)
        slots = self.core.translate(gi, addrs).to(torch.int64)
        if self.core.validate and not capturing(self.core.device):
            g = self.core.groups[gi]
            if self._prefill_round[gi] != self.core.round_serial or \
                    bool(((addrs >= 0) & (slots < 0)).any()):
                raise StaleSelectionError(
                    f"layer {layer_id} shares selection group {gi}, whose anchor layer "
                    f"{g.layers[0] + self.start_layer} did not make these rows resident "
                    "in this round")
        return slots

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """SGLang's name (``dsa_backend.forward_extend``) for :meth:`prefill_rows` of the layer
        the ``forward_extend`` hook recorded. Not a pure translation: it promotes rows."""
        return self.prefill_rows(self.current_layer_id, compressed_indices)

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        return self.rows_of(self.current_layer_id, compressed_indices)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor):
        return self.rows_of(self.current_layer_id, full_indices)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        DSATokenToKVPool.set_kv_buffer(self, layer, self.rows_of(layer_id, loc), cache_k,
                                       cache_v, layer_id_override=layer_id_override)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope,
                          layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        DSATokenToKVPool.set_mla_kv_buffer(self, layer, self.rows_of(layer_id, loc),
                                           cache_k_nope, cache_k_rope,
                                           layer_id_override=layer_id_override)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        self.current_layer_id = layer.layer_id
        rows = self.translate_loc_to_hisparse_device(loc)
        return DSATokenToKVPool.get_mla_kv_buffer(self, layer, rows, dst_dtype)

    def transfer_values_on_device(self, dst_indices, src_indices) -> None:
        raise NotImplementedError("ulacache keeps speculative tokens in place; stock HiSparse's "
                                  "slot-to-slot commit copy is never needed")
