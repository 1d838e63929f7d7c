"""TP mode's pool: ``kv_buffer`` rows are this rank's stripe of one address space plus a local
buffer of copies of peers' rows (``--ulacache-config '{"mode": "tp"}'``).

The ``P`` ranks of SGLang's attention-TP group (``get_dp_tp_group()``) stripe the logical
address space: address (``loc``) ``t`` lives on rank ``t mod P`` at local position ``t // P``
(:class:`ulacache.tp.TPAddressSpace`). SGLang's ``N`` (``size``) stays the global GPU token
count; each rank holds ``G = N / P`` own GPU rows and ``(ratio - 1) x G`` CPU rows per layer.

One tensor per selection group, ``uint8 [L_g, R, row_bytes]`` allocated through the peers
(POSIX shared memory on CPU, CUDA IPC on GPU) so that peers can read it; ``kv_buffer[layer]``
is its ``[R, 1, kv_cache_dim]`` view in SGLang's store dtype. Rows (``ula_rows``, a
:class:`ulacache.layout.PoolRows`)::

    [0, 64)                    padding sink (SGLang's page 0; dummy writes land here)
    [64, 64 + G)               own GPU slot (row - 64) of the layer's selection group
    64 + G                     the core's scratch row
    [65 + G, 65 + G + B)       buffer slot (row - 65 - G): a copy of a peer's row
    [65 + G + B, R)            padding to a multiple of 64 rows (FlashMLA views 64-row pages)

Writes (``set_mla_kv_buffer``): every rank computes the same latent rows, so the owner stores
its own tokens in its pool and every other rank stores its copy in the buffer slot the
placement gave it; anything else (padding, overflow) goes to row 0. Reads: the coordinator's
``plan`` / ``load`` (decode) and :meth:`prefill_rows` (prefill) return rows of this tensor.
"""

from __future__ import annotations

import logging

import torch

from ulacache.config import SGLangOptions
from ulacache.errors import ConfigError, StaleSelectionError
from ulacache.layout import PoolRows
from ulacache.streams import capturing
from ulacache.tp import TPAddressSpace

from . import sglang_tp_support as tps
from .sglang_pool import UlaCacheDSATokenToKVPool, layer_groups_from_skip, sglang_options

logger = logging.getLogger(__name__)


def make_tp_peers(grp, device):
    """The peers of ``grp`` (a GroupCoordinator): :class:`~ulacache.ipc.ShmPeers` on CPU,
    :class:`~ulacache.ipc.CudaIpcPeers` on CUDA (handles over the gloo ``cpu_group``, per-step
    all-gathers on the device group). Collective: every rank constructs them together."""
    from ulacache.ipc import CudaIpcPeers, ShmPeers

    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaIpcPeers(grp.cpu_group, device=dev,
                            collective=lambda out, inp: tps.all_gather_into(grp, out, inp))
    return ShmPeers(grp.cpu_group)


class UlaCacheTPDSATokenToKVPool(UlaCacheDSATokenToKVPool):
    """DSA latent pool of one TP rank (see the module docstring).

    Extra keyword arguments (tests and tools; SGLang passes none): ``ulacache_tp_group`` (a
    GroupCoordinator-like object with ``world_size``, ``rank_in_group``, ``cpu_group``,
    ``device_group``; default ``get_dp_tp_group()``), ``ulacache_top_k`` (sizes the buffer when
    neither ``buffer_slots`` nor the sizing hook's record is there; default 2048),
    ``ulacache_peers`` (a :class:`ulacache.ipc.Peers` of the group; default
    :func:`make_tp_peers`: ``ulacache rehearse`` passes in-process peers on the meta device).
    """

    def __init__(self, size: int, page_size: int, kv_lora_rank: int, dtype: torch.dtype,
                 qk_rope_head_dim: int, layer_num: int, device: str, index_head_dim: int,
                 enable_memory_saver: bool, kv_cache_dim: int, start_layer: int | None = None,
                 end_layer: int | None = None, index_kpool: int = 1,
                 index_kpool_compress: bool = False, tail_extra_slots: int = 0,
                 max_running_requests: int | None = None,
                 skip_topk_layers: list[bool] | None = None, host_to_device_ratio: int = 2,
                 ulacache_options: SGLangOptions | None = None, ulacache_tp_group=None,
                 ulacache_top_k: int | None = None, ulacache_peers=None):
        from .plugin import verify_tp

        verify_tp()  # a launch whose TP hooks did not take effect stops here, loudly
        self.ula_options = opts = ulacache_options or sglang_options()
        self.ula_group = grp = ulacache_tp_group or tps.tp_group()
        P, rank = int(grp.world_size), int(grp.rank_in_group)
        if P not in tps.TP_SIZES or page_size % P or size % P:
            raise ConfigError(
                f"ulacache TP mode stripes over the attention-TP group: its size must be one of "
                f"{tps.TP_SIZES} and divide the page ({page_size}) and the pool ({size} tokens);"
                f" got {P} ranks")
        self.ula_P, self.ula_rank = P, rank
        self.ula_groups = layer_groups_from_skip(skip_topk_layers, layer_num, start_layer or 0)
        G = size // P
        sized = tps.SIZED
        if opts.buffer_slots is None and sized is not None and sized.tp_size == P:
            B = sized.buffer_slots  # exactly what the sizing hook charged
        else:
            B = tps.resolve_buffer_slots(opts, max_running_requests,
                                         ulacache_top_k or tps.DEFAULT_TOP_K, tps.draft_tokens())
        self.ula_rows = PoolRows(page_size, G, B)  # read by _create_buffers, called below
        self.ula_peers = ulacache_peers or make_tp_peers(grp, device)
        # SGLang's own pool constructor, skipping the DP pool's (which builds a DP core). Not
        # ``HiSparseDSATokenToKVPool.__init__`` by name: under the plugin that name is bound to
        # ulacache's DP pool class once the class swap has run (seen on a live TP launch).
        super(UlaCacheDSATokenToKVPool, self).__init__(
            size, page_size, kv_lora_rank, dtype, qk_rope_head_dim, layer_num, device,
            index_head_dim, enable_memory_saver, kv_cache_dim, start_layer=start_layer,
            end_layer=end_layer, index_kpool=index_kpool,
            index_kpool_compress=index_kpool_compress, tail_extra_slots=tail_extra_slots,
            max_running_requests=max_running_requests, skip_topk_layers=skip_topk_layers,
            host_to_device_ratio=host_to_device_ratio)
        ratio = int(host_to_device_ratio)
        cfg = self.core_config(G, ratio, max_running_requests, tp_size=P, buffer_slots=B,
                               shard_indexer=opts.shard_indexer)
        layer_ids = [[x - self.start_layer for x in g] for g in self.ula_groups]
        self.core = TPAddressSpace(cfg, self.ula_peers, n_logical=size * ratio + page_size,
                                   layer_groups=layer_ids, storage=self._ula_storage,
                                   row_offset=self.ula_rows.row_base)
        self._prefill_round = [-1] * len(self.ula_groups)
        self.current_layer_id = self.start_layer  # set by the forward_extend hook
        tps.ACTIVE = tps.TPActive(grp, opts.shard_indexer)
        rb = cfg.row_layout.row_bytes
        logger.info(
            "ulacache TP pool: rank %d/%d, %d selection group(s) x %d layers; own GPU %d slots, "
            "buffer %d rows, %d rows per layer (%.2f GiB GPU); CPU %d slots (%.2f GiB host); "
            "%d logical tokens over the group; index-K replicated; shard_indexer %s", rank, P,
            len(self.ula_groups), layer_num, G, B, self.ula_rows.total,
            self.ula_rows.total * layer_num * rb / 2**30, cfg.cpu_slots,
            cfg.cpu_slots * layer_num * rb / 2**30, size * ratio, opts.shard_indexer)

    def _create_buffers(self) -> None:
        """One peer-shared ``uint8 [L_g, R, row_bytes]`` tensor per selection group (outside
        SGLang's memory-saver region and custom pool: the peers allocate it)."""
        rb = self.kv_cache_dim * torch._utils._element_size(self.store_dtype)
        self._ula_storage, self._group_buffers = [], []
        for gi, g in enumerate(self.ula_groups):
            name = f"kv_group{gi}"
            t = self.ula_peers.alloc_shared(name, (len(g), self.ula_rows.total, rb),
                                            torch.uint8)
            self._ula_storage.append((name, t))
            self._group_buffers.append(
                t.view(self.store_dtype).view(len(g), self.ula_rows.total, 1, self.kv_cache_dim))
        self.kv_buffer = [buf[i] for buf in self._group_buffers for i in range(buf.shape[0])]

    # -- translation ---------------------------------------------------------------------
    def rows_of(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """``kv_buffer[layer]`` rows for writes of logical ``loc`` (int64, same shape): this
        rank's own GPU row for its tokens, the buffer slot of its copy for peers' tokens placed
        this round; row 0 (the sink) for padding, the sink page and anything else. Pure."""
        gi = self._group_index(layer_id)
        flat = loc.reshape(-1).to(torch.int64)
        ok = (flat >= self.page_size) & (flat < self.core.n_logical)
        rows = self.core.translate(gi, torch.where(ok, flat, -1)).to(torch.int64)
        return torch.where(rows >= 0, rows + self.ula_rows.row_base, 0).view(loc.shape)

    def _prefill_slots(self, gi: int, layer_id: int, anchor: bool, addrs: torch.Tensor
                       ) -> torch.Tensor:
        """One piece of a prefill table (:meth:`prefill_rows` of the DP pool, which takes the
        table in pieces of ``call_capacity`` entries). Collective on the group's anchor
        (first) layer: the plan (own promotions, one all-gather of slot tables, buffer claims
        for peers' rows) and the copy of every layer's bytes of the planned peer rows
        (``access``; the rows fetched are older than this batch, whose own peer rows are
        buffer hits written by each rank, so no later layer's write is overtaken). A shared
        layer only translates; one whose anchor did not run this round raises
        :class:`StaleSelectionError` with validate on."""
        if anchor:
            return self.core.access(gi, addrs).to(torch.int64)
        g = self.core.groups[gi]
        if self.core.validate and not capturing(self.core.device) and \
                self._prefill_round[gi] != self.core.round_serial:
            raise StaleSelectionError(
                f"layer {layer_id} shares selection group {gi}, whose anchor layer "
                f"{g.layers[0] + self.start_layer} did not plan these rows in this round")
        return self.core.translate(gi, addrs).to(torch.int64)

    def close_peers(self) -> None:
        """Release this rank's shared tensors (tests and shutdown; peers' mappings stay valid
        until their views die)."""
        self.ula_peers.close()
